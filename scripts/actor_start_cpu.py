"""CPU time of a Ray worker that starts as an actor and moves one small
`jax_nixl` object (producer and consumer), and whether torch got imported:
what an actor that only moves jax arrays pays to start.

  python scripts/actor_start_cpu.py [--pairs N]

Starts N producer/consumer pairs one after the other on a local Ray (2 CPUs),
each pair moving a 10-element jax array; prints each worker's CPU seconds
(user + system, its whole life so far, imports included), their median, and
whether any worker imported torch. The rdt_jax measured is the one first on
PYTHONPATH (the workers get the same PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pairs", type=int, default=5, help="producer/consumer pairs, one after the other")
  args = parser.parse_args()

  import jax.numpy as jnp
  import ray

  import rdt_jax

  rdt_jax.register()
  ray.init(num_cpus=2, include_dashboard=False, logging_level="error",
           runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})

  @ray.remote(enable_tensor_transport=True)
  class Actor:
    @ray.method(tensor_transport="jax_nixl")
    def make(self, n: int) -> dict:
      return {"x": jnp.arange(n, dtype=jnp.float32)}

    def take(self, value: dict) -> float:
      return float(value["x"].sum())

    def cpu(self) -> tuple[float, bool]:
      import resource

      r = resource.getrusage(resource.RUSAGE_SELF)
      return r.ru_utime + r.ru_stime, "torch" in sys.modules

  seconds, torch_seen = [], set()
  for _ in range(args.pairs):
    producer, consumer = Actor.remote(), Actor.remote()
    assert ray.get(consumer.take.remote(producer.make.remote(10))) == 45.0
    for cpu, seen in ray.get([producer.cpu.remote(), consumer.cpu.remote()]):
      seconds.append(cpu)
      torch_seen.add(seen)
    ray.kill(producer)
    ray.kill(consumer)
  ray.shutdown()
  print("rdt_jax:", rdt_jax.__file__)
  print("worker CPU s:", " ".join(f"{s:.2f}" for s in seconds))
  print(f"median worker CPU: {statistics.median(seconds):.2f} s; torch imported in a worker: {sorted(torch_seen)}")


if __name__ == "__main__":
  main()
