"""cupy arrays: describe, export, rebuild from device bytes, and import any
DLPack producer on a cuda device (`from_dlpack`); `_interop` uses these to
convert between cupy and the other frameworks.

cupy arrays live on cuda devices only. A cupy leaf can be sent by any
backend that moves cuda memory, and arrives as cupy in "source" receive mode
(the consumer needs cupy; otherwise it raises, naming `receive_as`). It is
not a `receive_as` mode: `receive_as("jax" | "torch")` turns cupy leaves into
jax or torch arrays on the device, `receive_as("numpy")` / a cpu target
device into numpy. cupy has no bfloat16 or float8 dtypes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rdt_jax._dlpack._devices import Device
from rdt_jax._dlpack._dtypes import check_dtype
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._specs import DescribedLeaf, single_chunk


def describe(x: Any, path: str) -> DescribedLeaf:
  """A cupy leaf as one chunk in cuda memory.

  Queued kernels writing it are waited for once per object and device before
  a backend reads it (`_cuda.wait_for_producers`, on cupy's current stream).

  Raises:
    UnsupportedLeafError: for a non-contiguous array or a dtype rdt_jax
      cannot move, naming the leaf and the fix.
  """
  dt = check_dtype(np.dtype(x.dtype), path)
  if not x.flags.c_contiguous:
    raise UnsupportedLeafError(
        path,
        f"is a non-contiguous cupy array (shape {x.shape}, strides {x.strides})",
        "Return cupy.ascontiguousarray(x) instead.",
    )
  shape = tuple(int(d) for d in x.shape)
  dev = device(x)
  return single_chunk(shape, path, "cupy", dt, "cuda", dev.index, pointer(x), x)


def pointer(x: Any) -> int:
  return int(x.data.ptr)


def device(x: Any) -> Device:
  return Device("cuda", int(x.device.id))


def dtype(x: Any) -> np.dtype:
  return np.dtype(x.dtype)


def is_c_contiguous(x: Any) -> bool:
  return bool(x.flags.c_contiguous)


def is_writable(x: Any) -> bool:
  return True


def to_host(x: Any, path: str) -> np.ndarray:
  """The array's values as a host numpy array (one device-to-host copy)."""
  import cupy

  return cupy.asnumpy(x)


def from_dlpack(x: Any, path: str) -> Any:
  """A jax or torch array on a cuda device as a cupy array (zero-copy).

  Raises:
    UnsupportedLeafError: if cupy is missing here, the array is in host
      memory, or its dtype has no cupy type (bfloat16, float8), naming the
      leaf, its device and the fix.
  """
  try:
    import cupy
  except ImportError:
    raise UnsupportedLeafError(
        path,
        "was sent as a cupy array, but cupy is not importable in this process",
        "Install cupy here, or receive it as jax or torch "
        "(rdt_jax.receive_as('jax'|'torch')).",
    ) from None
  try:
    return cupy.from_dlpack(x)
  except (BufferError, RuntimeError, TypeError, ValueError) as e:
    raise UnsupportedLeafError(
        path,
        f"cannot become a cupy array ({type(e).__name__}: {e})",
        "Receive it as jax or torch (rdt_jax.receive_as('jax'|'torch')), or as "
        "numpy for host memory; cupy has no bfloat16 or float8 types.",
    ) from None


def from_device_bytes(buf: Any, dtype: np.dtype, shape: tuple[int, ...], path: str) -> Any:
  """A leaf's bytes in a received region (a uint8 torch view or jax array)
  as a cupy array on the same device, zero-copy."""
  raw = from_dlpack(buf, path)
  return raw[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def copy_into(target: Any, values: Any) -> None:
  target[...] = values
