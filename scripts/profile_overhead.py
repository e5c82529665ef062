"""Where the per-object and per-leaf time of an rdt_jax transport goes.

Runs `ray.put(tree, _tensor_transport=T)` in a producer actor and `ray.get`
of the ref in a consumer actor, for pytrees of several leaf counts with the
same payload, and reports per side (inside the actors) the time per object
and, with `--profile`, the functions that took it (cProfile, by own time).
The rest of the driver's end-to-end time is Ray's (task submission, the
owner's metadata, the return of the results).

Usage:
  python scripts/profile_overhead.py [--transport jax_nixl] [--leaves 1,1000,10000]
      [--bytes 67108864] [--one-bytes 4096] [--reps 7] [--profile] [--top 15]
      [--device cpu|gpu]

With `--device gpu` the leaves live on the GPU and both actors hold a share
of it (the consumer's read then includes a device-to-host copy per leaf).

Columns: the driver's end-to-end time; the producer's `ray.put`; the
consumer's `ray.get`; the consumer's read of every byte of what it got (a
checksum, through `np.asarray` per leaf: for a `jax.Array`, jax's cost of
exposing its buffer); and the rest (two actor calls, the owner's metadata,
the free of the object).

Wall-clock figures are only comparable within one run (the script interleaves
leaf counts per repetition); cProfile counts and shares are what to compare
across runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import numpy as np


def _tree(n: int, nbytes: int, device: str, seed: int = 0) -> dict:
  import jax

  where = jax.devices("gpu")[0] if device == "gpu" else jax.devices("cpu")[0]
  leaf = max(8, nbytes // n // 8 * 8)
  out = {}
  for i in range(n):
    x = np.arange(leaf // 4, dtype=np.int32) + (seed + i)
    out[f"l{i:05d}"] = jax.device_put(x, where)
  return jax.block_until_ready(out)


class Producer:
  def __init__(self) -> None:
    import rdt_jax

    rdt_jax.register()
    self.trees: dict[int, dict] = {}
    self.prof: dict[int, cProfile.Profile] = {}

  def build(self, n: int, nbytes: int, device: str) -> int:
    self.trees[n] = _tree(n, nbytes, device)
    return sum(int(np.asarray(x).astype(np.int64).sum()) for x in self.trees[n].values())

  def put(self, n: int, transport: str, profile: bool) -> tuple[list, float]:
    import ray

    tree = self.trees[n]
    prof = self.prof.setdefault(n, cProfile.Profile()) if profile else None
    t0 = time.perf_counter()
    if prof is not None:
      prof.enable()
    ref = ray.put(tree, _tensor_transport=transport)
    if prof is not None:
      prof.disable()
    return [ref], time.perf_counter() - t0

  def stats(self, n: int, top: int) -> str:
    return _format(self.prof.get(n), top)


class Consumer:
  def __init__(self) -> None:
    import rdt_jax

    rdt_jax.register()
    self.prof: dict[int, cProfile.Profile] = {}

  def get(self, refs: list, n: int, profile: bool) -> tuple[int, float]:
    import ray

    prof = self.prof.setdefault(n, cProfile.Profile()) if profile else None
    t0 = time.perf_counter()
    if prof is not None:
      prof.enable()
    value = ray.get(refs[0])
    if prof is not None:
      prof.disable()
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    checksum = sum(int(np.asarray(x).astype(np.int64).sum()) for x in value.values())
    return checksum, dt, time.perf_counter() - t1

  def stats(self, n: int, top: int) -> str:
    return _format(self.prof.get(n), top)


def _format(prof: cProfile.Profile | None, top: int) -> str:
  if prof is None:
    return ""
  s = io.StringIO()
  stats = pstats.Stats(prof, stream=s)
  stats.sort_stats("tottime").print_stats(top)
  lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
  site = os.path.dirname(os.path.dirname(np.__file__))
  return "\n".join(ln.replace(site + "/", "").replace(os.getcwd() + "/", "") for ln in lines[2:])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--transport", default="jax_nixl")
  p.add_argument("--leaves", default="1,1000,10000")
  p.add_argument("--bytes", type=int, default=64 << 20, help="payload of the trees of more than one leaf")
  p.add_argument("--one-bytes", type=int, default=4096, help="payload of the one-leaf object")
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--profile", action="store_true")
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
  args = p.parse_args()
  os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
  import ray

  import rdt_jax

  rdt_jax.register()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  gpus = 1 if args.device == "gpu" else 0
  path = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH", "")) if x)
  ray.init(
      num_cpus=2, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
      runtime_env={"env_vars": {"PYTHONPATH": path, "NIXL_LOG_LEVEL": "WARN",
                                "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}},
  )
  counts = [int(x) for x in args.leaves.split(",")]
  remote = ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
  share = 0.1 if gpus else 0
  prod = remote(Producer).options(num_cpus=0, num_gpus=share).remote()
  cons = remote(Consumer).options(num_cpus=0, num_gpus=share).remote()
  sizes = {n: (args.one_bytes if n == 1 else args.bytes) for n in counts}
  expected = {n: ray.get(prod.build.remote(n, sizes[n], args.device)) for n in counts}
  rows: dict[int, list[tuple[float, float, float, float]]] = {n: [] for n in counts}
  for rep in range(-1, args.reps):
    for n in counts[rep % len(counts):] + counts[: rep % len(counts)]:
      profile = args.profile and rep >= 0
      t0 = time.perf_counter()
      refs, t_put = ray.get(prod.put.remote(n, args.transport, profile))
      checksum, t_get, t_read = ray.get(cons.get.remote(refs, n, profile))
      e2e = time.perf_counter() - t0
      assert checksum == expected[n], (n, checksum, expected[n])
      del refs
      if rep >= 0:
        rows[n].append((e2e, t_put, t_get, t_read))
  med = {n: tuple(statistics.median(r[i] for r in rows[n]) for i in range(4)) for n in counts}
  print(f"# {args.transport} ({args.device}): medians of {args.reps} reps, load average {os.getloadavg()}")
  print(f"{'leaves':>7} {'bytes':>10} {'end-to-end':>11} {'producer put':>13} {'consumer get':>13} "
        f"{'consumer read':>14} {'rest':>11}")
  for n in counts:
    e2e, tp, tg, tr = med[n]
    rest = e2e - tp - tg - tr
    print(f"{n:>7} {sizes[n]:>10} {e2e * 1e3:>8.2f} ms {tp * 1e3:>10.2f} ms "
          f"{tg * 1e3:>10.2f} ms {tr * 1e3:>11.2f} ms {rest * 1e3:>8.2f} ms")
  big = [n for n in counts if sizes[n] == args.bytes]
  if len(big) >= 2:
    a, b = min(big), max(big)
    print(f"per added leaf ({a} -> {b} leaves, same bytes): " + ", ".join(
        f"{name} {(med[b][i] - med[a][i]) / (b - a) * 1e6:.2f} us"
        for i, name in ((0, "end-to-end"), (1, "producer"), (2, "consumer"), (3, "consumer read"))))
  if args.profile:
    for n in counts:
      print(f"\n## producer, {n} leaves, ray.put, cProfile over {args.reps} puts (own time)")
      print(ray.get(prod.stats.remote(n, args.top)))
      print(f"\n## consumer, {n} leaves, ray.get, cProfile over {args.reps} gets (own time)")
      print(ray.get(cons.stats.remote(n, args.top)))
  ray.shutdown()


if __name__ == "__main__":
  sys.exit(main())
