"""The Ray versions rdt_jax runs on, and the shape of every Ray internal it
touches, checked before anything is wrapped.

`check_ray()` runs at `install()` (`registration.py`): it refuses a Ray
whose internals changed shape (`check_ray_shapes`: each function still
takes the parameters, and still uses the attributes, that the wraps rely
on) and a Ray minor outside `SUPPORTED_RAY` unless `ALLOW_UNTESTED_ENV` is
set. `rdt-jax doctor` reports the same range.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import MutableMapping
from typing import Any, Final

from rdt_jax import _settings
from rdt_jax._errors import UnsupportedRayError
from rdt_jax._ray import wrapping

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "SUPPORTED_RAY",
    "TESTED_RAY_MINORS",
    "UnsupportedRayError",
    "check_ray",
    "check_ray_shapes",
    "params",
    "ray_version_tested",
    "uses",
]

# Ray minor versions whose RDT internals we have read and whose suite runs in
# CI (scripts/matrix.sh); pyproject.toml states the same range.
TESTED_RAY_MINORS: Final = frozenset({(2, 59), (2, 60)})
SUPPORTED_RAY: Final = ">=2.59,<2.61"
#: Set to 1 to let `register()` run on a Ray minor outside SUPPORTED_RAY
#: (warning instead of refusal); the shape checks still apply.
ALLOW_UNTESTED_ENV: Final = "RDT_JAX_ALLOW_UNTESTED_RAY"


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


def params(obj: Any, attr: str, params: tuple[str, ...]) -> str | None:
  """`obj.attr` exists and takes (at least, in order) the named parameters."""
  fn = wrapping.unwrapped(getattr(obj, attr, None))
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


def uses(fn: Any, where: str, names: tuple[str, ...]) -> str | None:
  """The code of `fn` (or a function nested in it) still uses attributes `names`."""
  code = getattr(wrapping.unwrapped(fn), "__code__", None)
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


def check_ray_shapes() -> list[str]:
  """Every Ray internal the rooms of `rdt_jax._ray` rely on, checked; what
  is missing or changed, one line each (empty: this Ray fits)."""
  import ray
  from ray import cloudpickle
  from ray._private import serialization, worker
  from ray.actor import ActorHandle
  from ray.experimental.rdt import rdt_manager, util

  ctx = serialization.SerializationContext
  mgr = rdt_manager.RDTManager
  problems = [
      params(util, "register_tensor_transport", ("transport_name", "devices", "transport_manager_class", "data_type")),
      params(util, "_ensure_default_transports_registered", ()),
      uses(getattr(util, "_ensure_default_transports_registered", None), "util._ensure_default_transports_registered",
           ("_default_transports_registered", "transport_managers_lock", "register_tensor_transport")),
      params(util, "get_transport_data_type", ("tensor_transport",)),
      params(util, "get_tensor_transport_manager", ("transport_name",)),
      params(util, "normalize_and_validate_tensor_transport", ("tensor_transport",)),
      params(ctx, "serialize_rdt_objects", ("self", "value", "tensor_transport")),
      uses(getattr(ctx, "serialize_rdt_objects", None), "SerializationContext.serialize_rdt_objects",
            ("_thread_local", "use_external_transport", "rdt_tensors")),
      uses(ctx.__init__, "SerializationContext.__init__", ("_thread_local", "_rdt_custom_serializer_registered")),
      params(mgr, "register_custom_transports_on_actor", ("self", "actor")),
      params(mgr, "wait_until_custom_transports_registered", ("self", "actor")),
      uses(mgr.__init__, "RDTManager.__init__",
            ("actor_id_to_transports_registered", "_managed_rdt_metadata", "_lock")),
      params(mgr, "_trigger_fetch", ("self", "obj_id", "use_object_store")),
      params(mgr, "_abort_transport", ("self", "failed_ref", "ref_info_map", "exception")),
      params(mgr, "shutdown", ("self",)),
      uses(mgr.__init__, "RDTManager.__init__ (failure monitor)", ("_unmonitored_transfers",)),
      params(mgr, "fetch_and_get_rdt_objects", ("self", "object_ids")),
      params(mgr, "set_target_device_for_ref", ("self", "ref", "target_device")),
      params(mgr, "get_rdt_metadata", ("self", "obj_id")),
      params(mgr, "is_managed_object", ("self", "obj_id")),
      params(mgr, "wait_for_tensor_transport_metadata", ("self", "obj_id", "timeout")),
      params(worker.Worker, "deserialize_objects", ("self", "serialized_objects", "object_refs", "rdt_objects")),
      params(ctx, "_register_cloudpickle_reducer", ("self", "cls", "reducer")),
      params(ctx, "is_in_band_serialization", ("self",)),
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
  problems.append(uses(ActorHandle.__init__, "ActorHandle.__init__", ("_ray_enable_tensor_transport",)))
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
    problems = check_ray_shapes()
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
