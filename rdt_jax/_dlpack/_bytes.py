"""Raw memory seen as a 1-D uint8 array: numpy's array interface over host
memory, the CUDA Array Interface over cuda memory.

Zero-copy and framework-neutral: the memory may belong to any framework's
array or to a pool. A view does not own its memory; the caller keeps the
owner alive while the view is in use. The framework modules build their
byte tensors on these (`_torch.bytes_tensor`).
"""

from __future__ import annotations

import numpy as np


class _HostBytes:
  """`nbytes` of host memory at `pointer`, as numpy's array interface."""

  def __init__(self, pointer: int, nbytes: int):
    self.__array_interface__ = {
        "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3,
    }


class CudaBytes:
  """`nbytes` of cuda memory at `pointer`, as the CUDA Array Interface."""

  def __init__(self, pointer: int, nbytes: int):
    self.__cuda_array_interface__ = {
        "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3,
        "strides": None,
    }


def host_bytes(pointer: int, nbytes: int) -> np.ndarray:
  """A writable 1-D uint8 numpy view of `nbytes` of host memory at `pointer`.

  Zero-copy and framework-neutral: the memory may belong to any framework's
  array. The view does not own it; the caller keeps the owner alive while the
  view is in use.
  """
  return np.asarray(_HostBytes(pointer, nbytes))
