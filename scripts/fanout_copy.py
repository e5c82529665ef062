"""Several readers copying one host buffer on one machine: which copy is fastest?

A weight version read by N generators on the publisher's host is copied N
times, once into each generator's parameters. This measures the three ways a
reader process could make that copy of one buffer of `--mib` MiB, all N
readers at once, as the wall time from a common start until the last one is
done (the better of two rounds, modes interleaved, each the median of
`--reps` copies):

* `cma-anon`: `process_vm_readv` from the publisher's ordinary (anonymous)
  memory, as rdt_jax's node-local pulls read the publisher's pooled buffers;
* `cma-shm`: the same system call from shared memory (a `memfd`);
* `mmap-shm`: `memcpy` from the reader's own mapping of that `memfd`
  (mapped and faulted in once, before timing), as a shared staging region
  that readers map would be read.

Usage:
  python scripts/fanout_copy.py [--mib 256] [--readers 1,2,4] [--reps 5]

The publisher is this process; readers are child processes (multiprocessing,
fork). Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import platform
import statistics
import time
from typing import Any

import numpy as np

MODES = ("cma-anon", "cma-shm", "mmap-shm")


class _Iovec(ctypes.Structure):
  _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _reader(mode: str, pid: int, fd: int, address: int, nbytes: int, barrier: Any, reps: int) -> None:
  libc = ctypes.CDLL(None, use_errno=True)
  dst = np.ones(nbytes, np.uint8)  # faulted in before timing
  src = None
  if mode == "mmap-shm":
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    src = np.frombuffer(mmap.mmap(f, nbytes, prot=mmap.PROT_READ), np.uint8)
    os.close(f)
    np.copyto(dst, src)  # faults the mapping in
  for _ in range(reps):
    barrier.wait()
    if src is not None:
      ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)
    else:
      local, remote = _Iovec(dst.ctypes.data, nbytes), _Iovec(address, nbytes)
      got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
      if got != nbytes:
        raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {nbytes} bytes")
    barrier.wait()


def _run(mode: str, readers: int, reps: int, fd: int, address: int, nbytes: int) -> float:
  """Median wall seconds for `readers` processes to copy the buffer once each."""
  ctx = mp.get_context("fork")
  barrier = ctx.Barrier(readers + 1)
  procs = [ctx.Process(target=_reader, args=(mode, os.getpid(), fd, address, nbytes, barrier, reps))
           for _ in range(readers)]
  for p in procs:
    p.start()
  walls = []
  for _ in range(reps):
    barrier.wait()
    t0 = time.perf_counter()
    barrier.wait()
    walls.append(time.perf_counter() - t0)
  for p in procs:
    p.join()
    if p.exitcode:
      raise RuntimeError(f"a {mode} reader failed (exit code {p.exitcode})")
  return statistics.median(walls)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mib", type=int, default=256)
  parser.add_argument("--readers", default="1,2,4")
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()
  nbytes = args.mib << 20
  anon = np.full(nbytes, 7, np.uint8)
  fd = os.memfd_create("rdt-jax-fanout")
  os.ftruncate(fd, nbytes)
  shm = np.frombuffer(mmap.mmap(fd, nbytes), np.uint8)
  shm[:] = 7
  with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
    thp = f.read().strip()
  print(f"# {args.mib} MiB, {platform.platform()}, {os.cpu_count()} cpus, transparent huge pages: {thp}")
  print(f"# wall ms until every reader copied the buffer once: better of 2 interleaved rounds, "
        f"each the median of {args.reps}")
  print(f"{'readers':>8} " + " ".join(f"{m:>10}" for m in MODES))
  for readers in (int(r) for r in args.readers.split(",")):
    times = {m: [] for m in MODES}
    for _ in range(2):  # two rounds, modes interleaved
      for mode in MODES:
        address = anon.ctypes.data if mode == "cma-anon" else shm.ctypes.data
        times[mode].append(_run(mode, readers, args.reps, fd, address, nbytes))
    print(f"{readers:>8} " + " ".join(f"{min(times[m]) * 1e3:>10.1f}" for m in MODES), flush=True)


if __name__ == "__main__":
  main()
