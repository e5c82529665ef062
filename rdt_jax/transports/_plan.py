"""Receive plans: where each chunk of an object lands on the consumer, and how
its leaves are rebuilt from there.

A `ReceivePlan` decides, per leaf, the array type it arrives as (receive mode
or target), its device, and its memory: host chunks share one pooled, 64-byte
aligned buffer (one allocation and one registration for an object of many
small leaves, every leaf a zero-copy view into it); device chunks share one
pooled region per device (`_memory.device_pool`, registered once while the
pool keeps it, released for reuse only after the bytes landed and the leaves
were built); leaves with a numpy/torch target are received straight into the
target's memory, or staged (below). Backends see only the resulting
`Destination`s (`rdt_jax.transports._destinations`, with `Placement`).

Caller memory (a numpy/torch target, an `rdt_jax.Slice(into=...)` buffer) is
never written after its fetch returned or failed. A backend whose every write
ends before its receive hooks return (`DlpackTransport.receives_synchronously`:
node-local reads, collectives, in-band copies) receives straight into it
(`Destination.caller` marks it). Any other receive (a NIXL READ, which a fetch
may give up while it still runs) is *staged*: the leaf lands in rdt_jax's own
pooled memory, which a READ given up in flight keeps out of reuse until it
ended, and `build` copies it into the caller's buffer once the transfer
succeeded.

A leaf the consumer asks to reshard (a target sharding, or an
`rdt_jax.Slice`) is planned as copies from each source chunk's part to each
target piece (`rdt_jax._layout.target_layout`): for a backend that reads
parts (`reads_parts`: one-sided, byte-addressed), one `Destination` per
contiguous byte run of each (source chunk, target piece) intersection, so only
the bytes a piece needs cross; for any other backend, the leaf's whole chunks
are received into scratch memory and the pieces cut from them on the host.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rdt_jax import _dlpack, _layout, _memory
from rdt_jax._dlpack import Device, Framework, LeafSpec
from rdt_jax._metadata import MetadataError
from rdt_jax._targets import Target, align_targets, leaf_layout
from rdt_jax.transports._destinations import Destination, MemoryKind, Placement, memory_kind
from rdt_jax.transports._leaf_plan import JaxPending, LeafPlan


class ReceivePlan:
  """Receive buffers for one object, and how to rebuild its leaves from them.

  Raises (on construction):
    UnsupportedLeafError: for a 64-bit leaf that would arrive as jax while
      x64 is off, naming the leaf.
    ValueError: for a target that does not fit the object.

  Raises (`allocate`):
    MetadataError: for a copy planned past the end of a target, a piece or a
      source chunk (metadata that skipped `validate`), naming `obj_id`.
  """

  def __init__(
      self,
      leaves: list[LeafSpec],
      mode: str,
      target: Target | None = None,
      obj_id: str = "",
      raw: int | None = None,
      aligned: list[Any] | None = None,
  ):
    """`raw`: the index of a leaf received as it was sent, a numpy array in
    host memory whatever the mode and target (a pack buffer,
    `rdt_jax.transports._packed`). `aligned`: each leaf's target, already
    checked by `align_targets` (None: from `target`)."""
    self.obj_id = obj_id
    targets: list[Any] = (
        aligned if aligned is not None
        else align_targets(target.buffers, leaves) if target is not None and target.buffers is not None
        else [None] * len(leaves)
    )
    device = target.device if target else None
    # Leaves without a target that share (framework, device kind, dtype) get
    # the same plan but their own spec: checked once per object, not per leaf.
    checked: dict[tuple, LeafPlan] = {}
    self.plans = []
    for i, (spec, t) in enumerate(zip(leaves, targets)):
      if i == raw:
        self.plans.append(LeafPlan(spec, "numpy", Device("cpu")))
        continue
      key = (spec.framework, spec.device, spec.dtype) if t is None else None
      hit = checked.get(key) if key is not None else None
      if hit is not None:
        self.plans.append(LeafPlan(spec, hit.framework, hit.device))
        continue
      plan = self._plan_leaf(spec, mode, t, device)
      if key is not None:
        checked[key] = plan
      self.plans.append(plan)
    self.host: np.ndarray | None = None
    self._host_region: tuple[int, int] | None = None
    self._host_base = 0
    self.regions: list[_memory.Region] = []
    self.destinations: list[Destination] = []
    self.reads_parts = True

  def memory_kinds(self) -> set[MemoryKind]:
    """The memory kinds of every leaf's receive memory."""
    return {memory_kind(p.device) for p in self.plans}

  @property
  def nbytes(self) -> int:
    """Bytes the backend is asked to move (after `allocate`)."""
    return sum(d.nbytes for d in self.destinations)

  def placements(self) -> list[Placement]:
    """One `Placement` per leaf, for backends that receive whole arrays."""
    return [
        Placement(p.device, p.target if _dlpack.framework_of(p.target) == "jax" else None, p.layout)
        for p in self.plans
    ]

  @staticmethod
  def _plan_leaf(spec: LeafSpec, mode: str, target: Any, device: Device | None) -> LeafPlan:
    layout = None if target is None else leaf_layout(spec, target)
    if layout is not None:
      into = target.into if isinstance(target, _layout.Slice) else None
      into_fw = _dlpack.framework_of(into)
      if layout.sharding is not None or _dlpack.is_sharding(target) or into_fw == "jax":
        framework: Framework = "jax"
      elif into_fw is not None:
        framework = into_fw
      else:
        framework = spec.framework if mode == "source" else mode  # type: ignore[assignment]
      if framework == "jax":
        _dlpack.check_x64(spec.dtype, spec.path)
      return LeafPlan(
          spec, framework, Device("cpu"), layout=layout,
          into=into if into_fw in ("numpy", "torch") else None,
      )
    target_fw = _dlpack.framework_of(target)
    if target_fw is not None:
      device = _dlpack.device_of(target)
    elif device is None:
      device = Device(spec.device)
    framework = target_fw or (spec.framework if mode == "source" else mode)  # type: ignore[assignment]
    if framework == "cupy" and memory_kind(device) == "host":
      framework = "numpy"  # host memory was asked for: cupy's host type
    _dlpack.check_device(device, spec.path)  # cuda:N or an error, never another
    if framework == "jax":
      _dlpack.check_x64(spec.dtype, spec.path)
    return LeafPlan(spec, framework, device, target if target_fw else None)

  def allocate(self, reads_parts: bool = True, stage: bool = False) -> list[Destination]:
    """Takes the receive memory of every chunk; returns (and keeps) the
    `Destination`s, in leaf order.

    One per chunk, except for resharded leaves when `reads_parts`: one per
    byte run of each (source chunk, target piece) intersection. Without
    `reads_parts` a resharded leaf's chunks are received whole into scratch
    memory and cut on the host in `build`. With `stage`, leaves bound for
    caller memory are received into this plan's own memory and copied into
    the caller's buffer by `build` (see the module docstring).
    """
    self.reads_parts = reads_parts
    for plan in self.plans:
      plan.staged = stage and (plan.in_place or plan.into is not None)
    host_plans = [
        p for p in self.plans
        if memory_kind(p.device) == "host" and not p.in_place and (p.layout is None or not reads_parts)
    ]
    offsets, total = _layout.host_layout([p.spec for p in host_plans])
    for plan, leaf_offsets in zip(host_plans, offsets):
      plan.host_offsets = leaf_offsets
    self._allocate_regions()
    for plan in self.plans:
      if plan.layout is not None and not plan.into_direct:
        for piece in plan.layout.pieces:
          plan.piece_offsets.append(total)
          total += _memory.aligned(_piece_nbytes(piece, plan.spec))
    if total or host_plans:
      self.host = _memory.host_pool.acquire(total)
      self._host_region = _memory.host_pool.region_of(self.host)
      self._host_base = _memory.host_pointer(self.host)
    source = 0
    out = self.destinations
    host, base, region = self.host, self._host_base, self._host_region
    for plan in self.plans:
      if plan.layout is not None and reads_parts:
        out.extend(self._runs(plan, source))
      elif region is not None and plan.host_offsets and not plan.in_place:
        # The common case, inlined (`_destination`'s pooled host branch): it
        # runs once per chunk of every object.
        assert host is not None
        device = plan.device
        for i, (offset, chunk) in enumerate(zip(plan.host_offsets, plan.spec.chunks)):
          n = chunk.nbytes
          out.append(Destination(base + offset, n, device, host[offset : offset + n], region, True, source + i))
      else:
        for i, chunk in enumerate(plan.spec.chunks):
          d = self._destination(plan, i, chunk.nbytes)
          d.source = source + i
          self.destinations.append(d)
      source += len(plan.spec.chunks)
    _memory.settle_targets(p.device for p in self.plans if p.in_place or p.into is not None)
    return self.destinations

  def _allocate_regions(self) -> None:
    """One pooled region per device for every device chunk not received in place."""
    by_device: dict[Device, list[LeafPlan]] = {}
    for p in self.plans:
      if memory_kind(p.device) == "device" and not p.in_place:
        by_device.setdefault(p.device, []).append(p)
    for device, plans in by_device.items():
      offsets, total = _layout.pack_layout([p.spec for p in plans])
      source = _memory.region_source({p.framework for p in plans})
      region = _memory.device_pool.acquire(total, device, source)
      self.regions.append(region)
      for p, leaf_offsets in zip(plans, offsets):
        p.region, p.device_offsets = region, leaf_offsets

  def return_regions(self) -> None:
    """Returns the device regions to their pool, which reuses each once the
    leaves built on it are gone. Call only after the transfer reported
    success and nothing more will be built here; after a failure call
    `quarantine` instead."""
    for region in self.regions:
      region.release()
    self.regions = []

  def _piece_memory(self, plan: LeafPlan, p: int) -> tuple[int, tuple[int, int], bool, np.ndarray]:
    """(pointer, region, pooled, uint8 view) of piece `p`'s receive buffer."""
    nbytes = _piece_nbytes(plan.layout.pieces[p], plan.spec)  # type: ignore[union-attr]
    if plan.into_direct:
      pointer = _dlpack.buffer_pointer(plan.into)
      return pointer, (pointer, nbytes), False, _dlpack.host_bytes(pointer, nbytes)
    assert self.host is not None
    offset = plan.piece_offsets[p]
    base = _memory.host_pointer(self.host)
    view = self.host[offset : offset + nbytes]
    if self._host_region is not None:
      return base + offset, self._host_region, True, view
    return base + offset, (base, self.host.nbytes), False, view

  def _runs(self, plan: LeafPlan, source: int) -> list[Destination]:
    """A destination per byte run a resharded leaf's pieces need."""
    layout = plan.layout
    assert layout is not None
    boxes = _dlpack.source_boxes(plan.spec)
    itemsize = plan.spec.dtype.itemsize
    out = []
    for p, piece in enumerate(layout.pieces):
      pointer, region, pooled, view = self._piece_memory(plan, p)
      for c, box in enumerate(boxes):
        part = _dlpack.intersect(box, piece)
        if part is None:
          continue
        piece_nbytes = _piece_nbytes(piece, plan.spec)
        for src_off, dst_off, n in _layout.copy_runs(box, piece, part, itemsize):
          self._check_fits(plan.spec, c, src_off + n, plan.spec.chunks[c].nbytes, "its source chunk")
          self._check_fits(plan.spec, c, dst_off + n, piece_nbytes, f"piece {p}")
          out.append(Destination(
              pointer + dst_off, n, plan.device, view[dst_off : dst_off + n], region,
              pooled, source + c, src_off, True, caller=plan.into_direct,
          ))
    return out

  def _check_fits(self, spec: LeafSpec, chunk: int, end: int, room: int, what: str) -> None:
    """Refuses a copy planned past the end of the memory it lands in or is
    read from (`end` bytes into `room`): only metadata that `validate` did
    not check can plan one.

    Raises:
      MetadataError: naming the object, the leaf and the chunk.
    """
    if not 0 <= end <= room:
      raise MetadataError(
          self.obj_id, f"chunks[{chunk}]", f"plans {end} bytes into {what}, which holds {room}", spec.path
      )

  def _destination(self, plan: LeafPlan, i: int, nbytes: int) -> Destination:
    if plan.in_place:
      t = plan.target
      pointer = _dlpack.buffer_pointer(t)
      room = math.prod(int(n) for n in t.shape) * _dlpack.dtype_of(t).itemsize
      self._check_fits(plan.spec, i, nbytes, room, "its target")
      return Destination(pointer, nbytes, plan.device, t, (pointer, nbytes), caller=True)
    if memory_kind(plan.device) == "host":
      assert self.host is not None
      offset = plan.host_offsets[i]
      view = self.host[offset : offset + nbytes]
      base = self._host_base
      if self._host_region is not None:  # a pooled buffer: faulted in, reusable
        return Destination(base + offset, nbytes, plan.device, view, self._host_region, True)
      return Destination(base + offset, nbytes, plan.device, view, (base, self.host.nbytes))
    region = plan.region
    assert region is not None
    offset = plan.device_offsets[i]
    return Destination(
        region.pointer + offset, nbytes, plan.device, region.lease(offset, nbytes),
        (region.pointer, region.nbytes), region.kept,
    )

  def quarantine(self) -> None:
    """After a failed fetch: drops this plan's references to its receive
    memory without returning any of it to a pool.

    A transfer given up in flight may still write there, so its memory is
    reused only once nothing references it: the backend keeps its own
    references (`Destination.keepalive`: for a device region, a view of it)
    for as long as a transfer may still write, and the plan's must not
    outlive the failure in a traceback that Ray keeps. The host buffer pool
    and the device region pool both count those references, so device regions
    are released to their pool here and reused only after the backend let go;
    a "jax-copy" region (no torch to count views) is never released: it stays
    out of reuse for good."""
    for d in self.destinations:
      d.keepalive = None
    self.destinations = []
    self.host = None
    self._host_region = None
    for plan in self.plans:
      plan.region = None
    for region in self.regions:
      if region.counts_users:
        region.release()
    self.regions = []

  def build(self) -> list[Any]:
    """The received leaves, as each plan's framework (after the bytes moved).

    Returns the device regions to their pool afterwards (`return_regions`); a region
    whose leaves are device copies ("jax-copy") only once those copies ran.
    The destinations are dropped first: the bytes have moved, and their
    `keepalive` views would keep a region in use for as long as this plan lives.
    """
    for d in self.destinations:
      d.keepalive = None
    self.destinations = []
    try:
      leaves = self._build_all()
    except BaseException:
      if all(r.source != "jax-copy" for r in self.regions):
        self.return_regions()  # no copy out of them can still be queued
      raise
    if any(r.source == "jax-copy" for r in self.regions):
      _dlpack.block_until_ready(leaves)
    self.return_regions()
    return leaves

  def _build_all(self) -> list[Any]:
    # Caller memory received into this plan's own device memory (staged) is
    # copied in by `_build_leaf` on torch's current stream: work queued
    # against those targets on any other stream runs first.
    _memory.settle_targets(p.device for p in self.plans if p.staged and memory_kind(p.device) == "device")
    # Host leaves arriving as jax are made in one call per device: jax's
    # per-array overhead dominates objects of many small leaves.
    leaves: list[Any] = []
    batches: dict[Device, list[int]] = {}
    host = self.host
    for p in self.plans:
      spec = p.spec
      if p.framework == "jax" and p.target is None and p.layout is None and len(p.host_offsets) == 1 \
          and spec.sharding is None:
        # The common case, inlined (`_build_leaf`'s host jax branch).
        assert host is not None
        offset, chunk = p.host_offsets[0], spec.chunks[0]
        batches.setdefault(p.device, []).append(len(leaves))
        leaves.append(host[offset : offset + chunk.nbytes].view(spec.dtype).reshape(chunk.shape))
        continue
      leaf = self._build_leaf(p)
      if isinstance(leaf, JaxPending):
        batches.setdefault(leaf.device, []).append(len(leaves))
        leaf = leaf.view
      leaves.append(leaf)
    for device, indices in batches.items():
      arrays = _dlpack.host_to_jax_many([leaves[i] for i in indices], device)
      for i, array in zip(indices, arrays):
        leaves[i] = array
    return leaves

  def adopt(self, received: list[Any]) -> list[Any]:
    """The leaves from whole arrays a backend received (one per leaf, any
    framework): converted to each plan's framework, or copied into
    numpy/torch/cupy targets (`_memory.copy_into_many`: a CUDA target is
    written after the work queued against it on any stream, and the copies
    have ended before the received arrays can be dropped)."""
    out: list[Any] = []
    copies: list[tuple[Any, Any]] = []
    for plan, leaf in zip(self.plans, received):
      caller = plan.into if plan.into is not None else (
          plan.target if plan.target is not None and plan.framework != "jax" else None)
      if caller is not None:
        copies.append((caller, leaf))
        out.append(caller)
      else:
        out.append(_dlpack.convert_leaf(leaf, plan.framework, plan.spec.path))
    _memory.copy_into_many(copies)
    return out

  def _build_resharded(self, plan: LeafPlan) -> Any:
    layout, spec = plan.layout, plan.spec
    assert layout is not None
    views = [
        self._piece_memory(plan, p)[3].view(spec.dtype).reshape(_dlpack.box_shape(piece))
        for p, piece in enumerate(layout.pieces)
    ]
    if not self.reads_parts:  # whole chunks arrived in scratch memory: cut
      assert self.host is not None
      boxes = _dlpack.source_boxes(spec)
      for off, chunk, box in zip(plan.host_offsets, spec.chunks, boxes):
        chunk_view = _layout.host_chunk(self.host, off, spec.dtype, chunk)
        for view, piece in zip(views, layout.pieces):
          _layout.cut(view, piece, chunk_view, box)
    if plan.into is not None:
      if plan.staged:
        _copy_to_caller(plan.into, self._piece_memory(plan, 0)[3])
      _dlpack.mark_written(plan.into)  # raw writes: torch's autograd must see them
      return plan.into
    if layout.sharding is not None:
      return _layout.build_sharded(views, layout, spec.path)
    return _dlpack.rebuild_view(views[0], plan.framework, plan.device, spec.path)

  def _build_leaf(self, plan: LeafPlan) -> Any:
    spec = plan.spec
    if plan.layout is not None:
      return self._build_resharded(plan)
    if plan.in_place:
      _dlpack.mark_written(plan.target)  # raw writes: torch's autograd must see them
      return plan.target
    if memory_kind(plan.device) == "device":
      region = plan.region
      assert region is not None
      if plan.staged:  # one chunk: a target is never sharded
        nbytes = spec.chunks[0].nbytes
        _memory.copy_bytes(
            _dlpack.buffer_pointer(plan.target), region.pointer + plan.device_offsets[0], nbytes, plan.device
        )
        _memory.wait_for_copies(plan.device)  # the region is reused once build returns
        _dlpack.mark_written(plan.target)
        return plan.target
      views = [
          region.view(off, chunk.nbytes) for off, chunk in zip(plan.device_offsets, spec.chunks)
      ]
      return _dlpack.rebuild_device(views, spec, plan.framework)
    assert self.host is not None
    views = [
        _layout.host_chunk(self.host, off, spec.dtype, chunk)
        for off, chunk in zip(plan.host_offsets, spec.chunks)
    ]
    if plan.staged:  # one chunk: a target is never sharded
      offset = plan.host_offsets[0]
      _copy_to_caller(plan.target, self.host[offset : offset + spec.chunks[0].nbytes])
      _dlpack.mark_written(plan.target)
      return plan.target
    if plan.framework == "jax" and spec.sharding is None:
      return JaxPending(views[0], plan.device)  # made in build(), batched
    leaf = _dlpack.rebuild_host(views, spec, plan.framework, plan.device)
    if plan.target is not None and plan.framework != "jax":
      # A sharded leaf received for a numpy/torch target: one copy into it.
      _memory.copy_into(plan.target, leaf)
      return plan.target
    return leaf


def _copy_to_caller(target: Any, staged: np.ndarray) -> None:
  """Copies the bytes of a staged leaf (a uint8 view of host memory) into
  the caller's host buffer `target`, byte for byte (any dtype)."""
  np.copyto(_dlpack.host_bytes(_dlpack.buffer_pointer(target), staged.nbytes), staged)


def _piece_nbytes(piece: _dlpack.Box, spec: LeafSpec) -> int:
  return math.prod(_dlpack.box_shape(piece)) * spec.dtype.itemsize
