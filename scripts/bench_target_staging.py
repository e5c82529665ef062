"""What receiving into a caller's target costs on each read path.

A producer holds one numpy leaf; a consumer fetches it `--reps` times as a
new value and into a numpy target (`rdt_jax.set_target_for_ref`), read
node-locally (the default on one host) and through NIXL READs (node-local
reads refused with the `cma.read` fault point, as for a producer on another
host, where a READ into a target is staged in rdt_jax's memory and copied
into the target after it succeeded). Prints the median seconds per fetch.

    python scripts/bench_target_staging.py --mb 64 256 --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray

import rdt_jax

rdt_jax.register()  # before a class names the transport


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, nbytes: int):
    return {"x": np.full(nbytes, 7, np.uint8)}


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def time_fetches(self, refs, nbytes: int, reps: int, into: bool) -> float:
    target = np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(reps):
      if into:
        rdt_jax.set_target_for_ref(refs[0], {"x": target})
      t0 = time.perf_counter()
      value = ray.get(refs[0])
      times.append(time.perf_counter() - t0)
      assert value["x"][-1] == 7
      del value
    return statistics.median(times[1:])  # the first read connects


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mb", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--reps", type=int, default=7)
  args = parser.parse_args()
  ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="error")
  producer = Producer.remote()
  paths = {
      "node-local": Consumer.remote(),
      "NIXL READ": Consumer.options(runtime_env={"env_vars": {
          "RDT_JAX_FAULTS": "cma.read:fail", "RDT_JAX_FAULTS_ENABLE": "1"}}).remote(),
  }
  print(f"{'path':<12} {'MiB':>5} {'new value s':>12} {'into target s':>14} {'target / new':>13}")
  for mb in args.mb:
    ref = producer.make.remote(mb << 20)
    ray.wait([ref], fetch_local=False)
    for name, consumer in paths.items():
      new = ray.get(consumer.time_fetches.remote([ref], mb << 20, args.reps, False))
      into = ray.get(consumer.time_fetches.remote([ref], mb << 20, args.reps, True))
      print(f"{name:<12} {mb:>5} {new:>12.4f} {into:>14.4f} {into / new:>13.2f}")
    del ref
  ray.shutdown()


if __name__ == "__main__":
  main()
