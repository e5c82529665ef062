"""What the producer checks around a node-local copy cost a small weight pull.

One actor publishes a 4 KiB version (`WeightPublisher`) and pulls it into a
torch tensor (`WeightSubscriber`) on the same host, so every pull is a
node-local copy with its liveness checks of the publisher's process. Rounds
alternate between the two ways `rdt_jax._process.alive` answers: through a
pidfd (the default where pidfds exist) and by reading `/proc/<pid>/stat` at
every check. Prints the median pull time of each.

Usage:
  python scripts/pull_checks.py [--rounds 20] [--pulls 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray

import rdt_jax


@ray.remote(enable_tensor_transport=True)
class _Puller:
  def run(self, rounds: int, pulls: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import torch

    from rdt_jax import _process

    rdt_jax.register()
    publisher = rdt_jax.WeightPublisher(keep=2)
    subscriber = rdt_jax.WeightSubscriber([torch.empty(1024)])
    step = jax.jit(lambda p: [x + 1 for x in p])
    params = [jnp.arange(1024, dtype=jnp.float32)]
    pidfds = _process._pidfd_works[0]
    times: dict[str, list[float]] = {"pidfd": [], "/proc": []}
    version = 0
    try:
      for _ in range(rounds):
        for way in times:
          _process._pidfd_works[0] = pidfds and way == "pidfd"
          _process.forget_watched()  # forget what the other way watched
          for _ in range(pulls):
            params = jax.block_until_ready(step(params))
            handle = publisher.publish(params, version)
            version += 1
            t0 = time.perf_counter()
            subscriber.pull(handle)
            times[way].append(time.perf_counter() - t0)
    finally:
      _process._pidfd_works[0] = pidfds
    return {way: statistics.median(t) * 1e3 for way, t in times.items() if t}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--pulls", type=int, default=20)
  args = parser.parse_args()
  ray.init(include_dashboard=False, log_to_driver=False)
  try:
    result = ray.get(_Puller.remote().run.remote(args.rounds, args.pulls))
  finally:
    ray.shutdown()
  print(f"# 4 KiB weight pull on the publisher's host, {args.rounds} rounds x {args.pulls} pulls per way, "
        "ways alternating")
  for way, ms in result.items():
    print(f"{way:>6}: median pull {ms:.3f} ms")


if __name__ == "__main__":
  main()
