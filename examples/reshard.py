"""Resharding on receive: an 8-device trainer feeds two tensor-parallel generators.

The trainer shards every weight FSDP-style over 8 (forced cpu) devices. The
generator is tensor-parallel over two processes: rank 0 runs JAX on two
devices of its own, rank 1 runs PyTorch. Each rank asks, with
`rdt_jax.set_target_for_ref`, for its slice of every weight only
(`rdt_jax.Slice`): columns of the column-parallel `wq`, rows of the
row-parallel `wo`, and all of the small bias. Rank 0 also lays its slice over
its two devices with a `NamedSharding` of its own. Over `jax_nixl` each rank
reads only its bytes, straight from the trainer's 8 shards.

The check: both ranks' slices, put back together, equal the trainer's
gathered weights bit for bit; each rank moved half of the large weights.

Run:  python examples/reshard.py [--width 512] [--steps 2]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import ray

import rdt_jax

rdt_jax.register()

EIGHT_CPU_DEVICES = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}}
TWO_CPU_DEVICES = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}


@ray.remote(enable_tensor_transport=True)
class Trainer:
  """Weights sharded over an 8-device mesh (axis "fsdp")."""

  def __init__(self, width: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    rows = NamedSharding(mesh, PartitionSpec("fsdp", None))
    key = jax.random.PRNGKey(0)
    self.params = {
        "wq": jax.device_put(jax.random.normal(key, (width, 2 * width)), rows),
        "wo": jax.device_put(jax.random.normal(key, (2 * width, width)), rows),
        "b": jax.device_put(jnp.arange(width, dtype=jnp.float32), NamedSharding(mesh, PartitionSpec())),
    }

  def step(self) -> list:
    """One (pretend) training step; returns [ref] to the new weights."""
    import jax

    self.params = jax.tree_util.tree_map(lambda x: x * 0.5 + 1.0, self.params)
    # A list keeps Ray from resolving the ref before the generators see it.
    return [ray.put(self.params, _tensor_transport="jax_nixl")]

  def gathered(self) -> dict:
    return {k: np.asarray(v) for k, v in self.params.items()}


@ray.remote(enable_tensor_transport=True)
class Generator:
  """One tensor-parallel rank of a 2-way generator."""

  def __init__(self, rank: int, world: int, framework: str):
    self.rank, self.world, self.framework = rank, world, framework
    rdt_jax.receive_as(framework)

  # docs: begin slice
  def targets(self, width: int) -> dict:
    """This rank's part of every weight: what it asks the trainer for."""
    r, k = self.rank, 2 * width // self.world
    wq = rdt_jax.Slice[:, r * k : (r + 1) * k]  # column-parallel
    wo = rdt_jax.Slice[r * k : (r + 1) * k, :]  # row-parallel
    if self.framework == "jax":  # lay the slices over this process's 2 devices
      import jax
      from jax.sharding import Mesh, NamedSharding, PartitionSpec

      mesh = Mesh(np.array(jax.local_devices()[:2]), ("tp",))
      wq = rdt_jax.Slice(wq.index, into=NamedSharding(mesh, PartitionSpec(None, "tp")))
      wo = rdt_jax.Slice(wo.index, into=NamedSharding(mesh, PartitionSpec("tp", None)))
    return {"wq": wq, "wo": wo, "b": rdt_jax.Slice[:]}

  def sync(self, refs: list, width: int) -> tuple[dict, dict, dict]:
    rdt_jax.set_target_for_ref(refs[0], self.targets(width))
    params = ray.get(refs[0])  # only this rank's bytes cross
    # docs: end slice
    from ray.experimental.rdt.util import get_tensor_transport_manager

    stats = get_tensor_transport_manager("JAX_NIXL").receive_stats(reset=True)
    kinds = {k: "jax" if type(v).__module__.startswith("jax") else type(v).__module__ for k, v in params.items()}
    return rdt_jax.to_numpy(params), kinds, stats


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--steps", type=int, default=2)
  args = parser.parse_args(argv)
  width = args.width

  ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
  trainer = Trainer.options(runtime_env=EIGHT_CPU_DEVICES).remote(width)
  gens = [
      Generator.options(runtime_env=TWO_CPU_DEVICES).remote(0, 2, "jax"),
      Generator.remote(1, 2, "torch"),
  ]
  full_bytes = (2 * width * width * 2 + width) * 4
  ok = True
  for step in range(args.steps):
    refs = ray.get(trainer.step.remote())
    (p0, kinds0, s0), (p1, kinds1, s1) = ray.get([g.sync.remote(refs, width) for g in gens])
    want = ray.get(trainer.gathered.remote())
    same = (
        np.array_equal(np.concatenate([p0["wq"], p1["wq"]], axis=1), want["wq"])
        and np.array_equal(np.concatenate([p0["wo"], p1["wo"]], axis=0), want["wo"])
        and np.array_equal(p0["b"], want["b"])
        and np.array_equal(p1["b"], want["b"])
    )
    ok &= same
    print(f"step {step}: slices equal the gathered weights bit for bit: {same}")
    for rank, kinds, stats in ((0, kinds0, s0), (1, kinds1, s1)):
      print(
          f"  rank {rank} ({kinds['wq']}): moved {stats['bytes']} of {full_bytes} bytes "
          f"({stats['bytes'] / full_bytes:.0%}), {stats['descriptors']} descriptors"
      )
  ray.shutdown()
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
