"""asyncio and nested refs: `await ref` of an rdt_jax object fails at once
saying what to do, `rdt_jax.get_async`'s `ray.get` draws no advice to
`await`, and a ref nested in a value waits for its metadata or says why it
cannot be sent (`rdt_jax._aio_errors` has the errors, `rdt_jax._aio` the
awaitable that works).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final

from rdt_jax._ray import state, wrapping

__all__ = ["quiet_blocking_get_warning", "wrap_deserialize_objects", "wrap_object_ref_reducer"]


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
  return str(transport) if transport and state.is_rdt_jax_transport(str(transport)) else None


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


def wrap_deserialize_objects() -> None:
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

  Touches: `ray._private.worker.Worker.deserialize_objects` (wrapped); the
    thread Ray names `worker.io` (read from /proc).
  Why: `await ref` of an RDT ref never returns in Ray 2.59-2.60
    (ray-project/ray#59831, ray-project/ray#60435), and for an rdt_jax ref
    it could only wait forever.
  Retire when: Ray supports `await` on an RDT ref (it would run the fetch
    off the io thread, as `rdt_jax.get_async` does); a fix was proposed in
    ray-project/ray#62472.
  """
  from ray._private import worker

  cls = worker.Worker
  original = cls.deserialize_objects
  if wrapping.is_ours(original):
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

  wrapping.mark(deserialize_objects, original)
  cls.deserialize_objects = deserialize_objects  # type: ignore[method-assign]


_quiet_lock = threading.Lock()
_quiet_count = 0
_quiet_saved = False


@contextlib.contextmanager
def quiet_blocking_get_warning() -> Iterator[None]:
  """Within it, `ray.get` in an async actor does not log Ray's one-time
  advice to `await` the ref instead (`rdt_jax.get_async` runs `ray.get` in a
  worker thread, where it blocks no event loop). Ray's flag is restored when
  the last such `ray.get` ends.

  Touches: `ray._private.worker.blocking_get_inside_async_warned` (set).
  Why: the advice would be wrong for an rdt_jax ref, whose `await` is
    refused.
  Retire when: Ray supports `await` on an RDT ref (see
    `wrap_deserialize_objects`).
  """
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
  if not state.is_rdt_jax_transport(transport) or not worker.get_serialization_context().is_in_band_serialization():
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
  if wrapping.is_ours(original):
    return original

  def object_ref_reducer(ref: Any) -> Any:
    _nested_ref_ready(ref)
    return original(ref)

  wrapping.mark(object_ref_reducer, original)
  return object_ref_reducer


def wrap_object_ref_reducer() -> None:
  """Puts `_nested_ref_ready` in front of Ray's `ObjectRef` reducer: the one
  in place now (a connected worker's), and each one a new serialization
  context registers (a driver's `ray.init` after `register()`).

  Touches: `CloudPickler.dispatch[ObjectRef]` (chained),
    `SerializationContext._register_cloudpickle_reducer` (wrapped),
    `is_in_band_serialization`, `core_worker.get_objects` and
    `RDTManager.wait_for_tensor_transport_metadata` (called).
  Why: an RDT ref nested in a value before its object exists fails in Ray
    with a `NotImplementedError` about borrowing (ray-project/ray#59644), and a
    ready one can be sent before its transport metadata reached the owner.
  Retire when: Ray waits for (or refuses clearly) a nested RDT ref's
    metadata itself (ray-project/ray#59644).
  """
  import ray
  from ray import cloudpickle
  from ray._private.serialization import SerializationContext

  dispatch = cloudpickle.CloudPickler.dispatch
  if ray.ObjectRef in dispatch:
    dispatch[ray.ObjectRef] = _chained_ref_reducer(dispatch[ray.ObjectRef])
  original = SerializationContext._register_cloudpickle_reducer
  if wrapping.is_ours(original):
    return

  def _register_cloudpickle_reducer(self: Any, cls: Any, reducer: Any) -> None:
    original(self, cls, _chained_ref_reducer(reducer) if cls is ray.ObjectRef else reducer)

  wrapping.mark(_register_cloudpickle_reducer, original)
  SerializationContext._register_cloudpickle_reducer = _register_cloudpickle_reducer  # type: ignore[method-assign]
