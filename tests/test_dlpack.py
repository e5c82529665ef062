"""The DLPack layer and tree conversion. Imports no Ray: test_no_ray.py runs
this module in a process where `import ray` fails."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

# Most cases here convert to and from torch: on a host without it (the Python
# 3.12 leg of scripts/matrix.sh) the module skips.
torch = pytest.importorskip("torch")

import rdt_jax
from _helpers import sample, wait_for
from rdt_jax import _dlpack, _layout, _limits, _memory
from rdt_jax._dlpack import ChunkSpec, _dtypes
from rdt_jax._memory import _host

ALL_DTYPES = sorted(d.name for d in _dtypes.SUPPORTED_DTYPES)
TORCH_DTYPES = [n for n in ALL_DTYPES if isinstance(getattr(torch, n, None), torch.dtype)]


def host_copy(dtype: np.dtype, x: np.ndarray):
  """x's bytes in a fresh aligned receive buffer, as the transport leaves them."""
  buf = _host.aligned_host_buffer(x.nbytes)
  buf[:] = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
  return buf, _layout.host_chunk(buf, 0, dtype, ChunkSpec(tuple(x.shape), x.nbytes))


def test_import_imports_no_framework():
  code = (
      "import sys, rdt_jax; "
      "print(sorted(m for m in ('jax', 'torch', 'nixl', 'nixl_cu12') if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


def test_public_names():
  assert set(rdt_jax.__all__) >= {
      "register", "receive_as", "to_jax", "to_torch", "to_numpy",
      "set_target_for_ref", "set_target_device_for_ref",
  }
  assert dir(rdt_jax) == rdt_jax.__all__


@pytest.mark.parametrize(
    "x, fw",
    [(np.zeros(2), "numpy"), (jnp.zeros(2), "jax"), (torch.zeros(2), "torch"), (3, None), ("s", None)],
)
def test_framework_of(x, fw):
  assert _dlpack.framework_of(x) == fw


X64_DTYPES = ["int64", "uint64", "float64", "complex128"]


@pytest.mark.parametrize("name", [n for n in ALL_DTYPES if n not in X64_DTYPES])
def test_describe_rebuild_every_dtype_as_jax_zero_copy(name):
  x = jnp.asarray(sample((3, 4), name))
  leaf = _dlpack.describe(x, "['x']")
  assert leaf.spec.shape == (3, 4) and leaf.spec.dtype == np.dtype(x.dtype)
  assert leaf.spec.chunks[0].nbytes == x.nbytes and leaf.device == "cpu"
  buf, view = host_copy(leaf.spec.dtype, np.asarray(x))
  out = _dlpack.rebuild_host([view], leaf.spec, "jax", _dlpack.Device("cpu"))
  assert isinstance(out, jax.Array) and out.dtype == x.dtype
  assert out.unsafe_buffer_pointer() == buf.ctypes.data  # zero-copy
  np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.asarray(x).view(np.uint8))


@pytest.mark.parametrize("name", X64_DTYPES)
def test_64_bit_dtypes_with_x64(name):
  with jax.enable_x64(True):
    x = jnp.asarray(sample((5,), name))
    leaf = _dlpack.describe(x)
    _buf, view = host_copy(leaf.spec.dtype, np.asarray(x))
    out = _dlpack.rebuild_host([view], leaf.spec, "jax", _dlpack.Device("cpu"))
    assert out.dtype == np.dtype(name)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


def test_64_bit_leaf_as_jax_without_x64_raises():
  x = np.arange(3, dtype=np.int64)
  spec = _dlpack.describe(x, "['n']").spec
  _, view = host_copy(spec.dtype, x)
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['n'\].*int64.*receive_as\('numpy'\).*jax_enable_x64"):
    _dlpack.rebuild_host([view], spec, "jax", _dlpack.Device("cpu"))
  # ... and numpy/torch receive it fine.
  assert _dlpack.rebuild_host([view], spec, "numpy", _dlpack.Device("cpu")).dtype == np.int64


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_rebuild_as_torch_zero_copy(name):
  x = sample((2, 3), name)
  spec = _dlpack.describe(x).spec
  buf, view = host_copy(spec.dtype, x)
  out = _dlpack.rebuild_host([view], spec, "torch", _dlpack.Device("cpu"))
  assert isinstance(out, torch.Tensor) and str(out.dtype) == f"torch.{name}"
  assert out.data_ptr() == buf.ctypes.data
  np.testing.assert_array_equal(rdt_jax.to_numpy(out).view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("shape", [(), (0,), (2, 0), (1, 1, 1)])
def test_zero_d_and_empty(shape):
  x = jnp.ones(shape, jnp.float32)
  leaf = _dlpack.describe(x)
  assert leaf.spec.shape == shape and leaf.spec.nbytes == x.nbytes
  _, view = host_copy(leaf.spec.dtype, np.asarray(x))
  out = _dlpack.rebuild_host([view], leaf.spec, "jax", _dlpack.Device("cpu"))
  assert out.shape == shape


def test_host_layout_aligns_every_chunk():
  specs = [_dlpack.describe(np.zeros(n, np.uint8)).spec for n in (1, 100, 0, 64, 65)]
  offsets, total = _layout.host_layout(specs)
  flat = [o for leaf in offsets for o in leaf]
  assert all(o % _limits.HOST_ALIGNMENT == 0 for o in flat)
  assert total >= sum(s.nbytes for s in specs)
  buf = _host.aligned_host_buffer(total)
  assert buf.ctypes.data % _limits.HOST_ALIGNMENT == 0


# ---- errors


def test_deleted_array():
  x = jnp.ones(3)
  x.delete()
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['w'\] is a deleted jax.Array"):
    _dlpack.describe(x, "['w']")


def test_donated_array():
  f = jax.jit(lambda a: a + 1, donate_argnums=0)
  x = jnp.ones(8)
  f(x)
  with pytest.raises(rdt_jax.UnsupportedLeafError, match="deleted"):
    _dlpack.describe(x, "['x']")


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4])
def test_sub_byte(dtype):
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['q'\].*sub-byte dtype u?int4"):
    _dlpack.describe(jnp.zeros(4, dtype), "['q']")


def test_prng_key():
  # A typed key is described through its raw data, and rebuilt as the same key.
  key = jax.random.key(5, impl="rbg")
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"PRNG key.*prng_key_parts"):
    _dlpack.describe(key, "['k']")
  assert _dlpack.is_prng_key(key) and not _dlpack.is_prng_key(jnp.zeros(2, jnp.uint32))
  data, impl = _dlpack.prng_key_parts(key)
  assert impl == "rbg" and data.shape == (4,)
  back = _dlpack.wrap_prng_key(data, impl)
  assert jax.random.key_impl(back) == jax.random.key_impl(key)
  np.testing.assert_array_equal(jax.random.key_data(back), data)


def test_object_dtype():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match="object"):
    _dlpack.describe(np.array([None]), "['o']")


def test_string_dtype():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match="<U3"):
    _dlpack.describe(np.array(["abc"]), "['s']")


def test_non_contiguous_numpy():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"non-contiguous numpy.*ascontiguousarray"):
    _dlpack.describe(np.zeros((4, 4))[:, ::2], "['v']")


def test_negative_stride_numpy():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match="non-contiguous"):
    _dlpack.describe(np.arange(5)[::-1], "['r']")


def test_non_contiguous_torch():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"non-contiguous torch.*contiguous\(\)"):
    _dlpack.describe(torch.zeros(4, 4).t(), "['t']")


def test_sparse_torch():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match="sparse"):
    _dlpack.describe(torch.zeros(3).to_sparse(), "['s']")


def test_torch_meta_device():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match="meta"):
    _dlpack.describe(torch.empty(3, device="meta"), "['m']")


def test_not_an_array():
  with pytest.raises(TypeError, match=r"not a jax\.Array, torch\.Tensor, np\.ndarray or cupy\.ndarray"):
    _dlpack.describe([1, 2], "['l']")


# ---- devices


@pytest.mark.parametrize(
    "given, expected",
    [("cpu", "cpu"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1"), ("gpu:2", "cuda:2"), ("GPU", "cuda:0")],
)
def test_parse_device_strings(given, expected):
  assert str(_dlpack.parse_device(given)) == expected


def test_parse_device_objects():
  assert _dlpack.parse_device(jax.devices("cpu")[0]) == _dlpack.Device("cpu", 0)
  assert _dlpack.parse_device(torch.device("cuda:3")) == _dlpack.Device("cuda", 3)


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "mps", 7])
def test_parse_device_rejects(bad):
  with pytest.raises(ValueError, match="Unsupported device"):
    _dlpack.parse_device(bad)


# ---- to_jax / to_torch / to_numpy


def mixed_tree():
  return {
      "j": jnp.arange(4, dtype=jnp.float32),
      "t": torch.arange(3, dtype=torch.int32),
      "n": np.ones((2, 2), np.float16),
      "meta": {"step": 3, "name": "x", "none": None},
      "list": [jnp.zeros(2, jnp.bfloat16), torch.zeros(2, dtype=torch.bfloat16)],
  }


@pytest.mark.parametrize(
    "convert, kind",
    [(rdt_jax.to_jax, jax.Array), (rdt_jax.to_torch, torch.Tensor), (rdt_jax.to_numpy, np.ndarray)],
)
def test_convert_tree(convert, kind):
  tree = mixed_tree()
  out = convert(tree)
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
  assert out["meta"] == {"step": 3, "name": "x", "none": None}
  for leaf in (out["j"], out["t"], out["n"], *out["list"]):
    assert isinstance(leaf, kind)
  np.testing.assert_array_equal(rdt_jax.to_numpy(out["j"]), [0, 1, 2, 3])
  assert rdt_jax.to_numpy(out["list"][0]).dtype == ml_dtypes.bfloat16


def test_conversions_are_zero_copy_on_cpu():
  j = jnp.arange(8, dtype=jnp.float32)
  t = rdt_jax.to_torch(j)
  assert t.data_ptr() == j.unsafe_buffer_pointer()
  n = rdt_jax.to_numpy(j)
  assert n.ctypes.data == j.unsafe_buffer_pointer()
  tb = torch.zeros(4, dtype=torch.bfloat16)
  assert rdt_jax.to_numpy(tb).ctypes.data == tb.data_ptr()
  assert rdt_jax.to_jax(tb).unsafe_buffer_pointer() == tb.data_ptr()
  a = _host.aligned_host_buffer(64).view(np.float32)
  assert rdt_jax.to_jax(a).unsafe_buffer_pointer() == a.ctypes.data


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "bfloat16"])
def test_byte_view_dtypes_round_trip(name):
  x = jnp.asarray(sample((6,), name))
  back = rdt_jax.to_jax(rdt_jax.to_torch(x))
  np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(x).view(np.uint8))
  assert rdt_jax.to_numpy(x).dtype == np.dtype(x.dtype)


def test_to_torch_unsupported_dtype_names_leaf():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['f'\].*float8_e3m4"):
    rdt_jax.to_torch({"f": jnp.zeros(2, jnp.float8_e3m4)})


def test_to_jax_x64_error_names_leaf():
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['a'\]\[0\].*float64"):
    rdt_jax.to_jax({"a": [np.zeros(2)]})


def test_convert_deleted_array_raises():
  x = jnp.ones(2)
  x.delete()
  with pytest.raises(rdt_jax.UnsupportedLeafError, match="deleted"):
    rdt_jax.to_numpy({"x": x})


def test_receive_as_rejects_unknown_mode():
  with pytest.raises(ValueError, match="Unknown receive mode 'tensorflow'"):
    rdt_jax.receive_as("tensorflow")
  rdt_jax.receive_as("source")


def test_host_pool_reuses_only_free_buffers():
  pool = _memory.HostBufferPool(max_bytes=1 << 20)
  evicted = []
  pool.add_eviction_listener(lambda p, n, keepalive: evicted.append(n))
  a = pool.acquire(4096)
  first = a.ctypes.data
  assert pool.acquire(4096).ctypes.data != first  # `a` is still in use
  # A jax array made from a view keeps the buffer in use after the view is gone.
  x = _dlpack.host_to_jax_many([a.view(np.float32)], _dlpack.Device("cpu"))[0]
  del a
  assert x.unsafe_buffer_pointer() == first
  assert pool.acquire(4096).ctypes.data != first
  del x
  assert wait_for(lambda: _all_pooled_buffers_free(pool), timeout=5, interval=0.05)
  t = torch.from_numpy(pool.acquire(1 << 20))  # over the bound: evicts free buffers
  assert evicted and pool.pooled_bytes() <= (1 << 20) + 3 * 4096
  del t
  pool.clear()
  assert pool.pooled_bytes() == 0


def _all_pooled_buffers_free(pool) -> bool:
  import gc

  gc.collect()
  c = pool.counters()
  return c["buffers"] >= 2 and c["free_buffers"] == c["buffers"] and c["bytes_in_use"] == 0




def test_gc_paused_nests_and_restores_the_collector():
  import gc

  from rdt_jax import _memory

  assert gc.isenabled()
  with _memory.gc_paused(_limits.GC_PAUSE_MIN_LEAVES - 1):
    assert gc.isenabled()  # small objects: the collector runs as usual
  with _memory.gc_paused(_limits.GC_PAUSE_MIN_LEAVES):
    assert not gc.isenabled()
    with _memory.gc_paused(10_000):
      assert not gc.isenabled()
    assert not gc.isenabled()  # the outer pause still holds
  assert gc.isenabled()
  gc.disable()
  try:
    with _memory.gc_paused(10_000):
      pass
    assert not gc.isenabled()  # a collector the caller disabled stays disabled
  finally:
    gc.enable()


@pytest.mark.parametrize("how", ["unaligned", "owned"])
def test_a_copy_from_host_memory_has_finished_when_it_returns(how):
  """jax copies a host buffer it cannot alias (unaligned) on a thread of its
  own and returns before a large copy is done; `to_jax_exact(own=True)`
  copies an aliased one with an asynchronous jax op. Either way the result
  is what the buffer held at the call: a write right after it never shows
  (it did in most tries before the conversion waited for its copy)."""
  nbytes = 4 << 20
  for attempt in range(20):
    if how == "unaligned":
      source = np.zeros(nbytes + 1, np.uint8)[1:]
      assert source.ctypes.data % 64
      out = rdt_jax.to_jax(source)
    else:
      source = np.zeros(nbytes, np.uint8)
      out = _dlpack.to_jax_exact(source, "x", own=True)
    source[:] = 7
    assert not np.asarray(out).any(), f"attempt {attempt}: the write after the copy reached the result"
