"""Reads of Ray's state, and the few direct calls into it.

Lookups that change nothing (is this an rdt_jax transport, does this process
know an object, is an actor dead, Ray's fetch timeout, driver or worker), and
three calls: registering a transport, freeing an object at once, and running
a function on an actor's `_ray_system` group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rdt_jax._ray import wrapping

__all__ = [
    "actor_dead",
    "actor_id",
    "call_on_system_group",
    "current_actor_id",
    "free_now",
    "in_ray_worker",
    "is_managed_object",
    "is_rdt_jax_transport",
    "is_two_sided_object",
    "rdt_fetch_timeout_s",
    "register_tensor_transport",
    "registered_transports",
    "tensor_transport_enabled",
    "transport_info",
    "transport_manager",
    "transport_metadata",
]


def transport_info(name: str) -> Any:
  """Ray's registry entry for transport `name`, or None.

  Ray registers transports in a worker on its first lookup of its registry
  (`util._ensure_default_transports_registered`, which registers rdt_jax's
  too: `registration.py`). A worker that meets an rdt_jax ref
  before any such lookup (an actor created without
  `enable_tensor_transport=True` that borrows a ref nested in a value) would
  otherwise find no entry here, and the wrappers that ask would hand an
  rdt_jax object to Ray's own handling (Ray's `set_target_for_ref` buffers
  checked against numpy dtypes). So an unknown name in a worker makes that
  first lookup happen, as Ray's own lookups do, before it is looked up again.

  Touches: `ray.experimental.rdt.util.transport_manager_info` (read) and
    `util._ensure_default_transports_registered` (called).
  Why: Ray has no public lookup of a registered transport's class and
    devices, nor of whether a worker registered its transports yet.
  Retire when: Ray exposes its transport registry (a public
    `get_registered_transports()` or the like).
  """
  from ray.experimental.rdt import util

  key = name.upper()
  info = util.transport_manager_info.get(key)
  if info is None and in_ray_worker():
    util._ensure_default_transports_registered()
    info = util.transport_manager_info.get(key)
  return info


def is_rdt_jax_transport(name: str) -> bool:
  """True if Ray's transport `name` is an rdt_jax (DLPack) transport."""
  info = transport_info(name)
  return info is not None and getattr(info.transport_manager_class, "_rdt_jax_transport", False)


def registered_transports() -> list[str]:
  """The lower-case names of every transport registered with Ray in this process.

  Touches: `ray.experimental.rdt.util.transport_manager_info` (read).
  Why: error messages name what is registered; Ray has no public list.
  Retire when: Ray exposes its transport registry (see `transport_info`).
  """
  from ray.experimental.rdt import util

  return sorted(name.lower() for name in util.transport_manager_info)


def transport_manager(name: str) -> Any:
  """This process's instance of registered transport `name` (Ray makes one
  per process on first use).

  Touches: `ray.experimental.rdt.util.get_tensor_transport_manager` (called).
  Why: `rdt_jax.receive_stats` and the contract kit read the counters of
    this process's transport instance, which only Ray holds.
  Retire when: Ray exposes a registered transport's instance.
  """
  from ray.experimental.rdt import util

  return util.get_tensor_transport_manager(name.upper())


def register_tensor_transport(name: str, devices: list[str], cls: type, data_type: type) -> None:
  """Registers a transport with Ray unless one of that name exists.

  Touches: `ray.experimental.rdt.util.register_tensor_transport` (Ray's
    public registration, called through `util`) and `transport_manager_info`
    (read, for "exists").
  Why: Ray raises for a second registration of a name, and a worker may
    already hold the creator's registration (`registration.py`).
  Retire when: Ray's registration is idempotent for the same class.
  """
  from ray.experimental.rdt import util

  with wrapping.lock:
    if name.upper() not in util.transport_manager_info:
      util.register_tensor_transport(name, devices, cls, data_type)


def _rdt_manager() -> Any:
  """This process's RDT manager.

  Touches: `ray._private.worker.global_worker.rdt_manager` (read), and its
    `is_managed_object`, `get_rdt_metadata` (called).
  Why: whether this process knows an object, and its transport metadata and
    backend, are needed to route targets, two-sided refusals and frees; Ray
    has no public accessor.
  Retire when: Ray exposes an RDT object's metadata for a ref (public
    `ray.experimental` API).
  """
  import ray

  return ray._private.worker.global_worker.rdt_manager


def is_managed_object(obj_id: str) -> bool:
  """True if this process's RDT manager knows `obj_id` as an RDT object."""
  return bool(_rdt_manager().is_managed_object(obj_id))


def transport_metadata(obj_id: str) -> Any:
  """The transport metadata of `obj_id` if this process knows it yet, else None."""
  meta = _rdt_manager().get_rdt_metadata(obj_id)
  return None if meta is None else meta.tensor_transport_meta


def is_two_sided_object(obj_id: str) -> bool:
  """True if this process knows `obj_id` as an object of a two-sided transport."""
  meta = _rdt_manager().get_rdt_metadata(obj_id)
  info = None if meta is None else transport_info(str(meta.tensor_transport_backend))
  return info is not None and not info.transport_manager_class.is_one_sided()


def free_now(obj_id: str) -> None:
  """Frees RDT object `obj_id`, produced in this process, at once, whatever
  references to it remain elsewhere: the store drops it and its transport's
  `garbage_collect` releases its memory, as when Ray frees it after its last
  reference goes (Ray's later free of it then finds nothing and does nothing).
  A consumer reading it afterwards gets the freed-object error where its
  transport detects it (`docs/faults.md`). Does nothing for an object this
  process does not hold.

  Touches: `ray.experimental.rdt.rdt_store.__ray_free__` (called).
  Why: weight sync frees a version its publisher dropped at once, while
    subscribers may still hold handles; Ray frees an object only when its
    last reference goes.
  Retire when: Ray offers an explicit free of an RDT object by its
    producer.
  """
  from ray.experimental.rdt.rdt_store import __ray_free__

  meta = _rdt_manager().get_rdt_metadata(obj_id)
  if meta is None or meta.tensor_transport_meta is None:
    return
  __ray_free__(None, obj_id, meta.tensor_transport_backend, meta.tensor_transport_meta)


def actor_id(actor: Any) -> str:
  """The hex id of an actor handle.

  Touches: `ray.actor.ActorHandle._actor_id` (read).
  Why: per-actor caches (capabilities, the lifetime check) need a key, and a
    handle has no public id.
  Retire when: `ActorHandle` gets a public id accessor.
  """
  return str(actor._actor_id.hex())


def call_on_system_group(actor: Any, fn: Callable[..., Any], *args: Any) -> Any:
  """Runs `fn(actor_instance, *args)` on `actor` in Ray's `_ray_system`
  concurrency group (beside running methods); returns the ref.

  Touches: `ActorHandle.__ray_call__` with the `_ray_system` concurrency
    group (called).
  Why: asking an actor whether it can run a transport, or a publisher for a
    version, must not queue behind the actor's running methods.
  Retire when: Ray offers a public way to run a function beside an actor's
    methods.
  """
  return actor.__ray_call__.options(concurrency_group="_ray_system").remote(fn, *args)


def tensor_transport_enabled(actor: Any) -> bool:
  """True if `actor` (a handle; the current actor's from
  `ray.get_runtime_context().current_actor`) was created with
  `enable_tensor_transport=True` (or a method naming a tensor transport).

  Touches: `ActorHandle._ray_enable_tensor_transport` (read).
  Why: a weight publisher checks at construction that its actor can serve
    a subscriber on another host: only such an actor has the `_ray_system`
    concurrency group its subscribers' questions run on (without it they
    wait behind the running method), and gets its creator's transports.
  Retire when: Ray exposes an actor's tensor-transport setting publicly, or
    fails on its own when such an actor stores an RDT object.
  """
  return bool(getattr(actor, "_ray_enable_tensor_transport", False))


def current_actor_id() -> str | None:
  """The hex id of the actor this process runs, or None (a driver, a task,
  a process not connected to Ray). Never starts Ray."""
  import ray

  if not in_ray_worker():
    return None
  return ray.get_runtime_context().get_actor_id()


def actor_dead(actor_id: str) -> bool:
  """True if Ray records actor `actor_id` as dead (one GCS lookup).

  Ray records an actor dead before `ray.kill` returns and before its process
  is gone, so a consumer that asks after the kill is told, on every host.
  False for an alive, restarting or unknown actor.

  Touches: the GCS accessor of `ray._private.state.state`
    (`_connect_and_get_accessor`, `get_actor_info`) and
    `gcs_pb2.ActorTableData` (read).
  Why: the lifetime contract refuses bytes read from a dead producer, after
    every read; Ray's public state API (`ray.util.state.get_actor`) asks
    the dashboard's state server, which a cluster may not run.
  Retire when: Ray offers a cheap public actor-state lookup through the GCS.
  """
  import ray
  from ray.core.generated import gcs_pb2

  accessor = ray._private.state.state._connect_and_get_accessor()
  info = accessor.get_actor_info(ray.ActorID(bytes.fromhex(actor_id)))
  table = gcs_pb2.ActorTableData  # type: ignore[attr-defined]  # generated protobuf, no stubs
  return info is not None and table.FromString(info).state == table.DEAD


def rdt_fetch_timeout_s() -> float:
  """Ray's RDT fetch timeout in seconds (`RAY_rdt_fetch_fail_timeout_milliseconds`):
  how long Ray's monitor lets a transfer run before it aborts it.

  Touches: `ray._private.ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS` (read).
  Why: rdt_jax's own waits end before Ray's monitor aborts the transfer.
  Retire when: Ray passes its timeout to the transport, or makes it public.
  """
  from ray._private import ray_constants

  return float(ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)


def in_ray_worker() -> bool:
  """True in a Ray worker process (an actor or task), False in a driver.

  Touches: `ray._private.worker.global_worker.mode` (read).
  Why: registration and error messages differ in a worker and a driver, and
    the check must never start Ray (`ray.get_runtime_context()` would).
  Retire when: Ray's runtime context can be asked without connecting.
  """
  import ray

  return getattr(ray._private.worker.global_worker, "mode", None) == ray.WORKER_MODE
