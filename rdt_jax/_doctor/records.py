"""The doctor's records, plain data: a `Finding` (one conclusion, with why and
the fix) and the exit status of a list of them; what the loopback measured (a
`ReadResult` per memory kind, `Loopback` for the whole run)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Literal

Severity = Literal["ok", "warn", "fail"]


@dataclasses.dataclass(frozen=True)
class Finding:
  """One conclusion of the doctor.

  Attributes:
    severity: "ok", "warn" (works, with less or a caveat) or "fail" (broken,
      or slow enough to lose to Ray's object store).
    what: the conclusion, one line.
    why: the evidence or the consequence.
    fix: what to do (empty for "ok").
  """

  severity: Severity
  what: str
  why: str = ""
  fix: str = ""


def exit_status(findings: list[Finding]) -> int:
  """1 if any finding is a fail, else 0."""
  return int(any(f.severity == "fail" for f in findings))


@dataclasses.dataclass
class ReadResult:
  """One memory kind's loopback READ.

  Attributes:
    memory: "host" or "cuda".
    nbytes: bytes per READ.
    seconds: each READ's time, the first one (connection set-up) included.
    state: "DONE", or what went wrong (NIXL's state or the exception).
    bytes_ok: the READ delivered the target's bytes.
    allocator: what allocated the buffers ("numpy", "torch", "jax").
    devices: the initiator's and the target's device, "cpu" or "cuda:N".
  """

  memory: str
  nbytes: int
  seconds: list[float] = dataclasses.field(default_factory=list)
  state: str = "not run"
  bytes_ok: bool = False
  allocator: str = ""
  devices: str = ""

  @property
  def gbps(self) -> float | None:
    """Median rate of the READs after the first, in GB/s (None if none ran)."""
    timed = self.seconds[1:] or self.seconds
    return self.nbytes / statistics.median(timed) / 1e9 if timed else None


@dataclasses.dataclass
class Loopback:
  """What the loopback found: each memory kind's READ, the node-local read's
  state and rate, UCX's logs, and the children's output where something
  went wrong."""

  reads: dict[str, ReadResult]
  error: str | None = None
  node_local: str = "not run"
  node_local_gbps: float | None = None
  log: str = ""
  output: str = ""
