"""Memory registered with this process's NIXL agent.

A region is registered once and shared: objects and READs take references to
its registration (`register`) and drop them (`unregister`); the last drop
deregisters it. A pooled buffer's registration (the host buffer pool's
buffers, the device pool's kept regions) is flagged `pooled` and outlives
every reference: it stays registered, for reuse, until the pool evicts the
buffer (the pools' eviction listeners, `on_host_eviction` /
`on_device_eviction`).

A deregistration that fails keeps the region registered and the memory that
backs it alive (`stuck`), for the progress thread to try again
(`retry_stuck`): registered memory is never freed.

Registering and deregistering (NIXL pins or unpins the memory: gigabytes take
a while) run outside the cache's lock, so objects that use registered memory
are exported and released meanwhile. A region in either transition is marked
busy: another registration of it waits for the transition to end, then takes
a reference to the registration (or registers it again), so one region is
never registered twice.

`version` counts registrations and `dereg_epoch` deregistrations of
referenced regions (a pooled buffer leaves only when its pool evicts it, once
no object uses it): both go in the producer's metadata, so a consumer knows when its view of this agent needs
extending (new regions) or rebuilding (regions gone). `device_dereg_epoch`
counts deregistrations of device memory, pooled regions included: a device
allocator hands the same address out again, and NIXL refuses to extend a view
with a region at an address it already holds under another registration
(`views`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from rdt_jax import _dlpack, _faults
from rdt_jax._error_base import RdtJaxError
from rdt_jax.transports._destinations import memory_kind

__all__ = ["Key", "NixlError", "Registrations", "nixl_error", "nixl_memory"]

#: A registration's identity: (pointer, nbytes, device kind, device index),
#: the device as NIXL sees it (`nixl_memory`).
Key = tuple[int, int, str, int]


_HOST: Final = _dlpack.Device("cpu")


class NixlError(RdtJaxError, RuntimeError):
  """A NIXL (UCX) call failed. The message names the operation (create the
  agent, register, load a producer's agent, read), the object and producer
  it was for, NIXL's own error, and what to do; never a bare
  `nixlBackendError`.

  Attributes:
    operation: what failed ("register", "read", ...).
    object_id: the object it was for, or "".
  """

  def __init__(self, message: str, operation: str = "", object_id: str = ""):
    super().__init__(message)
    self.operation, self.object_id = operation, object_id

  def __reduce__(self) -> tuple[Any, ...]:
    return type(self), (str(self), self.operation, self.object_id)


NixlError.__module__ = "rdt_jax"  # public as rdt_jax.NixlError


def nixl_error(operation: str, subject: str, error: BaseException, fix: str, object_id: str = "") -> NixlError:
  """The `NixlError` for `operation` on `subject` ("object X from producer
  agent Y") that failed with NIXL's `error`; `fix` says what to do."""
  return NixlError(
      f"jax_nixl could not {operation} {subject}: NIXL reported {type(error).__name__}: "
      f"{str(error).strip() or 'no detail'}. {fix}",
      operation,
      object_id,
  )


#: What to do after a failed registration.
REGISTER_FIX: Final = (
    "Registration pins the memory: check the locked-memory limit (ulimit -l) and free memory "
    "on this host, and that UCX supports the memory type (CUDA memory needs a CUDA-enabled UCX); "
    "then retry."
)


def nixl_memory(device: _dlpack.Device) -> tuple[str, _dlpack.Device]:
  """NIXL's memory type and device for buffers on `device`: host memory is
  one DRAM region space (device index 0), device memory is VRAM of its own
  device. The host-or-device decision is `_destinations.memory_kind`'s."""
  if memory_kind(device) == "host":
    return "DRAM", _HOST
  return "VRAM", device


@dataclass
class _Registration:
  handle: Any
  pooled: bool  # a pool's buffer: registered until the pool evicts it
  count: int = 0  # references taken by `register(..., pooled=False)`


class Registrations:
  """The registration cache of one agent (see the module docstring).

  Args:
    agent: returns the agent (created on first use).
    changed: called when the set of failed deregistrations changes, so the
      transport can start or stop its progress thread (no lock held).
  """

  def __init__(self, agent: Callable[[], Any], changed: Callable[[], None]):
    self._agent = agent
    self._lock = threading.Lock()
    self._changed = changed
    self._regs: dict[Key, _Registration] = {}
    self._busy: dict[Key, threading.Event] = {}  # regions being registered or deregistered
    self._stuck: list[tuple[Any, Any]] = []  # (handle, memory) whose deregistration failed
    self._leaving = 0  # non-pooled regions out of the cache whose deregistration has not ended
    self.version = 0
    self.dereg_epoch = 0
    self.device_dereg_epoch = 0

  def epochs(self) -> tuple[int, int, int]:
    """(`version`, `dereg_epoch`, `device_dereg_epoch`), read together."""
    with self._lock:
      return self.version, self.dereg_epoch, self.device_dereg_epoch

  def register(
      self, pointer: int, nbytes: int, device: _dlpack.Device, pooled: bool = False, purpose: str = ""
  ) -> Key:
    """Registers a region, or takes another reference to its registration.

    A `pooled` region takes no reference: it stays registered until its pool
    evicts it, and its key need not be passed to `unregister`. NIXL's
    registration runs outside the cache's lock; a concurrent registration
    of the same region waits for it and shares it.

    Raises:
      NixlError: NIXL refused the registration; the message names the
        region, `purpose` (e.g. "for object X") and what to do.
    """
    mem_type, nixl_device = nixl_memory(device)
    key = (pointer, nbytes, nixl_device.kind, nixl_device.index)
    while True:
      with self._lock:
        reg = self._regs.get(key)
        if reg is not None:
          self._take(reg, pooled)
          return key
        busy = self._busy.get(key)
        if busy is None:
          done = self._busy[key] = threading.Event()
          break
      busy.wait()  # registered or deregistered by another thread meanwhile: look again
    try:
      if _faults.ON:
        _faults.hit("nixl.register")
      try:
        handle = self._agent().register_memory([(pointer, nbytes, nixl_device.index, "")], mem_type=mem_type)
      except Exception as e:
        where = f"{nbytes} bytes of {mem_type} at {pointer:#x} ({device.kind}:{device.index})"
        raise nixl_error("register", f"{where} {purpose}".strip(), e, REGISTER_FIX) from None
      with self._lock:
        reg = self._regs[key] = _Registration(handle, pooled)
        self.version += 1
        self._take(reg, pooled)
    finally:
      try:
        with self._lock:
          del self._busy[key]
      finally:
        done.set()
    return key

  @staticmethod
  def _take(reg: _Registration, pooled: bool) -> None:
    """Marks `reg` pooled, or takes a reference to it (lock held)."""
    if pooled:
      reg.pooled = True
    else:
      reg.count += 1

  def unregister(self, keys: list[Key], memory: Any = None) -> None:
    """Drops a reference to each registration; deregisters a non-pooled
    region once its last reference is gone (outside the cache's lock).

    A deregistration that fails keeps the region registered, and `memory`
    (what keeps the region's buffers alive) with it, for `retry_stuck`.
    """
    gone: list[tuple[Key, _Registration, threading.Event]] = []
    with self._lock:
      for key in keys:
        reg = self._regs.get(key)
        if reg is None or reg.count == 0:
          continue
        reg.count -= 1
        if reg.count == 0 and not reg.pooled:
          gone.append(self._leave(key, reg))
          self.dereg_epoch += 1  # consumers drop the region from their view
    self._deregister_all(gone, memory)

  def _leave(self, key: Key, reg: _Registration) -> tuple[Key, _Registration, threading.Event]:
    """Takes `key` out of the cache, marked busy until its deregistration
    ends (lock held)."""
    del self._regs[key]
    if key[2] != "cpu":
      self.device_dereg_epoch += 1
    event = self._busy[key] = threading.Event()
    self._leaving += not reg.pooled
    return key, reg, event

  def _deregister_all(self, gone: list[tuple[Key, _Registration, threading.Event]], memory: Any) -> None:
    """Deregisters what `_leave` took out (no lock held); a failure keeps the
    handle, and `memory`, for `retry_stuck`. Each region stops being busy
    once its deregistration ended or is kept for a retry, even if this
    thread is interrupted (what it did not reach is kept for a retry)."""
    if not gone:
      return
    done = 0
    try:
      for key, reg, event in gone:
        ok = self._deregister(reg.handle)
        self._settle(key, reg, event, ok, memory)
        done += 1
    finally:
      for key, reg, event in gone[done:]:
        self._settle(key, reg, event, False, memory)
      self._changed()

  def _settle(self, key: Key, reg: _Registration, event: threading.Event, ok: bool, memory: Any) -> None:
    """Ends the deregistration of `key`: kept for a retry unless `ok`, and no
    longer busy."""
    try:
      with self._lock:
        if self._busy.get(key) is event:  # settled once
          if not ok:
            self._stuck.append((reg.handle, memory))
          del self._busy[key]
          self._leaving -= not reg.pooled
    finally:
      event.set()

  def retry_stuck(self) -> None:
    """Tries again every deregistration that failed (progress thread)."""
    with self._lock:
      if not self._stuck:
        return
      stuck, self._stuck = self._stuck, []
    still = [(h, m) for h, m in stuck if not self._deregister(h)]
    with self._lock:
      self._stuck.extend(still)
    self._changed()

  def on_host_eviction(self, pointer: int, nbytes: int, keepalive: Any = None) -> None:
    """The host buffer pool stops keeping a buffer: deregister it (a failed
    deregistration keeps `keepalive`, the buffer, until a retry succeeds)."""
    self._evicted((pointer, nbytes, "cpu", 0), keepalive)

  def on_device_eviction(
      self, pointer: int, nbytes: int, device: _dlpack.Device, keepalive: Any = None
  ) -> None:
    """The device region pool stops keeping a region: deregister it (a failed
    deregistration keeps `keepalive`, the region's memory, until a retry succeeds)."""
    self._evicted((pointer, nbytes, device.kind, device.index), keepalive)

  def _evicted(self, key: Key, keepalive: Any) -> None:
    with self._lock:
      reg = self._regs.get(key)
      gone = [self._leave(key, reg)] if reg is not None else []
    self._deregister_all(gone, keepalive)

  def _deregister(self, handle: Any) -> bool:
    try:
      if _faults.ON:
        _faults.hit("nixl.deregister")
      self._agent().deregister_memory(handle)
    except Exception:  # kept registered; retried by the progress thread
      return False
    return True

  def has_stuck(self) -> bool:
    """True while a failed deregistration waits for a retry."""
    return bool(self._stuck)

  def count(self) -> int:
    """Registered regions outside the pools (0 when idle), including those
    being deregistered and those whose deregistration failed and waits for
    a retry."""
    with self._lock:
      return sum(1 for r in self._regs.values() if not r.pooled) + len(self._stuck) + self._leaving

  def count_pooled(self) -> int:
    """Registered pooled buffers, kept for reuse (bounded by the pools)."""
    with self._lock:
      return sum(1 for r in self._regs.values() if r.pooled)
