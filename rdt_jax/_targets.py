"""Receive targets: where a `ray.get` of an RDT ref puts the bytes it fetches.

`set_target_for_ref` and `set_target_device_for_ref` mirror Ray's functions of
the same names, for any framework's buffers and any jax device or device
string. Targets are kept per process, keyed by the ref, and used by the next
fetch of that ref in this process. A target whose ref is never fetched here is
dropped once Ray no longer manages the object (checked whenever a target is
set), so targets never outlive their objects by more than one `set_target_*`
call.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Any

import ray

from rdt_jax import _dlpack, _layout, _ray

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
  if not _ray.state.is_managed_object(ref.hex()):
    raise ValueError(
        f"{ref} is not an RDT object (or this process no longer knows it: "
        "freed): targets apply to live refs returned by a method with "
        "@ray.method(tensor_transport=...) or by ray.put(..., "
        "_tensor_transport=...). Set the target before the ray.get that "
        "uses it, while the ref is alive."
    )
  return ref.hex()


def set_target_for_ref(ref: ray.ObjectRef, target: Any) -> None:
  """Receives the next `ray.get(ref)` in this process into existing arrays,
  with a sharding of this process's choice, or only a slice of each leaf.

  `target` has the structure of the value behind `ref` (or is a list in the
  value's leaf order, as with Ray's own function); each array leaf of the
  value arrives as its `target` leaf at the same pytree path asks:

  * `np.ndarray` and `torch.Tensor` targets (C-contiguous, same shape and
    dtype) are written in place, and `ray.get` returns those very objects.
  * jax arrays are immutable: writing into one would change values that
    compiled computations and other references already hold. A jax target is
    therefore a placement template: the leaf arrives as a new `jax.Array`
    with the target's sharding. Delete the old array (or donate it) to free it.
  * A `jax.sharding.Sharding` is a template without the array: the leaf
    arrives as a `jax.Array` with that sharding.
  * An `rdt_jax.Slice` (e.g. `rdt_jax.Slice[r * k:(r + 1) * k, :]`) receives
    only that index range, as a C-contiguous array of the slice's shape
    (`Slice.into` picks the array or sharding it lands in).

  A sharding that differs from the producer's (other mesh shape, device count
  or partition spec, replicated or not) is resharded on receive: each of this
  process's devices gets exactly its shard, and, with `jax_nixl`, only the
  bytes some device here needs cross the wire, each distinct source shard
  read once (docs/resharding.md). Resharding lands in cpu memory.

  Everything is checked against the object's metadata when it is known here
  (else when the fetch starts, before any byte moves).

  Raises:
    TypeError: if `ref` is not an ObjectRef.
    ValueError: if `ref` is not an RDT object, is an object of a two-sided
      transport (whose bytes no consumer-side target can reach), or (when the
      metadata is known) a target leaf's shape or dtype differs from the
      value's, naming the leaf.
    UnsupportedLeafError: (when the metadata is known) for a slice outside
      the leaf's shape, or a target sharding over devices this process does
      not have, naming the leaf and the fix.
  """
  obj_id = _check_rdt_ref(ref)
  if _ray.state.is_two_sided_object(obj_id):
    raise ValueError(
        f"{ref} is an object of a two-sided transport (jax_gloo, jax_nccl): "
        "Ray moves it only as an argument of a task, before the task runs, "
        "and the producer sends what Ray's caller asked for, so no target set "
        "in the consumer can reach it. Return it with "
        "tensor_transport='jax_nixl' (or 'jax_transfer') to receive it into "
        "targets, with a sharding of your own, or as a slice."
    )
  buffers = flatten_target(target)
  check_disjoint(buffers)
  meta = _ray.state.transport_metadata(obj_id)
  if meta is not None:
    order = meta.value_leaves() if hasattr(meta, "value_leaves") else []
    align_targets(buffers, [spec for spec, _ in order])
  with _lock:
    _prune()
    _targets[obj_id] = Target(buffers=buffers)


def set_flat_target_for_ref(ref: ray.ObjectRef, buffers: dict[str, Any]) -> None:
  """`set_target_for_ref` with a target already flattened (`flatten_target`)
  and found to fit an object of the same structure: stores it without the
  checks `set_target_for_ref` makes when it is set (the fetch still checks
  every leaf against the object's metadata before any byte moves). For
  callers that set the same target for every version of a stream
  (`rdt_jax.WeightSubscriber`).

  Raises:
    TypeError, ValueError: as `set_target_for_ref`, for the ref.
  """
  obj_id = _check_rdt_ref(ref)
  with _lock:
    _prune()
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
    _prune()
    _targets[obj_id] = Target(device=parsed)


def _prune() -> None:
  """Drops targets of objects Ray has freed (lock held)."""
  for obj_id in [o for o in _targets if not _ray.state.is_managed_object(o)]:
    del _targets[obj_id]


def num_targets() -> int:
  """Targets set in this process and not yet used or dropped."""
  with _lock:
    return len(_targets)


def set_target_for_obj_id(obj_id: str, buffers: list[Any]) -> None:
  """Ray's `set_target_for_ref` on an rdt_jax ref (its buffers, in leaf order),
  for the fetch of `obj_id` that is starting (called from `rdt_jax._ray.fetch`)."""
  with _lock:
    _targets[obj_id] = Target(buffers={f"[{i}]": b for i, b in enumerate(buffers)})


def set_target_device_for_obj_id(obj_id: str, device: Any) -> None:
  """Ray's `set_target_device_for_ref` on an rdt_jax ref, for the fetch of
  `obj_id` that is starting (called from `rdt_jax._ray.fetch`)."""
  parsed = _dlpack.parse_device(device)
  with _lock:
    _targets[obj_id] = Target(device=parsed)


def pop_target(obj_id: str) -> Target | None:
  """The target set for `obj_id` in this process, removed (used once)."""
  with _lock:
    return _targets.pop(obj_id, None)


def _is_target_leaf(x: Any) -> bool:
  return _dlpack.is_array(x) or isinstance(x, _layout.Slice) or _dlpack.is_sharding(x)


def _key_data_target(x: Any) -> Any:
  """A typed PRNG key target stands for its raw key data (what crosses the
  wire, `rdt_jax._ray.fetch`): a placement template of the data's shape."""
  return _dlpack.prng_key_parts(x)[0] if _dlpack.is_prng_key(x) else x


def flatten_target(target: Any) -> dict[str, Any]:
  """A target's leaves by pytree path (typed keys stand for their key data)."""
  import jax

  if _is_target_leaf(target):
    return {"": target}
  flat, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_target_leaf)
  buffers = {jax.tree_util.keystr(p): _key_data_target(x) for p, x in flat if _is_target_leaf(x)}
  if not buffers:
    raise ValueError(
        "The target holds no jax, torch or numpy arrays, rdt_jax.Slice or "
        "jax.sharding.Sharding leaves."
    )
  return buffers


def align_targets(buffers: dict[str, Any], leaves: list[Any]) -> list[Any]:
  """The target of each leaf, in leaf order, checked against it.

  Targets are matched by pytree path; a target given as a plain list matches
  the value's leaves in order. Every check that needs no bytes runs here, so a
  target that cannot work fails before anything moves.

  Raises:
    ValueError: naming the first leaf whose target is missing, has another
      shape or dtype, is not C-contiguous, or is a read-only numpy array, or
      naming two leaves whose targets share memory (`check_disjoint`).
    UnsupportedLeafError: naming the leaf, for a slice out of range, a target
      sharding this process cannot hold or a `Slice.into` array outside host
      memory (see `leaf_layout`).
  """
  positional = [f"[{i}]" for i in range(len(leaves))]
  if set(buffers) == set(positional):
    buffers = {leaf.path: buffers[p] for p, leaf in zip(positional, leaves)}
  check_disjoint(buffers)
  aligned = []
  for leaf in leaves:
    if leaf.path not in buffers:
      raise ValueError(
          f"Target has no array for leaf {_leaf_name(leaf.path)} "
          f"(shape {leaf.shape}, dtype {leaf.dtype.name}); the target must "
          "have the value's structure."
      )
    buf = buffers[leaf.path]
    leaf_layout(leaf, buf)
    aligned.append(buf)
  return aligned


def leaf_layout(leaf: Any, target: Any) -> _layout.TargetLayout | None:
  """Checks one leaf's target; returns the part and split it asks for.

  None means the leaf arrives whole by the plain path: a numpy/torch array
  of the leaf's shape (written in place), or a single-device jax template for
  an unsharded leaf. Otherwise the leaf is resharded on receive: a
  `jax.sharding.Sharding` (or a jax template spread over several devices,
  or any jax template of a sharded leaf) splits the whole leaf over this
  process's devices; an `rdt_jax.Slice` asks for one box of it.

  Raises:
    ValueError, UnsupportedLeafError: as `align_targets` documents.
  """
  path = leaf.path
  if isinstance(target, _layout.Slice):
    box = target.box(leaf.shape, path)
    into = target.into
    sharding = None
    if _dlpack.is_sharding(into):
      sharding = into
    elif _dlpack.framework_of(into) == "jax":
      _check_buffer(leaf, into, _dlpack.box_shape(box), "slice ")
      sharding = into.sharding
    elif into is not None:
      if not _dlpack.is_array(into):
        raise TypeError(
            f"Slice.into for leaf {path} is a {type(into).__name__}; pass a "
            "numpy array, torch tensor, jax array or jax.sharding.Sharding."
        )
      _check_host_into(leaf, into)
      _check_buffer(leaf, into, _dlpack.box_shape(box), "slice ")
      _check_writable(leaf, into)
    return _layout.target_layout(box, sharding, path)
  full = _dlpack.full_box(leaf.shape)
  if _dlpack.is_sharding(target):
    return _layout.target_layout(full, target, path)
  _check_buffer(leaf, target, leaf.shape, "")
  if _dlpack.framework_of(target) != "jax":
    _check_writable(leaf, target)
    return None
  sharding = target.sharding
  if leaf.sharding is None and len(target.devices()) == 1:
    return None  # a placement: the plain path puts it on that device
  if _dlpack.device_of(target).kind != "cpu":
    raise _dlpack.UnsupportedLeafError(
        path,
        f"has a jax target sharded over {_dlpack.device_of(target).kind} devices; "
        "resharding on receive lands in cpu memory only (not implemented on cuda)",
        "Give a target sharded over cpu devices, or a single-device target.",
    )
  return _layout.target_layout(full, sharding, path)


def _check_buffer(leaf: Any, buf: Any, shape: tuple[int, ...], what: str) -> None:
  import numpy as np

  got = tuple(int(n) for n in buf.shape)
  dtype = _dlpack.dtype_of(buf)
  if got != shape or dtype != np.dtype(leaf.dtype):
    raise ValueError(
        f"Target for leaf {_leaf_name(leaf.path)} has shape {got} and dtype "
        f"{dtype.name}, but the value's leaf {what}has shape {shape} and "
        f"dtype {leaf.dtype.name}. Pass an array of shape {shape} and dtype "
        f"{leaf.dtype.name} (e.g. np.empty({shape}, np.{leaf.dtype.name})), or, to "
        "receive part of the leaf, an rdt_jax.Slice."
    )


def written_memory(target: Any) -> Any:
  """The array a target leaf has bytes written into in place (a numpy, torch
  or cupy array, or a `Slice`'s `into` one), or None (jax arrays and
  shardings are templates: the leaf arrives as a new array)."""
  if isinstance(target, _layout.Slice):
    target = target.into
  fw = _dlpack.framework_of(target)
  return target if fw is not None and fw != "jax" else None


def _byte_range(buf: Any) -> tuple[str, int, int] | None:
  """(device, first byte, end) of an array's memory; None when it has no
  bytes or lives on a device rdt_jax does not write (refused elsewhere)."""
  nbytes = math.prod(int(n) for n in buf.shape) * _dlpack.dtype_of(buf).itemsize
  if nbytes == 0:
    return None
  try:
    device = str(_dlpack.device_of(buf))
  except ValueError:
    return None
  start = _dlpack.buffer_pointer(buf)
  return device, start, start + nbytes


def check_disjoint(buffers: dict[str, Any]) -> None:
  """Raises if two target leaves would have bytes written into the same memory.

  Tied weights (one tensor given for two leaves) or two `Slice(into=...)`
  views over overlapping memory would receive two leaves' bytes in one place,
  the last write winning. Compares the byte range each target is written
  through (its pointer and size on its device).

  Raises:
    ValueError: naming both leaves and the shared memory.
  """
  ranges = []
  for path, target in buffers.items():
    buf = written_memory(target)
    span = None if buf is None else _byte_range(buf)
    if span is not None:
      ranges.append((span, path))
  ranges.sort()  # by device, then first byte: an overlap shows between neighbours
  for ((dev_a, _, end_a), path_a), ((dev_b, start_b, end_b), path_b) in itertools.pairwise(ranges):
    if dev_a == dev_b and start_b < end_a:
      raise ValueError(
          f"Targets for leaves {_leaf_name(path_a)} and {_leaf_name(path_b)} "
          f"share memory on {dev_a} (bytes {start_b:#x}..{min(end_a, end_b):#x}): each leaf's bytes "
          "would overwrite the other's. Give each leaf its own array (for tied weights, receive one "
          "and tie them again after ray.get)."
      )


def host_into_problem(device: _dlpack.Device | None) -> str | None:
  """Why a `Slice.into` array on `device` (None: a device rdt_jax cannot
  name) cannot receive a slice, or None for host memory. Slices are planned,
  read and copied in host memory only."""
  if device is not None and device.kind == "cpu":
    return None
  where = "on a device rdt_jax cannot write" if device is None else f"in {device} memory"
  return f"has a Slice.into array {where}; receiving a slice into device memory is not supported yet"


def _check_host_into(leaf: Any, into: Any) -> None:
  try:
    device: _dlpack.Device | None = _dlpack.device_of(into)
  except ValueError:
    device = None
  problem = host_into_problem(device)
  if problem is not None:
    raise _dlpack.UnsupportedLeafError(
        leaf.path, problem,
        "Receive the slice into a host array (numpy or a cpu torch tensor) and copy it to the device, "
        "or give Slice.into a jax sharding (or no into) and move the received array.",
    )

def _leaf_name(path: str) -> str:
  """A leaf's pytree path as messages print it ("" is the value itself)."""
  return path or "(the value itself)"


def _check_writable(leaf: Any, buf: Any) -> None:
  if not _dlpack.is_c_contiguous(buf):
    raise ValueError(
        f"Target for leaf {_leaf_name(leaf.path)} is not C-contiguous; pass a "
        "contiguous array to receive into."
    )
  if _dlpack.framework_of(buf) == "numpy" and not _dlpack.is_writable(buf):
    raise ValueError(
        f"Target for leaf {_leaf_name(leaf.path)} is a read-only numpy array (arrays "
        "from Ray's object store are); pass a writable copy (x.copy())."
    )
  if not _dlpack.is_writable(buf):
    raise ValueError(
        f"Target for leaf {leaf.path} is a torch conjugate or negative view, whose memory would "
        "read back conjugated or negated; pass a resolved tensor (x.resolve_conj().resolve_neg())."
    )
