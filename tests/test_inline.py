"""In-band sending (opt-in): small objects' bytes ride in the transport metadata.

The policy (`rdt_jax.transports._inband.inline_max_bytes`): off by default;
with `RDT_JAX_INLINE_MAX_BYTES` above 0, an object of a one-sided transport
whose leaves are all host memory and hold at most that many bytes in all is
copied into its metadata; the backend registers, sends and reads nothing.
Checked here in one process (two NIXL agents, as Ray drives them), and end to
end through Ray for every transport kind: one-sided (jax_nixl), whole-array
(jax_transfer), and two-sided (jax_gloo), which never sends in band. The
lifetime of in-band objects is in test_lifetime.
"""

from __future__ import annotations

import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray
import torch
from ray.experimental.collective import create_collective_group, destroy_collective_group
from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

import rdt_jax
from _helpers import digest, sample, transport_manager
from conftest import start_ray, worker_env
from rdt_jax import _dlpack, _handoff
from rdt_jax._metadata import MetadataError
from rdt_jax.transports import _inband
from rdt_jax.transports.nixl import NixlTransport

rdt_jax.register()  # the transports exist before the actor classes below name them

#: The threshold these tests turn in-band sending on with.
ON = str(100 << 10)


@pytest.fixture(autouse=True)
def in_band_on(monkeypatch):
  """In-band sending on in this process (the one-process tests' producer)."""
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", ON)

# ---- the policy, in one process


def _export(prod: NixlTransport, obj: str, leaves: list):
  for i, x in enumerate(leaves):
    _handoff.record_described(x, _dlpack.describe(x, f"[{i}]"))
  return prod.extract_tensor_transport_metadata(obj, leaves)


def _fetch(cons: NixlTransport, obj: str, meta) -> list:
  meta = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(meta))))  # producer -> owner -> consumer
  request = cons.fetch_multiple_tensors(obj, meta, CommunicatorMetadata())
  return cons.wait_fetch_complete(request, 30)


@pytest.fixture(scope="module")
def agents():
  return NixlTransport(), NixlTransport()


def test_threshold_default_and_environment(monkeypatch):
  monkeypatch.delenv("RDT_JAX_INLINE_MAX_BYTES", raising=False)
  assert _inband.inline_max_bytes() == 0  # opt-in
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", ON)
  assert _inband.inline_max_bytes() == 100 << 10
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "0")
  assert _inband.inline_max_bytes() == 0
  for bad in ("-1", "64KiB"):
    monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", bad)
    with pytest.raises(rdt_jax.SettingError, match="RDT_JAX_INLINE_MAX_BYTES"):
      _inband.inline_max_bytes()


def test_small_mixed_tree_moves_in_band_exactly(agents):
  prod, cons = agents
  leaves = [
      jnp.asarray(sample((3, 5), "bfloat16", 1)),
      np.ascontiguousarray(sample((7,), "int64", 2)),
      torch.from_numpy(sample((2, 2), "float32", 3)),
      jnp.zeros((0, 4), jnp.float32),
      jnp.asarray(sample((), "uint8", 4)),
  ]
  before = prod.counters()["registrations"]
  cons.receive_stats(reset=True)
  meta = _export(prod, "inline-mixed", leaves)
  assert isinstance(meta.inline, bytes)
  assert len(meta.inline) == meta.nbytes == sum(_dlpack.describe(x, "x").spec.nbytes for x in leaves)
  assert meta.agent_name is None and prod.counters()["registrations"] == before  # nothing exported
  got = _fetch(cons, "inline-mixed", meta)
  stats = cons.receive_stats(reset=True)
  assert stats["inline"] == 1 and stats["descriptors"] == 0
  assert [digest(g) for g in got] == [digest(x) for x in leaves]
  assert [type(g) for g in got] == [type(x) for x in leaves]  # "source" mode: as they left
  prod.garbage_collect("inline-mixed", meta, leaves)  # an in-band object: nothing to release


class _Recording(NixlTransport):
  """A jax_nixl transport that records which backend hooks ran."""

  def __init__(self) -> None:
    super().__init__()
    self.calls: list[str] = []

  def export_buffers(self, obj_id, leaves, meta):
    self.calls.append("export_buffers")
    return super().export_buffers(obj_id, leaves, meta)

  def start_receive(self, obj_id, meta, communicator_metadata, destinations):
    self.calls.append("start_receive")
    return super().start_receive(obj_id, meta, communicator_metadata, destinations)

  def finish_receive(self, handle):
    self.calls.append("finish_receive")
    return super().finish_receive(handle)

  def cancel_receive(self, handle):
    self.calls.append("cancel_receive")
    return super().cancel_receive(handle)

  def release(self, obj_id):
    self.calls.append("release")
    return super().release(obj_id)


def test_no_backend_hook_runs_for_an_in_band_object(monkeypatch):
  monkeypatch.setenv("RDT_JAX_NIXL_CMA", "0")
  prod, cons = _Recording(), _Recording()
  small = [jnp.asarray(sample((4,), "float32", 8))]
  meta = _export(prod, "inline-hooks", small)
  assert meta.inline is not None
  request = cons.fetch_multiple_tensors("inline-hooks", meta, CommunicatorMetadata())
  del request  # dropped unfinished: nothing of the backend's to cancel
  assert digest(_fetch(cons, "inline-hooks", meta)[0]) == digest(small[0])
  prod.garbage_collect("inline-hooks", meta, small)
  assert prod.calls == [] and cons.calls == []
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "0")  # the same object out of band
  meta = _export(prod, "oob-hooks", small)
  assert digest(_fetch(cons, "oob-hooks", meta)[0]) == digest(small[0])
  prod.garbage_collect("oob-hooks", meta, small)
  assert prod.calls == ["export_buffers", "release"]
  assert cons.calls == ["start_receive", "finish_receive"]


def test_threshold_is_inclusive_and_zero_turns_it_off(agents, monkeypatch):
  prod, cons = agents
  x = jnp.asarray(sample((256,), "float32", 5))  # 1 KiB
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "1024")
  at = _export(prod, "inline-at", [x])
  assert at.inline is not None
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "1023")
  over = _export(prod, "inline-over", [x])
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "0")
  off = _export(prod, "inline-off", [x])
  assert over.inline is None and off.inline is None and over.agent_name is not None
  cons.receive_stats(reset=True)
  for obj, meta in (("inline-at", at), ("inline-over", over), ("inline-off", off)):
    assert digest(_fetch(cons, obj, meta)[0]) == digest(x)
    prod.garbage_collect(obj, meta, [x])
  stats = cons.receive_stats(reset=True)
  assert stats["inline"] == 1 and stats["fetches"] == 3 and stats["descriptors"] >= 2


def sharded_round_trip() -> tuple[int, str, str, bool]:
  """In a process with 2 cpu devices: a sharded leaf in band, end to end."""
  prod, cons = NixlTransport(), NixlTransport()
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  x = jax.device_put(sample((8, 4), "float32", 6), sharding)
  meta = _export(prod, "inline-sharded", [x])
  assert meta.inline is not None
  (got,) = _fetch(cons, "inline-sharded", meta)
  return len(meta.leaves[0].chunks), digest(got), digest(x), got.sharding.is_equivalent_to(x.sharding, 2)


def test_wrong_inline_length_is_an_error_not_a_guess(agents):
  prod, cons = agents
  x = jnp.asarray(sample((4,), "int32", 7))
  meta = _export(prod, "inline-short", [x])
  meta.inline = meta.inline[:-1]
  with pytest.raises(MetadataError, match=r"field inline holds 15 bytes but the leaves describe 16.*different rdt_jax"):
    _fetch(cons, "inline-short", meta)


# ---- end to end through Ray, one transport of each kind


@pytest.fixture(scope="module")
def ray_cluster():
  start_ray(env={"RDT_JAX_INLINE_MAX_BYTES": ON}, num_cpus=8)
  yield
  ray.shutdown()


@ray.remote(enable_tensor_transport=True)
class Side:
  def __init__(self):
    rdt_jax.register()

  @ray.method(tensor_transport="jax_nixl")
  def nixl(self, seed: int):
    return {"w": jnp.asarray(sample((64,), "float32", seed)), "b": np.arange(3, dtype=np.int16)}

  @ray.method(tensor_transport="jax_gloo")
  def gloo(self, seed: int):
    return {"w": jnp.asarray(sample((64,), "float32", seed)), "b": np.arange(3, dtype=np.int16)}

  @ray.method(tensor_transport="jax_transfer")
  def transfer(self, seed: int):
    return {"w": jnp.asarray(sample((64,), "float32", seed)), "b": np.arange(3, dtype=np.int16)}

  def sharded_round_trip(self) -> tuple:
    return sharded_round_trip()

  def pid(self) -> int:
    return os.getpid()

  def take(self, value, transport: str) -> tuple:
    stats = transport_manager(transport).receive_stats(reset=True)
    return digest(value["w"]), digest(value["b"]), type(value["w"]).__name__, stats["inline"]


@pytest.fixture(scope="module")
def side_pair(ray_cluster):
  """A producer and a consumer with a jax_gloo group between them, for every transport."""
  producer, consumer = Side.options(runtime_env=worker_env()).remote(), Side.options(runtime_env=worker_env()).remote()
  group = create_collective_group([producer, consumer], backend="torch_gloo")
  yield producer, consumer
  destroy_collective_group(group)
  ray.kill(producer)
  ray.kill(consumer)


@pytest.mark.parametrize("transport", ["jax_nixl", "jax_gloo", "jax_transfer"])
def test_small_object_in_band_through_ray(side_pair, transport):
  """In band on the one-sided transports; jax_gloo sends it (Ray's send task
  runs on the producer for every transfer of a two-sided transport)."""
  producer, consumer = side_pair
  ref = getattr(producer, transport.removeprefix("jax_")).remote(11)
  got = ray.get(consumer.take.remote(ref, transport), timeout=60)
  want = (digest(jnp.asarray(sample((64,), "float32", 11))), digest(np.arange(3, dtype=np.int16)))
  assert got[:2] == want
  assert got[2] == "ArrayImpl" and got[3] == (0 if transport == "jax_gloo" else 1)


def test_sharded_leaf_in_band_keeps_its_sharding(ray_cluster):
  side = Side.options(runtime_env=worker_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")).remote()
  chunks, got, want, same_sharding = ray.get(side.sharded_round_trip.remote(), timeout=60)
  assert chunks == 2 and got == want and same_sharding
  ray.kill(side)


# ---- Ray's own target API on every size and path


@ray.remote(enable_tensor_transport=True)
class Pair:
  """Returns two int64 leaves of one framework (Ray's example: two 3-element tensors)."""

  def __init__(self):
    rdt_jax.register()

  @ray.method(tensor_transport="jax_nixl")
  def two(self, framework: str, n: int):
    a, b = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64) * 2
    return [torch.from_numpy(a), torch.from_numpy(b)] if framework == "torch" else [a, b]


@pytest.fixture(scope="module")
def pairs(ray_cluster):
  """One `Pair` producer per in-band setting, shared by the cases."""
  envs = {"on": {}, "off": {"RDT_JAX_INLINE_MAX_BYTES": "0"}}
  started = {inline: Pair.options(runtime_env=worker_env(**env)).remote() for inline, env in envs.items()}
  yield started
  for producer in started.values():
    ray.kill(producer)


@pytest.mark.parametrize("inline", ["on", "off"])
@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("n", [3, 1 << 20], ids=["3-elements", "8-MiB"])
def test_rays_set_target_api_on_every_ref(pairs, inline, framework, n):
  """`ray.experimental.set_target_for_ref` / `set_target_device_for_ref` on
  rdt_jax refs, in band (3 elements, in-band on) and out of band: the value
  lands in the given buffers, of either framework."""
  producer = pairs[inline]
  ref = producer.two.remote(framework, n)
  ray.wait([ref])
  buffers = [torch.zeros(n, dtype=torch.int64) for _ in range(2)]
  if framework == "numpy":
    buffers = [b.numpy() for b in buffers]
  transport_manager("jax_nixl").receive_stats(reset=True)
  ray.experimental.set_target_for_ref(ref, buffers)
  got = ray.get(ref, timeout=60)
  assert all(g is b for g, b in zip(got, buffers))
  assert int(buffers[1][-1]) == 2 * (n - 1) and int(buffers[0][1]) == 1
  in_band = transport_manager("jax_nixl").receive_stats(reset=True)["inline"]
  assert in_band == (1 if inline == "on" and n == 3 else 0)
  ref = producer.two.remote(framework, n)
  ray.experimental.set_target_device_for_ref(ref, "cpu")
  got = ray.get(ref, timeout=60)
  assert [type(g) for g in got] == [type(b) for b in buffers]
  assert [digest(g) for g in got] == [digest(np.arange(n, dtype=np.int64)), digest(np.arange(n, dtype=np.int64) * 2)]
