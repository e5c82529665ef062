"""Serialization: the reducers that take every array leaf out of band while
an rdt_jax transport serializes, and the wrap around Ray's serialization of
an RDT value that tells them so.

A leaf of any framework (jax, PRNG keys, NumPy, torch, cupy) is described by
the DLPack layer and appended to Ray's out-of-band list; otherwise the
reducer that was in `dispatch` before ours (Ray's own RDT serializer for
torch, say) runs, or the default pickle.
"""

from __future__ import annotations

import importlib
import operator
import pickle
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rdt_jax import _compat
from rdt_jax._ray import state, wrapping

if TYPE_CHECKING:
  from rdt_jax import _dlpack, _handoff, _leaf_pack

__all__ = ["install_reducers", "wrap_serialize_rdt_objects"]


def import_layers() -> None:
  """Binds `_dlpack`, `_handoff` and `_leaf_pack` in this module (all import numpy).

  Deferred to the first `install()` / `install_reducers()`, before which
  nothing here uses them, so that the name check can be installed at
  `import rdt_jax` without importing numpy.
  """
  if "_handoff" not in globals():
    globals()["_dlpack"] = importlib.import_module("rdt_jax._dlpack")
    globals()["_handoff"] = importlib.import_module("rdt_jax._handoff")
    globals()["_leaf_pack"] = importlib.import_module("rdt_jax._leaf_pack")


def _extracting() -> bool:
  s = _handoff.serializing
  return s.transport is not None and getattr(s.context._thread_local, "use_external_transport", False)


def _take_leaf(leaf: Any) -> tuple[Callable[[int], Any], tuple[int]]:
  """Moves `leaf` out of band: validates it and records its index."""
  described = _dlpack.describe(leaf, _handoff.leaf_path(leaf))
  tensors = _handoff.serializing.context._thread_local.rdt_tensors
  tensors.append(leaf)
  _handoff.record_described(leaf, described)
  return _leaf_from_transfer, (len(tensors) - 1,)


def _take_jax_leaf(leaf: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """Moves jax leaf `leaf` out of band: into the value's pack if it may be
  packed (`rdt_jax._leaf_pack`), else as a tensor of its own (`_take_leaf`).

  A packed leaf pickles as `operator.getitem(pack, k)`, where `pack` is one
  `_Pack` object per value: the pickler writes it once and refers to it from
  every other packed leaf, so the unpickler finds the pack's leaves once
  (`_leaf_from_transfer`) and takes each with a C call, no Python per leaf."""
  here = _pack_of_thread
  tensors = here.tensors
  if tensors is None:  # once per serialization: Ray makes the list as it starts
    tensors = here.tensors = _handoff.serializing.context._thread_local.rdt_tensors
  packed = _leaf_pack.take(leaf, tensors)
  if packed is None:
    return _take_leaf(leaf)
  slot, k = packed
  if k == 0:  # the value's first packed leaf (each serialization counts from 0)
    here.pack = _Pack(slot)
  return operator.getitem, (here.pack, k)


class _Pack:
  """The pack of the value being serialized: pickled as the tuple of packed
  leaves the transport delivers as tensor `slot` (rebuilt there from the
  pack buffer, `rdt_jax.transports._packed`), found as `_leaf_from_transfer`
  finds a leaf."""

  __slots__ = ("slot",)

  def __init__(self, slot: int):
    self.slot = slot

  def __reduce__(self) -> tuple[Callable[[int], Any], tuple[int]]:
    return _leaf_from_transfer, (self.slot,)


class _PackOfThread(threading.local):
  """The serialization running on this thread: its `_Pack`, and Ray's list
  of its out-of-band leaves (None until its first jax leaf)."""

  pack: _Pack | None = None
  tensors: list[Any] | None = None


_pack_of_thread = _PackOfThread()


def _leaf_from_transfer(index: int) -> Any:
  """Deserializer: the `index`-th leaf the transport delivered.

  Touches: `SerializationContext._thread_local.rdt_tensors` of
    `global_worker.get_serialization_context()` (read).
  Why: Ray hands the received leaves to its own deserializer of the one
    `data_type` it knows; leaves of other classes are found here by index.
  Retire when: Ray lets a transport claim several array types (see
    `install_reducers`).
  """
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
  _handoff.set_leaf_path(data, _handoff.leaf_path(key))
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

  Touches: `ray.cloudpickle.CloudPickler.dispatch` (a reducer put in front
    of each array class, chained), and
    `SerializationContext._thread_local.rdt_tensors` and
    `use_external_transport` (read and appended to).
  Why: Ray registers one `data_type` per transport and installs its
    serializer for it only, so a value mixing jax, torch and NumPy leaves
    would pickle the other leaves into the object store; Ray's public
    `register_serializer` replaces a reducer instead of chaining it, and
    cannot see which transport serializes, nor a leaf's pytree path.
  Retire when: Ray lets a transport claim several array types for its own
    serializations only (chained, with the transport's name).
  """
  import numpy as np

  import_layers()
  _chain(np.ndarray, _default_reduce_ex)
  if "jax" in sys.modules:
    _chain(_compat.array_impl_type(), _default_reduce, take=_take_jax_leaf)
    key_type = _compat.prng_key_array_type()
    if key_type is not None:
      _chain(key_type, _default_reduce, take=_take_prng_key)
  if "torch" in sys.modules:
    torch = sys.modules["torch"]
    _chain(torch.Tensor, _default_reduce_ex)
    _chain(torch.nn.Parameter, _default_reduce_ex)
  if "cupy" in sys.modules:
    _chain(sys.modules["cupy"].ndarray, _default_reduce_ex)


def wrap_serialize_rdt_objects() -> None:
  """Marks which rdt_jax transport serializes which value, around Ray's
  serialization of an RDT value.

  Touches: `SerializationContext.serialize_rdt_objects` (wrapped),
    `_rdt_custom_serializer_registered` (set) and
    `util.get_transport_data_type` (called).
  Why: the reducers must know that an rdt_jax transport serializes, and the
    value, to name leaves by pytree path and publish their descriptions for
    `extract_tensor_transport_metadata`; and Ray would replace our reducer
    with its single-type serializer for the transport's `data_type`.
  Retire when: Ray passes the transport and the value to a transport's own
    serialization hook.
  """
  from ray._private.serialization import SerializationContext

  original = SerializationContext.serialize_rdt_objects
  if wrapping.is_ours(original):
    return

  def serialize_rdt_objects(self: Any, value: Any, tensor_transport: str) -> Any:
    from ray.experimental.rdt import util

    if not state.is_rdt_jax_transport(tensor_transport):
      return original(self, value, tensor_transport)
    install_reducers()
    # Keep Ray from replacing our reducer with its single-type serializer.
    data_type = util.get_transport_data_type(tensor_transport.upper())
    self._rdt_custom_serializer_registered[data_type] = True
    _handoff.begin_serialization(tensor_transport, self, value)
    _leaf_pack.begin()
    _pack_of_thread.tensors = _pack_of_thread.pack = None
    try:
      serialized, leaves = original(self, _whole(value), tensor_transport)
      _leaf_pack.finish(leaves)
      _handoff.finish_serialization(leaves)
      return serialized, leaves
    finally:
      _pack_of_thread.tensors = _pack_of_thread.pack = None
      _leaf_pack.end()
      _handoff.end_serialization()

  wrapping.mark(serialize_rdt_objects, original)
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
