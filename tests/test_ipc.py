"""CUDA IPC for weight versions in device memory, where no GPU is: the path
says why it cannot run, and the publisher packs nothing on a device.

The copies themselves run in tests/gpu/test_gpu_weights_device.py.
"""

from __future__ import annotations

import ctypes

import pytest

from rdt_jax import _layout
from rdt_jax._memory import _ipc
from rdt_jax.weights import _packed


def _has_driver() -> bool:
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    return False
  return True


@pytest.mark.skipif(_has_driver(), reason="this host has a CUDA driver")
def test_without_a_driver_every_call_says_so():
  assert not _ipc.usable()
  assert not _packed.device_packing()
  for call in (lambda: _ipc.allocate(4096, 0), lambda: _ipc.export(1 << 20, 0), lambda: _ipc.copy_runs([(1, 2, 3)], 0)):
    with pytest.raises(_ipc.IpcError, match=r"libcuda\.so\.1"):
      call()


def test_a_handle_of_another_size_is_refused_before_any_driver_call():
  with pytest.raises(_ipc.IpcError, match="64 bytes"):
    with _ipc.mapped(b"\x00" * 16, 0):
      pass


def test_no_copies_touch_the_driver():
  _ipc.copy_runs([], 0)


def test_the_setting_turns_device_packing_off(monkeypatch):
  monkeypatch.setenv("RDT_JAX_WEIGHT_DEVICE_PACK", "0")
  assert not _packed.device_packing()


def test_only_leaves_on_one_cuda_device_pack_on_it():
  import numpy as np

  from rdt_jax import _dlpack

  host = _dlpack.describe(np.zeros(4, np.float32), "['a']")
  assert _layout.cuda_device_of([host]) is None
  assert _layout.cuda_device_of([]) is None
