"""Pausing Python's cyclic garbage collector around per-object bulk work.

Describing, planning and rebuilding an object of many leaves allocates a few
container objects per leaf; in a process holding many live objects (a model's
arrays, Ray's state) the collections those allocations trigger traverse the
whole heap, and on this project's host they cost more than the work itself
(docs/performance.md). Reference counting still frees everything at once;
only cycle detection waits until the object is done.

One framework ties more than cycles to the collector: jax releases the
Python objects behind arrays made zero-copy from outside memory (a pooled
host buffer, a DLPack capsule) only when the collector next runs (its
`gc.callbacks` entry). `release_deferred` runs those releases at once; the
memory pools call it before they decide memory is still in use.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Iterator

from rdt_jax import _limits

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
  return _limits.GC_PAUSE_MIN_LEAVES  # read at call time, so tests and benchmarks can change it


def release_deferred() -> None:
  """Runs the releases jax defers to the next garbage collection (no-op
  where jax is not loaded): a jax array made zero-copy from a host buffer or
  DLPack capsule keeps that memory referenced after the array is gone, until
  the collector runs. Without this a pool sees the previous object's buffer
  as in use and allocates (and registers) another one."""
  lib = sys.modules.get("jax._src.lib")
  collect = getattr(getattr(lib, "_jax", None), "collect_garbage", None)
  if collect is not None:
    collect()
