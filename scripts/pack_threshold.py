"""Where packing a return's small jax leaves into one buffer starts to pay.

Two producer actors, one with packing on for every value
(`RDT_JAX_PACK_MIN_LEAVES=1`) and one with it off (`0`), return the same
pytrees of `jax.Array`s over `jax_nixl` to one consumer, which reads every
byte; the two are interleaved per repetition. Two sweeps:

* leaf count at a fixed small leaf size (where `RDT_JAX_PACK_MIN_LEAVES`
  belongs), and
* leaf size at a fixed leaf count (where `_limits.PACK_MAX_CHUNK` belongs:
  a packed leaf is copied once more, on the producer, than a leaf read in
  place). For this sweep the packing producer packs leaves up to
  `--pack-max` bytes; the other keeps the fixed limit, below which its
  transport copies small leaves into one staging buffer anyway.

Usage:
  python scripts/pack_threshold.py [--reps 9] [--counts 4,16,32,64,128,512]
      [--count-bytes 4096] [--sizes 16384,65536,262144,1048576] [--size-leaves 200]
      [--pack-max 4194304]

Prints, per case, the median end-to-end time of each producer and their
ratio (below 1: packing is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


class Producer:
  def __init__(self) -> None:
    import rdt_jax

    rdt_jax.register()
    self.trees: dict[tuple[int, int], dict] = {}

  def set_pack_max(self, nbytes: int) -> None:
    """Packs leaves up to `nbytes` from now on (`_limits.PACK_MAX_CHUNK`, a
    fixed limit; changed here to measure where it belongs)."""
    from rdt_jax import _limits

    _limits.PACK_MAX_CHUNK = nbytes  # type: ignore[misc]

  def build(self, n: int, leaf_bytes: int) -> int:
    import jax

    tree = {f"l{i:05d}": jax.device_put(np.arange(leaf_bytes // 4, dtype=np.int32) + i) for i in range(n)}
    self.trees[(n, leaf_bytes)] = jax.block_until_ready(tree)
    return _checksum(tree)

  def send(self, n: int, leaf_bytes: int) -> dict:
    return self.trees[(n, leaf_bytes)]


class Consumer:
  def __init__(self) -> None:
    import rdt_jax

    rdt_jax.register()

  def read(self, value: dict) -> int:
    return _checksum(value)


def _checksum(tree: dict) -> int:
  return sum(int(np.asarray(x).astype(np.int64).sum()) for x in tree.values())


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--reps", type=int, default=9)
  p.add_argument("--counts", default="4,16,32,64,128,512")
  p.add_argument("--count-bytes", type=int, default=4096)
  p.add_argument("--sizes", default="16384,65536,262144,1048576")
  p.add_argument("--size-leaves", type=int, default=200)
  p.add_argument("--pack-max", type=int, default=4 << 20, help="largest leaf the packing producer packs")
  args = p.parse_args()
  os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
  import ray

  import rdt_jax

  rdt_jax.register()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"PYTHONPATH": root, "NIXL_LOG_LEVEL": "WARN"}})
  remote = ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
  producers = {
      setting: remote(Producer).options(
          num_cpus=0, runtime_env={"env_vars": {"RDT_JAX_PACK_MIN_LEAVES": setting}}
      ).remote()
      for setting in ("1", "0")
  }
  ray.get(producers["1"].set_pack_max.remote(args.pack_max))
  consumer = remote(Consumer).options(num_cpus=0).remote()
  cases = [(int(n), args.count_bytes) for n in args.counts.split(",")]
  cases += [(args.size_leaves, int(b)) for b in args.sizes.split(",")]
  expected = {}
  for case in cases:
    sums = {ray.get(prod.build.remote(*case)) for prod in producers.values()}
    assert len(sums) == 1
    expected[case] = sums.pop()
  times: dict[tuple[tuple[int, int], str], list[float]] = {}
  for rep in range(-1, args.reps):
    for case in cases:
      order = list(producers.items())
      if rep % 2:
        order.reverse()
      for setting, prod in order:
        t0 = time.perf_counter()
        ref = prod.send.options(tensor_transport="jax_nixl").remote(*case)
        got = ray.get(consumer.read.remote(ref))
        dt = time.perf_counter() - t0
        assert got == expected[case], (case, setting)
        del ref
        if rep >= 0:
          times.setdefault((case, setting), []).append(dt)
  print(f"# jax_nixl, packing on (RDT_JAX_PACK_MIN_LEAVES=1) and off (0); medians of {args.reps} "
        f"interleaved reps; load average {os.getloadavg()}")
  print(f"{'leaves':>7} {'leaf bytes':>11} {'packed':>11} {'unpacked':>11} {'packed/unpacked':>16}")
  for case in cases:
    on, off = (statistics.median(times[(case, s)]) for s in ("1", "0"))
    print(f"{case[0]:>7} {case[1]:>11} {on * 1e3:>8.2f} ms {off * 1e3:>8.2f} ms {on / off:>15.2f}x")
  ray.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
