"""Registration with Ray: transports, serializers for every array type, modes.

Ray extracts RDT leaves through a cloudpickle reducer registered for one
`data_type` per transport. rdt_jax instead installs one reducer for each array
class it moves (`jax.Array`'s concrete class, `torch.Tensor`,
`torch.nn.Parameter`, `np.ndarray`) and for jax PRNG key arrays (to refuse
them), in every process that imports it. A reducer pulls its leaf out of band
only while Ray serializes a value for an rdt_jax transport; everywhere else it
defers to the class's own pickling, so methods without `tensor_transport` keep
Ray's zero-copy pickle5 path for NumPy.

Two small wrappers around Ray 2.60 internals make this work (see `_compat`):
`SerializationContext.serialize_rdt_objects` records which transport is
serializing (and the value, to name leaves by pytree path in errors), and
`RDTManager.register_custom_transports_on_actor` submits the registration of
custom transports on a new actor as an ordinary, ordered actor task, so it runs
before any method the creator calls, closing Ray's race for `ray.put` as an
actor's first action.
"""

from __future__ import annotations

import pickle
import threading
from typing import TYPE_CHECKING, Any, Callable

from rdt_jax import _arrays, _compat
from rdt_jax._metadata import RECEIVE_MODES

if TYPE_CHECKING:
  from rdt_jax.transports._base import DlpackTransport

_lock = threading.RLock()
_installed = False
_receive_mode = "source"


class _SerializationState(threading.local):
  """Per-thread state of the rdt_jax serialization in progress, if any."""

  def __init__(self) -> None:
    self.transport: str | None = None
    self.context: Any = None
    self.root: Any = None
    self.paths: dict[int, str] | None = None
    # id(leaf) -> (leaf, DescribedLeaf), handed to extract_tensor_transport_metadata.
    self.described: dict[int, tuple[Any, _arrays.DescribedLeaf]] = {}


_state = _SerializationState()


# --------------------------------------------------------------------------
# Transports known to rdt_jax.


def _transport_classes() -> dict[str, type]:
  """The rdt_jax transports this process can run, by lower-case name."""
  from rdt_jax.transports import _collective
  from rdt_jax.transports._nixl import NixlTransport

  classes: dict[str, type] = {}
  if _compat.nixl_available():
    classes[NixlTransport.name] = NixlTransport
  if _collective.torch_importable():  # Ray's collective groups move torch tensors
    classes[_collective.GlooTransport.name] = _collective.GlooTransport
    classes[_collective.NcclTransport.name] = _collective.NcclTransport
  if _compat.has_jax_transfer():
    from rdt_jax.transports._transfer import TransferTransport

    classes[TransferTransport.name] = TransferTransport
  return classes


def is_rdt_jax_transport(name: str) -> bool:
  """True if Ray's transport `name` is an rdt_jax (DLPack) transport."""
  from ray.experimental.rdt import util

  from rdt_jax.transports._base import DlpackTransport

  info = util.transport_manager_info.get(name.upper())
  return info is not None and issubclass(info.transport_manager_class, DlpackTransport)


def register_transport(cls: type["DlpackTransport"]) -> str:
  """Registers one DlpackTransport subclass with Ray, once per process.

  Use it for your own transports, as `register()` does for rdt_jax's. Call it
  where you would call `register()`: before defining classes whose methods
  name the transport (`@ray.method(tensor_transport=...)` checks the name on
  definition) and before creating the actors that use it, in the process that
  creates them. A second call for the same class changes nothing.

  Args:
    cls: a `DlpackTransport` subclass with `name` and `devices` set. It must
      be importable by module path on every worker (Ray pickles it by
      reference), e.g. defined in a module on the workers' `PYTHONPATH`.

  Returns:
    The transport's lower-case name, to pass as `tensor_transport`.

  Raises:
    ValueError: if `cls` is not a `TensorTransportManager` subclass (Ray's check).
  """
  from ray.experimental.rdt import util

  install()
  name = cls.name.lower()
  with _lock:
    if name.upper() not in util.transport_manager_info:
      util.register_tensor_transport(
          name, list(cls.devices), cls, _compat.array_impl_type()
      )
  return name


def register() -> list[str]:
  """Registers every rdt_jax transport whose dependencies are importable.

  Idempotent: a second call changes nothing and returns the same names. Call
  it before defining classes whose methods name an rdt_jax transport
  (`@ray.method(tensor_transport="jax_nixl")` checks the name when the class
  is defined) and before creating the actors that use the transports, in the
  process that creates them (usually the driver). It may be called before or
  after `ray.init`, and inside actors.

  Returns:
    The registered transport names in lower case, e.g. `["jax_nixl"]`.
  """
  return [register_transport(cls) for cls in _transport_classes().values()]


# --------------------------------------------------------------------------
# Receive mode.


def receive_as(mode: str) -> None:
  """Sets the array type every leaf arriving in this process becomes.

  Args:
    mode: "jax", "torch" or "numpy" to convert every arriving leaf to that
      type, or "source" (the default) to keep each leaf's original type.

  Applies process-wide to every leaf that arrives by an rdt_jax transfer
  (task arguments and `ray.get`, driver included). A process reading its own
  RDT object gets the stored objects back, unconverted (Ray's semantics).

  Raises:
    ValueError: for any other mode.
  """
  global _receive_mode
  if mode not in RECEIVE_MODES:
    raise ValueError(
        f"Unknown receive mode {mode!r}; expected one of "
        f"{', '.join(repr(m) for m in RECEIVE_MODES)}."
    )
  _receive_mode = mode


def receive_mode() -> str:
  """The current process's receive mode (see `receive_as`)."""
  return _receive_mode


# --------------------------------------------------------------------------
# Serializers.


def _leaf_path(leaf: Any) -> str:
  """The pytree path of `leaf` in the value being serialized ("" if unknown)."""
  if _state.paths is None:
    import jax

    paths: dict[int, str] = {}
    try:
      flat, _ = jax.tree_util.tree_flatten_with_path(_state.root)
    except Exception:  # a value jax cannot flatten: paths stay unknown
      flat = []
    for path, x in flat:
      paths.setdefault(id(x), jax.tree_util.keystr(path))
    _state.paths = paths
  return _state.paths.get(id(leaf), "")


def _extracting() -> bool:
  return _state.transport is not None and getattr(
      _state.context._thread_local, "use_external_transport", False
  )


def _take_leaf(leaf: Any) -> tuple[Callable[[int], Any], tuple[int]]:
  """Moves `leaf` out of band: validates it and records its index."""
  described = _arrays.describe(leaf, _leaf_path(leaf))
  tensors = _state.context._thread_local.rdt_tensors
  tensors.append(leaf)
  _state.described[id(leaf)] = (leaf, described)
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
    _arrays.describe(leaf, _leaf_path(leaf))  # raises, naming the leaf
  return leaf.__reduce__()


def take_described(leaves: list[Any]) -> list[_arrays.DescribedLeaf]:
  """The DescribedLeaf for each leaf of an object being stored.

  Uses what the serializer recorded on this thread, describing again (without
  a pytree path) where it has nothing, e.g. for a retried task.
  """
  described = _state.described
  out = []
  for i, leaf in enumerate(leaves):
    hit = described.pop(id(leaf), None)
    out.append(hit[1] if hit is not None and hit[0] is leaf else _arrays.describe(leaf, f"<leaf {i}>"))
  return out


_reducers_for: set[str] = set()


def _install_reducers() -> None:
  """Installs the reducers for every framework imported so far, once each.

  A leaf can only be a jax or torch array if its framework is imported, so
  frameworks imported later are covered when the next RDT value is serialized.
  """
  import sys

  pickler = _compat.ray_cloudpickler()
  if "numpy" not in _reducers_for:
    import numpy as np

    pickler.dispatch[np.ndarray] = _reduce_ex
    _reducers_for.add("numpy")
  if "jax" not in _reducers_for and "jax" in sys.modules:
    pickler.dispatch[_compat.array_impl_type()] = _reduce_jax
    key_type = _compat.prng_key_array_type()
    if key_type is not None:
      pickler.dispatch[key_type] = _reduce_prng_key
    _reducers_for.add("jax")
  if "torch" not in _reducers_for and "torch" in sys.modules:
    torch = sys.modules["torch"]
    pickler.dispatch[torch.Tensor] = _reduce_ex
    pickler.dispatch[torch.nn.Parameter] = _reduce_ex
    _reducers_for.add("torch")


# --------------------------------------------------------------------------
# Ray wrappers.


def _wrap_serialize_rdt_objects() -> None:
  cls = _compat.ray_serialization_context_class()
  original = cls.serialize_rdt_objects
  if getattr(original, "_rdt_jax", False):
    return

  def serialize_rdt_objects(self, value, tensor_transport):
    from ray.experimental.rdt import util

    if not is_rdt_jax_transport(tensor_transport):
      return original(self, value, tensor_transport)
    _install_reducers()
    # Keep Ray from replacing our reducer with its single-type serializer.
    data_type = util.get_transport_data_type(tensor_transport.upper())
    self._rdt_custom_serializer_registered[data_type] = True
    _state.transport, _state.context, _state.root = tensor_transport, self, value
    _state.paths, _state.described = None, {}
    try:
      return original(self, value, tensor_transport)
    finally:
      _state.transport, _state.context, _state.root, _state.paths = None, None, None, None

  serialize_rdt_objects._rdt_jax = True
  cls.serialize_rdt_objects = serialize_rdt_objects


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

  def register_custom_transports_on_actor(self, actor):
    from ray.experimental.rdt import util

    util._ensure_default_transports_registered()
    if not util.has_custom_transports:
      self.actor_id_to_transports_registered[actor._actor_id] = True
      return
    # An ordinary actor task (default concurrency group): the actor runs it
    # before any method its creator calls afterwards, so even a first-action
    # `ray.put(x, _tensor_transport=...)` finds the transport registered. Ray
    # submits it on the `_ray_system` thread instead, which races.
    ref = actor.__ray_call__.remote(
        _register_transports_on_actor, dict(util.transport_manager_info)
    )
    self.actor_id_to_transports_registered[actor._actor_id] = ref

  register_custom_transports_on_actor._rdt_jax = True
  cls.register_custom_transports_on_actor = register_custom_transports_on_actor


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
  done = []

  def _ensure_default_transports_registered():
    original()
    if not done and _in_ray_worker():
      done.append(True)
      register()

  _ensure_default_transports_registered._rdt_jax = True
  util._ensure_default_transports_registered = _ensure_default_transports_registered


def _in_ray_worker() -> bool:
  import ray

  return getattr(ray._private.worker.global_worker, "mode", None) == ray.WORKER_MODE


def install() -> None:
  """Installs the reducers and Ray wrappers in this process, once."""
  global _installed
  with _lock:
    if _installed:
      return
    if not _compat.ray_version_tested():
      import warnings

      import ray

      warnings.warn(
          f"rdt_jax is tested with Ray {sorted(_compat.TESTED_RAY_MINORS)}; "
          f"Ray {ray.__version__} may have changed the RDT internals it wraps.",
          stacklevel=3,
      )
    _install_reducers()
    _wrap_serialize_rdt_objects()
    _wrap_register_on_actor()
    _wrap_default_registration()
    _installed = True


# Installed on import: a worker that unpickles an rdt_jax transport class (Ray
# ships them to every new actor) gets the reducers before its first RDT call.
install()
