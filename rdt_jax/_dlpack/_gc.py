"""Pausing Python's cyclic garbage collector around per-object bulk work.

Describing, planning and rebuilding an object of many leaves allocates a few
container objects per leaf; in a process holding many live objects (a model's
arrays, Ray's state) the collections those allocations trigger traverse the
whole heap, and on this project's host they cost more than the work itself
(docs/performance.md). Reference counting still frees everything at once;
only cycle detection waits until the object is done.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

#: Objects with at least this many leaves pause the collector.
GC_PAUSE_MIN_LEAVES = 64

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused(leaves: int) -> Iterator[None]:
  """Runs the body with the cyclic collector paused if `leaves` is at least
  `GC_PAUSE_MIN_LEAVES` (and it was enabled); nests and is thread-safe: the
  collector is enabled again when the last pauser leaves."""
  global _depth, _was_enabled
  if leaves < _min_leaves():
    yield
    return
  with _lock:
    if _depth == 0:
      _was_enabled = gc.isenabled()
      gc.disable()
    _depth += 1
  try:
    yield
  finally:
    with _lock:
      _depth -= 1
      if _depth == 0 and _was_enabled:
        gc.enable()


def _min_leaves() -> int:
  return GC_PAUSE_MIN_LEAVES  # read at call time, so tests and benchmarks can change it
