"""Stream ordering into caller-owned CUDA memory (skipped without CUDA).

Each test holds a kernel that runs for about two seconds on a stream the
transfer does not own, so a transfer that writes caller memory without
waiting for every stream of the device, or frees a source its queued copy
still reads, delivers wrong bytes here instead of by chance:

* a NIXL READ into a torch CUDA target (a READ may outlive a fetch given up,
  so the target is staged and copied after success): the copy must wait for
  work queued against the target on another stream;
* the atomic weight-sync commit into a CUDA template: the same, and the
  template holds the new bytes when `pull` returns;
* a whole-array transport (`jax_transfer`) into a torch CUDA target: the copy
  out of the received jax array must have run before that array is dropped
  (XLA's allocator does not follow torch's streams and reuses the buffer).
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

import rdt_jax
from gpu.conftest import SHARE

REGISTERED = rdt_jax.register()
TRANSFER = "jax_transfer" if "jax_transfer" in REGISTERED else None
#: About two seconds of a kernel at the H100/H200's clock (`torch.cuda._sleep`
#: counts cycles): far longer than any transfer here.
LONG_KERNEL_CYCLES = 4_000_000_000
N = 1 << 22  # 16 MiB of float32 per leaf


def _values(seed: int) -> np.ndarray:
  return (np.arange(N, dtype=np.float32) % 1009) + seed


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class Producer:
  def __init__(self):
    rdt_jax.register()

  @ray.method(tensor_transport="jax_nixl")
  def torch_weights(self, seed: int):
    import torch

    return {"w": torch.from_numpy(_values(seed)).to("cuda")}

  @ray.method(tensor_transport=TRANSFER or "jax_nixl")
  def transfer_weights(self, seed: int):
    import jax

    return {"w": jax.device_put(_values(seed), jax.devices("gpu")[0])}


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class Consumer:
  def __init__(self):
    import torch

    rdt_jax.register()
    self.side = torch.cuda.Stream()

  def _busy_reader(self, target):
    """Queues a two-second kernel and then a read of `target` on a side
    stream; returns the read's (lazy) result."""
    import torch

    with torch.cuda.stream(self.side):
      torch.cuda._sleep(LONG_KERNEL_CYCLES)
      return target.double().sum()

  def read_into_busy_target(self, refs: list, seed: int) -> tuple[float, bool, bool]:
    """(what the side stream's read saw, whether the result is the target
    itself, whether the target holds the producer's bytes)."""
    import torch

    target = {"w": torch.zeros(N, device="cuda")}
    seen = self._busy_reader(target["w"])
    rdt_jax.set_target_for_ref(refs[0], target)
    out = ray.get(refs[0])
    self.side.synchronize()
    torch.cuda.synchronize()
    same = out["w"] is target["w"]
    return float(seen), same, np.array_equal(target["w"].cpu().numpy(), _values(seed))

  def transfer_into_target_then_allocate(self, refs: list, seed: int) -> bool:
    """Receives through a whole-array transport into a torch CUDA target
    while torch's current stream is busy, then makes jax arrays of the same
    size (XLA reuses the received array's freed buffer for them): True if
    the target holds the producer's bytes."""
    import jax
    import jax.numpy as jnp
    import torch

    target = {"w": torch.zeros(N, device="cuda")}
    torch.cuda._sleep(LONG_KERNEL_CYCLES)  # delays whatever is queued after it on this stream
    rdt_jax.set_target_for_ref(refs[0], target)
    ray.get(refs[0])
    gpu = jax.devices("gpu")[0]
    others = [jnp.full((N,), -7.0, jnp.float32, device=gpu) for _ in range(8)]
    jax.block_until_ready(others)
    torch.cuda.synchronize()
    return np.array_equal(target["w"].cpu().numpy(), _values(seed))


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class Trainer:
  def __init__(self):
    rdt_jax.register()
    self.publisher = rdt_jax.WeightPublisher(transport="jax_nixl", keep=2)

  def publish(self, version: int):
    import jax

    gpu = jax.devices("gpu")[0]
    return self.publisher.publish({"w": jax.device_put(_values(version), gpu)}, version=version)


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class Generator:
  def __init__(self):
    import torch

    rdt_jax.register()
    self.template = {"w": torch.zeros(N, device="cuda")}
    self.subscriber = rdt_jax.WeightSubscriber(self.template, atomic=True)
    self.side = torch.cuda.Stream()

  def pull_while_busy(self, handle, version: int) -> tuple[float, bool, int | None]:
    """(what a side-stream read queued before the pull saw, whether the
    template held the version when `pull` returned, the subscriber's version)."""
    import torch

    before = float(self.template["w"].double().sum())
    with torch.cuda.stream(self.side):
      torch.cuda._sleep(LONG_KERNEL_CYCLES)
      seen = self.template["w"].double().sum()
    self.subscriber.pull(handle)
    # Read on a fresh stream that nothing orders after the commit's copy: a
    # copy still queued when pull returned shows as old bytes here.
    probe = torch.cuda.Stream()
    with torch.cuda.stream(probe):
      held = self.template["w"].to("cpu", non_blocking=False)
    self.side.synchronize()
    return float(seen) - before, np.array_equal(held.numpy(), _values(version)), self.subscriber.version



def test_nixl_read_into_a_cuda_target_waits_for_work_on_other_streams(gpu_ray):
  producer, consumer = Producer.remote(), Consumer.remote()
  try:
    ref = producer.torch_weights.remote(5)
    ray.wait([ref], timeout=120)
    seen, same, landed = ray.get(consumer.read_into_busy_target.remote([ref], 5), timeout=120)
    assert seen == 0.0, "the transfer wrote the target before a kernel queued against it on another stream ran"
    assert same and landed
  finally:
    ray.kill(producer)
    ray.kill(consumer)


def test_atomic_commit_into_a_cuda_template_waits_for_other_streams_and_has_landed(gpu_ray):
  trainer, generator = Trainer.remote(), Generator.remote()
  try:
    for version in (1, 2):
      handle = ray.get(trainer.publish.remote(version), timeout=120)
      changed, held, pulled = ray.get(generator.pull_while_busy.remote(handle, version), timeout=120)
      assert changed == 0.0, (
          f"version {version}: the commit wrote the template before queued work on another stream ran")
      assert held, f"version {version}: the template did not hold the version when pull returned"
      assert pulled == version
  finally:
    ray.kill(trainer)
    ray.kill(generator)


def test_whole_array_transport_into_a_cuda_target_copies_before_the_source_is_freed(gpu_ray):
  if TRANSFER is None:
    pytest.skip("this jax has no jax.experimental.transfer")
  producer, consumer = Producer.remote(), Consumer.remote()
  try:
    for seed in (3, 4):
      ref = producer.transfer_weights.remote(seed)
      ray.wait([ref], timeout=120)
      assert ray.get(consumer.transfer_into_target_then_allocate.remote([ref], seed), timeout=120), (
          f"seed {seed}: the target holds bytes of a later jax array, not the producer's")
  finally:
    ray.kill(producer)
    ray.kill(consumer)
