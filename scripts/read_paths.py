"""One host, two processes: the same bytes read three ways, without Ray.

A producer process holds a jax array and exports it through jax_nixl; this
process (the consumer) reads it, alternating per repetition:

* `nixl`: jax_nixl's fetch with node-local reads off, i.e. one NIXL READ
  (UCX picks its `cma` transport on one host: `process_vm_readv`);
* `direct`: jax_nixl's fetch with node-local reads on
  (`rdt_jax._node_local`: `process_vm_readv` called by rdt_jax);
* `syscall`: one `process_vm_readv` of the whole array into a buffer already
  faulted in, nothing else: the floor;
* `memcpy`: a copy of the same size inside this process.

It prints the median and range per way and size: the profile behind
node-local reads (docs/performance.md).

Usage: python scripts/read_paths.py [--sizes 1MiB,64MiB,256MiB] [--reps 9]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import pickle
import statistics
import time

WAYS = ("nixl", "direct", "syscall", "memcpy")


def _producer(sizes: list[int], requests: mp.Queue, replies: mp.Queue) -> None:
  os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
  import jax
  import numpy as np

  from rdt_jax import _dlpack, _handoff
  from rdt_jax.transports.nixl import NixlTransport

  prod = NixlTransport()
  arrays = {n: jax.device_put(np.arange(n // 4, dtype=np.int32)) for n in sizes}
  serial = 0
  while (n := requests.get()) is not None:
    serial += 1
    x = arrays[n]
    _handoff.record_described(x, _dlpack.describe(x, "x"))
    meta = prod.extract_tensor_transport_metadata(f"o{serial}", [x])
    replies.put((f"o{serial}", pickle.dumps(meta), os.getpid(), _dlpack.buffer_pointer(x)))
    requests.get()  # the consumer is done with it
    prod.garbage_collect(f"o{serial}", meta, [x])


def _parse(size: str) -> int:
  units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
  for unit, mult in units.items():
    if size.endswith(unit):
      return int(size[: -len(unit)]) * mult
  return int(size)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default="1MiB,64MiB,256MiB")
  p.add_argument("--reps", type=int, default=9)
  args = p.parse_args()
  sizes = [_parse(s) for s in args.sizes.split(",")]
  mp.set_start_method("spawn")
  requests: mp.Queue = mp.Queue()
  replies: mp.Queue = mp.Queue()
  child = mp.Process(target=_producer, args=(sizes, requests, replies))
  child.start()

  import numpy as np
  from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

  from rdt_jax import _limits
  from rdt_jax import _node_local as node_local
  from rdt_jax.transports.nixl import NixlTransport

  cons = NixlTransport()
  libc = ctypes.CDLL(None, use_errno=True)
  readv = libc.process_vm_readv
  readv.restype = ctypes.c_ssize_t
  times: dict[tuple[int, str], list[float]] = {}
  for rep in range(-2, args.reps):  # two warm-up rounds: agents connect, pools fill
    for i, n in enumerate(sizes):
      order = WAYS[(rep + i) % len(WAYS):] + WAYS[: (rep + i) % len(WAYS)]
      scratch = np.ones(n, np.uint8)
      src = np.ones(n, np.uint8)
      for way in order:
        requests.put(n)
        obj, meta_bytes, pid, pointer = replies.get()
        meta = pickle.loads(meta_bytes)
        t0 = time.perf_counter()
        if way in ("nixl", "direct"):
          os.environ["RDT_JAX_NIXL_CMA"] = "1" if way == "direct" else "0"
          got = cons.wait_fetch_complete(cons.fetch_multiple_tensors(obj, meta, CommunicatorMetadata()), 60)
          elapsed = time.perf_counter() - t0
          assert cons.receive_stats(reset=True)["direct"] == (way == "direct")
          del got
        elif way == "syscall":
          local = (ctypes.c_void_p * 2)(scratch.ctypes.data, n)
          remote = (ctypes.c_void_p * 2)(pointer, n)
          assert readv(pid, local, 1, remote, 1, 0) == n
          elapsed = time.perf_counter() - t0
        else:
          np.copyto(scratch, src)
          elapsed = time.perf_counter() - t0
        requests.put(True)
        if rep >= 0:
          times.setdefault((n, way), []).append(elapsed)
  requests.put(None)
  child.join()
  print(f"# {args.reps} alternating repetitions per way; load average {os.getloadavg()}; "
        f"node-local read threads: {node_local.THREADS} from {_limits.PARALLEL_MIN_BYTES >> 20} MiB")
  print(f"{'size':>10} " + "".join(f"{w + ' (ms)':>24}" for w in WAYS))
  for n in sizes:
    cells = []
    for w in WAYS:
      v = times[(n, w)]
      cells.append(f"{statistics.median(v) * 1e3:.2f} [{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}]")
    print(f"{n >> 20:>6} MiB " + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
  main()
