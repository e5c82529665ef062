"""A/B of pausing the cyclic GC around rdt_jax's per-object work, interleaved.

One process, `jax_nixl` with two agents, an object of 10,000 jax leaves
(6.5 KiB each): extract (describe every leaf, metadata, NIXL export) and the
consumer's fetch + wait + build, with `rdt_jax._memory.gc_paused` active
(the default) and disabled, alternating per repetition; medians.

Usage: python scripts/gc_pause_ab.py [--leaves 10000] [--reps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--leaves", type=int, default=10000)
  p.add_argument("--reps", type=int, default=6)
  args = p.parse_args()
  os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
  import jax
  import numpy as np
  from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

  from rdt_jax import _limits
  from rdt_jax.transports.nixl import NixlTransport

  size = (64 << 20) // args.leaves // 4
  tree = jax.block_until_ready(
      [jax.device_put(np.arange(size, dtype=np.int32) + i) for i in range(args.leaves)]
  )
  prod, cons = NixlTransport(), NixlTransport()
  default = _limits.GC_PAUSE_MIN_LEAVES
  res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
  n = 0
  for r in range(-1, args.reps):
    for pause in (True, False) if r % 2 else (False, True):
      _limits.GC_PAUSE_MIN_LEAVES = default if pause else 1 << 62
      n += 1
      t0 = time.perf_counter()
      meta = prod.extract_tensor_transport_metadata(f"o{n}", tree)
      t1 = time.perf_counter()
      request = cons.fetch_multiple_tensors(f"o{n}", meta, CommunicatorMetadata())
      out = cons.wait_fetch_complete(request, 60)
      t2 = time.perf_counter()
      assert int(out[7][3]) == int(tree[7][3])
      del out, request
      prod.garbage_collect(f"o{n}", meta, tree)
      if r >= 0:
        res[pause].append((t1 - t0, t2 - t1))
  _limits.GC_PAUSE_MIN_LEAVES = default
  print(f"# {args.leaves} leaves, medians of {args.reps}, load average {os.getloadavg()}")
  med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in res.items()}
  for pause in (True, False):
    e, c = med[pause]
    print(f"gc {'paused' if pause else 'on    '}: extract {e * 1e3:.1f} ms, fetch+wait+build {c * 1e3:.1f} ms")
  print(f"ratio paused / on: extract {med[True][0] / med[False][0]:.2f}, "
        f"fetch+wait+build {med[True][1] / med[False][1]:.2f}")


if __name__ == "__main__":
  main()
