"""The one seam to Ray's internals.

Every place where rdt_jax touches something of Ray that is not public API is
in this module, so a Ray upgrade has one file to check. `install()` checks
that each internal still has the shape we rely on (`check_ray()`), then puts
the wrappers and reducers in place, once per process.

What is used, and why (docs/ray_integration.md has the long form, with the
public extension points tried first):

* `ray.cloudpickle.CloudPickler.dispatch`: a reducer per array class, so a
  leaf of any framework is extracted out of band (Ray registers one
  `data_type` per transport, and matches the exact class). Chained: ours
  defers to the reducer that was there whenever rdt_jax is not extracting.
* `SerializationContext.serialize_rdt_objects` (wrapped): records which
  transport is serializing, and the value, to name leaves by pytree path;
  publishes the leaves' descriptions for `extract_tensor_transport_metadata`.
* `SerializationContext._thread_local.rdt_tensors` /
  `use_external_transport` and `_rdt_custom_serializer_registered`: where Ray
  collects extracted leaves, and its per-type serializer flag.
* `RDTManager.register_custom_transports_on_actor` (wrapped): registration of
  custom transports on a new actor on Ray's `_ray_system` concurrency group
  (never behind a running method), plus an ordered no-wait copy that closes
  the first-action race of a fresh actor.
* `util._ensure_default_transports_registered` (wrapped): registers rdt_jax's
  transports in a worker on its first RDT lookup (consumer-only actors);
  rdt_jax's own lookups of a name not yet registered make that first lookup
  (`transport_info`), and a second thread waits for the registration.
* `RDTManager._trigger_fetch` (wrapped): `ray.get` of a two-sided ref names
  the fixes; Ray's target buffers/device on an rdt_jax ref go to rdt_jax.
* `RDTManager.set_target_device_for_ref` (wrapped) and `RDTManager._lock` /
  `_managed_rdt_metadata` (written): Ray's public `set_target_for_ref` /
  `set_target_device_for_ref` work on rdt_jax refs, through rdt_jax's targets.
* `util.normalize_and_validate_tensor_transport` (wrapped): Ray's check of
  a `tensor_transport` name raises `rdt_jax.TransportNotRegisteredError`
  for an rdt_jax name or a near miss, saying why and what to do. Installed
  by `install()`, and at `import rdt_jax` where Ray is already imported
  (`install_name_check()`), so a class defined before `register()` says so.
* `RDTManager.fetch_and_get_rdt_objects` (wrapped): its bare "No metadata
  found" assertion becomes `rdt_jax.UnknownObjectError`, saying why; and
  when it raises (one fetch of a batch failed or timed out, and Ray drops
  the others unfinished), every rdt_jax fetch it started and did not finish
  is given up at once (`track_fetch`), not when its request is collected.
* `ray._private.state.state` (`get_actor_info`): whether an object's producer
  actor is dead, asked once per fetch (`actor_dead`); and
  `ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS` (`rdt_fetch_timeout_s`).
* `Worker.deserialize_objects` (wrapped): `await ref` of an rdt_jax object
  (Ray deserializes it in a callback on its core worker's io thread, the
  thread Ray names `worker.io`) returns `rdt_jax.AwaitNotSupportedError`,
  which Ray's future raises at once, instead of waiting there for a transfer
  that thread would have to serve. `worker.blocking_get_inside_async_warned`
  (set around `rdt_jax.get_async`'s `ray.get`): no advice to `await` instead.
* `CloudPickler.dispatch[ObjectRef]` (chained, also through
  `SerializationContext._register_cloudpickle_reducer`): an rdt_jax ref
  nested in a value waits for its transport metadata if its object is ready,
  else raises `rdt_jax.RefNotReadyError` naming the fix.
* `RDTManager._abort_transport` and `RDTManager.shutdown` (wrapped), and
  `RDTManager._unmonitored_transfers` (drained): Ray's failure monitor, the
  driver thread that aborts a failed or timed-out transfer (for a two-sided
  one, by killing both actors), dies on the first exception it meets and is
  never restarted in that process: an abort whose `ray.kill` finds the
  actor's handle gone, or, after `ray.shutdown()` and `ray.init()`, a ref of
  the ended session still queued. Later failed transfers then hang. The
  abort wrapper finishes what Ray's abort left undone (each actor killed
  on its own, errors logged); the shutdown wrapper empties the queue.
* `util.transport_manager_info`, `util.get_tensor_transport_manager`,
  `global_worker.rdt_manager`
  (`is_managed_object`, `get_rdt_metadata`), `global_worker.mode`,
  `ActorHandle._actor_id`, `__ray_call__` on `_ray_system`: reads and calls.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import pickle
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, Final

from rdt_jax import _compat, _errors, _hooks, _settings
from rdt_jax._errors import TransportNotRegisteredError, UnknownObjectError
from rdt_jax._errors import UnsupportedRayError as UnsupportedRayError

if TYPE_CHECKING:
  from rdt_jax import _dlpack, _state

# Ray minor versions whose RDT internals we have read and whose suite runs in
# CI (scripts/matrix.sh); pyproject.toml states the same range.
TESTED_RAY_MINORS: Final = frozenset({(2, 59), (2, 60)})
SUPPORTED_RAY: Final = ">=2.59,<2.61"
#: Set to 1 to let `register()` run on a Ray minor outside SUPPORTED_RAY
#: (warning instead of refusal); the shape checks still apply.
ALLOW_UNTESTED_ENV: Final = "RDT_JAX_ALLOW_UNTESTED_RAY"

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_installed = False



def _import_layers() -> None:
  """Binds `_dlpack` and `_state` in this module (both import numpy).

  Deferred to the first `install()` / `install_reducers()`, before which
  nothing here uses them, so that `install_name_check()` can run at
  `import rdt_jax` without importing numpy.
  """
  if "_state" not in globals():
    globals()["_dlpack"] = importlib.import_module("rdt_jax._dlpack")
    globals()["_state"] = importlib.import_module("rdt_jax._state")


def _ray_minor(version: str) -> tuple[int, int] | None:
  parts = version.split(".")
  try:
    return int(parts[0]), int(parts[1])
  except (IndexError, ValueError):
    return None


def ray_version_tested() -> bool:
  """True if the installed Ray is a minor version we test against."""
  import ray

  return _ray_minor(ray.__version__) in TESTED_RAY_MINORS


# --------------------------------------------------------------------------
# Shape checks: each internal this module touches, checked when `install()`
# runs. A check returns what is missing, or None.


def _mark(wrapper: Any, original: Any) -> None:
  """Marks `wrapper` as ours, keeping `original` for the shape checks."""
  wrapper._rdt_jax = True
  wrapper._rdt_jax_original = original


def _unwrapped(fn: Any) -> Any:
  return getattr(fn, "_rdt_jax_original", fn)


def _params(obj: Any, attr: str, params: tuple[str, ...]) -> str | None:
  """`obj.attr` exists and takes (at least, in order) the named parameters."""
  fn = _unwrapped(getattr(obj, attr, None))
  where = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}.{attr}"
  if fn is None or not callable(fn):
    return f"{where} is missing"
  try:
    names = list(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return None  # no signature to read (a C function): existence is all we can check
  if names[: len(params)] != list(params):
    return f"{where}{inspect.signature(fn)} no longer takes ({', '.join(params)})"
  return None


def _uses(fn: Any, where: str, names: tuple[str, ...]) -> str | None:
  """The code of `fn` (or a function nested in it) still uses attributes `names`."""
  code = getattr(_unwrapped(fn), "__code__", None)
  if code is None:
    return f"{where} is missing"
  seen: set[str] = set()
  stack = [code]
  while stack:
    c = stack.pop()
    seen.update(c.co_names)
    stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
  missing = [n for n in names if n not in seen]
  return f"{where} no longer uses {', '.join(missing)}" if missing else None


def _check_ray_shapes() -> list[str]:
  """Every Ray internal this module relies on, checked; what is missing."""
  import ray
  from ray import cloudpickle
  from ray._private import serialization, worker
  from ray.actor import ActorHandle
  from ray.experimental.rdt import rdt_manager, util

  ctx = serialization.SerializationContext
  mgr = rdt_manager.RDTManager
  problems = [
      _params(util, "register_tensor_transport", ("transport_name", "devices", "transport_manager_class", "data_type")),
      _params(util, "_ensure_default_transports_registered", ()),
      _params(util, "get_transport_data_type", ("tensor_transport",)),
      _params(util, "get_tensor_transport_manager", ("transport_name",)),
      _params(util, "normalize_and_validate_tensor_transport", ("tensor_transport",)),
      _params(ctx, "serialize_rdt_objects", ("self", "value", "tensor_transport")),
      _uses(getattr(ctx, "serialize_rdt_objects", None), "SerializationContext.serialize_rdt_objects",
            ("_thread_local", "use_external_transport", "rdt_tensors")),
      _uses(ctx.__init__, "SerializationContext.__init__", ("_thread_local", "_rdt_custom_serializer_registered")),
      _params(mgr, "register_custom_transports_on_actor", ("self", "actor")),
      _params(mgr, "wait_until_custom_transports_registered", ("self", "actor")),
      _uses(mgr.__init__, "RDTManager.__init__",
            ("actor_id_to_transports_registered", "_managed_rdt_metadata", "_lock")),
      _params(mgr, "_trigger_fetch", ("self", "obj_id", "use_object_store")),
      _params(mgr, "_abort_transport", ("self", "failed_ref", "ref_info_map", "exception")),
      _params(mgr, "shutdown", ("self",)),
      _uses(mgr.__init__, "RDTManager.__init__ (failure monitor)", ("_unmonitored_transfers",)),
      _params(mgr, "fetch_and_get_rdt_objects", ("self", "object_ids")),
      _params(mgr, "set_target_device_for_ref", ("self", "ref", "target_device")),
      _params(mgr, "get_rdt_metadata", ("self", "obj_id")),
      _params(mgr, "is_managed_object", ("self", "obj_id")),
      _params(mgr, "wait_for_tensor_transport_metadata", ("self", "obj_id", "timeout")),
      _params(worker.Worker, "deserialize_objects", ("self", "serialized_objects", "object_refs", "rdt_objects")),
      _params(ctx, "_register_cloudpickle_reducer", ("self", "cls", "reducer")),
      _params(ctx, "is_in_band_serialization", ("self",)),
  ]
  if not hasattr(worker, "blocking_get_inside_async_warned"):
    problems.append("ray._private.worker.blocking_get_inside_async_warned is missing")
  if not isinstance(getattr(util, "transport_manager_info", None), dict):
    problems.append("ray.experimental.rdt.util.transport_manager_info is not a dict")
  if not hasattr(util, "has_custom_transports"):
    problems.append("ray.experimental.rdt.util.has_custom_transports is missing")
  fields = getattr(getattr(rdt_manager, "RDTMeta", None), "_fields", ())
  missing_fields = [
      f for f in ("tensor_transport_backend", "tensor_transport_meta", "target_buffers", "target_device")
      if f not in fields
  ]
  if missing_fields:
    problems.append(f"RDTMeta has no field {', '.join(missing_fields)}")
  from ray._private import ray_constants

  if not hasattr(ray_constants, "RDT_FETCH_FAIL_TIMEOUT_SECONDS"):
    problems.append("ray._private.ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS is missing")
  state = getattr(getattr(ray, "_private", None), "state", None)
  if not hasattr(getattr(state, "GlobalState", None), "_connect_and_get_accessor"):
    problems.append("ray._private.state.GlobalState._connect_and_get_accessor is missing")
  if not isinstance(getattr(cloudpickle.CloudPickler, "dispatch", None), MutableMapping):
    problems.append("ray.cloudpickle.CloudPickler.dispatch is not a mutable mapping")
  if not isinstance(getattr(ActorHandle, "_actor_id", None), property):
    problems.append("ray.actor.ActorHandle._actor_id is missing")
  if not isinstance(getattr(worker.Worker, "rdt_manager", None), property):
    problems.append("ray._private.worker.Worker.rdt_manager is missing")
  if not hasattr(worker, "global_worker") or not hasattr(ray, "WORKER_MODE"):
    problems.append("ray._private.worker.global_worker or ray.WORKER_MODE is missing")
  return [p for p in problems if p is not None]


def check_ray() -> None:
  """Checks the installed Ray before anything of it is wrapped.

  Raises:
    UnsupportedRayError: if an internal rdt_jax relies on is missing or has
      changed shape (always), or if the Ray minor version is outside
      SUPPORTED_RAY and RDT_JAX_ALLOW_UNTESTED_RAY is not set to 1. With it
      set, an untested but shape-compatible Ray gets a warning instead.
  """
  import ray

  version = ray.__version__
  try:
    problems = _check_ray_shapes()
  except ImportError as e:
    problems = [f"cannot import a Ray RDT module ({e})"]
  if problems:
    raise UnsupportedRayError(
        f"rdt_jax cannot run on Ray {version}: its RDT internals changed. Missing or "
        f"changed: {'; '.join(problems)}. rdt_jax supports ray{SUPPORTED_RAY}; install a "
        f"Ray in that range (pip install 'ray{SUPPORTED_RAY}') or an rdt_jax release "
        "that supports this Ray."
    )
  if _ray_minor(version) in TESTED_RAY_MINORS:
    return
  if _settings.value(ALLOW_UNTESTED_ENV):
    warnings.warn(
        f"rdt_jax is tested with ray{SUPPORTED_RAY}, not Ray {version}; running anyway "
        f"because {ALLOW_UNTESTED_ENV}=1. The RDT internals it wraps passed its shape "
        "checks, but their behaviour is untested here.",
        stacklevel=4,
    )
    return
  raise UnsupportedRayError(
      f"rdt_jax does not support Ray {version}: it is tested with ray{SUPPORTED_RAY} "
      "(Ray's RDT API is alpha and changes between minor versions). Install a Ray "
      f"in that range (pip install 'ray{SUPPORTED_RAY}'), or set {ALLOW_UNTESTED_ENV}=1 "
      "in the environment of the driver and of every worker to try this Ray at "
      "your own risk."
  )


# --------------------------------------------------------------------------
# Reads of Ray's state.


def transport_info(name: str) -> Any:
  """Ray's registry entry for transport `name`, or None.

  Ray registers transports in a worker on its first lookup of its registry
  (`util._ensure_default_transports_registered`, which registers rdt_jax's
  too: `_wrap_default_registration`). A worker that meets an rdt_jax ref
  before any such lookup (an actor created without
  `enable_tensor_transport=True` that borrows a ref nested in a value) would
  otherwise find no entry here, and the wrappers that ask would hand an
  rdt_jax object to Ray's own handling (Ray's `set_target_for_ref` buffers
  checked against numpy dtypes). So an unknown name in a worker makes that
  first lookup happen, as Ray's own lookups do, before it is looked up again.
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
  """The lower-case names of every transport registered with Ray in this process."""
  from ray.experimental.rdt import util

  return sorted(name.lower() for name in util.transport_manager_info)


def transport_manager(name: str) -> Any:
  """This process's instance of registered transport `name` (Ray makes one
  per process on first use)."""
  from ray.experimental.rdt import util

  return util.get_tensor_transport_manager(name.upper())


def register_tensor_transport(name: str, devices: list[str], cls: type, data_type: type) -> None:
  """Registers a transport with Ray unless one of that name exists."""
  from ray.experimental.rdt import util

  with _lock:
    if name.upper() not in util.transport_manager_info:
      util.register_tensor_transport(name, devices, cls, data_type)


def _rdt_manager() -> Any:
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
  process does not hold."""
  from ray.experimental.rdt.rdt_store import __ray_free__

  meta = _rdt_manager().get_rdt_metadata(obj_id)
  if meta is None or meta.tensor_transport_meta is None:
    return
  __ray_free__(None, obj_id, meta.tensor_transport_backend, meta.tensor_transport_meta)


def actor_id(actor: Any) -> str:
  """The hex id of an actor handle."""
  return str(actor._actor_id.hex())


def call_on_system_group(actor: Any, fn: Callable[..., Any], *args: Any) -> Any:
  """Runs `fn(actor_instance, *args)` on `actor` in Ray's `_ray_system`
  concurrency group (beside running methods); returns the ref."""
  return actor.__ray_call__.options(concurrency_group="_ray_system").remote(fn, *args)


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
  """
  import ray
  from ray.core.generated import gcs_pb2

  accessor = ray._private.state.state._connect_and_get_accessor()
  info = accessor.get_actor_info(ray.ActorID(bytes.fromhex(actor_id)))
  table = gcs_pb2.ActorTableData  # type: ignore[attr-defined]  # generated protobuf, no stubs
  return info is not None and table.FromString(info).state == table.DEAD


def rdt_fetch_timeout_s() -> float:
  """Ray's RDT fetch timeout in seconds (`RAY_rdt_fetch_fail_timeout_milliseconds`):
  how long Ray's monitor lets a transfer run before it aborts it."""
  from ray._private import ray_constants

  return float(ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)


def in_ray_worker() -> bool:
  """True in a Ray worker process (an actor or task), False in a driver."""
  import ray

  return getattr(ray._private.worker.global_worker, "mode", None) == ray.WORKER_MODE


# --------------------------------------------------------------------------
# Reducers: every array class is extracted out of band while an rdt_jax
# transport serializes; otherwise the reducer that was in `dispatch` before
# ours (Ray's own RDT serializer for torch, say) runs, or the default pickle.


def _extracting() -> bool:
  s = _state.serializing
  return s.transport is not None and getattr(s.context._thread_local, "use_external_transport", False)


def _take_leaf(leaf: Any) -> tuple[Callable[[int], Any], tuple[int]]:
  """Moves `leaf` out of band: validates it and records its index."""
  described = _dlpack.describe(leaf, _state.leaf_path(leaf))
  tensors = _state.serializing.context._thread_local.rdt_tensors
  tensors.append(leaf)
  _state.record_described(leaf, described)
  return _leaf_from_transfer, (len(tensors) - 1,)


def _leaf_from_transfer(index: int) -> Any:
  """Deserializer: the `index`-th leaf the transport delivered."""
  import ray

  ctx = ray._private.worker.global_worker.get_serialization_context()
  return ctx._thread_local.rdt_tensors[index]


def _default_reduce_ex(leaf: Any) -> Any:
  return leaf.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _default_reduce(leaf: Any) -> Any:
  return leaf.__reduce__()


def _take_prng_key(key: Any) -> tuple[Callable[[Any, str], Any], tuple[Any, str]]:
  """Moves a typed PRNG key array out of band as its raw key data (itself a
  jax leaf, taken by `_take_leaf` under the key's pytree path) and its
  implementation's name; `_key_from_transfer` rebuilds the same typed key."""
  data, impl = _dlpack.prng_key_parts(key)
  _state.set_leaf_path(data, _state.leaf_path(key))
  return _key_from_transfer, (data, impl)


def _key_from_transfer(data: Any, impl: str) -> Any:
  """Deserializer: a typed key of implementation `impl` over the received key
  data, which arrives as jax whatever this process's receive mode."""
  return _dlpack.wrap_prng_key(_dlpack.convert_leaf(data, "jax"), impl)


def _chained(previous: Callable[[Any], Any] | None, default: Callable[[Any], Any],
             take: Callable[[Any], Any] = _take_leaf) -> Callable[[Any], Any]:
  """Our reducer in front of `previous` (the one that was there, or None):
  `take` while rdt_jax extracts, else `previous` or `default`."""
  fallback = previous if previous is not None else default

  def reduce(leaf: Any) -> Any:
    if _extracting():
      return take(leaf)
    return fallback(leaf)

  reduce._rdt_jax_reducer = True  # type: ignore[attr-defined]
  reduce._rdt_jax_previous = previous  # type: ignore[attr-defined]
  return reduce


def _chain(cls: type, default: Callable[[Any], Any], take: Callable[[Any], Any] = _take_leaf) -> None:
  from ray import cloudpickle

  dispatch = cloudpickle.CloudPickler.dispatch
  current = dispatch.get(cls)
  if not getattr(current, "_rdt_jax_reducer", False):
    dispatch[cls] = _chained(current, default, take)


def install_reducers() -> None:
  """Puts our reducer in front of each array class of the frameworks imported so far.

  Runs at every rdt_jax serialization: a leaf can only be a jax or torch array
  if its framework is imported, so frameworks imported later are covered by
  the next RDT value serialized; and where another serializer replaced ours
  (Ray registers its RDT serializer for torch on first use of its NIXL), ours
  goes back in front of it, deferring to it whenever rdt_jax is not extracting.
  """
  import numpy as np

  _import_layers()
  _chain(np.ndarray, _default_reduce_ex)
  if "jax" in sys.modules:
    _chain(_compat.array_impl_type(), _default_reduce)
    key_type = _compat.prng_key_array_type()
    if key_type is not None:
      _chain(key_type, _default_reduce, take=_take_prng_key)
  if "torch" in sys.modules:
    torch = sys.modules["torch"]
    _chain(torch.Tensor, _default_reduce_ex)
    _chain(torch.nn.Parameter, _default_reduce_ex)
  if "cupy" in sys.modules:
    _chain(sys.modules["cupy"].ndarray, _default_reduce_ex)


# --------------------------------------------------------------------------
# Wrappers around Ray's functions. Each is installed once (marked `_rdt_jax`).


def _wrap_serialize_rdt_objects() -> None:
  from ray._private.serialization import SerializationContext

  original = SerializationContext.serialize_rdt_objects
  if getattr(original, "_rdt_jax", False):
    return

  def serialize_rdt_objects(self: Any, value: Any, tensor_transport: str) -> Any:
    from ray.experimental.rdt import util

    if not is_rdt_jax_transport(tensor_transport):
      return original(self, value, tensor_transport)
    install_reducers()
    # Keep Ray from replacing our reducer with its single-type serializer.
    data_type = util.get_transport_data_type(tensor_transport.upper())
    self._rdt_custom_serializer_registered[data_type] = True
    _state.begin_serialization(tensor_transport, self, value)
    try:
      serialized, leaves = original(self, _whole(value), tensor_transport)
      _state.finish_serialization(leaves)
      return serialized, leaves
    finally:
      _state.end_serialization()

  _mark(serialize_rdt_objects, original)
  SerializationContext.serialize_rdt_objects = serialize_rdt_objects  # type: ignore[method-assign]


class _Pickled:
  """A value Ray's serializer pickles whole (`_whole`)."""

  __slots__ = ("value",)

  def __init__(self, value: Any):
    self.value = value

  def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
    return _unwrap, (self.value,)


def _unwrap(value: Any) -> Any:
  """Deserializer of `_Pickled`: the value itself."""
  return value


def _whole(value: Any) -> Any:
  """`value`, made opaque to Ray's MessagePack pass if it is a dict or list.

  Ray serializes a value with MessagePack, which walks dicts and lists
  itself and hands every other object (each array leaf) to its own pickle
  call: an ext record, a list entry and a pickler dispatch per leaf. Wrapped,
  the container is pickled whole in one pass (the deserialized value is the
  same: `_unwrap` returns it), without that per-leaf work on either side
  (docs/development/performance-log.md). Anything else is left as Ray would
  see it.
  """
  return _Pickled(value) if type(value) in (dict, list) else value


def _kill_quietly(actor: Any) -> None:
  import ray

  try:
    ray.kill(actor)
  except Exception as e:  # already gone, or its handle released: nothing left to stop
    logger.info("rdt_jax: could not kill actor %s after a failed transfer: %s", actor, e)


def _wrap_failure_monitor() -> None:
  from ray.experimental.rdt.rdt_manager import RDTManager

  original_abort = RDTManager._abort_transport
  if getattr(original_abort, "_rdt_jax", False):
    return
  original_shutdown = RDTManager.shutdown

  def _abort_transport(self: Any, failed_ref: Any, ref_info_map: dict[str, Any], exception: Exception) -> None:
    ref_info = ref_info_map.get(failed_ref.hex())
    try:
      original_abort(self, failed_ref, ref_info_map, exception)
    except Exception as e:
      # Ray's abort stopped half way (the monitor thread would die with it):
      # stop both actors of the transfer one by one, as it meant to.
      logger.warning("rdt_jax: Ray's abort of a failed transfer raised %s: %s; finishing it", type(e).__name__, e)
      if ref_info is not None:
        from ray.experimental.rdt.rdt_manager import RDTSource

        if ref_info.src_actor != RDTSource.DRIVER:
          _kill_quietly(ref_info.src_actor)
        _kill_quietly(ref_info.dst_actor)

  def shutdown(self: Any) -> None:
    original_shutdown(self)
    # The monitor thread has stopped: what it did not take yet belongs to the
    # ended session, and would end the next session's monitor.
    queue = self._unmonitored_transfers
    while not queue.empty():
      queue.get_nowait()

  _mark(_abort_transport, original_abort)
  _mark(shutdown, original_shutdown)
  RDTManager._abort_transport = _abort_transport  # type: ignore[method-assign]
  RDTManager.shutdown = shutdown  # type: ignore[method-assign]


def _register_transports_on_actor(self: Any, info: dict[str, Any]) -> None:
  """Runs on a new actor: registers the creator's custom transports there."""
  from ray.experimental.rdt import util

  install()
  util._ensure_default_transports_registered()
  with _lock:
    for name, transport in info.items():
      if name not in util.transport_manager_info:
        util.register_tensor_transport(
            name, transport.devices, transport.transport_manager_class, transport.data_type
        )


def _wrap_register_on_actor() -> None:
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls.register_custom_transports_on_actor
  if getattr(original, "_rdt_jax", False):
    return

  def register_custom_transports_on_actor(self: Any, actor: Any) -> None:
    from ray.experimental.rdt import util

    util._ensure_default_transports_registered()
    if not util.has_custom_transports:
      self.actor_id_to_transports_registered[actor._actor_id] = True
      return
    info = dict(util.transport_manager_info)
    # What Ray waits on before it submits an RDT method or sends an RDT
    # argument to the actor: on the `_ray_system` concurrency group, as Ray
    # does, so it never waits behind a running method.
    ref = call_on_system_group(actor, _register_transports_on_actor, info)
    # And an ordinary task nobody waits on: on an actor with one thread, it
    # runs before any method its creator calls afterwards, so even a first
    # action `ray.put(x, _tensor_transport=...)` finds the transport (the
    # `_ray_system` copy alone may run after that method started). On a busy
    # actor it just runs later, as a no-op.
    actor.__ray_call__.remote(_register_transports_on_actor, info)
    self.actor_id_to_transports_registered[actor._actor_id] = ref

  _mark(register_custom_transports_on_actor, original)
  cls.register_custom_transports_on_actor = register_custom_transports_on_actor  # type: ignore[method-assign]


def _wrap_default_registration() -> None:
  """Registers rdt_jax's transports in a Ray worker on its first RDT use.

  Ray registers custom transports on an actor only if it was created with
  `enable_tensor_transport=True` after the creator registered them. A
  consumer-only actor created without it still receives rdt_jax refs (their
  metadata imports rdt_jax there), so Ray's first RDT lookup in that worker
  registers rdt_jax's transports instead of failing with `KeyError: JAX_NIXL`.
  """
  from ray.experimental.rdt import util

  original = util._ensure_default_transports_registered
  if getattr(original, "_rdt_jax", False):
    return
  started: list[bool] = []
  finished: list[bool] = []

  def _ensure_default_transports_registered() -> None:
    original()
    if finished or not in_ray_worker():
      return
    # Another thread waits here until the registration it would look up is
    # complete; the registering thread's own lookups (`started`) return.
    with _lock:
      if started:
        return
      started.append(True)
      try:
        # The registry sits above this module: reached through `_hooks`.
        _hooks.register_transports()
      finally:
        finished.append(True)

  _mark(_ensure_default_transports_registered, original)
  util._ensure_default_transports_registered = _ensure_default_transports_registered


_refusals: dict[str, Callable[[str], str]] = {}


def refuse_driver_get(name: str, message: Callable[[str], str]) -> None:
  """Makes `ray.get` of a ref of transport `name` raise `message(name)`.

  For two-sided transports: Ray 2.60 refuses such a `ray.get` in
  `RDTManager._trigger_fetch` with a message that suggests "a one-sided
  transport" without naming one. Takes effect once `install()` has run.
  """
  _refusals[name.lower()] = message


def _forward_ray_targets(manager: Any, obj_id: str, meta: Any) -> Any:
  """Moves a target set through Ray's functions on an rdt_jax ref to rdt_jax.

  Ray validates target buffers and allocates target devices as torch tensors
  from `tensor_meta`, which holds numpy dtypes for rdt_jax transports; so the
  target goes to `rdt_jax.set_target_*_for_ref` instead (kept for the next
  fetch, as Ray keeps it) and Ray's fetch runs without it.
  """
  if meta.target_buffers:
    buffers = [r() for r in meta.target_buffers]
    if all(b is not None for b in buffers):  # Ray's rule: any dead buffer drops them all
      _hooks.set_target_buffers(obj_id, buffers)
  elif meta.target_device is not None:
    _hooks.set_target_device(obj_id, meta.target_device)
  return meta._replace(target_buffers=None, target_device=None)


def _wrap_trigger_fetch() -> None:
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls._trigger_fetch
  if getattr(original, "_rdt_jax", False):
    return

  def _trigger_fetch(self: Any, obj_id: str, use_object_store: bool) -> Any:
    meta = self.get_rdt_metadata(obj_id)
    transport = (meta.tensor_transport_backend or "") if meta is not None else ""
    if not use_object_store:
      refusal = _refusals.get(transport.lower())
      if refusal is not None:
        raise ValueError(refusal(transport))
    if meta is not None and (meta.target_buffers or meta.target_device is not None) and is_rdt_jax_transport(transport):
      with self._lock:
        self._managed_rdt_metadata[obj_id] = _forward_ray_targets(self, obj_id, meta)
      try:
        return original(self, obj_id, use_object_store)
      finally:
        with self._lock:  # Ray keeps a target for every later get: so do we
          current = self._managed_rdt_metadata.get(obj_id)
          if current is not None:
            self._managed_rdt_metadata[obj_id] = current._replace(
                target_buffers=meta.target_buffers, target_device=meta.target_device
            )
    return original(self, obj_id, use_object_store)

  _mark(_trigger_fetch, original)
  cls._trigger_fetch = _trigger_fetch  # type: ignore[method-assign]


def _wrap_set_target_device() -> None:
  """Ray's `set_target_device_for_ref` parses the device with torch before any
  transport is asked. For an rdt_jax ref, rdt_jax parses it (jax devices and
  "gpu" too, no torch needed); Ray keeps it for the fetch as usual."""
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls.set_target_device_for_ref
  if getattr(original, "_rdt_jax", False):
    return

  def set_target_device_for_ref(self: Any, ref: Any, target_device: Any) -> None:
    meta = self.get_rdt_metadata(ref.hex())
    transport = (meta.tensor_transport_backend or "") if meta is not None else ""
    if not is_rdt_jax_transport(transport):
      return original(self, ref, target_device)
    device = _dlpack.parse_device(target_device)  # raises for what no rdt_jax transport moves
    devices = transport_info(transport).devices
    if device.kind not in devices:
      raise ValueError(
          f"Tensor transport {transport} moves {', '.join(devices)} arrays, not "
          f"{device.kind} ({target_device!r})."
      )
    with self._lock:
      self._managed_rdt_metadata[ref.hex()] = self._managed_rdt_metadata[ref.hex()]._replace(
          target_buffers=None, target_device=target_device
      )
    return None

  _mark(set_target_device_for_ref, original)
  cls.set_target_device_for_ref = set_target_device_for_ref  # type: ignore[method-assign]


def _invalid_transport_error(name: Any, error: ValueError) -> TransportNotRegisteredError | None:
  """rdt_jax's account of Ray's "Invalid tensor transport" for `name`, or
  None where the name has nothing to do with rdt_jax (Ray's error stands)."""
  if not isinstance(name, str):
    return None
  explanation, suggestion = _errors.explain_unregistered(name, registered_transports(), in_ray_worker())
  if explanation is None:
    return None
  return TransportNotRegisteredError(f"{error}. {explanation}", name, suggestion)


def _wrap_transport_name_check() -> None:
  """Ray checks a `tensor_transport` name (`@ray.method`, `.options`,
  `ray.put`) with `util.normalize_and_validate_tensor_transport`, whose error
  names only the upper-cased name. For an rdt_jax transport name, or one close
  to a registered name, the wrapper raises `TransportNotRegisteredError` (a
  `ValueError`) saying why the name is missing here and what to do."""
  from ray.experimental.rdt import util

  original = util.normalize_and_validate_tensor_transport
  if getattr(original, "_rdt_jax", False):
    return

  def normalize_and_validate_tensor_transport(tensor_transport: str) -> str:
    try:
      return str(original(tensor_transport))
    except ValueError as e:
      error = _invalid_transport_error(tensor_transport, e)
      if error is None:
        raise
      raise error from None

  _mark(normalize_and_validate_tensor_transport, original)
  util.normalize_and_validate_tensor_transport = normalize_and_validate_tensor_transport


def install_name_check() -> None:
  """Installs only the transport-name check (see `_wrap_transport_name_check`).

  `import rdt_jax` calls it where Ray is already imported, so a class defined
  before `rdt_jax.register()` gets the error that says so; `install()`
  installs it too. Does nothing on a Ray whose check function has another
  shape (`install()` then refuses that Ray).
  """
  from ray.experimental.rdt import util

  with _lock:
    if _params(util, "normalize_and_validate_tensor_transport", ("tensor_transport",)) is None:
      _wrap_transport_name_check()


_NO_METADATA = "No metadata found for "


def _wrap_fetch_and_get() -> None:
  """`ray.get` of an RDT ref whose object this process does not know (freed,
  or a ref not obtained from Ray) fails in Ray's
  `RDTManager.fetch_and_get_rdt_objects` with a bare `AssertionError`; the
  wrapper raises `UnknownObjectError` (an `AssertionError`) saying why and
  what to do."""
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls.fetch_and_get_rdt_objects
  if getattr(original, "_rdt_jax", False):
    return

  def fetch_and_get_rdt_objects(self: Any, object_ids: list[str], *args: Any, **kwargs: Any) -> Any:
    outer = getattr(_batch, "started", None)
    started: list[Any] = []
    _batch.started = started
    try:
      return original(self, object_ids, *args, **kwargs)
    except BaseException as e:
      for request in started:
        with contextlib.suppress(Exception):  # the original error is the one to raise
          request.give_up()
      text = str(e)
      if not isinstance(e, AssertionError) or not text.startswith(_NO_METADATA):
        raise
      obj_id = text[len(_NO_METADATA):]
      raise UnknownObjectError(
          f"{text}: this process knows no RDT object {obj_id}. It was freed before this "
          "ray.get (every ref to it went out of scope, or its producer released it), or "
          "the ref was not obtained from Ray (rebuilt from its id, or kept from an earlier "
          "Ray session). Keep the ref that the method or ray.put returned alive until "
          "every consumer has fetched the object, and fetch it through that ref.",
          obj_id,
      ) from None
    finally:
      _batch.started = outer
      started.clear()

  _mark(fetch_and_get_rdt_objects, original)
  cls.fetch_and_get_rdt_objects = fetch_and_get_rdt_objects  # type: ignore[method-assign]


#: The rdt_jax fetches started by the `fetch_and_get_rdt_objects` call running
#: in this thread (`started`), so the wrapper can give up those Ray drops.
_batch = threading.local()


def track_fetch(request: Any) -> None:
  """Notes a fetch request an rdt_jax transport started (it has `give_up()`);
  kept only while Ray's batched fetch that started it runs in this thread."""
  started = getattr(_batch, "started", None)
  if started is not None:
    started.append(request)


# --------------------------------------------------------------------------
# `await ref` and refs nested in values (rdt_jax._aio_errors has the errors,
# rdt_jax._aio the awaitable that works).

#: The name Ray gives its core worker's io thread, where it runs the
#: deserialization of an awaited ref.
_RAY_IO_THREAD: Final = "worker.io"
_io_thread_ids: set[int] = set()


def _on_ray_io_thread() -> bool:
  """True on Ray's core worker io thread (Linux: the thread's name)."""
  tid = threading.get_native_id()
  if tid in _io_thread_ids:
    return True
  try:
    with open(f"/proc/self/task/{tid}/comm") as f:
      named = f.read().strip() == _RAY_IO_THREAD
  except OSError:
    return False
  if named:
    _io_thread_ids.add(tid)
  return named


def _rdt_jax_transport_of(manager: Any, ref: Any, serialized: Any) -> str | None:
  """The rdt_jax transport of the value `ref` holds, or None (an ordinary
  value, an error Ray raises as such, or another transport's object)."""
  from ray._private import ray_constants

  _, metadata, transport = serialized
  if not metadata or metadata.split(b",")[0] != ray_constants.OBJECT_METADATA_TYPE_PYTHON:
    return None
  if transport is None:  # a borrowed ref: the transport is in its RDT metadata
    meta = manager.get_rdt_metadata(ref.hex())
    transport = None if meta is None else meta.tensor_transport_backend
  return str(transport) if transport and is_rdt_jax_transport(str(transport)) else None


def _awaited_rdt_jax_objects(worker: Any, serialized_objects: list[Any], object_refs: list[Any]) -> dict[int, str]:
  """Position -> transport of each rdt_jax object Ray deserializes for an
  awaited ref (its get-async callback, on the io thread); empty on every
  other path (task arguments)."""
  if sys._getframe(1).f_back is not None:  # Python code below: not Ray's callback
    return {}
  manager = worker.rdt_manager
  found = {}
  for i, (ref, serialized) in enumerate(zip(object_refs, serialized_objects)):
    transport = _rdt_jax_transport_of(manager, ref, serialized)
    if transport is not None:
      found[i] = transport
  return found if found and _on_ray_io_thread() else {}


def _wrap_deserialize_objects() -> None:
  """`await ref` of an rdt_jax object fails at once, saying what to do.

  Ray deserializes an awaited ref in its get-async callback on the io thread,
  with no fetch started, and waits there for the object to reach this
  process: it never does (that thread would have to serve the transfer, and
  it delivers the transport metadata too), the wait ends in a callback error
  and the coroutine waits forever. There the wrapper returns
  `rdt_jax.AwaitNotSupportedError` for each rdt_jax object instead (a
  `RayError`, which Ray's future raises), wherever the object lives (Ray's
  path fails for this process's own objects too); ordinary objects and other
  transports' objects are untouched.
  """
  from ray._private import worker

  cls = worker.Worker
  original = cls.deserialize_objects
  if getattr(original, "_rdt_jax", False):
    return

  def deserialize_objects(self: Any, serialized_objects: Any, object_refs: Any, rdt_objects: Any = None) -> Any:
    if rdt_objects is not None:
      return original(self, serialized_objects, object_refs, rdt_objects)
    refused = _awaited_rdt_jax_objects(self, serialized_objects, object_refs)
    if not refused:
      return original(self, serialized_objects, object_refs, rdt_objects)
    aio = importlib.import_module("rdt_jax._aio_errors")
    rest = [i for i in range(len(object_refs)) if i not in refused]
    values = dict(zip(rest, original(self, [serialized_objects[i] for i in rest], [object_refs[i] for i in rest])))
    values.update({i: aio.await_error(object_refs[i].hex(), t) for i, t in refused.items()})
    return [values[i] for i in range(len(object_refs))]

  _mark(deserialize_objects, original)
  cls.deserialize_objects = deserialize_objects  # type: ignore[method-assign]


_quiet_lock = threading.Lock()
_quiet_count = 0
_quiet_saved = False


@contextlib.contextmanager
def quiet_blocking_get_warning() -> Iterator[None]:
  """Within it, `ray.get` in an async actor does not log Ray's one-time
  advice to `await` the ref instead (`rdt_jax.get_async` runs `ray.get` in a
  worker thread, where it blocks no event loop). Ray's flag is restored when
  the last such `ray.get` ends."""
  global _quiet_count, _quiet_saved
  from ray._private import worker

  with _quiet_lock:
    if _quiet_count == 0:
      _quiet_saved = worker.blocking_get_inside_async_warned
      worker.blocking_get_inside_async_warned = True
    _quiet_count += 1
  try:
    yield
  finally:
    with _quiet_lock:
      _quiet_count -= 1
      if _quiet_count == 0:
        worker.blocking_get_inside_async_warned = _quiet_saved


def _nested_ref_ready(ref: Any) -> None:
  """Before Ray's reducer pickles rdt_jax ref `ref` inside a value: waits
  for its transport metadata where its object is ready (the metadata reaches
  the owner just after the object), and raises `RefNotReadyError` where the
  object does not exist yet or is the producer's error (Ray's
  `NotImplementedError` would say to use `ray.put`)."""
  import ray
  from ray._private import ray_constants

  worker = ray._private.worker.global_worker
  manager = worker.rdt_manager
  meta = manager.get_rdt_metadata(ref.hex())
  if meta is None or meta.tensor_transport_meta is not None:
    return
  transport = str(meta.tensor_transport_backend or "")
  if not is_rdt_jax_transport(transport) or not worker.get_serialization_context().is_in_band_serialization():
    return
  aio = importlib.import_module("rdt_jax._aio_errors")
  ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
  if not ready:
    raise aio.not_ready_error(ref.hex(), transport)
  [(_, metadata, _)] = worker.core_worker.get_objects([ref], 0)  # type: ignore[attr-defined]  # ready: no wait
  if metadata and metadata.split(b",")[0] != ray_constants.OBJECT_METADATA_TYPE_PYTHON:
    raise aio.failed_object_error(ref.hex(), transport)  # an error: no metadata will come
  manager.wait_for_tensor_transport_metadata(ref.hex(), ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)


def _chained_ref_reducer(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
  if getattr(original, "_rdt_jax", False):
    return original

  def object_ref_reducer(ref: Any) -> Any:
    _nested_ref_ready(ref)
    return original(ref)

  _mark(object_ref_reducer, original)
  return object_ref_reducer


def _wrap_object_ref_reducer() -> None:
  """Puts `_nested_ref_ready` in front of Ray's `ObjectRef` reducer: the one
  in place now (a connected worker's), and each one a new serialization
  context registers (a driver's `ray.init` after `register()`)."""
  import ray
  from ray import cloudpickle
  from ray._private.serialization import SerializationContext

  dispatch = cloudpickle.CloudPickler.dispatch
  if ray.ObjectRef in dispatch:
    dispatch[ray.ObjectRef] = _chained_ref_reducer(dispatch[ray.ObjectRef])
  original = SerializationContext._register_cloudpickle_reducer
  if getattr(original, "_rdt_jax", False):
    return

  def _register_cloudpickle_reducer(self: Any, cls: Any, reducer: Any) -> None:
    original(self, cls, _chained_ref_reducer(reducer) if cls is ray.ObjectRef else reducer)

  _mark(_register_cloudpickle_reducer, original)
  SerializationContext._register_cloudpickle_reducer = _register_cloudpickle_reducer  # type: ignore[method-assign]


def install() -> None:
  """Checks Ray, then installs the reducers and Ray wrappers in this process, once.

  Raises:
    UnsupportedRayError: see `check_ray`.
  """
  global _installed
  with _lock:
    if _installed:
      return
    check_ray()
    _import_layers()
    install_reducers()
    _wrap_transport_name_check()
    _wrap_fetch_and_get()
    _wrap_serialize_rdt_objects()
    _wrap_register_on_actor()
    _wrap_default_registration()
    _wrap_trigger_fetch()
    _wrap_set_target_device()
    _wrap_deserialize_objects()
    _wrap_object_ref_reducer()
    _wrap_failure_monitor()
    _installed = True
