"""Weight sync from a trainer that spans processes: every process of a
multi-controller JAX trainer publishes its shards of each version, and a
generator pulls the whole version from all of them at once.

Two Ray actors form one JAX program (`jax.distributed`, CPU collectives
through gloo, two CPU devices each): the parameters are global arrays
sharded over all four devices, and each step is one jitted function over
them. Every step, each trainer process calls `WeightPublisher.publish` on
the same tree; the handles meet in a named collector actor, which combines
them (`WeightsHandle.combine`) into the version's one handle. A torch
generator and a tensor-parallel generator (its half of each matrix's rows)
ask the collector for the newest version and pull it.

On a real cluster the trainer's processes are on different hosts (one per
host); the code is the same. Each generator's pulled bytes are checked
against the global arrays gathered from the trainer.

Run:  python examples/weight_sync_multihost.py [--steps 3]
"""

from __future__ import annotations

import argparse
import socket
import sys

import numpy as np
import ray

import rdt_jax

rdt_jax.register()

PROCESSES = 2
SHAPES = {"dense": (64, 32), "bias": (32,), "out": (32, 16)}


@ray.remote(enable_tensor_transport=True)
class TrainerProcess:
  """One process of the multi-controller trainer."""

  def __init__(self, process: int, coordinator: str):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=PROCESSES, process_id=process)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))  # every process's devices
    specs = {"dense": P("x", None), "bias": P(), "out": P(None, "x")}
    self.params = {
        name: jax.make_array_from_callback(
            shape, NamedSharding(mesh, specs[name]),
            lambda index, shape=shape: np.ones(shape, np.float32)[index] * 0.01)
        for name, shape in SHAPES.items()
    }
    self.step_fn = jax.jit(lambda p, lr: jax.tree_util.tree_map(lambda x: x - lr * (x * x - 0.5), p))
    self.pub = rdt_jax.WeightPublisher(keep=2)
    self.collector = ray.get_actor("weights-collector")

  def train_step(self, version: int) -> None:
    """One optimizer step of the global program, then this process's part
    of the version, sent to the collector."""
    self.params = self.step_fn(self.params, 0.1)
    handle = self.pub.publish(self.params, version=version)
    ray.get(self.collector.add.remote(handle))

  def gathered(self) -> dict:
    """The parameters' global bytes (a collective: every process calls it)."""
    from jax.experimental import multihost_utils

    return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in self.params.items()}


@ray.remote
class Collector:
  """Where the trainer's processes leave their handles, and generators find
  the newest complete version."""

  def __init__(self):
    self.parts: dict[int, list] = {}
    self.newest: rdt_jax.WeightsHandle | None = None

  def add(self, handle: rdt_jax.WeightsHandle) -> None:
    parts = self.parts.setdefault(handle.version, [])
    parts.append(handle)
    if len(parts) == PROCESSES:
      self.newest = rdt_jax.WeightsHandle.combine(self.parts.pop(handle.version))

  def latest(self) -> rdt_jax.WeightsHandle | None:
    return self.newest


@ray.remote(enable_tensor_transport=True)
class Generator:
  """An engine of torch tensors: the whole model, or one tensor-parallel
  rank's rows of each matrix."""

  def __init__(self, rank: int | None = None):
    import torch

    if rank is None:
      template = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    else:  # rank of 2: its half of the rows of each matrix, all of the bias
      template = {"dense": rdt_jax.Slice[32 * rank:32 * (rank + 1)], "bias": torch.zeros(32),
                  "out": rdt_jax.Slice[16 * rank:16 * (rank + 1)]}
    self.rank = rank
    self.sub = rdt_jax.WeightSubscriber(template)
    self.collector = ray.get_actor("weights-collector")

  def refresh(self) -> dict:
    handle = ray.get(self.collector.latest.remote())
    params = self.sub.pull(handle)
    return {name: np.asarray(x) for name, x in params.items()}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args(argv)
  ray.init(address="local", include_dashboard=False, num_cpus=6, log_to_driver=False)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    coordinator = f"127.0.0.1:{s.getsockname()[1]}"
  collector = Collector.options(name="weights-collector").remote()
  ray.get(collector.latest.remote())  # it runs: the actors below find it by name
  flags = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}
  trainer = [TrainerProcess.options(runtime_env=flags).remote(i, coordinator) for i in range(PROCESSES)]
  whole, tp = Generator.remote(), [Generator.remote(rank) for rank in range(2)]
  for version in range(1, args.steps + 1):
    ray.get([p.train_step.remote(version) for p in trainer])
    truth = ray.get([p.gathered.remote() for p in trainer])[0]
    got = ray.get(whole.refresh.remote())
    ranks = ray.get([g.refresh.remote() for g in tp])
    same = all(np.array_equal(got[k], truth[k]) for k in SHAPES)
    same_tp = all(np.array_equal(np.concatenate([r[k] for r in ranks]), truth[k]) for k in ("dense", "out"))
    handle = ray.get(collector.latest.remote())
    print(f"version {version}: {len(handle.parts)} trainer processes; whole model bit for bit: {same}; "
          f"two tensor-parallel ranks bit for bit: {same_tp}")
    if not (same and same_tp):
      return 1
  ray.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
