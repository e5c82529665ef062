"""Can a consumer process read a producer's GPU memory through CUDA IPC, and
how fast? Two processes on GPU 0, no Ray and no NIXL.

  python scripts/cuda_ipc_probe.py [--mb 256] [--reps 5] [--alloc torch,jax]

For each allocator the producer makes a buffer, finds the start of the CUDA
allocation that holds it (`cuMemGetAddressRange`: XLA's and torch's
allocators hand out pieces of larger allocations) and exports that
allocation with `cudaIpcGetMemHandle`. The consumer opens the handle
(`cudaIpcOpenMemHandle`), copies the buffer into its own memory, checks the
bytes and times the copy next to a copy within its own memory. An allocation
made through CUDA's virtual memory API (`cuMemCreate`) or a stream-ordered
pool has no IPC handle: the export fails, and the line says how.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import time


def _libcuda() -> ctypes.CDLL:
  return ctypes.CDLL("libcuda.so.1")


def allocation_range(pointer: int) -> tuple[int, int]:
  """(base, size) of the CUDA allocation that holds device address `pointer`."""
  cuda = _libcuda()
  base, size = ctypes.c_uint64(), ctypes.c_size_t()
  rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
  if rc != 0:
    raise RuntimeError(f"cuMemGetAddressRange failed with CUresult {rc}")
  return base.value, size.value


def _buffer(alloc: str, nbytes: int):
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if alloc == "jax":
    import jax
    import jax.numpy as jnp

    x = jnp.arange(nbytes // 4, dtype=jnp.int32, device=jax.devices("gpu")[0])
    x.block_until_ready()
    return x, x.unsafe_buffer_pointer()
  import torch

  x = torch.arange(nbytes // 4, dtype=torch.int32, device="cuda")
  torch.cuda.synchronize()
  return x, x.data_ptr()


def producer(conn, alloc: str, nbytes: int) -> None:
  import cupy

  try:
    keep, pointer = _buffer(alloc, nbytes)
    base, size = allocation_range(pointer)
    handle = cupy.cuda.runtime.ipcGetMemHandle(base)
    conn.send(("ok", bytes(handle), pointer - base, size))
  except Exception as e:
    conn.send(("error", f"{type(e).__name__}: {e}", 0, 0))
    return
  conn.recv()  # the consumer is done
  del keep


def consumer(conn, nbytes: int, reps: int, out) -> None:
  import cupy
  import torch

  status, handle, offset, size = conn.recv()
  if status != "ok":
    out["result"] = f"export failed: {handle}"
    conn.send("done")
    return
  t0 = time.perf_counter()
  try:
    base = cupy.cuda.runtime.ipcOpenMemHandle(handle)
  except Exception as e:
    out["result"] = f"open failed: {type(e).__name__}: {e}"
    conn.send("done")
    return
  open_ms = (time.perf_counter() - t0) * 1e3
  dst = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
  own = torch.arange(nbytes // 4, dtype=torch.int32, device="cuda")
  stream = torch.cuda.current_stream().cuda_stream
  times, local = [], []
  for _ in range(reps + 1):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cupy.cuda.runtime.memcpyAsync(dst.data_ptr(), base + offset, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    dst.copy_(own)
    torch.cuda.synchronize()
    local.append(time.perf_counter() - t0)
  dst.zero_()
  cupy.cuda.runtime.memcpy(dst.data_ptr(), base + offset, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice)
  ok = bool(torch.equal(dst, own))
  ipc, mem = statistics.median(times[1:]), statistics.median(local[1:])
  out["result"] = (f"open {open_ms:.2f} ms (allocation of {size >> 20} MiB, buffer at +{offset}); "
                   f"IPC copy median {ipc * 1e3:.3f} ms = {nbytes / ipc / 1e9:.1f} GB/s, own-memory copy "
                   f"{mem * 1e3:.3f} ms = {nbytes / mem / 1e9:.1f} GB/s; bytes ok: {ok}")
  cupy.cuda.runtime.ipcCloseMemHandle(base)
  conn.send("done")


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--alloc", default="torch,jax")
  a = p.parse_args()
  ctx = mp.get_context("spawn")
  nbytes = a.mb << 20
  for alloc in a.alloc.split(","):
    with ctx.Manager() as m:
      out = m.dict()
      c1, c2 = ctx.Pipe()
      procs = [ctx.Process(target=producer, args=(c1, alloc, nbytes)),
               ctx.Process(target=consumer, args=(c2, nbytes, a.reps, out))]
      for proc in procs:
        proc.start()
      for proc in procs:
        proc.join(120)
        if proc.is_alive():
          proc.kill()
      print(f"cuda_ipc alloc={alloc} {a.mb} MiB: {out.get('result', 'no result')}", flush=True)


if __name__ == "__main__":
  main()
