"""The two-host cluster of the test suite: `rdt_jax.bench._twohost.TwoHosts`
with the tests' directory (and the examples) on the drivers' `PYTHONPATH`.

Each host is a Ray node in namespaces of its own (network, pid, ipc, uts,
mount, with a private `/dev/shm`), joined by a veth pair with Ray's token
authentication; see `rdt_jax.bench._twohost` for how it is built and torn
down. The drivers and every Ray worker inherit this process's environment
(its `PYTHONPATH` included), so they import the rdt_jax under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rdt_jax.bench._twohost import HEAD_PORT, SUBNET, Host, namespaces_available
from rdt_jax.bench._twohost import TwoHosts as _TwoHosts

__all__ = ["HEAD_PORT", "REPO", "SUBNET", "TESTS_DIR", "Host", "TwoHosts", "namespaces_available"]

TESTS_DIR = Path(__file__).parent
REPO = TESTS_DIR.parent


@dataclass
class TwoHosts(_TwoHosts):
  """`rdt_jax.bench._twohost.TwoHosts` whose drivers run in tests/ and import
  the tests' helpers and the examples."""

  pythonpath: list[str] = field(default_factory=lambda: [str(TESTS_DIR), str(REPO / "examples")])
  cwd: Path | None = TESTS_DIR
