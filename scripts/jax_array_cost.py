"""jax's own cost of making one `jax.Array` from host memory, per array.

What a consumer of many small leaves pays jax whatever carries the bytes:
rdt_jax's batched zero-copy call (`_dlpack.host_to_jax_many`, the one a
fetch makes for host jax leaves), `jnp.asarray` per array (what a user of
the object store with NumPy does, a copy), `jax.device_put` of the list, and
`np.asarray` of a received array (jax's cost of exposing its buffer to read
it). Medians of 7 rounds of `--arrays` arrays of `--bytes` bytes each.

  python scripts/jax_array_cost.py [--arrays 10000] [--bytes 6704]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rdt_jax import _dlpack
from rdt_jax._dlpack import Device

ALIGN = 64  # jax aliases host memory on this boundary


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--arrays", type=int, default=10_000)
  p.add_argument("--bytes", type=int, default=6704)
  args = p.parse_args()
  n, nbytes = args.arrays, args.bytes // 4 * 4
  stride = -(-nbytes // ALIGN) * ALIGN
  raw = np.empty(n * stride + ALIGN, np.uint8)
  buf = raw[(-raw.ctypes.data) % ALIGN :][: n * stride]
  views = [buf[i * stride : i * stride + nbytes].view(np.int32) for i in range(n)]
  plain = [np.arange(nbytes // 4, dtype=np.int32) + i for i in range(n)]
  device = jax.devices("cpu")[0]

  def per_array(f) -> float:
    times = []
    for _ in range(7):
      t0 = time.perf_counter()
      out = f()
      times.append(time.perf_counter() - t0)
      del out
    return statistics.median(times) / n * 1e6

  print(f"# {n} arrays of {nbytes} bytes; medians of 7; load average {os.getloadavg()}")
  cpu0 = Device("cpu", 0)
  rows = [
      ("rdt_jax's batched call (host_to_jax_many, zero-copy)", lambda: _dlpack.host_to_jax_many(views, cpu0)),
      ("jnp.asarray per array (a copy)", lambda: [jnp.asarray(v) for v in plain]),
      ("jax.device_put of the list (a copy)", lambda: jax.device_put(plain, device)),
  ]
  for name, f in rows:
    print(f"{name:<56} {per_array(f):8.2f} us per array")
  arrays = _dlpack.host_to_jax_many(views, cpu0)
  print(f"{'np.asarray of a received jax.Array (to read it)':<56} "
        f"{per_array(lambda: [np.asarray(a) for a in arrays]):8.2f} us per array")


if __name__ == "__main__":
  main()
