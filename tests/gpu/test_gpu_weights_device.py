"""Weight versions packed in device memory (skipped without CUDA).

A version whose leaves all live on one GPU is packed into an allocation of
the publisher's own; a subscriber on the host whose template is CUDA
tensors written in place copies it through CUDA IPC (no Ray object); any
other subscriber gets the version's tree through Ray. Each test checks the
bytes, and the route where it matters:

* in place into torch CUDA tensors: the IPC route, which waits for work
  queued against the template on another stream before it writes;
* into jax arrays on the GPU and atomically: through Ray, same bytes;
* a version that left the window: `StaleWeightsError`, on both routes;
* an engine's own CUDA tensors with `source=` (a reshape, a transpose, a cast):
  the version's tree through Ray, written in the engine's layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

import rdt_jax
from gpu.conftest import SHARE

#: About two seconds of a kernel at the H100/H200's clock (`torch.cuda._sleep` counts cycles).
LONG_KERNEL_CYCLES = 4_000_000_000
N = 1 << 20  # float32 per large leaf


def _values(version: int) -> dict[str, np.ndarray]:
  return {
      "w": (np.arange(N, dtype=np.float32) % 1013) + version,
      "b": np.full((3, 5), version, np.int32),
      "s": np.array(version * 0.5, np.float32),
  }


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class Trainer:
  def __init__(self, keep: int, device_pack: bool | None = None):
    rdt_jax.register()
    self.publisher = rdt_jax.WeightPublisher(transport="jax_nixl", keep=keep, device_pack=device_pack)

  def publish(self, version: int):
    import jax

    gpu = jax.devices("gpu")[0]
    tree = {k: jax.device_put(v, gpu) for k, v in _values(version).items()}
    handle = self.publisher.publish(tree, version=version)
    return handle, handle.ref is None and handle.packed is not None and handle.packed.device >= 0


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class Generator:
  def __init__(self, kind: str):
    import jax
    import torch

    rdt_jax.register()
    self.kind = kind
    if kind == "jax":
      gpu = jax.devices("gpu")[0]
      self.template = {k: jax.device_put(np.zeros_like(v), gpu) for k, v in _values(0).items()}
    elif kind == "mapped":  # an engine's own CUDA tensors, names and layouts (source=)
      self.template = {"w2": torch.zeros(1024, N // 1024, device="cuda"),
                       "bT": torch.zeros(5, 3, dtype=torch.int32, device="cuda"),
                       "s": torch.zeros((), dtype=torch.bfloat16, device="cuda")}
      self.subscriber = rdt_jax.WeightSubscriber(self.template, source={
          "w2": rdt_jax.From("w", reshape=(1024, N // 1024)), "bT": rdt_jax.From("b", transpose=(1, 0)), "s": "s"})
      self.side = torch.cuda.Stream()
      return
    else:
      self.template = {k: torch.zeros(v.shape, dtype=torch.from_numpy(v).dtype, device="cuda")
                       for k, v in _values(0).items()}
    self.subscriber = rdt_jax.WeightSubscriber(self.template, atomic=kind == "atomic")
    self.side = torch.cuda.Stream()

  def pull(self, handle, busy: bool = False):
    """(whether every leaf holds the version, what a side-stream read queued
    before the pull saw change, the subscriber's version, IPC mappings open,
    the pull's route)."""
    import torch

    from rdt_jax._memory import _ipc

    seen = 0.0
    if busy:
      before = float(self.template["w"].double().sum())
      with torch.cuda.stream(self.side):
        torch.cuda._sleep(LONG_KERNEL_CYCLES)
        queued = self.template["w"].double().sum()
    value = self.subscriber.pull(handle)
    if busy:
      self.side.synchronize()
      seen = float(queued) - before
    torch.cuda.synchronize()
    got = {k: np.asarray(v.cpu() if hasattr(v, "cpu") else v) for k, v in value.items()}
    want = _values(handle.version)
    same = all(np.array_equal(got[k], want[k]) for k in want)
    return same, seen, self.subscriber.version, _ipc.mappings(), self.subscriber.last_pull.route

  def pull_mapped(self, handle) -> tuple[bool, int | None, str]:
    """(whether every engine tensor holds its transform of the version, the
    subscriber's version, the pull's route)."""
    import ml_dtypes
    import torch

    self.subscriber.pull(handle)
    torch.cuda.synchronize()
    v = _values(handle.version)
    want = {"w2": v["w"].reshape(1024, -1), "bT": v["b"].T, "s": v["s"].astype(ml_dtypes.bfloat16)}
    got = {k: t.cpu().float().numpy() if k == "s" else t.cpu().numpy() for k, t in self.template.items()}
    same = all(np.array_equal(got[k], np.asarray(want[k], dtype=got[k].dtype)) for k in want)
    return same, self.subscriber.version, self.subscriber.last_pull.route

  def pull_error(self, handle) -> str:
    try:
      self.subscriber.pull(handle)
    except rdt_jax.StaleWeightsError as e:
      return f"stale: {e}"
    return "pulled"



def test_in_place_cuda_tensors_pull_through_cuda_ipc_after_queued_work(gpu_ray):
  trainer, generator = Trainer.remote(2), Generator.remote("torch")
  try:
    for version in (1, 2, 3, 4):
      handle, device_packed = ray.get(trainer.publish.remote(version), timeout=120)
      assert device_packed, "a version of leaves on one GPU was not packed in device memory"
      same, seen, pulled, mappings, route = ray.get(generator.pull.remote(handle, busy=version == 2), timeout=120)
      assert same and pulled == version and route == "cuda_ipc"
      assert seen == 0.0, "the pull wrote the template before work queued against it on another stream ran"
      assert 1 <= mappings <= 3, f"{mappings} IPC mappings open after {version} versions of keep=2"
  finally:
    ray.kill(trainer)
    ray.kill(generator)


@pytest.mark.parametrize(("device_pack", "setting", "packed"), [
    (False, "1", False), (True, "0", True), (None, "0", False)], ids=["off", "on-over-setting", "setting"])
def test_device_pack_decides_for_its_stream_over_the_setting(gpu_ray, device_pack, setting, packed):
  """`WeightPublisher(device_pack=)` packs a stream's GPU versions in device
  memory or sends them as pytrees, whatever `RDT_JAX_WEIGHT_DEVICE_PACK` says;
  left out, the setting decides. Either way the bytes arrive."""
  env = {"env_vars": {"RDT_JAX_WEIGHT_DEVICE_PACK": setting}}
  trainer = Trainer.options(runtime_env=env).remote(2, device_pack)
  generator = Generator.remote("torch")
  try:
    handle, device_packed = ray.get(trainer.publish.remote(1), timeout=120)
    assert device_packed == packed and (handle.ref is None) == packed, (handle, device_packed)
    same, _, pulled, _, route = ray.get(generator.pull.remote(handle), timeout=120)
    assert same and pulled == 1 and route == ("cuda_ipc" if packed else "ray"), route
  finally:
    ray.kill(trainer)
    ray.kill(generator)


@pytest.mark.parametrize("kind", ["jax", "atomic"])
def test_other_templates_pull_the_device_version_through_ray(gpu_ray, kind):
  trainer, generator = Trainer.remote(2), Generator.remote(kind)
  try:
    for version in (1, 2, 3):
      handle, _ = ray.get(trainer.publish.remote(version), timeout=120)
      same, _, pulled, _, route = ray.get(generator.pull.remote(handle), timeout=120)
      assert same and pulled == version and route == "ray"
  finally:
    ray.kill(trainer)
    ray.kill(generator)


@pytest.mark.parametrize("kind", ["torch", "jax"])
def test_a_dropped_device_version_is_stale_on_both_routes(gpu_ray, kind):
  trainer, generator = Trainer.remote(1), Generator.remote(kind)
  try:
    old, _ = ray.get(trainer.publish.remote(1), timeout=120)
    ray.get(trainer.publish.remote(2), timeout=120)
    said = ray.get(generator.pull_error.remote(old), timeout=120)
    assert said.startswith("stale"), said
  finally:
    ray.kill(trainer)
    ray.kill(generator)


def test_an_engine_of_cuda_tensors_maps_the_device_version(gpu_ray):
  trainer, generator = Trainer.remote(2), Generator.remote("mapped")
  try:
    for version in (1, 2, 3):
      handle, _ = ray.get(trainer.publish.remote(version), timeout=120)
      same, pulled, route = ray.get(generator.pull_mapped.remote(handle), timeout=120)
      assert same and pulled == version and route == "ray", (same, pulled, route)
  finally:
    ray.kill(trainer)
    ray.kill(generator)
