"""torch tensors: describe, export, rebuild from host or device buffers, and
byte tensors over raw memory.

Knows torch and numpy (the layer's host buffer type) only; conversions from
and to other frameworks are in `_interop`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rdt_jax._dlpack._bytes import CudaBytes, host_bytes
from rdt_jax._dlpack._devices import Device, parse_device
from rdt_jax._dlpack._dtypes import (
    NUMPY_NATIVE_DTYPES,
    check_dtype,
    np_dtype_from_name,
    unsigned_view_dtype,
)
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._lazy import importable, loaded_type
from rdt_jax._dlpack._specs import DescribedLeaf, single_chunk


def available() -> bool:
  """True if torch can be imported here (checked without importing it)."""
  return importable("torch")


#: `torch_dtype`'s answers, by numpy dtype (numpy's `dtype.name` costs
#: microseconds: a per-leaf step asks once per dtype).
_TORCH_DTYPES: dict[np.dtype, Any] = {}


def torch_dtype(dtype: np.dtype, path: str) -> Any:
  """The `torch.dtype` for a numpy dtype.

  Raises:
    UnsupportedLeafError: if torch has no such type, naming the leaf.
  """
  found = _TORCH_DTYPES.get(dtype)
  if found is not None:
    return found
  import torch

  tdt = getattr(torch, dtype.name, None)
  if isinstance(tdt, torch.dtype) and len(_TORCH_DTYPES) < 256:
    _TORCH_DTYPES[dtype] = tdt
  if not isinstance(tdt, torch.dtype):
    raise UnsupportedLeafError(
        path,
        f"has dtype {dtype.name}, which PyTorch {torch.__version__} has no type for",
        "Receive it as jax or numpy (rdt_jax.receive_as('jax'|'numpy')) or "
        "cast it on the producer.",
    )
  return tdt


def torch_dtype_or_none(dtype: np.dtype) -> Any:
  """The `torch.dtype` for a numpy dtype, or None if torch has none."""
  import torch

  tdt = getattr(torch, dtype.name, None)
  return tdt if isinstance(tdt, torch.dtype) else None


def dtype(t: Any) -> np.dtype:
  """The numpy dtype of a tensor (`ml_dtypes` types for bfloat16 and float8).

  Raises:
    TypeError: for a torch dtype numpy and `ml_dtypes` have no name for.
  """
  return np_dtype_from_name(str(t.dtype).removeprefix("torch."))


def describe(x: Any, path: str) -> DescribedLeaf:
  """A torch leaf as one chunk in host or cuda memory.

  Conjugate and negative views (`t.conj()` of a complex tensor, `is_neg()`
  views) are refused, not resolved: their memory holds the values before the
  lazy conjugation or negation, so sending it raw would deliver other values,
  and resolving them would be a hidden copy. torch's own DLPack export refuses
  them too.

  Raises:
    UnsupportedLeafError: for a sparse, non-contiguous, conjugate or negative
      view tensor, a dtype or device rdt_jax cannot move, naming the leaf and
      the fix.
  """
  import torch

  if x.layout != torch.strided:
    raise UnsupportedLeafError(
        path, f"is a {x.layout} torch tensor", "Convert it with .to_dense() before returning it."
    )
  lazy = lazy_bits(x)
  if lazy:
    raise UnsupportedLeafError(
        path,
        f"is a torch {lazy} view: its memory holds the values before that lazy operation, so "
        "its raw bytes are not its values",
        "Return x.resolve_conj().resolve_neg() (a copy) instead.",
    )
  try:
    dt = dtype(x)
  except TypeError:
    raise UnsupportedLeafError(
        path,
        f"has torch dtype {str(x.dtype).removeprefix('torch.')}, which has no "
        "numpy/ml_dtypes equivalent",
        "Cast it to a standard dtype before returning it.",
    ) from None
  dt = check_dtype(dt, path)
  if not x.is_contiguous():
    raise UnsupportedLeafError(
        path,
        f"is a non-contiguous torch tensor (shape {tuple(x.shape)}, stride {x.stride()})",
        "Return x.contiguous() instead.",
    )
  try:
    dev = parse_device(x.device)
  except ValueError:
    raise UnsupportedLeafError(
        path,
        f"lives on torch device {x.device}, which rdt_jax cannot move",
        "Move it to 'cpu' or 'cuda' first.",
    ) from None
  # Queued kernels writing a cuda tensor are waited for once per object and
  # device, before a backend reads it (`_cuda.wait_for_producers`).
  shape = tuple(int(d) for d in x.shape)
  return single_chunk(shape, path, "torch", dt, dev.kind, dev.index, pointer(x), x)


def lazy_bits(t: Any) -> str:
  """"conjugate", "negative", both, or "" for a tensor whose memory holds
  its values (torch's lazy conjugate and negative bits unset)."""
  bits = [name for name, on in (("conjugate", t.is_conj()), ("negative", t.is_neg())) if on]
  return " and ".join(bits)


def pointer(t: Any) -> int:
  return int(t.data_ptr())


def device(t: Any) -> Device:
  return parse_device(t.device)


def is_c_contiguous(t: Any) -> bool:
  return bool(t.is_contiguous())


def is_writable(t: Any) -> bool:
  """False for a conjugate or negative view: bytes written raw into its
  memory would read back conjugated or negated."""
  return not lazy_bits(t)


def mark_written(t: Any) -> None:
  """Records that bytes were written into `t`'s memory outside torch.

  Bumps the tensor's version counter, as an in-place torch operation does,
  so autograd refuses a backward pass through a graph that saved the old
  values (instead of silently using the new ones). Call it once after each
  raw write into a received torch target.
  """
  import torch

  torch.autograd.graph.increment_version(t)


def mark_written_many(ts: list[Any]) -> None:
  """`mark_written` of every tensor of `ts`, in one call."""
  import torch

  if ts:
    torch.autograd.graph.increment_version(ts)


def from_host(x: np.ndarray, path: str) -> Any:
  """A host numpy array as a cpu tensor, zero-copy (a byte view for bfloat16
  and float8).

  Raises:
    UnsupportedLeafError: for a dtype torch has no type for.
  """
  import torch

  tdt = torch_dtype(x.dtype, path)
  if x.dtype in NUMPY_NATIVE_DTYPES:
    return torch.from_numpy(x)
  return torch.from_numpy(x.view(unsigned_view_dtype(x.dtype))).view(tdt)


def to_host(t: Any, path: str) -> np.ndarray:
  """A tensor's values as a host numpy array (zero-copy for cpu tensors)."""
  import torch

  dt = dtype(t)
  t = t.detach()
  if t.device.type != "cpu":
    t = t.cpu()
  if dt in NUMPY_NATIVE_DTYPES:
    return t.numpy()
  bits = getattr(torch, f"uint{dt.itemsize * 8}")
  return t.view(bits).numpy().view(dt)


def from_device_bytes(buf: Any, dtype: np.dtype, shape: tuple[int, ...], path: str) -> Any:
  """A leaf's bytes in a received region as a tensor on the same device.

  Args:
    buf: a uint8 byte view of at least the leaf's bytes (a torch tensor, or
      any other DLPack producer, imported through `torch.from_dlpack`).
    dtype, shape: the leaf's.

  Zero-copy. Raises `UnsupportedLeafError` for a dtype torch lacks.
  """
  import torch

  if not isinstance(buf, torch.Tensor):
    buf = torch.from_dlpack(buf)
  tdt = torch_dtype(dtype, path)
  return buf[: math.prod(shape) * dtype.itemsize].view(tdt).reshape(shape)


def byte_view(t: Any) -> Any:
  """A contiguous tensor's memory as a flat uint8 tensor (zero-copy)."""
  import torch

  return t.reshape(-1).view(torch.uint8)


def copy_into(target: Any, values: Any) -> None:
  """`target.copy_(values)`, outside autograd (a parameter that requires
  grad is written like any tensor)."""
  import torch

  with torch.no_grad():
    target.copy_(values)


def region_writer(region: Any, source: np.dtype, perm: tuple[int, ...] | None, shape: tuple[int, ...] | None,
                  box: Any, rows: Any, path: str) -> Any:
  """A function writing a host array of dtype `source`, transposed,
  reshaped and cut (each optional), into `region` (a tensor outside
  autograd, of the result's shape), cast to its dtype; or, given `row`, the
  part a run of source rows makes (`rows`: `_dispatch._RowParts`)."""
  import torch

  cut = None if box is None else tuple(slice(a, b) for a, b in box)
  scalar = region.dim() == 0
  native = source in NUMPY_NATIVE_DTYPES

  def write(v: np.ndarray, row: int | None = None) -> None:
    t = torch.from_numpy(v) if native else from_host(v, path)
    if row is not None:
      part = rows.part(row, len(v))
      if part is None:
        return
      src, index, dst = part
      t = t[src]
      if perm is not None:
        t = t.permute(perm)
      region[dst].copy_(t[index])
      return
    if perm is not None:
      t = t.permute(perm)
    if shape is not None:
      t = t.reshape(shape)
    if cut is not None:
      t = t[cut]
    region.copy_(t.reshape(()) if scalar else t)

  return write


def empty_bytes(nbytes: int, device: Device) -> tuple[Any, int]:
  """A uint8 tensor of `nbytes` on `device` and its address.

  Memory from torch's caching allocator may still be the target of kernels
  queued before it was freed: before a transfer writes it outside stream
  order, the caller waits for the allocating stream (`_cuda.settle_fresh`).
  """
  import torch

  t = torch.empty(nbytes, dtype=torch.uint8, device=str(device))
  return t, int(t.data_ptr())


def is_tensor(x: Any) -> bool:
  """True if `x` is a torch tensor (never imports torch)."""
  tensor = loaded_type("torch", "Tensor")
  return tensor is not None and isinstance(x, tensor)


def storage_use_count(t: Any) -> int:
  """How many tensors (views, DLPack exports, `t` itself) hold `t`'s storage.

  A jax array made from a view through DLPack holds the view's storage until
  it is deleted, so this counts it too. Uses torch's `_storage_Use_Count`
  (private; present since torch 1.x): the storage's reference count, less the
  temporary Python storage object made to ask.
  """
  import torch

  return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata)) - 1


_USE_COUNT_WORKS: bool | None = None


def storage_use_count_works() -> bool:
  """True if `storage_use_count` counts views and DLPack exports in this
  torch (checked once per process on a small cpu tensor): a region pool
  reuses memory only when it does, since a wrong count could hand out memory
  a live array still uses."""
  global _USE_COUNT_WORKS
  if _USE_COUNT_WORKS is None:
    _USE_COUNT_WORKS = _probe_use_count()
  return _USE_COUNT_WORKS


def _probe_use_count() -> bool:
  try:
    import torch

    root = torch.zeros(4, dtype=torch.uint8)
    alone = storage_use_count(root)
    view = root[1:3]
    exported = torch.from_dlpack(root[:2])
    counted = storage_use_count(root)
    del view, exported
    return alone == 1 and counted == 3 and storage_use_count(root) == 1
  except Exception:  # the private call is gone or changed
    return False


def from_dlpack(x: Any) -> Any:
  """`torch.from_dlpack(x)`: a tensor aliasing any DLPack producer's memory."""
  import torch

  return torch.from_dlpack(x)


def bytes_tensor(pointer: int, nbytes: int, device: Device) -> Any:
  """A 1-D `torch.uint8` tensor over `nbytes` at `pointer` on `device`.

  Zero-copy, for backends whose library takes torch tensors (Ray's GLOO and
  NCCL collective groups): host memory goes through DLPack from a numpy view,
  cuda memory through the CUDA Array Interface (untested here: no GPU). The
  tensor does not own the memory; the caller keeps the owner alive while the
  tensor is in use.
  """
  import torch

  if device.kind == "cpu":
    return torch.from_dlpack(host_bytes(pointer, nbytes))
  return torch.as_tensor(CudaBytes(pointer, nbytes), device=str(device))
