"""The shared half of every rdt_jax transport.

`DlpackTransport` implements Ray's `TensorTransportManager` for any array
type: it turns the leaves Ray extracted into framework-neutral metadata and raw
buffers (through `rdt_jax._arrays`), allocates receive buffers, and rebuilds
the consumer's arrays. A backend subclass only moves bytes. It implements:

* `export_buffers` (producer): make the described buffers reachable and add
  what consumers need to the metadata (one-sided backends register memory);
* `start_receive` / `wait_receive` (consumer): move the bytes of every chunk
  into the given destinations;
* `release` (producer): undo `export_buffers` when Ray frees the object;
* `send_buffers` (producer, two-sided backends only): push every chunk to the
  consumer, whose `wait_receive` takes them in the same order.

Two kinds of backend need one more hook each. A two-sided backend (its
`is_one_sided()` is False) gets `send_buffers`; when the consumer cannot take
an object (a 64-bit leaf where x64 is off, a target that does not fit), the
base still receives the bytes, into scratch buffers, so the sender never
blocks on a receive that will not come. A backend that receives whole arrays
rather than bytes (`delivers_arrays = True`, e.g. `jax_transfer`) overrides
`export_arrays` to see the producer's arrays, gets one `Destination` per leaf
(a device and, for a jax target, the template array; no memory), and returns
one array per leaf from `wait_receive`; the base converts them.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
)

from rdt_jax import _arrays, _registry, _targets
from rdt_jax._metadata import DlpackTransportMetadata, Framework, LeafSpec

if TYPE_CHECKING:
  import ray


@dataclass
class Destination:
  """Where one chunk lands on the consumer.

  Attributes:
    pointer: address of the chunk's first byte.
    nbytes: the chunk's size.
    device: the device the memory is on.
    array: the framework object owning the memory (a uint8 numpy view, a
      torch tensor or a jax array), for backends that need one.
    region: `(pointer, nbytes)` of the whole allocation the chunk lies in
      (chunks of one object share a host buffer): what a backend registers.
    pooled: True if `region` belongs to the process's host buffer pool and
      outlives this transfer (a backend may keep it registered until the
      pool evicts it; see `rdt_jax._arrays.HostBufferPool`).
  """

  pointer: int
  nbytes: int
  device: _arrays.Device
  array: Any
  region: tuple[int, int]
  pooled: bool = False


@dataclass(frozen=True)
class _JaxPending:
  """A host view that build() turns into a jax.Array with its batch."""

  view: Any
  device: _arrays.Device


@dataclass
class _LeafPlan:
  spec: LeafSpec
  framework: Framework
  device: _arrays.Device
  target: Any = None  # a numpy/torch array received in place, or a jax template
  host_offsets: list[int] = field(default_factory=list)
  device_buffers: list[_arrays.DeviceBuffer] = field(default_factory=list)


class ReceivePlan:
  """Receive buffers for one object, and how to rebuild its leaves from them.

  Host chunks share one 64-byte aligned buffer, so an object of many small
  leaves costs one allocation (and one registration); every leaf is a
  zero-copy view into it. Device chunks get a buffer each. Leaves with a
  numpy/torch target are received straight into the target's memory.
  """

  def __init__(
      self,
      leaves: list[LeafSpec],
      mode: str,
      target: _targets.Target | None = None,
      allocate: bool = True,
  ):
    targets = (
        _targets.align_targets(target.buffers, leaves)
        if target is not None and target.buffers is not None
        else [None] * len(leaves)
    )
    self.plans = [
        self._plan_leaf(spec, mode, t, target.device if target else None)
        for spec, t in zip(leaves, targets)
    ]
    self.host: Any = None
    self.destinations: list[Destination] = []
    if allocate:
      self._allocate()

  def leaf_destinations(self) -> list[Destination]:
    """One memory-less Destination per leaf: where it should arrive.

    For backends that receive whole arrays (`delivers_arrays`): `device` is
    the leaf's receive device and `array` its jax target (a placement
    template) or None; `pointer` and `region` are 0.
    """
    return [
        Destination(
            0,
            p.spec.nbytes,
            p.device,
            p.target if _arrays.framework_of(p.target) == "jax" else None,
            (0, 0),
        )
        for p in self.plans
    ]

  @staticmethod
  def _plan_leaf(
      spec: LeafSpec, mode: str, target: Any, device: _arrays.Device | None
  ) -> _LeafPlan:
    target_fw = _arrays.framework_of(target)
    if target_fw == "jax":
      devices = list(target.sharding.device_set)
      device = _arrays.parse_device(devices[0])
    elif target_fw is not None:
      device = _arrays.parse_device(getattr(target, "device", "cpu"))
    elif device is None:
      device = _arrays.Device(spec.device)
    framework = target_fw or (spec.framework if mode == "source" else mode)
    if framework == "jax":
      _arrays.check_x64(spec.dtype, spec.path)
    return _LeafPlan(spec, framework, device, target if target_fw else None, [], [])

  def _allocate(self) -> None:
    host_plans = [p for p in self.plans if p.device.kind == "cpu" and not self._in_place(p)]
    offsets, total = _arrays.host_layout([p.spec for p in host_plans])
    self.host = _arrays.host_pool.acquire(total) if host_plans else None
    self._host_region = _arrays.host_pool.region_of(self.host) if host_plans else None
    for plan, leaf_offsets in zip(host_plans, offsets):
      plan.host_offsets = leaf_offsets
    for plan in self.plans:
      for i, chunk in enumerate(plan.spec.chunks):
        self.destinations.append(self._destination(plan, i, chunk.nbytes))

  @staticmethod
  def _in_place(plan: _LeafPlan) -> bool:
    return (
        plan.target is not None
        and _arrays.framework_of(plan.target) != "jax"
        and plan.spec.sharding is None
    )

  def _destination(self, plan: _LeafPlan, i: int, nbytes: int) -> Destination:
    if self._in_place(plan):
      t = plan.target
      fw = _arrays.framework_of(t)
      pointer = t.ctypes.data if fw == "numpy" else t.data_ptr()
      return Destination(pointer, nbytes, plan.device, t, (pointer, nbytes))
    if plan.device.kind == "cpu":
      offset = plan.host_offsets[i]
      view = self.host[offset : offset + nbytes]
      base = self.host.ctypes.data
      if self._host_region is not None:  # a pooled buffer: faulted in, reusable
        return Destination(base + offset, nbytes, plan.device, view, self._host_region, True)
      return Destination(base + offset, nbytes, plan.device, view, (base, self.host.nbytes))
    buf = _arrays.allocate_device_buffer(nbytes, plan.device)
    plan.device_buffers.append(buf)
    return Destination(buf.pointer, nbytes, plan.device, buf.array, (buf.pointer, buf.nbytes))

  def build(self, received: list[Any] | None = None) -> list[Any]:
    """The received leaves, as each plan's framework (after the bytes moved).

    Args:
      received: for a backend that receives whole arrays, one array (of any
        framework) per leaf; converted, or copied into numpy/torch targets.
    """
    if received is not None:
      return [self._adopt_leaf(p, x) for p, x in zip(self.plans, received)]
    leaves = [self._build_leaf(p) for p in self.plans]
    # Host leaves arriving as jax are made in one call per device: jax's
    # per-array overhead dominates objects of many small leaves.
    batches: dict[_arrays.Device, list[int]] = {}
    for i, leaf in enumerate(leaves):
      if isinstance(leaf, _JaxPending):
        batches.setdefault(leaf.device, []).append(i)
    for device, indices in batches.items():
      arrays = _arrays.host_to_jax_many([leaves[i].view for i in indices], device)
      for i, array in zip(indices, arrays):
        leaves[i] = array
    return leaves

  @staticmethod
  def _adopt_leaf(plan: _LeafPlan, leaf: Any) -> Any:
    if plan.target is not None and plan.framework != "jax":
      _arrays.copy_into(plan.target, leaf)
      return plan.target
    return _arrays.convert_leaf(leaf, plan.framework, plan.spec.path)

  def _build_leaf(self, plan: _LeafPlan) -> Any:
    spec = plan.spec
    if self._in_place(plan):
      return plan.target
    if plan.device.kind != "cpu":
      return _arrays.rebuild_device(plan.device_buffers, spec, plan.framework)
    views = [
        _arrays.host_chunk(self.host, off, spec.dtype, chunk)
        for off, chunk in zip(plan.host_offsets, spec.chunks)
    ]
    if plan.framework == "jax" and spec.sharding is None:
      return _JaxPending(views[0], plan.device)  # made in build(), batched
    leaf = _arrays.rebuild_host(views, spec, plan.framework, plan.device)
    if plan.target is not None and plan.framework != "jax":
      # A sharded leaf received for a numpy/torch target: one copy into it.
      _arrays.copy_into(plan.target, leaf)
      return plan.target
    return leaf


@dataclass
class DlpackFetchRequest(FetchRequest):
  """An in-flight fetch: the receive plan and the backend's transfer handle."""

  plan: ReceivePlan | None = None
  handle: Any = None
  transport: "DlpackTransport | None" = None
  done: bool = False

  def __del__(self) -> None:
    if self.transport is not None and not self.done:
      self.transport.cancel_receive(self.handle)


class DlpackTransport(TensorTransportManager):
  """Base class of every rdt_jax transport: subclass it to add a backend.

  The base implements Ray's `TensorTransportManager` for jax, torch and numpy
  leaves alike: it validates and describes the leaves Ray extracted, builds
  the metadata (`DlpackTransportMetadata`), allocates receive buffers (a
  `Destination` per chunk), rebuilds each leaf as the type the consumer asked
  for (`rdt_jax.receive_as`) and handles targets, aborts and errors. A
  subclass only moves bytes. It sets:

  * `name`: the lower-case transport name users pass as `tensor_transport`;
  * `devices`: the device kinds it moves ("cpu", "cuda");
  * `is_one_sided()` and `can_abort_transport()` (Ray's static methods);

  and implements, on the producer, `export_buffers(obj_id, leaves, meta)`
  (make the described buffers reachable, add what consumers need to `meta`)
  and `release(obj_id)` (undo it when Ray frees the object); a two-sided
  backend also `send_buffers(...)`. On the consumer it implements
  `start_receive(obj_id, meta, communicator_metadata, destinations)` (start
  moving every chunk into its destination; return a handle),
  `wait_receive(handle, obj_id, timeout)`, and `finish_receive(handle)` /
  `cancel_receive(handle)` to release what the receive took. A backend that
  receives whole arrays instead of bytes sets `delivers_arrays = True` and
  overrides `export_arrays`. Register a subclass with
  `rdt_jax.register_transport(MyTransport)`; `examples/shm_transport.py` is a
  complete one in under 100 lines.
  """

  name: ClassVar[str]
  devices: ClassVar[tuple[str, ...]] = ("cpu",)
  metadata_class: ClassVar[type[DlpackTransportMetadata]] = DlpackTransportMetadata
  #: True if `wait_receive` returns whole arrays (one per leaf) instead of
  #: writing bytes into allocated destinations; see the module docstring.
  delivers_arrays: ClassVar[bool] = False

  def __init__(self) -> None:
    self._aborted: set[str] = set()
    self._aborted_lock = threading.Lock()
    self._actors_with_transport: dict[str, bool] = {}

  # ---- Ray's interface, shared by every backend.

  def tensor_transport_backend(self) -> str:
    return self.name.upper()

  @classmethod
  def available_in_process(cls) -> bool:
    """True if this process can run the transport (its dependencies import)."""
    return True

  def actor_has_tensor_transport(self, actor: "ray.actor.ActorHandle") -> bool:
    """Asks `actor` once whether it can run this transport; cached per actor."""
    import ray

    actor_id = actor._actor_id.hex()
    if actor_id not in self._actors_with_transport:
      ref = actor.__ray_call__.options(concurrency_group="_ray_system").remote(
          _actor_can_run, type(self)
      )
      self._actors_with_transport[actor_id] = bool(ray.get(ref))
    return self._actors_with_transport[actor_id]

  def extract_tensor_transport_metadata(
      self, obj_id: str, rdt_object: list[Any]
  ) -> DlpackTransportMetadata:
    """Ray calls this on the producer when it stores an RDT object."""
    described = _registry.take_described(rdt_object)
    device = self._common_device(described)
    meta = self.metadata_class(
        tensor_meta=[(d.spec.shape, d.spec.dtype) for d in described],
        tensor_device=device,
        leaves=[d.spec for d in described],
    )
    if described:
      self.export_arrays(obj_id, rdt_object, described, meta)
    return meta

  def _common_device(self, described: list[_arrays.DescribedLeaf]) -> str | None:
    if not described:
      return None
    first = described[0]
    for d in described:
      if d.device not in self.devices:
        raise _arrays.UnsupportedLeafError(
            d.spec.path,
            f"(dtype {d.spec.dtype.name}) lives on a {d.device} device, which "
            f"the {self.name} transport does not move (it moves "
            f"{', '.join(self.devices)})",
            "Use a transport for that device (jax_nixl moves cpu and cuda), "
            "or move the array first.",
        )
      if d.device != first.device:
        raise _arrays.UnsupportedLeafError(
            d.spec.path,
            f"lives on {d.device} but leaf {first.spec.path} lives on "
            f"{first.device}; one RDT object holds leaves of one device kind",
            "Return the cpu and cuda leaves from separate RDT methods, or "
            "move them to one device kind.",
        )
    return first.device

  def get_communicator_metadata(
      self,
      src_actor: "ray.actor.ActorHandle | None",
      dst_actor: "ray.actor.ActorHandle | None",
      backend: str | None = None,
  ) -> CommunicatorMetadata:
    return CommunicatorMetadata()

  def fetch_multiple_tensors(
      self,
      obj_id: str,
      tensor_transport_metadata: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      target_buffers: list[Any] | None = None,
  ) -> DlpackFetchRequest:
    """Ray calls this on the consumer: allocates buffers, starts the move."""
    self._raise_if_aborted(obj_id)
    target = _targets.pop_target(obj_id)
    if target is None and target_buffers:
      target = _targets.Target(buffers={f"[{i}]": b for i, b in enumerate(target_buffers)})
    leaves = tensor_transport_metadata.leaves
    try:
      plan = ReceivePlan(
          leaves, _registry.receive_mode(), target, allocate=not self.delivers_arrays
      )
    except Exception:
      if not self.is_one_sided():
        # The producer is already sending: take its bytes so it does not block.
        self._drain(obj_id, tensor_transport_metadata, communicator_metadata)
      raise
    request = DlpackFetchRequest(obj_id=obj_id, tensors=[], plan=plan, transport=self)
    destinations = plan.leaf_destinations() if self.delivers_arrays else plan.destinations
    if destinations:
      request.handle = self._wrap_errors(
          obj_id,
          self.start_receive,
          obj_id,
          tensor_transport_metadata,
          communicator_metadata,
          destinations,
      )
    return request

  def _drain(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
  ) -> None:
    """Receives an object this process cannot take into scratch buffers."""
    scratch = ReceivePlan(meta.leaves, "numpy")
    if scratch.destinations:
      handle = self.start_receive(obj_id, meta, communicator_metadata, scratch.destinations)
      self.wait_receive(handle, obj_id, -1)
      self.finish_receive(handle)

  def wait_fetch_complete(
      self, fetch_request: DlpackFetchRequest, timeout: float = -1
  ) -> list[Any]:
    """Ray calls this on the consumer: waits for the bytes, rebuilds leaves.

    Raises:
      TimeoutError: if `timeout` (seconds, -1 for none) passes first.
      ray.exceptions.RayDirectTransportError: if the transfer failed.
    """
    received = None
    if fetch_request.handle is not None:
      received = self._wrap_errors(
          fetch_request.obj_id,
          self.wait_receive,
          fetch_request.handle,
          fetch_request.obj_id,
          timeout,
      )
      fetch_request.done = True
      self.finish_receive(fetch_request.handle)
    fetch_request.done = True
    if not self.delivers_arrays:
      received = None
    elif received is None:  # an object without array leaves
      received = []
    return fetch_request.plan.build(received)

  def recv_multiple_tensors(
      self,
      obj_id: str,
      tensor_transport_metadata: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      target_buffers: list[Any] | None = None,
  ) -> list[Any]:
    """Ray calls this on the consumer of a task argument: fetch and wait."""
    request = self.fetch_multiple_tensors(
        obj_id, tensor_transport_metadata, communicator_metadata, target_buffers
    )
    return self.wait_fetch_complete(request)

  def send_multiple_tensors(
      self,
      tensors: list[Any],
      tensor_transport_metadata: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
  ) -> None:
    """Ray calls this on the producer of a two-sided transport, per consumer.

    `tensors` are the leaves this process stored for the object, in the order
    of `tensor_transport_metadata.leaves`; they are described again (cheap:
    no bytes move) and their buffers handed to `send_buffers`.
    """
    if self.is_one_sided():
      raise NotImplementedError(
          f"{self.name} is one-sided: Ray never calls send_multiple_tensors on it."
      )
    leaves = tensor_transport_metadata.leaves
    described = [_arrays.describe(t, spec.path) for t, spec in zip(tensors, leaves)]
    self.send_buffers(described, tensor_transport_metadata, communicator_metadata)

  def garbage_collect(
      self,
      obj_id: str,
      tensor_transport_meta: DlpackTransportMetadata,
      tensors: list[Any],
  ) -> None:
    """Ray calls this on the producer once the object is out of scope."""
    self.release(obj_id)

  def abort_transport(
      self, obj_id: str, communicator_metadata: CommunicatorMetadata
  ) -> None:
    """Ray calls this on both sides after a failure: the wait stops early."""
    with self._aborted_lock:
      self._aborted.add(obj_id)

  def aborted(self, obj_id: str) -> bool:
    """True (once) if Ray aborted the transfer of `obj_id` here."""
    with self._aborted_lock:
      if obj_id in self._aborted:
        self._aborted.discard(obj_id)
        return True
      return False

  def _raise_if_aborted(self, obj_id: str) -> None:
    if self.aborted(obj_id):
      raise RuntimeError(f"{self.name} transfer of object {obj_id} was aborted.")

  def _wrap_errors(self, obj_id: str, fn, *args) -> Any:
    """Runs a backend hook; failures become RayDirectTransportError."""
    from ray.exceptions import RayDirectTransportError

    try:
      return fn(*args)
    except (TimeoutError, _arrays.UnsupportedLeafError, ImportError, ValueError):
      raise
    except Exception:
      raise RayDirectTransportError(
          f"The {self.name} transfer of object {obj_id} failed. The source "
          "actor may have died during the transfer. The backend raised:\n"
          f"{traceback.format_exc()}"
      ) from None

  # ---- The backend's half.

  def export_buffers(
      self,
      obj_id: str,
      leaves: list[_arrays.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    """Producer: make the leaves' buffers reachable; extend `meta` in place."""

  def export_arrays(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_arrays.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    """Producer: like `export_buffers`, also given the leaves themselves.

    Override it in a backend that moves whole arrays rather than buffers;
    by default it calls `export_buffers`.
    """
    self.export_buffers(obj_id, leaves, meta)

  def send_buffers(
      self,
      leaves: list[_arrays.DescribedLeaf],
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
  ) -> None:
    """Producer of a two-sided backend: push every non-empty chunk, in leaf
    order, to the consumer named by `communicator_metadata`."""
    raise NotImplementedError(f"{self.name} is two-sided but has no send_buffers.")

  def start_receive(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      destinations: list[Destination],
  ) -> Any:
    """Consumer: start moving every chunk into `destinations`; return a handle."""
    raise NotImplementedError

  def wait_receive(self, handle: Any, obj_id: str, timeout: float) -> Any:
    """Consumer: block until the move started by `start_receive` is done.

    Returns:
      None; or, for a backend with `delivers_arrays`, one array per leaf.

    Raises:
      TimeoutError: after `timeout` seconds (-1: no limit).
    """

  def finish_receive(self, handle: Any) -> None:
    """Consumer: release what `start_receive` took, after success."""

  def cancel_receive(self, handle: Any) -> None:
    """Consumer: release what `start_receive` took, after failure or if the
    request was dropped unfinished."""

  def release(self, obj_id: str) -> None:
    """Producer: undo `export_buffers` for `obj_id`."""


def _actor_can_run(self: Any, cls: type[DlpackTransport]) -> bool:
  """Runs on an actor: whether it can run transport `cls`."""
  from rdt_jax import _registry as registry

  registry.install()
  return cls.available_in_process()
