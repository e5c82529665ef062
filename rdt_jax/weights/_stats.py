"""What a pull did (`PullStats`, which `WeightSubscriber.last_pull` reports)
and what a publisher did (`PublishStats`, `WeightPublisher.stats`).

A pull's route records its name and the RDT objects it fetched on the pull
in progress (`rdt_jax.weights._pull.Pull`), and the last check of the
publisher's kept versions the versions it saw; the subscriber makes the
record once the pull succeeded. Nothing here costs a call or a per-leaf
step: a version's byte count comes from its layout, or is counted once per
structure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from rdt_jax import _dlpack, _metrics
from rdt_jax.weights._handle import StaleWeightsError, WeightsHandle, flatten, stream_of

logger = logging.getLogger(__name__)

__all__ = ["KINDS", "ROUTES", "PublishStats", "PullStats", "count_failed", "count_pulled", "lag_of", "version_bytes"]

#: How a version travels, as `PublishStats.last_kind` names it.
KINDS: Final = ("packed", "packed_device", "pytree")

#: The routes a pull can take, as `PullStats.route` names them.
ROUTES: Final = ("node_local", "cuda_ipc", "buckets", "ray", "colocated", "mixed")


@dataclass(frozen=True)
class PullStats:
  """One successful pull of a `WeightSubscriber` (its `last_pull`).

  Attributes:
    version: the version pulled.
    nbytes: the size of the version's array leaves as published, in bytes
      (a `Slice` template receives part of them); for a subscriber with
      `source=`, or a pull of a combined handle, the bytes it read.
    seconds: wall-clock time of the pull, from its first check to its
      return; waiting for another pull of the same subscriber is not counted.
    route: how the bytes came: "node_local" (copied from the publisher's
      host memory on this host), "cuda_ipc" (from its device memory on this
      host), "buckets" (a packed version's RDT objects through Ray), "ray"
      (the version's RDT object through Ray) or "colocated" (the publisher
      lives in this process); for a combined handle
      (`WeightsHandle.combine`), the route every part took, or "mixed".
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


@dataclass(frozen=True)
class PublishStats:
  """What a `WeightPublisher` did since it was created (its `stats`).

  Attributes:
    published: versions published.
    last_version: the newest version published (None before the first).
    last_kind: how it travels: "packed" (one host buffer), "packed_device"
      (one CUDA allocation, copied through CUDA IPC on this host) or
      "pytree" (one RDT object of the tree); None before the first.
    last_nbytes: its array leaves' size in bytes.
    last_seconds: wall-clock time its `publish` took.
    answered: questions subscribers asked (which versions are kept, and for
      the RDT objects of a version); pulls on the publisher's host through
      the kept-versions table ask none.
    objects: RDT objects made: one per pytree version at `publish`, and for
      packed versions one per bucket or device version's tree, at the first
      subscriber's request.
  """

  published: int = 0
  last_version: int | None = None
  last_kind: str | None = None
  last_nbytes: int = 0
  last_seconds: float = 0.0
  answered: int = 0
  objects: int = 0


def version_bytes(cache: dict[str, int], structure: str, value: Any, layout: Any) -> int:
  """The array bytes of a pulled version of `structure`, counted once per
  structure into `cache` (the last few kept): from its packed `layout`
  where the route had one, else from the pulled `value`."""
  size = cache.get(structure)
  if size is None:
    if layout is not None:
      size = sum(layout.sizes)
    else:
      size = sum(int(getattr(x, "nbytes", 0) or 0) for _, x in flatten(value) if _dlpack.is_array(x))
    cache[structure] = size
    if len(cache) > 4:  # structures change rarely: keep the last few
      cache.pop(next(iter(cache)))
  return size


def count_pulled(handle: WeightsHandle, stats: PullStats | None) -> None:
  """Counts a successful pull in rdt_jax's Ray metrics (`rdt_jax._metrics`),
  and logs it at DEBUG (`logging.getLogger("rdt_jax")`): version, stream,
  route, bytes, seconds."""
  if stats is not None:
    _metrics.count_pull(stream_of(handle), stats.route, "ok", stats.nbytes, stats.seconds, stats.lag)
    if logger.isEnabledFor(logging.DEBUG):
      logger.debug("rdt_jax: pulled version %d of stream %s: %d bytes in %.2f ms (route %s, %d RDT objects)",
                   stats.version, stream_of(handle), stats.nbytes, stats.seconds * 1e3, stats.route, stats.objects)


def count_failed(handle: WeightsHandle, error: BaseException) -> None:
  """Counts a refused or failed pull: "stale" for `StaleWeightsError`,
  "failed" for any other error (route "none": it may not have begun)."""
  _metrics.count_pull(stream_of(handle), "none", "stale" if isinstance(error, StaleWeightsError) else "failed")
  if logger.isEnabledFor(logging.DEBUG):
    logger.debug("rdt_jax: the pull of version %s of stream %s failed: %s", handle.version, stream_of(handle),
                 type(error).__name__)
