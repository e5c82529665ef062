"""A JAX -> PyTorch -> JAX pipeline and a sharded round trip over jax_nixl.

Three actors, each working in its own framework, pass one pytree along:

1. a JAX actor makes parameters (jax arrays, a torch tensor and a numpy array
   mixed in one pytree) and returns them over `jax_nixl`;
2. a PyTorch actor calls `rdt_jax.receive_as("torch")`, so every leaf arrives
   as a `torch.Tensor`; it updates them with torch ops and returns them;
3. a JAX actor (`receive_as("jax")`) receives jax arrays and checks the values.

Then a `jax.Array` sharded over 4 cpu devices (a 2x2 mesh) goes to an actor
with 4 devices and arrives with the same mesh shape, axis names and partition
spec, shard by shard, without being gathered.

Run:  python examples/pipeline.py
"""

from __future__ import annotations

import sys

import numpy as np
import ray

import rdt_jax

rdt_jax.register()  # before classes with @ray.method(tensor_transport=...)

FOUR_CPU_DEVICES = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}}


@ray.remote(enable_tensor_transport=True)
class JaxStage:
  def __init__(self):
    rdt_jax.receive_as("jax")

  @ray.method(tensor_transport="jax_nixl")
  def init_params(self):
    import jax.numpy as jnp
    import torch

    return {
        "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
        "b": jnp.ones(4, jnp.bfloat16),
        "scale": torch.tensor([2.0]),
        "mask": np.array([True, False, True]),
        "step": 0,
    }

  def check(self, params) -> dict:
    import jax

    kinds = {type(x).__name__ for x in jax.tree_util.tree_leaves(params) if hasattr(x, "shape")}
    host = rdt_jax.to_numpy(params)
    return {"kinds": sorted(kinds), "w": host["w"].tolist(), "step": params["step"]}

  @ray.method(tensor_transport="jax_nixl")
  def sharded(self):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8)
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", "model")))

  def describe_sharding(self, x) -> tuple:
    s = x.sharding
    return dict(s.mesh.shape), tuple(s.spec), float(x.sum())


@ray.remote(enable_tensor_transport=True)
class TorchStage:
  def __init__(self):
    rdt_jax.receive_as("torch")

  @ray.method(tensor_transport="jax_nixl")
  def train_step(self, params):
    import torch

    assert all(isinstance(params[k], torch.Tensor) for k in ("w", "b", "scale", "mask"))
    params["w"] = params["w"] * params["scale"] + 1  # torch ops on received leaves
    params["step"] += 1
    return params


def main() -> int:
  ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
  # docs: begin three-hop
  first, torch_stage, last = JaxStage.remote(), TorchStage.remote(), JaxStage.remote()
  params = first.init_params.remote()                 # jax actor -> ...
  updated = torch_stage.train_step.remote(params)     # ... torch actor -> ...
  result = ray.get(last.check.remote(updated))         # ... jax actor
  expected = (np.arange(12, dtype=np.float32).reshape(3, 4) * 2 + 1).tolist()
  assert result["w"] == expected, result
  assert result["kinds"] == ["ArrayImpl"] and result["step"] == 1, result
  print(
      f"JAX -> PyTorch -> JAX: leaves arrived as {result['kinds']}, w updated, "
      f"step {result['step']}"
  )
  # docs: end three-hop

  # docs: begin sharded
  producer = JaxStage.options(runtime_env=FOUR_CPU_DEVICES).remote()
  consumer = JaxStage.options(runtime_env=FOUR_CPU_DEVICES).remote()
  mesh, spec, total = ray.get(consumer.describe_sharding.remote(producer.sharded.remote()))
  assert mesh == {"data": 2, "model": 2} and spec == ("data", "model") and total == 2016.0
  print(f"sharded round trip: mesh {mesh}, spec {spec}, sum {total}")
  # docs: end sharded
  ray.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
