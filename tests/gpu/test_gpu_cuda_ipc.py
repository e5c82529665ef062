"""jax_nixl plain returns of device memory through CUDA IPC on one node
(`RDT_JAX_NIXL_CUDA_IPC=1`, opt-in), on a real GPU (skipped without CUDA; see
conftest.py). The decisions of the path run on CPU with a fake driver in
tests/test_cuda_ipc_read.py; here the driver is CUDA's.

Covers: a mixed jax/torch/cupy tree copied through CUDA IPC (counted as
`cuda_ipc`, values exact); new objects in reused producer memory read with
the mappings kept, never stale bytes; a write into a caller's CUDA target
ordered after work queued against it; an object in memory CUDA IPC cannot
map (XLA's, beyond the producer's device pool) read through NIXL and counted
as `cuda_ipc_fallback`; the driver as consumer.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

import rdt_jax
from gpu.conftest import SHARE
from gpu.test_gpu_backends import _ready, assert_arrived, check_values, describe_leaves, make_tree
from rdt_jax import _dlpack
from rdt_jax._memory import _ipc

REGISTERED = rdt_jax.register()
IPC_ENV = {"RDT_JAX_NIXL_CUDA_IPC": "1"}


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class IpcActor:
  def __init__(self):
    rdt_jax.register()

  @ray.method(tensor_transport="jax_nixl")
  def tree(self, cupy_leaf: bool = True):
    return make_tree("cuda", cupy_leaf)

  @ray.method(tensor_transport="jax_nixl")
  def filled(self, seed: int, n: int = 1 << 22):
    """`n` float32 of jax and of torch device memory, each `seed` everywhere."""
    import jax
    import torch

    return {
        "j": jax.device_put(np.full(n, seed, np.float32), jax.devices("gpu")[0]),
        "t": torch.full((n,), float(seed), device="cuda"),
    }

  def take(self, tree: dict) -> tuple[dict, list[str], dict]:
    return describe_leaves(tree), check_values(tree), rdt_jax.receive_stats("jax_nixl", reset=True)

  def take_filled(self, tree: dict) -> tuple[list[float], dict, int]:
    out = []
    for k in ("j", "t"):
      host = _dlpack.convert_leaf(tree[k], "numpy")
      out += [float(host.min()), float(host.max())]
    return out, rdt_jax.receive_stats("jax_nixl", reset=True), _ipc.mappings()

  def into_busy_cuda_target(self, refs: list, n: int = 1 << 22) -> tuple[float, bool, dict]:
    """Receives into a cuda target while a side stream still reads it: the
    read sees the old values, the target the new ones."""
    import torch

    target = {"j": torch.zeros(n, device="cuda"), "t": torch.zeros(n, device="cuda")}
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
      torch.cuda._sleep(200_000_000)
      seen = target["t"].sum()
    rdt_jax.set_target_for_ref(refs[0], target)
    out = ray.get(refs[0])
    side.synchronize()
    ok = out["t"] is target["t"] and bool((out["t"] == out["t"][0]).all()) and float(out["t"][0]) > 0
    return float(seen), ok, rdt_jax.receive_stats("jax_nixl", reset=True)


def _actors(producer_env: dict | None = None) -> tuple:
  env = {"env_vars": IPC_ENV}
  producer = IpcActor.options(runtime_env={"env_vars": {**IPC_ENV, **(producer_env or {})}}).remote()
  return producer, IpcActor.options(runtime_env=env).remote()


@pytest.fixture(scope="module")
def ipc_pair(gpu_ray):
  pair = _actors()
  yield pair
  for actor in pair:
    ray.kill(actor)


def test_a_mixed_tree_is_copied_through_cuda_ipc(ipc_pair):
  producer, consumer = ipc_pair
  described, bad, stats = ray.get(consumer.take.remote(producer.tree.remote()))
  assert_arrived(described, bad, "source", "cuda")
  assert stats["cuda_ipc"] == 1 and stats["cuda_ipc_fallback"] == 0, stats


def test_new_objects_in_reused_memory_are_read_fresh_through_kept_mappings(ipc_pair):
  producer, consumer = ipc_pair
  mappings = []
  for seed in range(1, 7):
    got, stats, kept = ray.get(consumer.take_filled.remote(producer.filled.remote(seed)))
    assert got == [seed] * 4, f"object {seed} read {got}"
    assert stats["cuda_ipc"] == 1, stats
    mappings.append(kept)
  # Kept per allocation (the producer's pooled staging regions), not per object.
  assert max(mappings) <= 4, f"mappings kept after each of 6 objects: {mappings}"


def test_a_write_into_a_caller_target_waits_for_work_queued_against_it(ipc_pair):
  producer, consumer = ipc_pair
  seen, ok, stats = ray.get(consumer.into_busy_cuda_target.remote(_ready(producer.filled.remote(3))))
  assert seen == 0.0 and ok
  assert stats["cuda_ipc"] == 1, stats


def test_memory_cuda_ipc_cannot_map_is_read_through_nixl_and_counted(gpu_ray):
  """With a device pool of 1 MiB the producer reads its jax leaf in place
  from XLA's memory, which CUDA IPC cannot export: the object goes through
  NIXL, counted, with the right bytes."""
  producer, consumer = _actors({"RDT_JAX_DEVICE_POOL_BYTES": str(1 << 20)})
  try:
    got, stats, _ = ray.get(consumer.take_filled.remote(producer.filled.remote(5)))
    assert got == [5.0] * 4
    assert stats["cuda_ipc"] == 0 and stats["cuda_ipc_fallback"] == 1, stats
  finally:
    ray.kill(producer)
    ray.kill(consumer)


def test_the_driver_reads_through_cuda_ipc(ipc_pair, monkeypatch):
  monkeypatch.setenv("RDT_JAX_NIXL_CUDA_IPC", "1")  # read per use, in this process
  producer, _ = ipc_pair
  rdt_jax.receive_stats("jax_nixl", reset=True)
  tree = ray.get(producer.tree.remote(cupy_leaf=False))
  assert check_values(tree) == []
  assert rdt_jax.receive_stats("jax_nixl")["cuda_ipc"] == 1
