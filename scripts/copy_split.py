"""Where a large array's time goes: the object store's copy against jax_nixl's.

One producer actor returns the same array through the object store (a NumPy
array, `ray.put`) and through `jax_nixl` (a `jax.Array`), alternating, to 1
and to N consumer actors at once. Each side is timed inside its actor:

* the producer's `ray.put` (the object store copies the array into its
  shared memory here; jax_nixl only describes and exports it);
* each consumer's `ray.get` (the object store maps that memory, no copy;
  jax_nixl copies the bytes with `process_vm_readv` into its own buffer);
* the wall time of the consumers' gets together, from the driver.

The bytes are copied once either way for one consumer: on the producer by
Ray's multi-threaded `memcpy`, or on the consumer by the kernel's
cross-process copy, whose rate the second column shows against the first.
For N consumers the object store still copies once, jax_nixl N times.

Usage:
  python scripts/copy_split.py [--mib 256] [--consumers 4] [--reps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import ray


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mib", type=int, default=256)
  parser.add_argument("--consumers", type=int, default=4)
  parser.add_argument("--reps", type=int, default=12)
  args = parser.parse_args()
  nbytes = args.mib << 20

  @ray.remote
  class Producer:
    def __init__(self) -> None:
      import jax

      import rdt_jax

      rdt_jax.register()
      self.host = np.arange(nbytes // 4, dtype=np.float32)
      self.array = jax.block_until_ready(jax.device_put(self.host))

    def put(self, path: str) -> tuple[list, float]:
      t0 = time.perf_counter()
      if path == "object store":
        ref = ray.put(self.host)
      else:
        ref = ray.put(self.array, _tensor_transport="jax_nixl")
      return [ref], time.perf_counter() - t0

  @ray.remote(enable_tensor_transport=True)
  class Consumer:
    def __init__(self) -> None:
      import rdt_jax

      rdt_jax.register()

    def get(self, refs: list) -> float:
      t0 = time.perf_counter()
      value = ray.get(refs[0])
      elapsed = time.perf_counter() - t0
      assert np.asarray(value)[-1] == nbytes // 4 - 1
      return elapsed

  ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
  producer = Producer.remote()
  consumers = [Consumer.remote() for _ in range(args.consumers)]
  samples: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
  for rep in range(args.reps + 2):  # two warm-up rounds
    for path in ("object store", "jax_nixl"):
      for n in sorted({1, args.consumers}):
        refs, put_s = ray.get(producer.put.remote(path))
        t0 = time.perf_counter()
        gets = ray.get([c.get.remote(refs) for c in consumers[:n]])
        wall = time.perf_counter() - t0
        del refs
        if rep >= 2:
          samples.setdefault((path, n), []).append((put_s, max(gets), wall))
  load = os.getloadavg()
  print(f"# {args.mib} MiB, medians of {args.reps} alternating repetitions, {os.cpu_count()} CPUs, "
        f"load average {tuple(round(x, 2) for x in load)}")
  print(f"{'path':>14} {'consumers':>10} {'producer put':>14} {'slowest get':>13} {'gets, wall':>12}")
  for (path, n), rows in sorted(samples.items()):
    put_s, get_s, wall = (statistics.median(r[i] for r in rows) * 1e3 for i in range(3))
    print(f"{path:>14} {n:>10} {put_s:>11.1f} ms {get_s:>10.1f} ms {wall:>9.1f} ms")
  ray.shutdown()


if __name__ == "__main__":
  main()
