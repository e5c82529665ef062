"""Receive targets: where a `ray.get` of an RDT ref puts the bytes it fetches.

`set_target_for_ref` and `set_target_device_for_ref` mirror Ray's functions of
the same names, for any framework's buffers and any jax device or device
string. Targets are kept per process, keyed by the ref, and used by the next
fetch of that ref in this process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import ray

from rdt_jax import _dlpack, _seam

_lock = threading.Lock()
_targets: dict[str, Target] = {}


@dataclass(frozen=True)
class Target:
  """A ref's receive target: arrays by pytree path, or a device."""

  buffers: dict[str, Any] | None = None
  device: _dlpack.Device | None = None


def _check_rdt_ref(ref: Any) -> str:
  if not isinstance(ref, ray.ObjectRef):
    raise TypeError(f"Expected a ray.ObjectRef, got {type(ref).__name__}.")
  if not _seam.is_managed_object(ref.hex()):
    raise ValueError(
        f"{ref} is not an RDT object: targets apply to refs returned by a "
        "method with @ray.method(tensor_transport=...) or by ray.put(..., "
        "_tensor_transport=...)."
    )
  return ref.hex()


def set_target_for_ref(ref: ray.ObjectRef, target: Any) -> None:
  """Receives the next `ray.get(ref)` in this process into existing arrays.

  `target` has the structure of the value behind `ref` (or is a list in the
  value's leaf order, as with Ray's own function); each array leaf of the
  value is received into the `target` leaf at the same pytree path. The
  weight-sync pattern: a generator passes its current parameters.

  * `np.ndarray` and `torch.Tensor` targets (C-contiguous, same shape and
    dtype) are written in place, and `ray.get` returns those very objects.
  * jax arrays are immutable: writing into one would change values that
    compiled computations and other references already hold. A jax target is
    therefore a placement template: the leaf arrives as a new `jax.Array` on
    the target's device. Delete the old array (or donate it) to free it.

  Shapes and dtypes are checked against the object's metadata when it is
  known here, and otherwise when the fetch starts.

  Raises:
    TypeError: if `ref` is not an ObjectRef.
    ValueError: if `ref` is not an RDT object, or (when the metadata is known)
      a target leaf's shape or dtype differs from the value's, naming the leaf.
  """
  obj_id = _check_rdt_ref(ref)
  buffers = _flatten_target(target)
  meta = _seam.transport_metadata(obj_id)
  if meta is not None:
    align_targets(buffers, getattr(meta, "leaves", []))
  with _lock:
    _targets[obj_id] = Target(buffers=buffers)


def set_target_device_for_ref(ref: ray.ObjectRef, device: Any) -> None:
  """Fetches the next `ray.get(ref)` in this process onto `device`.

  Args:
    ref: an RDT ObjectRef of an rdt_jax transport.
    device: a `jax.Device`, a `torch.device`, or a string such as "cpu",
      "cuda:0" or "gpu". Torch is not needed.

  Raises:
    TypeError: if `ref` is not an ObjectRef.
    ValueError: if `ref` is not an RDT object or the device is not a cpu or
      cuda device.
  """
  obj_id = _check_rdt_ref(ref)
  parsed = _dlpack.parse_device(device)
  with _lock:
    _targets[obj_id] = Target(device=parsed)


def set_target_for_obj_id(obj_id: str, buffers: list[Any]) -> None:
  """Ray's `set_target_for_ref` on an rdt_jax ref (its buffers, in leaf order),
  for the fetch of `obj_id` that is starting (called from `rdt_jax._seam`)."""
  with _lock:
    _targets[obj_id] = Target(buffers={f"[{i}]": b for i, b in enumerate(buffers)})


def set_target_device_for_obj_id(obj_id: str, device: Any) -> None:
  """Ray's `set_target_device_for_ref` on an rdt_jax ref, for the fetch of
  `obj_id` that is starting (called from `rdt_jax._seam`)."""
  parsed = _dlpack.parse_device(device)
  with _lock:
    _targets[obj_id] = Target(device=parsed)


def pop_target(obj_id: str) -> Target | None:
  """The target set for `obj_id` in this process, removed (used once)."""
  with _lock:
    return _targets.pop(obj_id, None)


def _flatten_target(target: Any) -> dict[str, Any]:
  import jax

  if _dlpack.is_array(target):
    return {"": target}
  flat, _ = jax.tree_util.tree_flatten_with_path(target)
  buffers = {jax.tree_util.keystr(p): x for p, x in flat if _dlpack.is_array(x)}
  if not buffers:
    raise ValueError("The target holds no jax, torch or numpy arrays.")
  return buffers


def align_targets(buffers: dict[str, Any], leaves: list[Any]) -> list[Any]:
  """The target array for each leaf, in leaf order, checked against it.

  Targets are matched by pytree path; a target given as a plain list matches
  the value's leaves in order.

  Raises:
    ValueError: naming the first leaf whose target is missing, has another
      shape or dtype, is not C-contiguous, or is a read-only numpy array.
  """
  import numpy as np

  positional = [f"[{i}]" for i in range(len(leaves))]
  if set(buffers) == set(positional):
    buffers = {leaf.path: buffers[p] for p, leaf in zip(positional, leaves)}
  aligned = []
  for leaf in leaves:
    if leaf.path not in buffers:
      raise ValueError(
          f"Target has no array for leaf {leaf.path or '(the value itself)'} "
          f"(shape {leaf.shape}, dtype {leaf.dtype.name}); the target must "
          "have the value's structure."
      )
    buf = buffers[leaf.path]
    shape = tuple(int(n) for n in buf.shape)
    dtype = _dlpack.dtype_of(buf)
    if shape != leaf.shape or dtype != np.dtype(leaf.dtype):
      raise ValueError(
          f"Target for leaf {leaf.path} has shape {shape} and dtype "
          f"{dtype.name}, but the value's leaf has shape {leaf.shape} and "
          f"dtype {leaf.dtype.name}."
      )
    if not _dlpack.is_c_contiguous(buf):
      raise ValueError(
          f"Target for leaf {leaf.path} is not C-contiguous; pass a "
          "contiguous array to receive into."
      )
    if _dlpack.framework_of(buf) == "numpy" and not _dlpack.is_writable(buf):
      raise ValueError(
          f"Target for leaf {leaf.path} is a read-only numpy array (arrays "
          "from Ray's object store are); pass a writable copy (x.copy())."
      )
    aligned.append(buf)
  return aligned

