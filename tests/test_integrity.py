"""Arrays the DLPack layer cannot send or write faithfully are refused by name.

Torch conjugate and negative views, jax arrays in a non-default layout or
memory kind, targets sharing memory, `Slice.into` arrays outside host memory,
autograd's view of raw writes into torch targets, and fault rules that act
only where tests enable them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental.layout import Format, Layout

from rdt_jax import _dlpack, _layout, _targets
from rdt_jax._dlpack import _jax


def leaf_of(x, path: str):
  """The metadata a producer sends for `x`, under pytree path `path`."""
  return _dlpack.describe(x, path).spec


def raw_bytes(pointer: int, nbytes: int) -> bytes:
  return ctypes.string_at(pointer, nbytes)


# ---- torch conjugate and negative views


def complex_tensor():
  return torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)


@pytest.mark.parametrize(
    "make, bit",
    [
        (lambda: complex_tensor().conj(), "conjugate"),
        (lambda: torch._neg_view(torch.arange(4.0)), "negative"),
        (lambda: complex_tensor().conj().imag, "negative"),
    ],
    ids=["conj", "neg_view", "conj_imag"],
)
def test_lazy_torch_views_are_refused_by_name(make, bit):
  x = make()
  with pytest.raises(_dlpack.UnsupportedLeafError, match=rf"\['w'\] is a torch {bit} view.*resolve_conj"):
    _dlpack.describe(x, "['w']")
  resolved = _dlpack.describe(x.resolve_conj().resolve_neg(), "['w']")
  assert raw_bytes(resolved.pointers[0], resolved.spec.nbytes) == x.resolve_conj().resolve_neg().numpy().tobytes()


def test_lazy_torch_view_is_refused_as_a_target():
  leaf = leaf_of(np.zeros(2, np.complex64), "['w']")
  target = torch.zeros(2, dtype=torch.complex64).conj()
  with pytest.raises(ValueError, match=r"leaf \['w'\] is a torch conjugate or negative view"):
    _targets.align_targets({"['w']": target}, [leaf])


# ---- jax layouts and memory kinds


def test_non_default_jax_layout_is_refused_by_name():
  x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
  column_major = jax.device_put(x, Format(Layout(major_to_minor=(1, 0)), x.sharding))
  # Its buffer really is in another order than its shape says.
  assert raw_bytes(column_major.unsafe_buffer_pointer(), 48) != np.asarray(x).tobytes()
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"\['p'\] has a non-default layout.*x\.copy\(\)"):
    _dlpack.describe(column_major, "['p']")
  jitted = jax.jit(lambda a: a + 0, out_shardings=Format(Layout(major_to_minor=(1, 0)), x.sharding))(x)
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"major_to_minor=\(1, 0\)"):
    _dlpack.describe(jitted, "['p']")
  fixed = _dlpack.describe(column_major.copy(), "['p']")
  assert raw_bytes(fixed.pointers[0], 48) == np.asarray(x).tobytes()
  # A row-major array of the same shape and dtype described first (its layout
  # remembered) does not let a column-major one through.
  with pytest.raises(_dlpack.UnsupportedLeafError, match="non-default layout"):
    _dlpack.describe(column_major, "['p']")


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_cpu_memory_kinds_are_host_memory_and_sent_as_is(kind):
  cpu = jax.devices("cpu")[0]
  assert kind in {m.kind for m in cpu.addressable_memories()}
  x = jnp.arange(6, dtype=jnp.int32)
  y = jax.device_put(x, x.sharding.with_memory_kind(kind))
  d = _dlpack.describe(y, "['h']")
  assert d.spec.device == "cpu"
  assert raw_bytes(d.pointers[0], d.spec.nbytes) == np.asarray(x).tobytes()


# A gpu array cannot be made here: these small objects carry exactly the
# public attributes `placement_problem` reads (platform, default_memory(),
# memory_kind, device_set, format.layout), with jax's real Layout.
@dataclasses.dataclass(frozen=True)
class _Memory:
  kind: str


@dataclasses.dataclass(frozen=True)
class _GpuDevice:
  platform: str = "gpu"

  def default_memory(self) -> _Memory:
    return _Memory("device")

  def __str__(self) -> str:
    return "cuda:0"


@dataclasses.dataclass(frozen=True)
class _Sharding:
  memory_kind: str | None
  device_set: frozenset


@dataclasses.dataclass(frozen=True)
class _Format:
  layout: Layout


@dataclasses.dataclass(frozen=True)
class _GpuArray:
  memory_kind: str | None
  shape: tuple = (2, 3)

  @property
  def sharding(self) -> _Sharding:
    return _Sharding(self.memory_kind, frozenset({_GpuDevice()}))

  @property
  def format(self) -> _Format:
    return _Format(Layout(major_to_minor=(0, 1)))


def test_gpu_host_memory_kinds_are_refused():
  assert _jax.placement_problem(_GpuArray("device")) is None
  assert _jax.placement_problem(_GpuArray(None)) is None
  problem = _jax.placement_problem(_GpuArray("pinned_host"))
  assert problem is not None and "'pinned_host'" in problem and "default is 'device'" in problem
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"\['g'\] lives in memory kind 'pinned_host'.*memory_kind"):
    _jax.check_placement(_GpuArray("pinned_host"), "['g']")


# ---- targets sharing memory


def test_one_tensor_for_two_leaves_is_refused_naming_both():
  leaves = [leaf_of(np.zeros(4, np.float32), "['a']"), leaf_of(np.zeros(4, np.float32), "['b']")]
  tied = torch.zeros(4)
  with pytest.raises(ValueError, match=r"leaves \['a'\] and \['b'\] share memory"):
    _targets.align_targets({"['a']": tied, "['b']": tied}, leaves)
  with pytest.raises(ValueError, match=r"leaves \['a'\] and \['b'\] share memory"):
    _targets.align_targets({"[0]": tied, "[1]": tied.view(2, 2).reshape(4)}, leaves)
  _targets.align_targets({"['a']": torch.zeros(4), "['b']": torch.zeros(4)}, leaves)


def rows(start: int, stop: int, into):
  return _layout.Slice((slice(start, stop),), into=into)


def test_overlapping_slice_intos_are_refused_and_adjacent_ones_pass():
  leaves = [leaf_of(np.zeros((4, 2), np.float32), "['a']"), leaf_of(np.zeros((4, 2), np.float32), "['b']")]
  buf = np.zeros((5, 2), np.float32)
  overlapping = {"['a']": rows(0, 3, buf[0:3]), "['b']": rows(1, 4, buf[2:5])}
  with pytest.raises(ValueError, match=r"leaves \['a'\] and \['b'\] share memory"):
    _targets.check_disjoint(overlapping)
  buf = np.zeros((6, 2), np.float32)
  adjacent = {"['a']": rows(0, 3, buf[0:3]), "['b']": rows(1, 4, buf[3:6])}
  _targets.align_targets(adjacent, leaves)
  # jax templates are never written: one template for many leaves is fine.
  template = jnp.zeros((4, 2), jnp.float32)
  _targets.align_targets({"['a']": template, "['b']": template}, leaves)


# ---- Slice.into outside host memory


def test_slice_into_outside_host_memory_is_refused():
  leaf = leaf_of(np.zeros((4, 2), np.float32), "['a']")
  meta = torch.empty((2, 2), device="meta")
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"\['a'\] has a Slice.into array on a device"):
    _targets.leaf_layout(leaf, rows(0, 2, meta))
  _targets.leaf_layout(leaf, rows(0, 2, torch.empty((2, 2))))


def test_host_into_decision():
  # The device a cuda tensor or cupy array reports (`_dlpack.device_of`);
  # neither can be made here.
  assert _targets.host_into_problem(_dlpack.Device("cpu")) is None
  problem = _targets.host_into_problem(_dlpack.Device("cuda", 1))
  assert problem is not None and "in cuda:1 memory" in problem and "not supported yet" in problem
  assert _targets.host_into_problem(None) is not None


# ---- raw writes into torch targets and autograd


def test_mark_written_makes_autograd_see_a_raw_write():
  weight = torch.ones(3, requires_grad=True)
  target = torch.ones(3)
  loss = (weight * target).sum()  # saves `target` for the backward pass
  before = target._version
  target.numpy()[:] = 5.0  # a raw write, as a transport makes
  assert target._version == before
  _dlpack.mark_written(target)
  assert target._version == before + 1
  with pytest.raises(RuntimeError, match="modified by an inplace operation"):
    loss.backward()


def test_mark_written_on_parameters_and_inference_tensors():
  param = torch.nn.Parameter(torch.ones(3))
  _dlpack.mark_written(param)
  assert param._version == 1
  with torch.inference_mode():
    frozen = torch.ones(3)
  _dlpack.mark_written(frozen)  # keeps no version counter: nothing to do, no error


def test_mark_written_on_numpy_is_nothing():
  x = np.zeros(3)
  _dlpack.mark_written(x)
  assert (x == 0).all()


# ---- fault rules need enabling


def faults_on(env: dict[str, str]) -> str:
  code = "from rdt_jax import _faults; print(_faults.ON, _faults.injected())"
  clean = {k: v for k, v in os.environ.items() if not k.startswith("RDT_JAX_FAULTS")}
  out = subprocess.run(
      [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True
  )
  return out.stdout.strip() + "|" + out.stderr


def test_fault_rules_from_the_environment_need_the_enabling_variable():
  ignored = faults_on({"RDT_JAX_FAULTS": "nixl.post:kill"})
  assert ignored.startswith("False {}|"), ignored
  assert "RDT_JAX_FAULTS_ENABLE=1" in ignored
  assert faults_on({"RDT_JAX_FAULTS": "nixl.post:kill", "RDT_JAX_FAULTS_ENABLE": "0"}).startswith("False")
  assert faults_on({"RDT_JAX_FAULTS": "nixl.post:kill", "RDT_JAX_FAULTS_ENABLE": "1"}).startswith(
      "True {'nixl.post': 0}"
  )


def test_a_torch_target_written_by_a_receive_plan_is_marked_written():
  """The receive plan marks an in-place torch target (and a Slice's torch
  into) written, so autograd sees what the transfer wrote."""
  import ctypes

  from rdt_jax._targets import Target
  from rdt_jax.transports._plan import ReceivePlan

  x = np.arange(6, dtype=np.float32)
  spec = _dlpack.describe(x, "['w']").spec
  for target_of in (lambda t: t, lambda t: _layout.Slice((slice(0, 6),), into=t)):
    t = torch.zeros(6)
    before = t._version
    plan = ReceivePlan([spec], "source", Target(buffers={"['w']": target_of(t)}))
    for d in plan.allocate(True):
      ctypes.memmove(d.pointer, x.ctypes.data + d.source_offset, d.nbytes)
    (leaf,) = plan.build()
    assert leaf is t and t._version > before
    np.testing.assert_array_equal(t.numpy(), x)
