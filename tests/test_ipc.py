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


def test_a_publisher_s_device_buffers_are_reused_and_freed(monkeypatch):
  """The reuse policy of `DeviceBuffers` (the driver calls recorded here: no
  GPU): a buffer comes back for the next version of its size, buffers of
  another size are freed at the next acquire, `close` frees the rest."""
  from rdt_jax import _memory
  from rdt_jax.weights import _device

  made: list[int] = []
  freed: list[int] = []

  def allocate(nbytes: int, device: int) -> int:
    made.append(0x10000 * (len(made) + 1))
    return made[-1]

  monkeypatch.setattr(_memory, "ipc_allocate", allocate)
  monkeypatch.setattr(_memory, "ipc_export", lambda pointer, device: (bytes([len(made)]) * 64, 0))
  monkeypatch.setattr(_memory, "ipc_free", lambda pointer, device: freed.append(pointer))
  pool = _device.DeviceBuffers()
  a, b = pool.acquire(4096, 0), pool.acquire(4096, 0)
  assert a.pointer != b.pointer and a.handle != b.handle and a.offset == 0
  pool.release(a)
  assert pool.acquire(4096, 0) is a  # reused, not allocated again
  pool.release(a)
  pool.release(b)
  c = pool.acquire(8192, 0)  # a new structure's size: the old buffers are freed
  assert sorted(freed) == sorted([a.pointer, b.pointer]) and c.pointer not in freed
  d = pool.acquire(8192, 0)
  pool.release(d)
  pool.close([c])
  assert sorted(freed) == sorted([a.pointer, b.pointer, c.pointer, d.pointer])
  assert len(made) == 4


def test_only_cuda_tensors_written_in_place_take_the_ipc_route():
  import jax
  import numpy as np
  import torch

  from rdt_jax.weights._device import DevicePlan
  from rdt_jax.weights._packed import PackedLayoutInfo

  info = PackedLayoutInfo(_layout.PackedLayout.of([16]), jax.tree_util.tree_structure([0]), (0,), ((4,),))
  entries = (("[0]", "array", (4,), "float32"),)
  for target in (torch.zeros(4), np.zeros(4, np.float32), jax.numpy.zeros(4)):
    assert DevicePlan.make(info, entries, {"[0]": target}, atomic=False) is None, type(target)
  assert DevicePlan.make(info, entries, {"[0]": torch.zeros(4)}, atomic=True) is None
