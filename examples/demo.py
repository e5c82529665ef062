"""rdt_jax demo: a JAX learner sends its parameters to two workers, three ways.

Starts a local Ray, creates a "learner" actor holding a pytree of parameters
(256 MiB in 48 leaves by default; on the GPU where Ray sees one) and two
"worker" actors, then moves the parameters to both workers over each path,
the paths interleaved round by round:

* `jax_nixl` (rdt_jax): the learner's method returns the pytree under
  `@ray.method(tensor_transport="jax_nixl")`; only metadata goes through Ray,
  the workers read the bytes straight from the learner's memory and receive
  `jax.Array`s;
* Ray's object store with the same `jax.Array`s: copied to host, pickled,
  stored and rebuilt on each worker;
* Ray's object store with NumPy arrays (the learner converted them once,
  beforehand): stored once in shared memory, which every worker on the node
  maps without a copy. On one host this is the path to beat for host arrays.

What is timed: from the learner's method call until both workers hold the
arrays and have read every byte (a CRC-32 of each leaf, which also checks it
against the learner's: any wrong or misplaced byte fails the run). The CRC's
own share is printed beside it.

Run:  python examples/demo.py [--mb 256] [--leaves 48] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib

import numpy as np
import ray

import rdt_jax

# Before defining classes: @ray.method validates the transport name.
rdt_jax.register()


def crc(x) -> int:
  """CRC-32 of every byte of an array (jax, torch or NumPy), in order."""
  host = np.ascontiguousarray(rdt_jax.to_numpy(x))
  return zlib.crc32(memoryview(host.reshape(-1).view(np.uint8)))


def type_name(x) -> str:
  """What a leaf arrives as, in the words users write: `jax.Array`, ..."""
  if isinstance(x, np.ndarray):
    return "np.ndarray"
  import jax

  return "jax.Array" if isinstance(x, jax.Array) else type(x).__name__


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
  return jax.block_until_ready(params)


@ray.remote(enable_tensor_transport=True)
class Learner:
  def __init__(self, total_mb: int, leaves: int):
    import jax

    self.params = make_params(total_mb, leaves)
    self.numpy_params = jax.tree_util.tree_map(np.asarray, self.params)

  def summary(self) -> tuple[int, int, str, dict]:
    import jax

    flat = jax.tree_util.tree_leaves(self.params)
    device = flat[0].devices().pop().platform
    return len(flat), sum(x.nbytes for x in flat), device, jax.tree_util.tree_map(crc, self.params)

  @ray.method(tensor_transport="jax_nixl")
  def params_rdt(self) -> dict:
    return self.params

  def params_object_store(self) -> dict:
    return self.params

  def params_numpy(self) -> dict:
    return self.numpy_params


@ray.remote(enable_tensor_transport=True)
class Worker:
  def receive(self, params: dict) -> tuple[str, dict, float]:
    """What the leaves arrived as, their CRCs, and the seconds the CRCs took."""
    import jax

    start = time.perf_counter()
    sums = jax.tree_util.tree_map(crc, params)
    elapsed = time.perf_counter() - start
    kinds = {type_name(x) for x in jax.tree_util.tree_leaves(params)}
    return ",".join(sorted(kinds)), sums, elapsed


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


PATHS = ("jax_nixl (rdt_jax)", "object store, jax.Array", "object store, NumPy")


def run(args: argparse.Namespace) -> int:
  ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
  share = {"num_gpus": 1 / 3} if ray.cluster_resources().get("GPU", 0) >= 1 else {}
  progress = Progress(2 + len(PATHS) * args.rounds)
  learner = Learner.options(**share).remote(args.mb, args.leaves)
  workers = [Worker.options(**share).remote() for _ in range(2)]
  n_leaves, nbytes, device, expected = ray.get(learner.summary.remote())
  ray.get([w.receive.remote({}) for w in workers])  # workers up
  progress.step(f"learner holds {n_leaves} leaves, {nbytes / 2**20:.0f} MiB on {device}")

  methods = dict(zip(PATHS, (learner.params_rdt, learner.params_object_store, learner.params_numpy)))
  # One warm-up transfer per path (agents, connections, first allocations).
  for method in methods.values():
    ray.get([w.receive.remote(method.remote()) for w in workers])
  progress.step("warm-up done")

  times: dict[str, list[float]] = {name: [] for name in PATHS}
  crc_times: dict[str, list[float]] = {name: [] for name in PATHS}
  kinds: dict[str, str] = {}
  for r in range(args.rounds):
    order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]  # each path leads in turn
    for name in order:
      t0 = time.perf_counter()
      ref = methods[name].remote()
      results = ray.get([w.receive.remote(ref) for w in workers])
      elapsed = time.perf_counter() - t0
      del ref
      for kind, sums, _crc_s in results:
        if sums != expected:
          print(f"MISMATCH on {name}: received bytes differ from the learner's", file=sys.stderr)
          return 1
        kinds[name] = kind
      times[name].append(elapsed)
      crc_times[name].append(max(crc_s for _, _, crc_s in results))
      progress.step(f"round {r + 1}: {name:<24} {elapsed:.3f} s, verified")

  moved = 2 * nbytes
  print(f"\nMoved {n_leaves} leaves, {nbytes / 2**20:.0f} MiB on {device}, from 1 learner to 2 workers "
        f"({moved / 2**20:.0f} MiB per round), {args.rounds} rounds per path, every byte verified.")
  print("Timed: method call until both workers hold the arrays and have read every byte (CRC-32).\n")
  print(f"{'path':<26}{'arrives as':<12}{'median s':>9}{'min s':>8}{'max s':>8}{'of which CRC':>13}"
        f"{'without CRC':>12}{'GB/s':>7}")
  medians, bare = {}, {}
  for name in PATHS:
    ts = times[name]
    medians[name] = med = statistics.median(ts)
    bare[name] = statistics.median(t - c for t, c in zip(ts, crc_times[name]))
    print(f"{name:<26}{kinds[name]:<12}{med:>9.3f}{min(ts):>8.3f}{max(ts):>8.3f}"
          f"{statistics.median(crc_times[name]):>13.3f}{bare[name]:>12.3f}{moved / med / 1e9:>7.2f}")
  nixl, nixl_bare = medians[PATHS[0]], bare[PATHS[0]]
  print(f"\nObject store's median over jax_nixl's: {medians[PATHS[1]] / nixl:.2f}x with jax.Array, "
        f"{medians[PATHS[2]] / nixl:.2f}x with NumPy; without the CRC, {bare[PATHS[1]] / nixl_bare:.2f}x and "
        f"{bare[PATHS[2]] / nixl_bare:.2f}x (above 1: jax_nixl is faster).")
  print("When to use which: jax_nixl for jax.Arrays (or mixed jax/torch pytrees) of a few megabytes or more, "
        "and for device arrays; for host NumPy arrays on one machine, Ray's object store.")
  ray.shutdown()
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mb", type=int, default=256, help="total parameter size in MiB")
  parser.add_argument("--leaves", type=int, default=48, help="number of leaves")
  parser.add_argument("--rounds", type=int, default=7, help="timed rounds per path")
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
