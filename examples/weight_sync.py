"""RL-style weight sync: a JAX trainer publishes versions, generators pull them.

The trainer holds its parameters sharded over 4 (forced host) devices and
publishes each step's parameters with `rdt_jax.WeightPublisher`; it hands the
small `WeightsHandle` to the generators. A torch generator pulls every version
into its own tensors in place (an inference engine's parameters); a JAX
generator pulls them onto a 2-device mesh of its own. Midway the torch
generator is killed; a new one joins and pulls the next version. Every pull
is checked bit for bit against the trainer's bytes.

Run:  python examples/weight_sync.py [--steps 4] [--mb 8]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import ray

import rdt_jax

rdt_jax.register()


def digest(tree) -> str:
  """sha256 over every leaf's bytes (typed keys by their key data)."""
  import jax
  import numpy as np

  h = hashlib.sha256()
  for x in jax.tree_util.tree_leaves(tree):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    h.update(np.ascontiguousarray(rdt_jax.to_numpy(x)).tobytes())
  return h.hexdigest()


def noisy_step(layers: dict, key):
  """A pretend training step: every weight moves by the same random amount."""
  import jax

  return jax.tree_util.tree_map(lambda x: x + jax.random.uniform(key), layers)


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self, mb: int, layers: int = 4):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rows = (mb << 20) // 4 // layers // 1024
    shard = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data", None))
    self.params = {
        f"layer{i}": {"w": jax.device_put(jnp.zeros((rows, 1024)), shard), "b": jnp.zeros(1024)}
        for i in range(layers)
    }
    self.params["rng"] = jax.random.key(0)
    self.update = jax.jit(noisy_step)  # built once: jax compiles it at the first step only
    self.publisher = rdt_jax.WeightPublisher(transport="jax_nixl", keep=2)
    self.version = 0

  def shapes(self) -> dict:
    import jax

    return jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), self.params)

  def step(self) -> tuple[rdt_jax.WeightsHandle, str]:
    """One (pretend) training step; publishes the new parameters."""
    import jax

    self.params["rng"], key = jax.random.split(self.params["rng"])
    layers = {k: v for k, v in self.params.items() if k != "rng"}
    self.params.update(self.update(layers, key))
    self.version += 1
    return self.publisher.publish(self.params, version=self.version), digest(self.params)


@ray.remote(enable_tensor_transport=True)
class TorchGenerator:
  """An inference engine's torch parameters, updated in place."""

  def __init__(self, shapes: dict):
    import jax
    import torch

    self.params = {
        name: {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, (shape, dt) in layer.items()}
        for name, layer in shapes.items() if name != "rng"
    }
    self.params["rng"] = jax.random.key(0)  # a typed key arrives as a typed key
    self.subscriber = rdt_jax.WeightSubscriber(self.params)

  def pull(self, handle: rdt_jax.WeightsHandle) -> tuple[int | None, str, bool]:
    w = self.params["layer0"]["w"]
    params = self.subscriber.pull(handle)
    return self.subscriber.version, digest(params), params["layer0"]["w"] is w


@ray.remote(enable_tensor_transport=True)
class JaxGenerator:
  """A JAX sampler on a 2-device mesh of its own: columns split, not rows."""

  def __init__(self, shapes: dict):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    columns, replicated = NamedSharding(mesh, PartitionSpec(None, "model")), NamedSharding(mesh, PartitionSpec())
    template = {name: {"w": columns, "b": replicated} for name in shapes if name != "rng"}
    template["rng"] = jax.random.key(0)
    self.subscriber = rdt_jax.WeightSubscriber(template)

  def pull(self, handle: rdt_jax.WeightsHandle) -> tuple[int | None, str, bool]:
    params = self.subscriber.pull(handle)
    return self.subscriber.version, digest(params), len(params["layer0"]["w"].sharding.device_set) == 2


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--mb", type=int, default=8, help="parameter size in MiB")
  args = parser.parse_args(argv)

  ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")

  def devices(n: int) -> dict:
    return {"env_vars": {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}}

  # docs: begin sync-loop
  trainer = Trainer.options(runtime_env=devices(4)).remote(args.mb)
  shapes = ray.get(trainer.shapes.remote())
  torch_gen = TorchGenerator.remote(shapes)
  jax_gen = JaxGenerator.options(runtime_env=devices(2)).remote(shapes)
  for step in range(1, args.steps + 1):
    if step == 2:
      ray.kill(torch_gen)  # a generator dies...
    if step == 3:
      torch_gen = TorchGenerator.remote(shapes)  # ...and a new one joins
    t0 = time.perf_counter()
    handle, want = ray.get(trainer.step.remote())
    gens = [jax_gen] if step == 2 else [torch_gen, jax_gen]
    results = ray.get([g.pull.remote(handle) for g in gens])
    elapsed = time.perf_counter() - t0
    assert all(version == handle.version and got == want and ok for version, got, ok in results), results
    print(f"version {handle.version}: {len(gens)} generator(s) hold it bit for bit ({elapsed:.3f} s)")
  # docs: end sync-loop
  ray.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
