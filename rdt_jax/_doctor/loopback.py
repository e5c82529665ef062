"""The loopback READ: two NIXL agents in two spawned processes (`children`)
READ each memory kind from each other with UCX logging its protocol tables
(`run_loopback`); beside it, rdt_jax's own node-local read (`process_vm_readv`)
of the same host buffer."""

from __future__ import annotations

import dataclasses
import glob
import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any

from rdt_jax._doctor import children
from rdt_jax._doctor.records import Loopback, ReadResult
from rdt_jax._doctor.ucx_log import UCX_LOG_ENV


def _node_local_read(identity: Any, remote_ptr: int, nbytes: int) -> tuple[str, float | None]:
  """rdt_jax's node-local read of the target's host buffer into this
  process: ("ok", GB/s), ("off", None) or (the error, None)."""
  import numpy as np

  from rdt_jax import _memory
  from rdt_jax import _node_local as node_local

  if not node_local.enabled():
    return "off", None
  if not node_local.can_read(identity):
    return "not on this host's pid namespace", None
  buf = np.zeros(nbytes, np.uint8)
  pairs = [(_memory.host_pointer(buf), remote_ptr, nbytes)]
  seconds = []
  try:
    for _ in range(3):  # the first one also faults the fresh buffer's pages in
      start = time.perf_counter()
      node_local.read(identity, pairs)
      seconds.append(time.perf_counter() - start)
  except OSError as e:
    return f"{type(e).__name__}: {e}", None
  if not np.array_equal(buf, children.pattern(nbytes)):
    return "read wrong bytes", None
  return "ok", nbytes / statistics.median(seconds[1:]) / 1e9


def _receive(conn: Any, proc: Any, deadline: float) -> Any:
  """The next message from a child, or raises TimeoutError / EOFError."""
  while time.monotonic() < deadline:
    if conn.poll(0.05):
      return conn.recv()
    if not proc.is_alive() and not conn.poll(0):
      raise EOFError(f"the process exited with status {proc.exitcode} before answering")
  raise TimeoutError("no answer")


def run_loopback(env: dict[str, str], api_module: str, memories: list[str], nbytes: int, gpus: tuple[int, int],
                 timeout_s: float, reps: int = 4) -> Loopback:
  """Runs the loopback READ (see the `rdt_jax._doctor` docstring) and returns what it found.

  Args:
    env: the children's extra environment (UCX variables); the UCX log
      variables are added here.
    api_module: NIXL's `_api` module to import ("nixl_cu12._api").
    memories: "host", and "cuda" where a GPU is visible.
    nbytes: bytes per READ.
    gpus: (initiator's GPU, target's GPU) for "cuda".
    timeout_s: the whole loopback's limit; children still running then are killed.
    reps: timed READs per memory kind, after one untimed.

  Never raises for what the children do: a failure is in `Loopback.error`
  or in a READ's `state`. The children are spawned, so they import the
  caller's `__main__` module again: call this from a script whose top level
  is guarded by `if __name__ == "__main__":` (the `rdt-jax` command is).
  """
  ctx = multiprocessing.get_context("spawn")
  deadline = time.monotonic() + timeout_s
  loop = Loopback({m: ReadResult(m, nbytes) for m in memories})
  with tempfile.TemporaryDirectory(prefix="rdt-jax-doctor-") as tmp:
    child_env = {**env, **UCX_LOG_ENV, "UCX_LOG_FILE": os.path.join(tmp, "ucx.%p.log")}
    out = os.path.join(tmp, "children.out")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    target = ctx.Process(target=children.run_target, args=(t_child, child_env, api_module, memories, nbytes, gpus, out),
                         daemon=True)
    initiator = ctx.Process(
        target=children.run_initiator,
        args=(i_child, child_env, api_module, memories, nbytes, gpus, reps, timeout_s, out), daemon=True,
    )
    procs = [target, initiator]
    stage = "starting the processes"
    try:
      for p in procs:
        p.start()
      t_child.close()
      i_child.close()
      stage = "the target's agent"
      msg = _receive(t_parent, target, deadline)
      if msg[0] == "error":
        raise RuntimeError(msg[1])
      _, meta, where, identity = msg
      i_parent.send((meta, where, identity))
      stage = "the initiator's READs"
      msg = _receive(i_parent, initiator, deadline)
      if msg[0] == "error":
        raise RuntimeError(msg[1])
      for memory, fields in msg[1].items():
        loop.reads[memory] = ReadResult(**fields)
      if "host" in where:  # after the READs: on a small host they would compete for its cores
        loop.node_local, loop.node_local_gbps = _node_local_read(identity, where["host"][0], nbytes)
      t_parent.send("stop")
      target.join(max(0.5, min(5.0, deadline - time.monotonic())))
    except TimeoutError:
      loop.error = f"the loopback did not finish within {timeout_s:g} s (waiting for {stage})"
    except (EOFError, RuntimeError, OSError) as e:
      loop.error = f"{stage} failed: {e}"
    finally:
      for p in procs:
        p.join(0.5 if loop.error else max(0.5, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
          p.kill()
          p.join(1)
    for memory, result in loop.reads.items():
      if result.state == "not run" and loop.error:
        loop.reads[memory] = dataclasses.replace(result, state=loop.error)
    loop.log = "".join(_read_text(p) for p in sorted(glob.glob(os.path.join(tmp, "ucx.*.log"))))
    if loop.error or any(r.state != "DONE" for r in loop.reads.values()):
      loop.output = _read_text(out)[-4000:]
  return loop


def _read_text(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except OSError:
    return ""
