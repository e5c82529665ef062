"""Node-local reads: copy a producer's host memory with `process_vm_readv`.

When a jax_nixl consumer shares its producer's host (same boot id and pid
namespace, `rdt_jax._process.same_host`) and both sides' memory is host memory,
it reads the producer's chunks itself, one system call per up to `IOV_MAX`
descriptors, split over a few threads for large objects. NIXL's UCX reads the
same memory with the same system call (its `cma` transport), from one thread
per READ; reading in several threads at once is where most of the gain on
large objects comes from (docs/performance.md), and reading directly also skips
connecting to the producer's agent and NIXL's request machinery.

The policy, in `enabled`: on unless the setting `RDT_JAX_NIXL_CMA` is 0
(`rdt_jax._settings`, read at each object), and off for the
rest of the process after the kernel refuses the first read (`EPERM`: Yama's
`ptrace_scope` or a container policy forbids it), which then goes through NIXL.
This module only copies bytes; `rdt_jax.transports.nixl.read` decides when it
is used, and checks staleness first (`rdt_jax.transports.nixl.staleness`).

The producer is named by pid and start time (`rdt_jax._process.Identity`). A
pid names one process until that process exits; then the kernel may give it
to another. So the read checks that the producer still runs under its pid
(`rdt_jax._process.alive`: its start time at the first check, a pidfd after
it) before the first system call and again after the last: a producer that
exited during the read (its pid possibly reused, the bytes possibly another
process's) fails the read, never delivers it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

from rdt_jax import _faults, _limits, _process, _settings

logger = logging.getLogger(__name__)

#: Threads reading one large object (the calling thread included).
THREADS: Final = max(1, min(4, os.cpu_count() or 1))


class _Iovec(ctypes.Structure):
  _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_lock = threading.Lock()
_state: dict[str, object] = {}


def _readv() -> object | None:
  """libc's `process_vm_readv`, or None where there is none."""
  with _lock:
    if "readv" not in _state:
      fn = None
      try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
      except (OSError, AttributeError):
        fn = None
      _state["readv"] = fn
    return _state["readv"]


def enabled() -> bool:
  """True if this process may read other processes' memory directly: not
  turned off (`RDT_JAX_NIXL_CMA=0`, or refused once by the kernel) and the
  system call exists."""
  if _state.get("refused") or not _settings.value("RDT_JAX_NIXL_CMA"):
    return False
  return _readv() is not None


def can_read(origin: _process.Identity | None) -> bool:
  """True if the producer `origin` is a process on this host that this one
  may read directly (see `enabled`)."""
  return origin is not None and enabled() and _process.same_host(origin)


def _split(pairs: Sequence[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
  """`pairs` (local, remote, nbytes) cut into `parts` runs of about equal
  bytes; a pair may be cut in two."""
  total = sum(n for _, _, n in pairs)
  share = -(-total // parts)
  out: list[list[tuple[int, int, int]]] = [[]]
  room = share
  for local, remote, n in pairs:
    while n:
      take = min(n, room)
      out[-1].append((local, remote, take))
      local, remote, n, room = local + take, remote + take, n - take, room - take
      if not room and len(out) < parts:
        out.append([])
        room = share
  return [p for p in out if p]


#: One system call's arguments: (local iovecs, remote iovecs, count, bytes).
_Batch = tuple[ctypes.Array, ctypes.Array, int, int]


def _batches(pairs: Sequence[tuple[int, int, int]]) -> list[_Batch]:
  out = []
  for start in range(0, len(pairs), _limits.IOV_MAX):
    batch = pairs[start : start + _limits.IOV_MAX]
    local = (_Iovec * len(batch))(*[_Iovec(a, n) for a, _, n in batch])
    remote = (_Iovec * len(batch))(*[_Iovec(b, n) for _, b, n in batch])
    out.append((local, remote, len(batch), sum(n for _, _, n in batch)))
  return out


def _read_run(pid: int, batches: list[_Batch]) -> None:
  readv = _readv()
  assert readv is not None
  for local, remote, count, want in batches:
    got = readv(pid, local, count, remote, count, 0)  # type: ignore[operator]
    if got == want:
      continue
    err = ctypes.get_errno() if got < 0 else errno.EFAULT
    if err == errno.EPERM:
      raise PermissionError(err, f"process_vm_readv of pid {pid} not permitted")
    if err == errno.ESRCH:
      raise ProcessLookupError(err, f"producer process {pid} has exited")
    raise OSError(err, f"process_vm_readv of pid {pid} read {got} of {want} bytes: {os.strerror(err)}")


class Prepared:
  """A read's descriptor pairs made into system-call arguments once, for a
  read repeated with the same addresses (a weight stream's pulls): reading
  then costs the system calls alone, whatever the number of pairs.

  Args:
    pairs: (local address, remote address, nbytes) to copy.
  """

  def __init__(self, pairs: Sequence[tuple[int, int, int]]):
    pairs = [p for p in pairs if p[2]]
    self.nbytes = sum(n for _, _, n in pairs)
    self.count = len(pairs)
    runs = [pairs] if self.nbytes < _limits.PARALLEL_MIN_BYTES or THREADS == 1 else _split(pairs, THREADS)
    self.runs = [_batches(run) for run in runs]


_pool: list[ThreadPoolExecutor] = []


def _executor() -> ThreadPoolExecutor:
  with _lock:
    if not _pool:
      _pool.append(ThreadPoolExecutor(THREADS - 1, thread_name_prefix="rdt-jax-cma"))
    return _pool[0]


def read(origin: _process.Identity, pairs: Sequence[tuple[int, int, int]] | Prepared) -> None:
  """Copies each (local address, remote address, nbytes) of producer
  `origin` into this process (or the pairs of a `Prepared` read); returns
  when every byte is in place.

  Raises:
    PermissionError: the kernel refused (this process then stops trying:
      `enabled()` turns False, and the caller reads through NIXL instead).
    ProcessLookupError: the producer exited, or its pid names another
      process, before or during the read (what was read is not to be used).
    OSError: part of the producer's memory could not be read.
  """
  prepared = pairs if isinstance(pairs, Prepared) else Prepared(pairs)
  _check_same_process(origin, "before")
  _read_all(origin[2], prepared)
  _check_same_process(origin, "during")


def wait_all(futures: Sequence[Future[Any]]) -> None:
  """Waits until every one of `futures` has ended, even if the wait is
  interrupted (a `KeyboardInterrupt` in the calling thread): the interrupt is
  raised only once they all ended, so a read never writes into memory after
  its caller saw it fail."""
  interrupted: BaseException | None = None
  while True:
    try:
      concurrent.futures.wait(futures)
      break
    except BaseException as e:  # an interrupt while waiting: the other threads still write
      interrupted = interrupted or e
  if interrupted is not None:
    raise interrupted


def _check_same_process(origin: _process.Identity, when: str) -> None:
  """Raises ProcessLookupError unless pid `origin[2]` still names the process
  `origin` (same start time): it exited, and its pid may now be another's."""
  if not _process.alive(origin):
    raise ProcessLookupError(
        errno.ESRCH, f"producer process {origin[2]} has exited ({when} the read; its pid may now name another process)"
    )


def _read_all(pid: int, prepared: Prepared) -> None:
  """Copies every pair of `prepared` from `pid` (see `read`), in several
  threads if large."""
  try:
    if _faults.ON:
      try:
        _faults.hit("cma.read")
      except _faults.InjectedFault as e:
        raise PermissionError(errno.EPERM, str(e)) from None
    runs = prepared.runs
    if len(runs) <= 1:
      for run in runs:
        _read_run(pid, run)
      return
    futures = [_executor().submit(_read_run, pid, run) for run in runs[1:]]
    try:
      _read_run(pid, runs[0])
    finally:
      wait_all(futures)  # no thread still writes when this returns or raises
    for f in futures:
      if f.exception() is not None:
        raise f.exception()  # type: ignore[misc]
  except PermissionError:
    if not _state.get("refused"):
      logger.info("process_vm_readv was refused (ptrace_scope?); jax_nixl reads through NIXL from now on")
    _state["refused"] = True
    raise
