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
* optionally `send_buffers` (producer, two-sided backends only).
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
  """

  pointer: int
  nbytes: int
  device: _arrays.Device
  array: Any
  region: tuple[int, int]


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
    self._allocate()

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
    self.host = _arrays.aligned_host_buffer(total) if host_plans else None
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
      return Destination(base + offset, nbytes, plan.device, view, (base, self.host.nbytes))
    buf = _arrays.allocate_device_buffer(nbytes, plan.device)
    plan.device_buffers.append(buf)
    return Destination(buf.pointer, nbytes, plan.device, buf.array, (buf.pointer, buf.nbytes))

  def build(self) -> list[Any]:
    """The received leaves, as each plan's framework (after the bytes moved)."""
    return [self._build_leaf(p) for p in self.plans]

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

  Subclasses set `name` (the lower-case transport name users pass as
  `tensor_transport`) and `devices` (the device kinds they move: "cpu",
  "cuda"), and implement the byte-moving hooks listed in the module docstring.
  Register a subclass with `rdt_jax.register_transport(MyTransport)`.
  """

  name: ClassVar[str]
  devices: ClassVar[tuple[str, ...]] = ("cpu",)
  metadata_class: ClassVar[type[DlpackTransportMetadata]] = DlpackTransportMetadata

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
      self.export_buffers(obj_id, described, meta)
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
    plan = ReceivePlan(tensor_transport_metadata.leaves, _registry.receive_mode(), target)
    request = DlpackFetchRequest(obj_id=obj_id, tensors=[], plan=plan, transport=self)
    if plan.destinations:
      request.handle = self._wrap_errors(
          obj_id,
          self.start_receive,
          obj_id,
          tensor_transport_metadata,
          communicator_metadata,
          plan.destinations,
      )
    return request

  def wait_fetch_complete(
      self, fetch_request: DlpackFetchRequest, timeout: float = -1
  ) -> list[Any]:
    """Ray calls this on the consumer: waits for the bytes, rebuilds leaves.

    Raises:
      TimeoutError: if `timeout` (seconds, -1 for none) passes first.
      ray.exceptions.RayDirectTransportError: if the transfer failed.
    """
    if fetch_request.handle is not None:
      try:
        self._wrap_errors(
            fetch_request.obj_id,
            self.wait_receive,
            fetch_request.handle,
            fetch_request.obj_id,
            timeout,
        )
      except TimeoutError:
        raise
      fetch_request.done = True
      self.finish_receive(fetch_request.handle)
    fetch_request.done = True
    return fetch_request.plan.build()

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
    raise NotImplementedError(
        f"{self.name} is one-sided: Ray never calls send_multiple_tensors on it."
    )

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

  def start_receive(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      destinations: list[Destination],
  ) -> Any:
    """Consumer: start moving every chunk into `destinations`; return a handle."""
    raise NotImplementedError

  def wait_receive(self, handle: Any, obj_id: str, timeout: float) -> None:
    """Consumer: block until the move started by `start_receive` is done.

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
