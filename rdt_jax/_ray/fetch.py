"""Fetches: `ray.get` of an rdt_jax ref, the targets Ray's own functions set
on one, and the fetches a failed batch leaves behind.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable
from typing import Any

from rdt_jax import _hooks
from rdt_jax._errors import UnknownObjectError
from rdt_jax._ray import state, wrapping

__all__ = ["refuse_driver_get", "track_fetch", "wrap_fetch_and_get", "wrap_set_target_device", "wrap_trigger_fetch"]


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


def wrap_trigger_fetch() -> None:
  """Refuses a driver's `ray.get` of a two-sided ref with rdt_jax's message,
  and hands targets set through Ray's functions on an rdt_jax ref to
  rdt_jax's targets.

  Touches: `RDTManager._trigger_fetch` (wrapped), `RDTManager._lock` and
    `_managed_rdt_metadata` (written), `RDTMeta` fields
    `tensor_transport_backend`, `tensor_transport_meta`, `target_buffers`,
    `target_device` (read).
  Why: Ray's refusal of a two-sided `ray.get` suggests "a one-sided
    transport" without naming one; and Ray validates target buffers and
    allocates target devices as torch tensors from `tensor_meta`, which
    holds numpy dtypes for rdt_jax transports.
  Retire when: Ray asks the transport to validate and place targets (a
    transport hook for `set_target_for_ref`), and lets a transport word its
    refusal.
  """
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls._trigger_fetch
  if wrapping.is_ours(original):
    return

  def _trigger_fetch(self: Any, obj_id: str, use_object_store: bool) -> Any:
    meta = self.get_rdt_metadata(obj_id)
    transport = (meta.tensor_transport_backend or "") if meta is not None else ""
    if not use_object_store:
      refusal = _refusals.get(transport.lower())
      if refusal is not None:
        raise ValueError(refusal(transport))
    has_target = meta is not None and (meta.target_buffers or meta.target_device is not None)
    if has_target and state.is_rdt_jax_transport(transport):
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

  wrapping.mark(_trigger_fetch, original)
  cls._trigger_fetch = _trigger_fetch  # type: ignore[method-assign]


def wrap_set_target_device() -> None:
  """Ray's `set_target_device_for_ref` parses the device with torch before any
  transport is asked. For an rdt_jax ref, rdt_jax parses it (jax devices and
  "gpu" too, no torch needed); Ray keeps it for the fetch as usual.

  Touches: `RDTManager.set_target_device_for_ref` (wrapped), `RDTManager._lock`
    and `_managed_rdt_metadata` (written).
  Why: Ray's version needs torch and knows only torch devices.
  Retire when: Ray hands the device to the transport to parse.
  """
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls.set_target_device_for_ref
  if wrapping.is_ours(original):
    return

  def set_target_device_for_ref(self: Any, ref: Any, target_device: Any) -> None:
    meta = self.get_rdt_metadata(ref.hex())
    transport = (meta.tensor_transport_backend or "") if meta is not None else ""
    if not state.is_rdt_jax_transport(transport):
      return original(self, ref, target_device)
    # Raises for what no rdt_jax transport moves.
    device = importlib.import_module("rdt_jax._dlpack").parse_device(target_device)
    devices = state.transport_info(transport).devices
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

  wrapping.mark(set_target_device_for_ref, original)
  cls.set_target_device_for_ref = set_target_device_for_ref  # type: ignore[method-assign]


_NO_METADATA = "No metadata found for "


def wrap_fetch_and_get() -> None:
  """`ray.get` of an RDT ref whose object this process does not know (freed,
  or a ref not obtained from Ray) fails in Ray's
  `RDTManager.fetch_and_get_rdt_objects` with a bare `AssertionError`; the
  wrapper raises `UnknownObjectError` saying why and what to do. And when
  the batch raises, every rdt_jax fetch it started and did not finish is
  given up at once (`track_fetch`).

  Touches: `RDTManager.fetch_and_get_rdt_objects` (wrapped).
  Why: Ray's message names no cause or fix; and when one fetch of a batch
    fails or times out, Ray drops the others unfinished, leaving their reads
    to run until their requests are collected.
  Retire when: Ray raises a typed error for an unknown object, and cancels
    (`abort`s) the unfinished fetches of a failed batch (a follow-up of
    ray-project/ray#61773, concurrent one-sided fetches).
  """
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls.fetch_and_get_rdt_objects
  if wrapping.is_ours(original):
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

  wrapping.mark(fetch_and_get_rdt_objects, original)
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
