"""The one seam to Ray's internals.

Every place where rdt_jax touches something of Ray that is not public API is
in this module, so a Ray upgrade has one file to check. `install()` puts the
wrappers and reducers in place, once per process.

What is used, and why (docs/ray_integration.md has the long form):

* `ray.cloudpickle.CloudPickler.dispatch`: a reducer per array class, so a
  leaf of any framework is extracted out of band (Ray registers one
  `data_type` per transport, and matches the exact class).
* `SerializationContext.serialize_rdt_objects` (wrapped): records which
  transport is serializing, and the value, to name leaves by pytree path.
* `SerializationContext._thread_local.rdt_tensors` /
  `use_external_transport`: where Ray collects extracted leaves.
* `RDTManager.register_custom_transports_on_actor` (wrapped): registration of
  custom transports on a new actor as an ordered actor task.
* `util._ensure_default_transports_registered` (wrapped): registers rdt_jax's
  transports in a worker on its first RDT lookup (consumer-only actors).
* `RDTManager._trigger_fetch` (wrapped): `ray.get` of a two-sided ref names
  the fixes.
* `util.transport_manager_info`, `global_worker.rdt_manager`
  (`is_managed_object`, `get_rdt_metadata`), `ActorHandle._actor_id`: reads.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, Final

from rdt_jax import _compat, _dlpack, _state

# Ray minor versions whose RDT internals we have read and tested.
TESTED_RAY_MINORS: Final = frozenset({(2, 60)})

_lock = threading.RLock()
_installed = False


def ray_version_tested() -> bool:
  """True if the installed Ray is a minor version we test against."""
  import ray

  major, minor = ray.__version__.split(".")[:2]
  return (int(major), int(minor)) in TESTED_RAY_MINORS


# --------------------------------------------------------------------------
# Reads of Ray's state.


def transport_info(name: str) -> Any:
  """Ray's registry entry for transport `name`, or None."""
  from ray.experimental.rdt import util

  return util.transport_manager_info.get(name.upper())


def is_rdt_jax_transport(name: str) -> bool:
  """True if Ray's transport `name` is an rdt_jax (DLPack) transport."""
  info = transport_info(name)
  return info is not None and getattr(info.transport_manager_class, "_rdt_jax_transport", False)


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


def actor_id(actor: Any) -> str:
  """The hex id of an actor handle."""
  return str(actor._actor_id.hex())


def call_on_system_group(actor: Any, fn: Callable[..., Any], *args: Any) -> Any:
  """Runs `fn(actor_instance, *args)` on `actor` in Ray's `_ray_system`
  concurrency group (beside running methods); returns the ref."""
  return actor.__ray_call__.options(concurrency_group="_ray_system").remote(fn, *args)


def in_ray_worker() -> bool:
  """True in a Ray worker process (an actor or task), False in a driver."""
  import ray

  return getattr(ray._private.worker.global_worker, "mode", None) == ray.WORKER_MODE


# --------------------------------------------------------------------------
# Reducers: every array class is extracted out of band while an rdt_jax
# transport serializes, and pickled as usual otherwise.


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


def _reduce_ex(leaf: Any) -> Any:
  if _extracting():
    return _take_leaf(leaf)
  return leaf.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _reduce_jax(leaf: Any) -> Any:
  if _extracting():
    return _take_leaf(leaf)
  return leaf.__reduce__()


def _reduce_prng_key(leaf: Any) -> Any:
  if _extracting():
    _dlpack.describe(leaf, _state.leaf_path(leaf))  # raises, naming the leaf
  return leaf.__reduce__()


_reducers_for: set[str] = set()


def install_reducers() -> None:
  """Installs the reducers for every framework imported so far, once each.

  A leaf can only be a jax or torch array if its framework is imported, so
  frameworks imported later are covered when the next RDT value is serialized.
  """
  from ray import cloudpickle

  dispatch = cloudpickle.CloudPickler.dispatch
  if "numpy" not in _reducers_for:
    import numpy as np

    dispatch[np.ndarray] = _reduce_ex
    _reducers_for.add("numpy")
  if "jax" not in _reducers_for and "jax" in sys.modules:
    dispatch[_compat.array_impl_type()] = _reduce_jax
    key_type = _compat.prng_key_array_type()
    if key_type is not None:
      dispatch[key_type] = _reduce_prng_key
    _reducers_for.add("jax")
  if "torch" not in _reducers_for and "torch" in sys.modules:
    torch = sys.modules["torch"]
    dispatch[torch.Tensor] = _reduce_ex
    dispatch[torch.nn.Parameter] = _reduce_ex
    _reducers_for.add("torch")
  if "cupy" not in _reducers_for and "cupy" in sys.modules:
    dispatch[sys.modules["cupy"].ndarray] = _reduce_ex
    _reducers_for.add("cupy")


# --------------------------------------------------------------------------
# Wrappers around Ray's functions.


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
      return original(self, value, tensor_transport)
    finally:
      _state.end_serialization()

  serialize_rdt_objects._rdt_jax = True  # type: ignore[attr-defined]
  SerializationContext.serialize_rdt_objects = serialize_rdt_objects  # type: ignore[method-assign]


def _register_transports_on_actor(self: Any, info: dict[str, Any]) -> None:
  """Runs on a new actor: registers the creator's custom transports there."""
  from ray.experimental.rdt import util

  install()
  util._ensure_default_transports_registered()
  for name, transport in info.items():
    if name not in util.transport_manager_info:
      util.register_tensor_transport(
          name, transport.devices, transport.transport_manager_class, transport.data_type
      )


def _wrap_register_on_actor() -> None:
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  if getattr(cls.register_custom_transports_on_actor, "_rdt_jax", False):
    return

  def register_custom_transports_on_actor(self: Any, actor: Any) -> None:
    from ray.experimental.rdt import util

    util._ensure_default_transports_registered()
    if not util.has_custom_transports:
      self.actor_id_to_transports_registered[actor._actor_id] = True
      return
    # An ordinary actor task (default concurrency group): the actor runs it
    # before any method its creator calls afterwards, so even a first-action
    # `ray.put(x, _tensor_transport=...)` finds the transport registered. Ray
    # submits it on the `_ray_system` thread instead, which races.
    ref = actor.__ray_call__.remote(_register_transports_on_actor, dict(util.transport_manager_info))
    self.actor_id_to_transports_registered[actor._actor_id] = ref

  register_custom_transports_on_actor._rdt_jax = True  # type: ignore[attr-defined]
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
  done: list[bool] = []

  def _ensure_default_transports_registered() -> None:
    original()
    if not done and in_ray_worker():
      done.append(True)
      # Resolved at run time: the registry knows the transports, which
      # import this module.
      importlib.import_module("rdt_jax._registry").register()

  _ensure_default_transports_registered._rdt_jax = True  # type: ignore[attr-defined]
  util._ensure_default_transports_registered = _ensure_default_transports_registered


_refusals: dict[str, Callable[[str], str]] = {}


def refuse_driver_get(name: str, message: Callable[[str], str]) -> None:
  """Makes `ray.get` of a ref of transport `name` raise `message(name)`.

  For two-sided transports: Ray 2.60 refuses such a `ray.get` in
  `RDTManager._trigger_fetch` with a message that suggests "a one-sided
  transport" without naming one.
  """
  _refusals[name.lower()] = message
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls._trigger_fetch
  if getattr(original, "_rdt_jax", False):
    return

  def _trigger_fetch(self: Any, obj_id: str, use_object_store: bool) -> Any:
    if not use_object_store:
      meta = self.get_rdt_metadata(obj_id)
      transport = meta.tensor_transport_backend if meta is not None else ""
      refusal = _refusals.get((transport or "").lower())
      if refusal is not None:
        raise ValueError(refusal(transport))
    return original(self, obj_id, use_object_store)

  _trigger_fetch._rdt_jax = True  # type: ignore[attr-defined]
  cls._trigger_fetch = _trigger_fetch  # type: ignore[method-assign]


def install() -> None:
  """Installs the reducers and Ray wrappers in this process, once."""
  global _installed
  with _lock:
    if _installed:
      return
    if not ray_version_tested():
      import ray

      warnings.warn(
          f"rdt_jax is tested with Ray {sorted(TESTED_RAY_MINORS)}; "
          f"Ray {ray.__version__} may have changed the RDT internals it wraps.",
          stacklevel=3,
      )
    install_reducers()
    _wrap_serialize_rdt_objects()
    _wrap_register_on_actor()
    _wrap_default_registration()
    _installed = True
