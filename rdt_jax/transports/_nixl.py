"""`jax_nixl`: one-sided transfers with NIXL (UCX), for cpu and cuda memory.

The producer registers each leaf's buffer with its process's NIXL agent and
puts the serialized descriptors and the agent's metadata in the RDT metadata.
The consumer allocates its receive buffers, registers them, and issues one
NIXL READ for the whole object; `ray.get` of many refs starts every READ
before waiting on any.

Choices, measured on this project's 2-core CPU host (see docs/performance.md):

* One agent per process, created on first use, with NIXL's progress thread
  off: idle, that thread spins a core. The producer side is progressed
  instead by a thread that calls `get_new_notifs()` every 10 ms, and only
  while this process has memory registered; otherwise it sleeps on a
  condition and costs nothing.
* Registrations are cached per buffer and reference-counted across objects:
  sending the same array in two objects registers it once; `garbage_collect`
  deregisters it when the last object holding it is freed.
* Remote agents are added (or refreshed, when their registrations changed)
  and never removed while the process runs: removing an agent kills its
  in-flight transfers, which is how Ray's own NIXL transport fails batched
  gets while the producer frees objects. Re-adding an agent is safe.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Final

from rdt_jax import _arrays, _compat
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports._base import Destination, DlpackTransport

#: Seconds between progress polls of a process that has memory registered.
PROGRESS_INTERVAL_S: Final = 0.01


@dataclass
class NixlTransportMetadata(DlpackTransportMetadata):
  """`jax_nixl` metadata: where the producer's chunks are and who has them.

  Attributes:
    agent_name: the producer's NIXL agent.
    agent_meta: that agent's metadata (for `add_remote_agent`).
    agent_version: bumped whenever the producer registers new memory, so a
      consumer refreshes its view of the agent only when needed.
    descs: the serialized NIXL descriptor list, one per non-empty chunk.
  """

  agent_name: str | None = None
  agent_meta: bytes | None = None
  agent_version: int = 0
  descs: bytes | None = None

  __eq__ = object.__eq__
  __hash__ = object.__hash__


def _mem_type(kind: str) -> str:
  return "DRAM" if kind == "cpu" else "VRAM"


class _Poller:
  """Progresses an agent's target side while memory is registered."""

  def __init__(self, agent: Any):
    self._agent = agent
    self._cond = threading.Condition()
    self._active = 0
    self._thread = threading.Thread(target=self._run, name="rdt-jax-nixl-progress", daemon=True)
    self._thread.start()

  def set_active(self, count: int) -> None:
    with self._cond:
      self._active = count
      self._cond.notify()

  def _run(self) -> None:
    while True:
      with self._cond:
        while self._active == 0:
          self._cond.wait()
      try:
        self._agent.get_new_notifs()
      except Exception:  # a broken peer must not kill progress for the others
        pass
      time.sleep(PROGRESS_INTERVAL_S)


@dataclass
class _Registration:
  handle: Any
  count: int


@dataclass
class _Receive:
  xfer: Any
  keys: list[tuple]


class NixlTransport(DlpackTransport):
  """The `jax_nixl` transport: one-sided NIXL READs of cpu and cuda memory."""

  name = "jax_nixl"
  devices = ("cpu", "cuda")
  metadata_class = NixlTransportMetadata

  def __init__(self) -> None:
    super().__init__()
    self._lock = threading.RLock()
    self._agent: Any = None
    self._poller: _Poller | None = None
    self._registrations: dict[tuple, _Registration] = {}
    self._object_keys: dict[str, list[tuple]] = {}
    self._version = 0
    self._remote_versions: dict[str, int] = {}

  @staticmethod
  def is_one_sided() -> bool:
    return True

  @staticmethod
  def can_abort_transport() -> bool:
    return True

  @classmethod
  def available_in_process(cls) -> bool:
    return _compat.nixl_available()

  # ---- agent and registrations

  def agent(self) -> Any:
    """This process's NIXL agent, created on first use.

    Raises:
      ImportError: if NIXL is not installed here, saying what to install.
    """
    with self._lock:
      if self._agent is None:
        api = _compat.nixl_api()
        import ray

        actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        name = f"rdt-jax-{actor_id or 'driver'}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = api.nixl_agent(name, config)
        self._poller = _Poller(self._agent)
      return self._agent

  def _register(self, pointer: int, nbytes: int, device: _arrays.Device) -> tuple:
    key = (pointer, nbytes, device.kind, device.index)
    with self._lock:
      reg = self._registrations.get(key)
      if reg is not None:
        reg.count += 1
        return key
      handle = self.agent().register_memory(
          [(pointer, nbytes, device.index, "")], mem_type=_mem_type(device.kind)
      )
      self._registrations[key] = _Registration(handle, 1)
      self._version += 1
      self._poller.set_active(len(self._registrations))
      return key

  def _unregister(self, keys: list[tuple]) -> None:
    with self._lock:
      for key in keys:
        reg = self._registrations.get(key)
        if reg is None:
          continue
        reg.count -= 1
        if reg.count == 0:
          del self._registrations[key]
          self._agent.deregister_memory(reg.handle)
      if self._poller is not None:
        self._poller.set_active(len(self._registrations))

  def num_registrations(self) -> int:
    """How many distinct buffers this process has registered with NIXL now."""
    with self._lock:
      return len(self._registrations)

  def num_objects(self) -> int:
    """How many RDT objects this process currently exports."""
    with self._lock:
      return len(self._object_keys)

  # ---- producer

  def export_buffers(
      self,
      obj_id: str,
      leaves: list[_arrays.DescribedLeaf],
      meta: NixlTransportMetadata,
  ) -> None:
    agent = self.agent()
    keys, descs = [], []
    mem = None
    for leaf in leaves:
      for pointer, chunk, index in zip(leaf.pointers, leaf.spec.chunks, leaf.device_indices):
        if chunk.nbytes == 0:
          continue
        device = _arrays.Device(leaf.device, index)
        keys.append(self._register(pointer, chunk.nbytes, device))
        descs.append((pointer, chunk.nbytes, index))
        mem = _mem_type(leaf.device)
    with self._lock:
      self._object_keys[obj_id] = self._object_keys.get(obj_id, []) + keys
      meta.agent_version = self._version
    meta.agent_name = agent.name
    meta.agent_meta = agent.get_agent_metadata()
    if descs:
      meta.descs = agent.get_serialized_descs(agent.get_xfer_descs(descs, mem_type=mem))

  def release(self, obj_id: str) -> None:
    with self._lock:
      keys = self._object_keys.pop(obj_id, [])
    self._unregister(keys)

  # ---- consumer

  def start_receive(
      self,
      obj_id: str,
      meta: NixlTransportMetadata,
      communicator_metadata: Any,
      destinations: list[Destination],
  ) -> _Receive | None:
    dests = [d for d in destinations if d.nbytes > 0]
    if not dests:
      return None
    agent = self.agent()
    remote = meta.agent_name
    with self._lock:
      if self._remote_versions.get(remote, -1) < meta.agent_version:
        agent.add_remote_agent(meta.agent_meta)
        self._remote_versions[remote] = meta.agent_version
    keys = self._register_destinations(dests)
    try:
      local = agent.get_xfer_descs(
          [(d.pointer, d.nbytes, d.device.index) for d in dests],
          mem_type=_mem_type(dests[0].device.kind),
      )
      xfer = agent.initialize_xfer("READ", local, agent.deserialize_descs(meta.descs), remote, b"")
      receive = _Receive(xfer, keys)
      if agent.transfer(xfer) == "ERR":
        raise RuntimeError("NIXL transfer entered the error state on start.")
    except BaseException:
      self._unregister(keys)
      raise
    return receive

  def _register_destinations(self, dests: list[Destination]) -> list[tuple]:
    """Registers the receive memory: each distinct allocation once."""
    regions = {(d.region, d.device): None for d in dests}
    return [self._register(ptr, nbytes, device) for (ptr, nbytes), device in regions]

  def wait_receive(self, handle: _Receive | None, obj_id: str, timeout: float) -> None:
    if handle is None:
      return
    agent = self._agent
    deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
    sleep = 0.0
    while True:
      state = agent.check_xfer_state(handle.xfer)
      if state == "DONE":
        return
      if state == "ERR":
        raise RuntimeError(f"NIXL READ of object {obj_id} entered the error state.")
      if self.aborted(obj_id):
        raise RuntimeError(f"NIXL READ of object {obj_id} was aborted.")
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"NIXL READ of object {obj_id} timed out after {timeout}s.")
      # Spin briefly for small transfers, then back off to 1 ms sleeps.
      sleep = min(0.001, sleep + 0.00005)
      time.sleep(sleep)

  def finish_receive(self, handle: _Receive | None) -> None:
    if handle is None:
      return
    self._agent.release_xfer_handle(handle.xfer)
    self._unregister(handle.keys)
    handle.keys = []

  def cancel_receive(self, handle: _Receive | None) -> None:
    if handle is None or not handle.keys:
      return
    try:
      self._agent.release_xfer_handle(handle.xfer)
    except Exception:  # NIXL refuses to release a handle still in flight
      pass
    self._unregister(handle.keys)
    handle.keys = []
