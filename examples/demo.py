"""rdt_jax demo: a JAX learner sends its parameters to two workers.

Starts a local Ray, creates a "learner" actor holding a pytree of parameters
(a few hundred MB in several dozen leaves) and two "worker" actors, then moves
the parameters to both workers twice per round, side by side:

* over `jax_nixl` (the learner returns the pytree from a method decorated with
  `@ray.method(tensor_transport="jax_nixl")`; only metadata goes through Ray,
  the workers read the bytes directly), and
* through Ray's object store (the same method without `tensor_transport`: the
  jax arrays are copied to host, pickled, stored and copied back).

Each worker checks every leaf bit for bit against the learner's checksums.

Run:  python examples/demo.py [--mb 256] [--leaves 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import ray

import rdt_jax

# Before defining classes: @ray.method validates the transport name.
rdt_jax.register()


def checksum(x) -> int:
  """XOR of the array's 32-bit words: cheap, exact, framework-neutral."""
  words = np.ascontiguousarray(rdt_jax.to_numpy(x)).reshape(-1).view(np.uint32)
  return int(np.bitwise_xor.reduce(words)) if words.size else 0


def make_params(total_mb: int, leaves: int) -> dict:
  import jax
  import jax.numpy as jnp

  per_layer = max(1, leaves // 2)
  width = int(np.sqrt(total_mb * (1 << 20) / 4 / per_layer))
  params = {}
  key = jax.random.key(0)
  for i in range(per_layer):
    key, sub = jax.random.split(key)
    params[f"layer_{i:02d}"] = {
        "w": jax.random.normal(sub, (width, width), jnp.float32),
        "b": jnp.full((width,), i, jnp.float32),
    }
  return params


@ray.remote(enable_tensor_transport=True)
class Learner:
  def __init__(self, total_mb: int, leaves: int):
    self.params = make_params(total_mb, leaves)
    self.params = {
        k: {n: v.block_until_ready() for n, v in layer.items()} for k, layer in self.params.items()
    }

  def summary(self) -> tuple[int, int, dict]:
    import jax

    flat = jax.tree_util.tree_leaves(self.params)
    sums = jax.tree_util.tree_map(checksum, self.params)
    return len(flat), sum(x.nbytes for x in flat), sums

  @ray.method(tensor_transport="jax_nixl")
  def params_rdt(self) -> dict:
    return self.params

  def params_object_store(self) -> dict:
    return self.params


@ray.remote(enable_tensor_transport=True)
class Worker:
  def receive(self, params: dict) -> tuple[str, dict]:
    import jax

    kinds = {type(x).__name__ for x in jax.tree_util.tree_leaves(params)}
    return ",".join(sorted(kinds)), jax.tree_util.tree_map(checksum, params)


class Progress:
  """A one-line progress display on stderr."""

  def __init__(self, total: int):
    self.total, self.done = total, 0
    self.tty = sys.stderr.isatty()

  def step(self, message: str) -> None:
    self.done += 1
    bar = "#" * (20 * self.done // self.total)
    line = f"[{bar:<20}] {self.done}/{self.total} {message}"
    end = "\r" if self.tty and self.done < self.total else "\n"
    print(f"{line:<78}", end=end, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
  ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
  progress = Progress(2 + 2 * args.rounds)
  learner = Learner.remote(args.mb, args.leaves)
  workers = [Worker.remote() for _ in range(2)]
  n_leaves, nbytes, expected = ray.get(learner.summary.remote())
  ray.get([w.receive.remote({}) for w in workers])  # workers up
  progress.step(f"learner holds {n_leaves} leaves, {nbytes / 2**20:.0f} MiB")

  paths = {
      "jax_nixl (rdt_jax)": learner.params_rdt,
      "Ray object store": learner.params_object_store,
  }
  # One warm-up transfer per path (agents, connections, first allocations).
  for method in paths.values():
    ray.get([w.receive.remote(method.remote()) for w in workers])
  progress.step("warm-up done")

  times: dict[str, list[float]] = {name: [] for name in paths}
  kinds: dict[str, str] = {}
  for r in range(args.rounds):
    for name, method in (paths.items() if r % 2 == 0 else reversed(paths.items())):
      t0 = time.perf_counter()
      ref = method.remote()
      results = ray.get([w.receive.remote(ref) for w in workers])
      elapsed = time.perf_counter() - t0
      del ref
      for kind, sums in results:
        if sums != expected:
          print(f"MISMATCH on {name}: received values differ", file=sys.stderr)
          return 1
        kinds[name] = kind
      times[name].append(elapsed)
      progress.step(f"round {r + 1}: {name:<20} {elapsed:.3f} s, verified")

  moved = 2 * nbytes
  print(f"\nMoved {n_leaves} leaves, {nbytes / 2**20:.0f} MiB, from 1 learner to 2 workers "
        f"({moved / 2**20:.0f} MiB per round), {args.rounds} rounds, every leaf verified.\n")
  print(f"{'path':<22}{'arrives as':<12}{'median s':>10}{'min s':>9}{'GB/s':>8}")
  base = statistics.median(times["Ray object store"])
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f"{name:<22}{kinds[name]:<12}{med:>10.3f}{min(ts):>9.3f}{moved / med / 1e9:>8.2f}")
  speedup = base / statistics.median(times["jax_nixl (rdt_jax)"])
  print(f"\njax_nixl is {speedup:.1f}x faster than the object store for this pytree.")
  ray.shutdown()
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mb", type=int, default=256, help="total parameter size in MiB")
  parser.add_argument("--leaves", type=int, default=48, help="number of leaves")
  parser.add_argument("--rounds", type=int, default=3, help="timed rounds per path")
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
