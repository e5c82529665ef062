"""Device receive and staging regions: one pool, registered once, device-agnostic.

A `RegionPool` hands out `Region`s: one allocation per object and device,
into which every chunk of that object on that device is packed
(`rdt_jax._layout.pack_layout`), so a backend registers one region per
object instead of one per leaf, and a region it registered stays registered
while the pool keeps it (NIXL's registration cost grows with the number of
regions).

The pool knows nothing about CUDA: an `Allocator` makes the memory and says
whether anything still uses it. The same pool logic runs on host memory in
the tests (torch cpu tensors and jax cpu arrays standing in for device
buffers) and on cuda devices in a GPU process.

Reuse rule (a transfer's first duty is never to deliver wrong bytes): a
region is handed out again only when

1. its holder released it (`Region.release`): the transfer into it reported
   DONE and the leaves were built; a region whose transfer failed, timed out
   or was dropped is never released, so it stays *quarantined*: kept, never
   reused, never freed back to the framework's allocator (which could give
   the memory to a new tensor that a late write would then corrupt); and
2. no array built on it is alive (`Allocator.in_use`: for a torch-viewed
   region, the reference count of its storage, which counts every view, and
   every DLPack export of a view, jax arrays made from it included; where
   this torch's count cannot be trusted, `_torch.storage_use_count_works`,
   a region is never reused); and
3. before it is written again, every stream of its device has drained
   (`Allocator.reuse`: kernels queued against the arrays that were built on
   it may outlive their last Python reference).

A failed transfer's region (`ReceivePlan.quarantine`) is released at once
when its memory is torch's: the backend whose transfer may still write holds
a view of it (`Destination.keepalive`), which keeps it in use by rule 2
until the transfer ended. A "jax-copy" region (no torch: nothing counts its
users) stays quarantined.

Eviction tells the listeners (a backend deregisters) while the region is
still alive and hands them its root (`keepalive`); a listener that raises is
logged, not raised into the unrelated caller whose release or acquire evicted,
and the region is kept (`stranded`), never freed or reused.

Where the memory comes from (`source`): "torch" allocates through torch's
caching allocator; "jax" through XLA's allocator (a `jnp.zeros` buffer, viewed
through torch by DLPack), so that a jax consumer's receive buffers live inside
XLA's preallocated pool instead of competing with it. Both need torch in the
consuming process for the zero-copy byte views; without torch a region is a
jax array of its own and leaves are built from it by a copy (`source`
"jax-copy", see `rdt_jax._dlpack._jax.from_device_bytes`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rdt_jax import _settings
from rdt_jax._dlpack import _jax, _torch
from rdt_jax._dlpack._devices import Device
from rdt_jax._memory import _cuda
from rdt_jax._memory._gc import release_deferred
from rdt_jax._memory._host import tell_listeners

Source = Literal["torch", "jax", "jax-copy"]


def region_source(frameworks: set[str]) -> Source:
  """Where a region for leaves arriving as `frameworks` should come from.

  The memory rule: a region holding any leaf that arrives as jax is made by
  XLA's allocator ("jax"), so it lives inside the memory XLA preallocated
  instead of competing with it; otherwise torch's ("torch"). Without torch in
  this process, "jax-copy" (leaves are device copies out of the region).
  """
  if not _torch.available():
    return "jax-copy"
  return "jax" if "jax" in frameworks else "torch"


class Allocator(Protocol):
  """Makes region memory and tells whether arrays built on it are alive."""

  def allocate(self, nbytes: int, device: Device, source: Source) -> tuple[Any, int]:
    """A fresh region: its owning object (the root) and its address."""
    ...

  def in_use(self, root: Any) -> bool:
    """True while any array other than `root` itself uses the memory."""
    ...

  def view(self, root: Any, offset: int, nbytes: int) -> Any:
    """A uint8 view of `nbytes` at `offset` inside the region (zero-copy for
    torch roots; a copy for "jax-copy" roots)."""
    ...

  def reuse(self, root: Any, device: Device) -> None:
    """Called before a free region is handed out again: returns once no work
    queued against arrays that were built on it can still run."""
    ...


class FrameworkAllocator:
  """The allocator of every pool in rdt_jax: torch or jax memory, torch views."""

  def allocate(self, nbytes: int, device: Device, source: Source) -> tuple[Any, int]:
    if source == "torch":
      root, pointer = _torch.empty_bytes(nbytes, device)
      _cuda.settle_fresh(device)  # kernels queued on the freed block come first
      return root, pointer
    array, pointer = _jax.empty_bytes(nbytes, device)
    if source == "jax":
      return _torch.from_dlpack(array), pointer
    return array, pointer

  def in_use(self, root: Any) -> bool:
    if not _torch.is_tensor(root):
      return False  # a "jax-copy" root: leaves are copies, waited for before release
    if not _torch.storage_use_count_works():
      return True  # cannot tell: never reuse
    return _torch.storage_use_count(root) > 1

  def view(self, root: Any, offset: int, nbytes: int) -> Any:
    return root[offset : offset + nbytes]

  def reuse(self, root: Any, device: Device) -> None:
    _cuda.settle_reuse(device)


@dataclass(eq=False)
class Region:
  """One pooled allocation: the chunks of one object on one device.

  Attributes:
    root: the object owning the memory (a torch uint8 tensor, or a jax uint8
      array for source "jax-copy").
    pointer: its first byte's address.
    nbytes: its size.
    device: where it lives.
    source: which framework allocated it.
    kept: True while the pool keeps it for reuse (a backend may keep its
      registration until the pool's eviction listeners are told).
  """

  root: Any
  pointer: int
  nbytes: int
  device: Device
  source: Source
  kept: bool = False
  held: bool = True
  _pool: RegionPool | None = field(default=None, repr=False)

  def view(self, offset: int, nbytes: int) -> Any:
    """A uint8 view of part of the region (see `Allocator.view`)."""
    assert self._pool is not None
    return self._pool.allocator.view(self.root, offset, nbytes)

  @property
  def counts_users(self) -> bool:
    """True if the pool sees every array or view using this region (torch
    memory): then a holder may `release` it while a transfer still holds a
    `lease`, which keeps it out of reuse until dropped."""
    return self.source != "jax-copy"

  def lease(self, offset: int, nbytes: int) -> Any:
    """An object whose life keeps this region in use: a zero-copy view of
    `nbytes` at `offset` where the pool counts users (`counts_users`), else
    the root itself. A backend whose transfer may still write keeps it."""
    return self.view(offset, nbytes) if self.counts_users else self.root

  def release(self) -> None:
    """The holder is done writing and reading the region itself: the transfer
    into it reported DONE and the leaves on it exist. Only then can it be
    reused (once those leaves are gone). Never call this for a region a
    transfer may still write: leave it held (quarantined)."""
    if self._pool is not None:
      self._pool._release(self)


class RegionPool:
  """Reuses device regions; see the module docstring for the reuse rule.

  Free regions are kept up to `max_bytes` in total (env var
  `RDT_JAX_DEVICE_POOL_BYTES`, default 1 GiB; 0 disables reuse), least
  recently used dropped first, after telling every eviction listener
  (`fn(pointer, nbytes, device)`: a backend deregisters the memory).
  """

  def __init__(self, allocator: Allocator | None = None, max_bytes: int | None = None):
    if max_bytes is None:
      max_bytes = _settings.value("RDT_JAX_DEVICE_POOL_BYTES")
    self.allocator: Allocator = allocator or FrameworkAllocator()
    self.max_bytes = max_bytes
    self._regions: list[Region] = []  # every live region, least recently used first
    self._listeners: list[Callable[..., None]] = []
    self._stranded: list[Region] = []  # evicted regions a listener failed on
    self._lock = threading.Lock()

  def add_eviction_listener(self, fn: Callable[..., None]) -> None:
    """Calls `fn(pointer, nbytes, device, keepalive=root)` for each region the
    pool stops keeping, before its memory can be freed; a listener that must
    keep the memory past its return (a failed deregistration) keeps `keepalive`."""
    with self._lock:
      self._listeners.append(fn)

  def _free(self, r: Region) -> bool:
    return not r.held and not self.allocator.in_use(r.root)

  def acquire(self, nbytes: int, device: Device, source: Source) -> Region:
    """A held region of at least `nbytes` on `device` from `source`.

    Reuses a free region of the same device and source (the smallest that
    fits, up to 2x `nbytes`), else allocates one. The caller releases it
    (`Region.release`) once no transfer can write it any more.
    """
    with self._lock:
      best = self._best_free(nbytes, device, source)
      if best is None and any(r.device == device and nbytes <= r.nbytes <= 2 * nbytes for r in self._regions):
        release_deferred()  # a region whose jax leaves are gone may be waiting for the collector
        best = self._best_free(nbytes, device, source)
      if best is not None:
        self._regions.remove(best)
        self._regions.append(best)
        best.held = True
    if best is not None:
      try:
        self.allocator.reuse(best.root, device)
      except BaseException:
        best.release()
        raise
      return best
    root, pointer = self.allocator.allocate(nbytes, device, source)
    region = Region(root, pointer, nbytes, device, source, _pool=self)
    with self._lock:
      region.kept = nbytes <= self.max_bytes
      self._regions.append(region)
      evicted = self._evict(self.max_bytes)
      listeners = list(self._listeners)
    self._notify(evicted, listeners)
    return region

  def _best_free(self, nbytes: int, device: Device, source: Source) -> Region | None:
    """The smallest free region of `nbytes` to 2x `nbytes` on `device` from `source`."""
    best = None
    for r in self._regions:
      if (
          r.device == device and r.source == source and nbytes <= r.nbytes <= 2 * nbytes
          and self._free(r) and (best is None or r.nbytes < best.nbytes)
      ):
        best = r
    return best

  def _release(self, region: Region) -> None:
    with self._lock:
      region.held = False
      evicted = self._evict(self.max_bytes)
      listeners = list(self._listeners)
    self._notify(evicted, listeners)

  def _evict(self, limit: int) -> list[Region]:
    """Drops free regions, oldest first, until at most `limit` bytes of kept
    regions remain; regions never kept are dropped as soon as they are free."""
    evicted = []
    total = sum(r.nbytes for r in self._regions if r.kept)
    for r in list(self._regions):
      if not self._free(r):
        continue
      if not r.kept or total > limit:
        self._regions.remove(r)
        if r.kept:
          total -= r.nbytes
          evicted.append(r)
    return evicted

  def _notify(self, evicted: list[Region], listeners: list[Callable[..., None]]) -> None:
    """Tells every listener of each evicted region (alive until they all
    returned); one a listener raised on is kept (`stranded`)."""
    for r in evicted:
      if tell_listeners(listeners, r.pointer, r.nbytes, r.device, r.root):
        with self._lock:
          self._stranded.append(r)

  def clear(self) -> None:
    """Drops every free region (telling the listeners)."""
    with self._lock:
      evicted = self._evict(0)
      listeners = list(self._listeners)
    self._notify(evicted, listeners)

  def pooled_bytes(self) -> int:
    """Bytes of kept regions, in use or free."""
    with self._lock:
      return sum(r.nbytes for r in self._regions if r.kept)

  def stranded(self) -> int:
    """Evicted regions kept because an eviction listener failed on them."""
    with self._lock:
      return len(self._stranded)

  def quarantined(self) -> int:
    """Regions still held (a transfer into them in flight, failed or dropped)."""
    with self._lock:
      return sum(1 for r in self._regions if r.held)


#: The process's device region pool (receive regions and send staging).
device_pool = RegionPool()
