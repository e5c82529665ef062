"""Stale metadata: refusing to read an object its producer has freed.

The one mechanism, consulted by every read strategy (`rdt_jax.transports.nixl
.read`) before it reads a byte:

* the producer gives every export a serial (never reused) and puts in each
  object's metadata its serial and the serials of every object it exports at
  that moment (`live`, as ranges: objects are mostly freed in the order they
  were made, so a few ranges cover many);
* the consumer keeps, per producer agent, the `live` list of the newest
  metadata it has seen (`FreedObjects.check`);
* an object whose serial is missing from that list was freed by its producer,
  so its memory may hold another object's bytes by now: the read is refused.

What it catches: a read of an object whose freeing the consumer has learned
of, through metadata of a later object from the same producer.

What it cannot catch: an object freed after the newest metadata this consumer
has seen from its producer (nothing tells the consumer yet). Ray's reference
counting is the defence there: an object is freed only once no reference to
it is left, and a consumer holds one while it reads. Beyond that, the NIXL
READ has a second, NIXL-side defence: a region the producer deregistered stops
being readable once the consumer's view of the producer's agent is rebuilt
(`views.RemoteViews`), and the READ fails with NIXL_ERR_NOT_FOUND. A
node-local read (`node_local`) has no such defence: it reads whatever the
producer's memory holds at that address, or fails if it is unmapped.

Bounded: a producer's record is forgotten (`FreedObjects.forget`) once no
read from it ran for `producer_idle_s()` seconds, or once a producer on this
host has exited (checked by pid and start time). A record forgotten while
its producer lives is rebuilt from the next metadata of it the consumer
reads.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rdt_jax import _process, _settings
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata

__all__ = ["FreedObjects", "live_ranges", "producer_idle_s"]


@functools.cache
def producer_idle_s() -> float:
  """Seconds without a read from a producer after which a consumer forgets
  what it keeps for it: the setting `RDT_JAX_NIXL_PRODUCER_IDLE_S`, read once
  per process."""
  return float(_settings.value("RDT_JAX_NIXL_PRODUCER_IDLE_S"))


def live_ranges(serials: list[int]) -> list[tuple[int, int]]:
  """Serials as sorted inclusive (first, last) ranges, for `NixlTransportMetadata.live`."""
  out: list[list[int]] = []
  for n in sorted(serials):
    if out and out[-1][1] + 1 == n:
      out[-1][1] = n
    else:
      out.append([n, n])
  return [(a, b) for a, b in out]


def _in_ranges(n: int, ranges: list[tuple[int, int]]) -> bool:
  return any(a <= n <= b for a, b in ranges)


@dataclass
class _Producer:
  """What a consumer knows of one producer."""

  serial: int  # the newest export serial seen
  live: list[tuple[int, int]]  # the producer's live serials then
  origin: _process.Identity | None  # the producer's process, where known
  used: float  # time.monotonic() of the last read from it


class FreedObjects:
  """Consumer: what it knows of each producer's live objects (see the module
  docstring), and the check every read strategy makes.

  Args:
    changed: called (no lock held) when a producer is added or forgotten.
  """

  def __init__(self, changed: Callable[[], None] | None = None) -> None:
    self._lock = threading.Lock()
    self._changed = changed or (lambda: None)
    self._producers: dict[str, _Producer] = {}

  def __len__(self) -> int:
    """Producers this consumer keeps a record of (read without the lock)."""
    return len(self._producers)

  def check(self, obj_id: str, meta: NixlTransportMetadata) -> None:
    """Learns from `meta`, then refuses to read an object its producer is
    known to have freed.

    Raises:
      RuntimeError: naming the object and its producer, if it is known to be
        freed.
    """
    remote = meta.agent_name
    assert remote is not None
    now = time.monotonic()
    with self._lock:
      known = self._producers.get(remote)
      added = known is None
      if known is None:
        known = self._producers[remote] = _Producer(meta.serial, list(meta.live), meta.origin, now)
      elif meta.serial > known.serial:
        known.serial, known.live = meta.serial, list(meta.live)
      known.used = now
      live = known.live
    if added:
      self._changed()
    if meta.serial and not _in_ranges(meta.serial, live):
      raise RuntimeError(
          f"Object {obj_id} was freed by its producer (agent {remote}) before "
          "this read: its transport metadata is stale. Keep the ObjectRef alive "
          "until every consumer has fetched it."
      )

  def idle_or_gone(self, idle_s: float, now: float) -> list[str]:
    """Producers not read for `idle_s` seconds, or on this host and exited."""
    with self._lock:
      records = list(self._producers.items())
    return [
        remote for remote, p in records
        if now - p.used >= idle_s
        or (p.origin is not None and _process.same_host(p.origin) and not _process.alive(p.origin))
    ]

  def forget(self, remote: str) -> None:
    """Drops the record of producer `remote` (`idle_or_gone` chose it)."""
    with self._lock:
      gone = self._producers.pop(remote, None) is not None
    if gone:
      self._changed()
