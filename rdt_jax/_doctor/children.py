"""The loopback's two processes, each with a NIXL agent configured as
jax_nixl configures its own: the target registers filled buffers
(`run_target`), the initiator READs them, times each READ and checks the
bytes (`run_initiator`).

Both run in spawned children of `loopback.run_loopback`, their output kept
in a file apart from the doctor's report.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
import traceback
from typing import Any

from rdt_jax._doctor.records import ReadResult


def pattern(nbytes: int) -> Any:
  """The bytes the target's host buffer holds and the initiator checks: 0..250, repeated."""
  import numpy as np

  return np.resize(np.arange(251, dtype=np.uint8), nbytes)


def _child_setup(env: dict[str, str], out_path: str) -> None:
  """A loopback child's first steps: its output into `out_path` (NIXL and
  UCX write to stdout and stderr, which would mix into the doctor's report),
  then the environment UCX will read when the agent is created."""
  fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)
  os.environ.update(env)


def _child_agent(api_module: str, name: str) -> tuple[Any, Any]:
  """(NIXL's `_api` module, a new agent) configured as jax_nixl configures
  its agents (`rdt_jax.transports.nixl.agent.create_agent`: UCX backend, no
  progress thread, strict thread sync)."""
  api = importlib.import_module(api_module)
  config = api.nixl_agent_config(
      enable_prog_thread=False, backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
  )
  return api, api.nixl_agent(name, config)


def _child_buffer(memory: str, nbytes: int, fill: bool, gpu: int) -> tuple[Any, int, str, str, str]:
  """(array, its address, NIXL memory type, allocator, device) of a buffer of
  `nbytes` in `memory` ("host": numpy; "cuda": torch on GPU `gpu`, else jax
  with preallocation off), filled with the loopback's pattern or zeros."""
  from rdt_jax import _dlpack, _memory

  if memory == "host":
    import numpy as np

    host = pattern(nbytes) if fill else np.zeros(nbytes, np.uint8)
    return host, _memory.host_pointer(host), "DRAM", "numpy", "cpu"
  if _memory.cuda_available("torch"):
    import torch

    torch.cuda.set_device(gpu)  # NIXL registers device memory in the current device's context
    dev = torch.device("cuda", gpu)
    x = torch.arange(nbytes // 4, dtype=torch.int32, device=dev) if fill else torch.zeros(
        nbytes // 4, dtype=torch.int32, device=dev)
    torch.cuda.synchronize(dev)
    return x, _dlpack.buffer_pointer(x), "VRAM", "torch", f"cuda:{gpu}"
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  import jax
  import jax.numpy as jnp

  arr = jnp.arange(nbytes // 4, dtype=jnp.int32) if fill else jnp.zeros(nbytes // 4, jnp.int32)
  arr = jax.device_put(arr, jax.devices("gpu")[gpu]).block_until_ready()
  return arr, _dlpack.buffer_pointer(arr), "VRAM", "jax", f"cuda:{gpu}"


def _matches(memory: str, received: Any, nbytes: int) -> bool:
  """True if `received` holds the target's pattern (see `_child_buffer`)."""
  import numpy as np

  if memory == "host":
    return bool(np.array_equal(received, pattern(nbytes)))
  host = received.cpu().numpy() if hasattr(received, "cpu") else np.asarray(received)  # torch, else jax
  return bool(np.array_equal(host.reshape(-1), np.arange(nbytes // 4, dtype=np.int32)))


def run_target(conn: Any, env: dict[str, str], api_module: str, memories: list[str], nbytes: int,
                     gpus: tuple[int, int], out_path: str) -> None:
  """The loopback's target: registers one filled buffer per memory kind,
  sends ("ready", agent metadata, {memory: (address, device id)}, process
  identity), then progresses its agent until told to stop. Sends ("error",
  text) if anything fails."""
  _child_setup(env, out_path)
  try:
    from rdt_jax import _process

    _, agent = _child_agent(api_module, "rdt-jax-doctor-target")
    keep, where = [], {}
    for memory in memories:
      buf, ptr, kind, _, _ = _child_buffer(memory, nbytes, True, gpus[1])
      dev_id = gpus[1] if kind == "VRAM" else 0
      keep.append((buf, agent.register_memory([(ptr, nbytes, dev_id, "")], kind)))
      where[memory] = (ptr, dev_id)
    conn.send(("ready", agent.get_agent_metadata(), where, _process.identity()))
    while not conn.poll(0.001):
      agent.get_new_notifs()
    for _, reg in keep:
      agent.deregister_memory(reg)
  except Exception:
    conn.send(("error", traceback.format_exc()))


def run_initiator(conn: Any, env: dict[str, str], api_module: str, memories: list[str], nbytes: int,
                        gpus: tuple[int, int], reps: int, timeout_s: float, out_path: str) -> None:
  """The loopback's initiator: receives the target's metadata, READs each
  memory kind `reps` + 1 times, checks the bytes, destroys its agent (UCX
  writes its protocol tables then) and sends ("done", {memory: ReadResult
  fields}). Sends ("error", text) if setting up fails."""
  _child_setup(env, out_path)
  try:
    _, agent = _child_agent(api_module, "rdt-jax-doctor-initiator")
    # Receive memory first, as a jax_nixl consumer does (its receive region
    # exists before it loads the producer's view): UCX sets a connection's
    # lanes up when the view is loaded, and without a CUDA context in this
    # process by then it reads device memory by emulation.
    regs, bufs = [], {}
    for memory in memories:
      buf, ptr, kind, allocator, device = _child_buffer(memory, nbytes, False, gpus[0])
      dev_id = gpus[0] if kind == "VRAM" else 0
      regs.append((buf, agent.register_memory([(ptr, nbytes, dev_id, "")], kind)))
      bufs[memory] = (buf, ptr, kind, allocator, device, dev_id)
    meta, where, _ = conn.recv()
    remote = agent.add_remote_agent(meta)
    results: dict[str, dict[str, Any]] = {}
    for memory in memories:
      buf, ptr, kind, allocator, device, dev_id = bufs[memory]
      rptr, rdev = where[memory]
      local = agent.get_xfer_descs([(ptr, nbytes, dev_id)], kind)
      rdesc = agent.get_xfer_descs([(rptr, nbytes, rdev)], kind)
      devices = f"{device} <- cuda:{rdev}" if kind == "VRAM" else "cpu <- cpu"
      result = ReadResult(memory, nbytes, allocator=allocator, devices=devices)
      result.state = _timed_reads(agent, local, rdesc, remote, reps, timeout_s, result.seconds)
      if result.state == "DONE":
        result.bytes_ok = _matches(memory, buf, nbytes)
      results[memory] = dataclasses.asdict(result)
    for _, reg in regs:
      agent.deregister_memory(reg)
    agent.remove_remote_agent(remote)
    del agent  # UCX prints the protocol tables when the worker is destroyed
    conn.send(("done", results))
  except Exception:
    conn.send(("error", traceback.format_exc()))


def _timed_reads(agent: Any, local: Any, remote_desc: Any, remote: str, reps: int, timeout_s: float,
                 seconds: list[float]) -> str:
  """`reps` + 1 READs, each timed into `seconds`; "DONE", or what stopped them."""
  deadline = time.monotonic() + timeout_s
  for _ in range(reps + 1):
    handle = agent.initialize_xfer("READ", local, remote_desc, remote, b"rdt-jax-doctor")
    start = time.perf_counter()
    try:
      state = agent.transfer(handle)
      while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    except Exception as e:  # NIXL raises on a failed post (UCX found no protocol)
      return f"{type(e).__name__}: {e}"
    if state != "DONE":
      return f"NIXL state {state}" if state != "PROC" else f"no completion within {timeout_s:.0f} s"
    seconds.append(time.perf_counter() - start)
    agent.release_xfer_handle(handle)
  return "DONE"
