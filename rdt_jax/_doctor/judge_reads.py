"""Decisions on the loopback's READs: host memory (`judge_host_read`), the
node-local read (`judge_node_local`), the UCX settings for device memory
(`judge_device_read_settings`) and device memory (`judge_device_read`).

Pure functions of what was measured; each returns a `Finding`.
"""

from __future__ import annotations

from rdt_jax import _limits
from rdt_jax._doctor.records import Finding, ReadResult
from rdt_jax._doctor.ucx_log import ReadPath


def _rate(result: ReadResult) -> str:
  rate = result.gbps
  return f"{rate:.2f} GB/s" if rate is not None else "no rate"


def judge_host_read(result: ReadResult | None, path: ReadPath | None, node_local_ok: bool,
                    errors: list[str]) -> Finding:
  """The verdict on READs of host memory between two processes of this host.

  Args:
    result: the loopback's host READ (None if no loopback ran: NIXL missing).
    path: the protocol UCX logged for it (`read_path(..., "host")`).
    node_local_ok: rdt_jax's own node-local read (`process_vm_readv`) works here.
    errors: UCX's errors from the loopback's logs, for the failure message.
  """
  what = "NIXL READ of host memory"
  if result is None:
    return Finding("ok", f"{what}: not checked (NIXL is not installed)")
  if result.state != "DONE":
    said = f" UCX said: {' | '.join(errors)}" if errors else ""
    return Finding(
        "fail", f"{what} failed in the loopback: {result.state}",
        f"two NIXL agents on this host could not READ {result.nbytes >> 20} MiB of host memory.{said}",
        "Check the UCX_* variables in this environment (UCX_TLS, UCX_PROTO_EMULATION_ENABLE, "
        "UCX_NET_DEVICES): unset them to let UCX choose, then run `rdt-jax doctor` again.",
    )
  if not result.bytes_ok:
    return Finding("fail", f"{what} delivered wrong bytes", "the loopback READ completed but the data differs",
                   "Report it with `rdt-jax doctor --json` output attached.")
  if path is None:
    return Finding("warn", f"{what}: works ({_rate(result)}), protocol unknown",
                   "UCX logged no protocol table for the READ (its log format may have changed).")
  how = f"{path.protocol} over {path.transport}, {_rate(result)}"
  if path.emulated or path.over_tcp:
    if node_local_ok:
      return Finding(
          "warn", f"{what}: {how}",
          "UCX has no shared-memory READ here; rdt_jax still reads host memory on this host directly "
          "(process_vm_readv), so only reads between hosts, or after the kernel refuses a direct read, use it.",
          "Unset UCX_TLS (or add cma to it) to let UCX use CMA.",
      )
    return Finding(
        "fail", f"{what}: {how}",
        "host memory moves between two processes on this host only through TCP (UCX emulates the READ, and "
        "rdt_jax's direct node-local read is off or refused): slower than Ray's object store.",
        "Allow process_vm_readv between the processes (Yama: `sysctl kernel.yama.ptrace_scope=0`; in a "
        "container: `--cap-add SYS_PTRACE`), keep RDT_JAX_NIXL_CMA unset, and unset UCX_TLS (or add cma).",
    )
  return Finding("ok", f"{what}: {how}")


def judge_node_local(state: str, gbps: float | None) -> Finding:
  """The verdict on rdt_jax's node-local host read (`process_vm_readv`).

  Args:
    state: "ok", "off" (`RDT_JAX_NIXL_CMA=0` or no such system call),
      "not run" (no loopback), or the error the read raised.
    gbps: its rate where it ran.
  """
  what = "node-local host read (process_vm_readv)"
  if state == "ok":
    return Finding("ok", f"{what}: works" + (f", {gbps:.2f} GB/s" if gbps else ""))
  if state == "not run":
    return Finding("ok", f"{what}: not checked (no loopback ran)")
  if state == "off":
    return Finding("warn", f"{what}: off",
                   "RDT_JAX_NIXL_CMA=0 (or no process_vm_readv here): every read of host memory on this host "
                   "goes through NIXL.", "Unset RDT_JAX_NIXL_CMA.")
  return Finding(
      "warn", f"{what}: refused ({state})",
      "every read of host memory on this host goes through NIXL instead.",
      "Allow process_vm_readv between the processes (Yama: `sysctl kernel.yama.ptrace_scope=0`; in a "
      "container: `--cap-add SYS_PTRACE`).",
  )


def judge_device_read_settings(problem: str | None, gpu_count: int) -> Finding:
  """The verdict on `rdt_jax.transports.nixl.ucx.device_read_problem()`
  (computed for the environment a jax_nixl process has here): a fail on a
  host with a GPU; without one it does not apply, and the problem is only
  reported (in `why`), for an environment also used on GPU hosts."""
  what = "UCX settings for device memory"
  if problem is None:
    return Finding("ok", f"{what}: nothing turns CUDA IPC READs off")
  if gpu_count:
    return Finding("fail", f"{what}: a READ of GPU memory will not use CUDA IPC", problem,
                   "Fix the variable as the reason says, in every process with a NIXL agent.")
  return Finding("ok", f"{what}: do not apply (no GPU)", f"on a GPU host: {problem}")


def judge_device_read(result: ReadResult | None, path: ReadPath | None, errors: list[str]) -> Finding:
  """The verdict on the loopback's READ of device memory (GPU hosts only).

  A READ UCX emulated or sent over TCP, one that failed or delivered wrong
  bytes, or one slower than `_limits.DOCTOR_DEVICE_READ_MIN_GBPS`, is a fail; one that
  used CUDA IPC is ok; any other path, or one UCX logged none for, a warning.
  """
  what = "NIXL READ of GPU memory"
  if result is None:
    return Finding("ok", f"{what}: not checked (no GPU visible)")
  where = f" ({result.allocator} memory, {result.devices})" if result.allocator else ""
  if result.state != "DONE":
    said = f" UCX said: {' | '.join(errors)}" if errors else ""
    return Finding("fail", f"{what} failed in the loopback{where}: {result.state}",
                   f"two NIXL agents on this host could not READ GPU memory.{said}",
                   "Check the UCX_* variables (UCX_TLS must allow cuda_ipc and cuda_copy).")
  if not result.bytes_ok:
    return Finding("fail", f"{what} delivered wrong bytes{where}", "the loopback READ completed but the data differs",
                   "Report it with `rdt-jax doctor --json` output attached.")
  rate = result.gbps
  how = f"{path.protocol} over {path.transport}, {_rate(result)}" if path else _rate(result)
  if path is not None and (path.emulated or path.over_tcp):
    return Finding(
        "fail", f"{what}{where}: {how}",
        "UCX emulates the READ through host memory and TCP (about 0.5 GB/s instead of hundreds): UCX 1.23 "
        "turns CUDA IPC READs off where NVML reports no active NVLink.",
        "Set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y in every process with a NIXL agent (rdt_jax does, unless "
        "RDT_JAX_UCX_DEFAULTS=0 or the variable is set); see docs/gpu.md.",
    )
  if rate is not None and rate < _limits.DOCTOR_DEVICE_READ_MIN_GBPS:
    return Finding("fail", f"{what}{where}: {how}",
                   f"slower than {_limits.DOCTOR_DEVICE_READ_MIN_GBPS} GB/s: "
                   "a device transfer this slow loses to Ray's object store.",
                   "Check the GPU topology below and the UCX_* variables; docs/gpu.md says what is known.")
  if path is None:
    return Finding("warn", f"{what}{where}: {how}, protocol unknown",
                   "UCX logged no protocol table for the READ (its log format may have changed).")
  if "cuda_ipc" not in path.transport:
    return Finding("warn", f"{what}{where}: {how}",
                   "the READ does not use CUDA IPC: it is staged through host memory.",
                   "Unset UCX_TLS (or add cuda_ipc to it).")
  return Finding("ok", f"{what}{where}: {how}")
