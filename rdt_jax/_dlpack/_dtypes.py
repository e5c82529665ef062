"""Dtypes: which ones can move, and their names across frameworks.

Every dtype is a numpy dtype here: DLPack's own types, plus bfloat16 and the
float8 family, which `ml_dtypes` gives real numpy dtypes and which cross as
bytes.
"""

from __future__ import annotations

import functools
from typing import Final

import ml_dtypes
import numpy as np

from rdt_jax._dlpack._errors import UnsupportedLeafError

#: Dtypes numpy has natively (and numpy's DLPack export accepts).
NUMPY_NATIVE_DTYPES: Final = frozenset(
    np.dtype(n)
    for n in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
        "uint32", "uint64", "float16", "float32", "float64", "complex64",
        "complex128",
    )
)
#: bfloat16 and the float8 family: moved through a byte view.
ML_DTYPES: Final = frozenset(
    np.dtype(getattr(ml_dtypes, n))
    for n in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4",
        "float8_e4m3", "float8_e8m0fnu",
    )
    if hasattr(ml_dtypes, n)
)
#: Every dtype rdt_jax can move.
SUPPORTED_DTYPES: Final = NUMPY_NATIVE_DTYPES | ML_DTYPES
#: DLPack has no sub-byte types; jax packs them in ways that differ per backend.
SUB_BYTE_DTYPE_NAMES: Final = frozenset({"int2", "uint2", "int4", "uint4", "float4_e2m1fn"})
BFLOAT16: Final = np.dtype(ml_dtypes.bfloat16)


@functools.lru_cache(maxsize=256)
def np_dtype_from_name(name: str) -> np.dtype:
  """The numpy dtype for a dtype name (`"float32"`, `"bfloat16"`, ...).

  Raises:
    TypeError: if neither numpy nor `ml_dtypes` has a dtype of that name.
  """
  try:
    return np.dtype(name)
  except TypeError:
    pass
  try:
    return np.dtype(getattr(ml_dtypes, name))
  except (AttributeError, TypeError):
    raise TypeError(f"No numpy dtype named {name!r}.") from None


def unsigned_view_dtype(dtype: np.dtype) -> np.dtype:
  """The unsigned integer dtype of the same width, for byte views."""
  return np.dtype(f"uint{dtype.itemsize * 8}")


def is_64_bit(dtype: np.dtype) -> bool:
  """True for the dtypes jax downcasts while `jax_enable_x64` is off."""
  return (dtype.itemsize == 8 and dtype.kind in "iuf") or dtype == np.complex128


def check_dtype(dtype: np.dtype, path: str) -> np.dtype:
  """Returns `dtype` if rdt_jax can move it.

  Raises:
    UnsupportedLeafError: naming the leaf and the dtype, and what to cast to.
  """
  if dtype in SUPPORTED_DTYPES:
    return dtype
  if dtype.name in SUB_BYTE_DTYPE_NAMES:
    raise UnsupportedLeafError(
        path,
        f"has sub-byte dtype {dtype.name}, which DLPack cannot carry",
        "Cast it to int8/uint8 (or pack it into a uint8 array) before "
        "returning it from an RDT method.",
    )
  if dtype.hasobject:
    raise UnsupportedLeafError(
        path,
        f"has dtype {dtype.name}: an object array holds Python objects, not "
        "bytes that can be moved out-of-band",
        "Convert it to a numeric dtype, or return it from a method without "
        "tensor_transport so it goes through the object store.",
    )
  raise UnsupportedLeafError(
      path,
      f"has dtype {dtype.name} ({dtype.str}), which rdt_jax cannot move",
      "Use a numeric dtype (bool, int, uint, float, complex, bfloat16 or float8).",
  )
