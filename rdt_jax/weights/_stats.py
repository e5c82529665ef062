"""What a pull did: `PullStats`, which `WeightSubscriber.last_pull` reports.

A pull's route records its name and the RDT objects it fetched on the pull
in progress (`rdt_jax.weights._routes.Pull`), and the last check of the
publisher's kept versions the versions it saw; the subscriber makes the
record once the pull succeeded. Nothing here costs a call or a per-leaf
step: a version's byte count comes from its layout, or is counted once per
structure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

__all__ = ["ROUTES", "PullStats", "lag_of"]

#: The routes a pull can take, as `PullStats.route` names them.
ROUTES: Final = ("node_local", "cuda_ipc", "buckets", "ray", "colocated")


@dataclass(frozen=True)
class PullStats:
  """One successful pull of a `WeightSubscriber` (its `last_pull`).

  Attributes:
    version: the version pulled.
    nbytes: the size of the version's array leaves as published, in bytes
      (a `Slice` template receives part of them).
    seconds: wall-clock time of the pull, from its first check to its
      return; waiting for another pull of the same subscriber is not counted.
    route: how the bytes came: "node_local" (copied from the publisher's
      host memory on this host), "cuda_ipc" (from its device memory on this
      host), "buckets" (a packed version's RDT objects through Ray), "ray"
      (the version's RDT object through Ray) or "colocated" (the publisher
      lives in this process).
    objects: the RDT objects the pull fetched through Ray (0 for the local
      routes).
    lag: how many versions behind the newest one the publisher kept at the
      pull's last check this pull's version was (0: it was the newest);
      None where that check saw no versions.
  """

  version: int
  nbytes: int
  seconds: float
  route: str
  objects: int
  lag: int | None


def lag_of(version: int, kept: Iterable[int] | None) -> int | None:
  """`PullStats.lag` of `version` given the versions kept at the last check."""
  newest = max(kept, default=None) if kept is not None else None
  return None if newest is None else max(0, newest - version)
