"""Abort marks: the transfers Ray aborted in this process.

Ray calls a transport's `abort_transport(obj_id, ...)` on the producer and the
consumer after a transfer failed or timed out (where `can_abort_transport()`
is True). The consumer's wait checks the mark and stops early; the next fetch
of the object takes the mark (once) and starts afresh. On a producer no fetch
ever takes it, so the marks are bounded (`MAX_ABORTED`, the oldest forgotten
first), and Ray's free of the object forgets its mark.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from rdt_jax import _limits

__all__ = ["AbortMarks"]


class AbortMarks:
  """The objects whose transfer Ray aborted here, oldest first, at most
  `MAX_ABORTED`; safe to use from any thread."""

  def __init__(self) -> None:
    self._marks: OrderedDict[str, None] = OrderedDict()
    self._lock = threading.Lock()

  def mark(self, obj_id: str) -> None:
    """Notes that Ray aborted the transfer of `obj_id` (forgetting the oldest
    marks beyond `MAX_ABORTED`)."""
    with self._lock:
      self._marks[obj_id] = None
      while len(self._marks) > _limits.MAX_ABORTED:
        self._marks.popitem(last=False)

  def take(self, obj_id: str) -> bool:
    """True (once) if the transfer of `obj_id` was aborted; drops the mark."""
    with self._lock:
      return self._marks.pop(obj_id, False) is None

  def forget(self, obj_id: str) -> None:
    """Drops the mark of `obj_id`, if any (Ray freed the object)."""
    with self._lock:
      self._marks.pop(obj_id, None)

  def __len__(self) -> int:
    with self._lock:
      return len(self._marks)
