"""Host memory: receive and staging buffers.

Host buffers come from one process-wide pool (`host_pool`) of 64-byte aligned,
already faulted-in buffers; device regions from `_regions.device_pool`. A
backend sees only pointers and sizes; the arrays rebuilt on top of these
buffers are made by the framework modules (`rdt_jax._dlpack`).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable

import numpy as np

from rdt_jax import _limits, _settings
from rdt_jax._memory._gc import release_deferred

logger = logging.getLogger(__name__)


def aligned(nbytes: int) -> int:
  """`nbytes` rounded up to a multiple of `_limits.HOST_ALIGNMENT`."""
  return -(-nbytes // _limits.HOST_ALIGNMENT) * _limits.HOST_ALIGNMENT


def aligned_host_buffer(nbytes: int) -> np.ndarray:
  """A fresh uint8 host buffer of `nbytes`, starting on an `_limits.HOST_ALIGNMENT` boundary."""
  raw = np.empty(nbytes + _limits.HOST_ALIGNMENT, dtype=np.uint8)
  offset = (-raw.ctypes.data) % _limits.HOST_ALIGNMENT
  return raw[offset : offset + nbytes]


def host_pointer(buffer: np.ndarray) -> int:
  """The address of a host buffer's first byte."""
  return int(buffer.ctypes.data)


def tell_listeners(listeners: list[Callable[..., None]], *args: object) -> bool:
  """Calls each eviction listener with `args` (the last one as `keepalive`);
  True if any raised (logged, not raised: the caller that triggered the
  eviction is not the one to handle a backend's deregistration failure)."""
  *head, keepalive = args
  failed = False
  for fn in listeners:
    try:
      fn(*head, keepalive=keepalive)
    except Exception:
      logger.warning("rdt_jax: an eviction listener failed; the memory is kept, never freed or reused",
                     exc_info=True)
      failed = True
  return failed


class HostBufferPool:
  """Reuses host buffers whose pages are already faulted in (and registered).

  A fresh buffer costs a page fault per 4 KiB page on first write, which
  dominates receiving into fresh memory (docs/performance.md has the figures).
  Received leaves are zero-copy views of their buffer, so a buffer is free
  again only once no view of it is alive; the pool checks that by reference
  count when a buffer is asked for, and never hands out one still in use.

  Free buffers are kept up to `max_bytes` in total (env var
  `RDT_JAX_HOST_POOL_BYTES`, default 1 GiB; 0 disables reuse); the least
  recently used are dropped first, after telling every eviction listener (a
  backend deregisters the memory).

  Eviction order: a listener is called with the buffer still alive and given
  it (`keepalive`), so a backend whose deregistration fails keeps the memory
  until a retry succeeds; registered memory is never freed. A listener that
  raises is logged, never raised into the caller that happened to trigger the
  eviction, and the buffer it was told about is kept for the life of the
  process (`stranded`), never freed and never reused.
  """

  def __init__(self, max_bytes: int | None = None):
    if max_bytes is None:
      max_bytes = _settings.value("RDT_JAX_HOST_POOL_BYTES")
    self.max_bytes = max_bytes
    self._buffers: list[np.ndarray] = []  # aligned uint8 views, oldest first
    self._listeners: list[Callable[..., None]] = []
    self._stranded: list[np.ndarray] = []  # evicted buffers a listener failed on
    self._lock = threading.Lock()

  def add_eviction_listener(self, fn: Callable[..., None]) -> None:
    """Calls `fn(pointer, nbytes, keepalive=buffer)` for each buffer the pool
    stops keeping, before the buffer can be freed; a listener that must keep
    the memory past its return (a failed deregistration) keeps `keepalive`."""
    with self._lock:
      self._listeners.append(fn)

  def _free_at(self, i: int) -> bool:
    # numpy views all reference the allocation's owner (`.base`) directly, so
    # it is free when referenced only by the pooled view (plus the argument).
    return sys.getrefcount(self._buffers[i].base) <= 2

  def acquire(self, nbytes: int) -> np.ndarray:
    """A 64-byte aligned uint8 buffer of exactly `nbytes`.

    Reuses a free pooled buffer (the smallest that fits, up to 2x `nbytes`),
    else allocates a fresh one and keeps it for later. The result is a view
    of the pooled buffer, which stays in use while the view, or any array
    built on it, is alive.

    Invariant: a buffer is handed out again only when nothing references it.
    A transport that lets a transfer write into (or read from) a buffer keeps
    a reference to it until the transfer has ended (NIXL reported it DONE or
    ERR), however the fetch that started it ended: given up, timed out,
    aborted or dropped. So no late transfer can land in another object's
    leaves (the jax_nixl backend parks abandoned READs for this).
    """
    with self._lock:
      best = self._best_free(nbytes)
      if best is None and any(nbytes <= b.nbytes <= 2 * nbytes for b in self._buffers):
        release_deferred()  # a buffer whose jax arrays are gone may be waiting for the collector
        best = self._best_free(nbytes)
      if best is not None:
        buf = self._buffers.pop(best)
        self._buffers.append(buf)  # most recently used last
        return buf[:nbytes]
      buf = aligned_host_buffer(nbytes)
      # The caller's view exists before the lock is released: from the moment
      # another thread can see the buffer in the pool, it is in use. (A view
      # made after the lock, as before, left a window in which a concurrent
      # acquire found the fresh buffer free and handed it out a second time:
      # two exports on one staging buffer, one object's bytes read as another's.)
      view = buf[:nbytes]
      evicted = []
      if 0 < nbytes <= self.max_bytes:
        self._buffers.append(buf)
        evicted = self._evict(self.max_bytes)
      listeners = list(self._listeners)
    self._notify(evicted, listeners)
    return view

  def _best_free(self, nbytes: int) -> int | None:
    """The index of the smallest free buffer of `nbytes` to 2x `nbytes`, if any."""
    best = None
    for i in range(len(self._buffers)):
      size = self._buffers[i].nbytes
      if nbytes <= size <= 2 * nbytes and self._free_at(i):
        if best is None or size < self._buffers[best].nbytes:
          best = i
    return best

  def _evict(self, limit: int) -> list[np.ndarray]:
    """Takes free buffers out, oldest first, until at most `limit` bytes are
    kept; the caller tells the listeners (`_notify`) before they are freed."""
    evicted = []
    total = sum(b.nbytes for b in self._buffers)
    i = 0
    while total > limit and i < len(self._buffers):
      if self._free_at(i):
        buf = self._buffers.pop(i)
        total -= buf.nbytes
        evicted.append(buf)
      else:
        i += 1
    return evicted

  def _notify(self, evicted: list[np.ndarray], listeners: list[Callable[..., None]]) -> None:
    """Tells every listener of each evicted buffer, which stays alive until
    they all returned; one a listener raised on is kept (`stranded`)."""
    while evicted:
      buf = evicted.pop()
      failed = tell_listeners(listeners, host_pointer(buf), buf.nbytes, buf)
      if failed:
        with self._lock:
          self._stranded.append(buf)
      del buf

  def stranded(self) -> int:
    """Evicted buffers kept because an eviction listener failed on them."""
    with self._lock:
      return len(self._stranded)

  def region_of(self, view: np.ndarray) -> tuple[int, int] | None:
    """`(pointer, nbytes)` of the pooled buffer `view` lies in, if any."""
    p, n = host_pointer(view), view.nbytes
    with self._lock:
      for b in self._buffers:
        start = host_pointer(b)
        if start <= p and p + n <= start + b.nbytes:
          return start, b.nbytes
    return None

  def clear(self) -> None:
    """Drops every free buffer (telling the listeners)."""
    with self._lock:
      evicted = self._evict(0)
      listeners = list(self._listeners)
    self._notify(evicted, listeners)

  def bytes_in_use(self) -> int:
    """Bytes of pooled buffers referenced now (by leaves, or by transfers
    that may still touch them); 0 when nothing holds a pooled buffer."""
    with self._lock:
      return sum(b.nbytes for i, b in enumerate(self._buffers) if not self._free_at(i))

  def pooled_bytes(self) -> int:
    """Bytes the pool keeps now, in use or free."""
    with self._lock:
      return sum(b.nbytes for b in self._buffers)

  def counters(self) -> dict[str, int]:
    """What the pool holds now: `buffers` it keeps, `free_buffers` among them
    (nothing references them), `pooled_bytes`, `bytes_in_use` and `stranded`
    buffers (kept for good after a listener failed on them)."""
    with self._lock:
      free = [self._free_at(i) for i in range(len(self._buffers))]
      return {
          "buffers": len(self._buffers),
          "free_buffers": sum(free),
          "pooled_bytes": sum(b.nbytes for b in self._buffers),
          "bytes_in_use": sum(b.nbytes for b, f in zip(self._buffers, free) if not f),
          "stranded": len(self._stranded),
      }


#: The process's host buffer pool (receive buffers and send staging buffers).
host_pool = HostBufferPool()
