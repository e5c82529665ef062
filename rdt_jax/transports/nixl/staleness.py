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
"""

from __future__ import annotations

import threading

from rdt_jax.transports.nixl.metadata import NixlTransportMetadata

__all__ = ["FreedObjects", "live_ranges"]


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


class FreedObjects:
  """Consumer: what it knows of each producer's live objects (see the module
  docstring), and the check every read strategy makes."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    # producer agent -> (newest export serial seen, that producer's live serials then)
    self._latest: dict[str, tuple[int, list[tuple[int, int]]]] = {}

  def check(self, obj_id: str, meta: NixlTransportMetadata) -> None:
    """Learns from `meta`, then refuses to read an object its producer is
    known to have freed.

    Raises:
      RuntimeError: naming the object and its producer, if it is known to be
        freed.
    """
    remote = meta.agent_name
    assert remote is not None
    with self._lock:
      latest = self._latest.get(remote)
      if latest is None or meta.serial > latest[0]:
        latest = self._latest[remote] = (meta.serial, list(meta.live))
    if meta.serial and not _in_ranges(meta.serial, latest[1]):
      raise RuntimeError(
          f"Object {obj_id} was freed by its producer (agent {remote}) before "
          "this read: its transport metadata is stale. Keep the ObjectRef alive "
          "until every consumer has fetched it."
      )
