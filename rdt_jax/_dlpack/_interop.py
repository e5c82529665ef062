"""Conversions between frameworks: the one module that knows two at once.

Each framework module (`_numpy`, `_jax`, `_torch`, `_cupy`) knows only its
own framework (and numpy, the layer's host buffer type): describe, export,
rebuild from a buffer. Turning one framework's array into another's is done
here, from those pieces, zero-copy where DLPack allows. Which framework an
array belongs to is decided by `_dispatch`, which calls `convert` with it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rdt_jax._dlpack import _cupy, _jax, _torch
from rdt_jax._dlpack._dtypes import BFLOAT16, NUMPY_NATIVE_DTYPES
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._specs import Framework


def convert(x: Any, src: Framework, dst: Framework, path: str) -> Any:
  """`x`, an array of framework `src`, as an array of `dst` (`src != dst`).

  Host arrays stay on the host and device arrays on their device, except
  that `dst` "numpy" always means host memory (one device-to-host copy).

  Raises:
    UnsupportedLeafError: for a deleted jax array, a dtype `dst` lacks, a
      64-bit leaf becoming jax while x64 is off, or host memory asked to
      become cupy, naming the leaf and the fix.
  """
  if src == "cupy":  # cuda memory: to the host only when numpy was asked for
    if dst == "numpy":
      return _cupy.to_host(x, path)
    return _jax.from_dlpack_exact(x, path) if dst == "jax" else _torch.from_dlpack(x)
  if dst == "cupy":
    on_host = src == "numpy" or (_jax.device(x) if src == "jax" else _torch.device(x)).kind == "cpu"
    if on_host:
      raise UnsupportedLeafError(
          path,
          f"(a {src} array in host memory) cannot become a cupy array, which lives on cuda",
          "Receive it as numpy, jax or torch instead.",
      )
    return _cupy.from_dlpack(x, path)
  if dst == "numpy":
    return _jax.to_host(x, path) if src == "jax" else _torch.to_host(x, path)
  if src == "numpy":
    return _jax.from_host(x, path) if dst == "jax" else _torch.from_host(x, path)
  if dst == "torch":
    return jax_to_torch(x, path)
  return torch_to_jax(x, path)


def jax_to_torch(x: Any, path: str) -> Any:
  """A jax array as a tensor on the same device, through DLPack (zero-copy).

  A cpu array DLPack cannot carry goes by a host byte view (still on the
  host). A cuda array never leaves its device: one DLPack cannot carry goes
  by a bitcast to uint8 on the device (one device copy).

  Raises:
    UnsupportedLeafError: for a dtype torch lacks, a jax array sharded over
      several cuda devices, or a cuda array that cannot be handed to torch on
      its device, naming the leaf, the device and the fix.
  """
  _jax.check_alive(x, path)
  dt = np.dtype(x.dtype)
  tdt = _torch.torch_dtype(dt, path)
  devices = list(x.sharding.device_set)
  on_cuda = devices[0].platform != "cpu"
  if len(devices) > 1:
    if on_cuda:
      raise UnsupportedLeafError(
          path,
          f"is a jax.Array sharded over {len(devices)} {devices[0].platform} devices "
          f"({', '.join(str(d) for d in devices)}); a torch tensor lives on one device",
          "Gather it onto one device first (jax.device_put(x, device)), or ask for "
          "host arrays (rdt_jax.to_numpy / receive_as('numpy')).",
      )
    return _torch.from_host(_jax.to_host(x, path), path)
  try:
    return _torch.from_dlpack(x)
  except (BufferError, RuntimeError, TypeError) as e:
    if not on_cuda:  # float8 variants torch cannot import: a host byte view
      return _torch.from_host(_jax.to_host(x, path), path)
    error = f"{type(e).__name__}: {e}"  # the text: the error itself would hold this frame in a cycle
  try:
    return _torch.from_dlpack(_jax.bytes_of(x)).view(tdt).reshape(tuple(x.shape))
  except (BufferError, RuntimeError, TypeError):
    pass
  raise UnsupportedLeafError(
      path,
      f"(dtype {dt.name}) lives on {devices[0]}, and neither DLPack nor a byte view "
      f"can hand it to torch there ({error})",
      "Ask for host arrays (rdt_jax.to_numpy / receive_as('numpy')), or cast it to "
      "a dtype both frameworks exchange on the device (float32, bfloat16) first.",
  )


def torch_to_jax(t: Any, path: str) -> Any:
  """A torch tensor as a jax.Array on the same device, through DLPack where
  jax imports the dtype (zero-copy); else a host byte view (cpu) or a bitcast
  on the device (cuda).

  Raises:
    UnsupportedLeafError: for a 64-bit leaf while x64 is off.
  """
  dt = _torch.dtype(t)
  _jax.check_x64(dt, path)
  t = t.detach()
  if not t.is_contiguous():
    t = t.contiguous()
  if dt in NUMPY_NATIVE_DTYPES or dt == BFLOAT16:
    return _jax.from_dlpack(t)
  if t.device.type == "cpu":
    return _jax.from_host(_torch.to_host(t, path), path)
  # A cuda dtype jax cannot import through DLPack: bitcast on the device.
  return device_bytes_to_jax(_torch.byte_view(t), dt, tuple(t.shape), path)


def device_bytes_to_jax(buf: Any, dtype: np.dtype, shape: tuple[int, ...], path: str) -> Any:
  """A leaf's bytes in a received region as a jax.Array on the same device.

  Args:
    buf: a uint8 byte view of at least the leaf's bytes: a torch tensor (a
      view into a pooled region) or a jax array (a region of a process
      without torch).
    dtype, shape: the leaf's.

  Zero-copy from a torch view for every dtype torch has (DLPack carries
  bfloat16 and torch's float8 types); a dtype torch lacks (`float8_e3m4`,
  ...) and a jax region are bitcast on the device (one device copy, never
  through the host). An empty leaf is made fresh (no bytes to alias).

  Raises:
    UnsupportedLeafError: for a 64-bit leaf while x64 is off.
  """
  if not _torch.is_tensor(buf):
    return _jax.from_device_bytes(buf, dtype, shape, path)
  _jax.check_x64(dtype, path)
  n = math.prod(shape)
  if n == 0:
    return _jax.zeros(shape, dtype, _torch.device(buf))
  raw = buf[: n * dtype.itemsize]
  tdt = _torch.torch_dtype_or_none(dtype)
  if tdt is not None:
    return _jax.from_dlpack(raw.view(tdt).reshape(shape))
  return _jax.from_device_bytes(_jax.from_dlpack(raw), dtype, shape, path)
