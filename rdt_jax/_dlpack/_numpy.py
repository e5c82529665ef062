"""NumPy arrays: describe and export (numpy is also the host buffer type of
every framework module)."""

from __future__ import annotations

import numpy as np

from rdt_jax._dlpack._devices import CPU, Device
from rdt_jax._dlpack._dtypes import check_dtype
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._specs import DescribedLeaf, single_chunk


def describe(x: np.ndarray, path: str) -> DescribedLeaf:
  """A numpy leaf as one host chunk.

  Raises:
    UnsupportedLeafError: for a dtype rdt_jax cannot move or a
      non-contiguous array, naming the leaf.
  """
  dtype = check_dtype(x.dtype, path)
  if not x.flags.c_contiguous:
    raise UnsupportedLeafError(
        path,
        f"is a non-contiguous numpy array (shape {x.shape}, strides {x.strides})",
        "Return np.ascontiguousarray(x) instead.",
    )
  shape = tuple(int(d) for d in x.shape)
  return single_chunk(shape, path, "numpy", dtype, "cpu", 0, pointer(x), x)


def pointer(x: np.ndarray) -> int:
  return int(x.ctypes.data)


def device(x: np.ndarray) -> Device:
  return CPU


def dtype(x: np.ndarray) -> np.dtype:
  return x.dtype


def is_c_contiguous(x: np.ndarray) -> bool:
  return bool(x.flags.c_contiguous)


def is_writable(x: np.ndarray) -> bool:
  return bool(x.flags.writeable)


def copy_into(target: np.ndarray, host: np.ndarray) -> None:
  np.copyto(target, host)
