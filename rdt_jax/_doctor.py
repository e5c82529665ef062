"""`rdt-jax doctor`: what this host will do with rdt_jax, checked before the first transfer.

It reports, for this host and this environment:

* versions: Python, Ray, jax/jaxlib, numpy, torch, cupy, NIXL (the distribution
  `rdt_jax._compat.nixl_api` imports), and the CUDA build of each;
* transports: what `rdt_jax.register()` returns here, and Ray's built-in ones;
* whether the Ray minor is inside the tested range (`rdt_jax._seam`);
* GPUs: count, names, peer access between each pair, and `nvidia-smi`'s
  NVLink status and topology where it exists;
* UCX: which protocol and transport a NIXL READ uses for host memory and, where
  a GPU is visible, for device memory, and at what rate. The NIXL wheels ship no
  `ucx_info`, so this is found the way a user can: a loopback READ of
  `--mb` MiB between two NIXL agents in two child processes, run with the
  environment a jax_nixl process has (`rdt_jax.transports.nixl.ucx.apply_defaults`
  applied) plus `UCX_LOG_LEVEL=info UCX_PROTO_INFO=used UCX_LOG_FILE=...`, then
  the protocol tables UCX logs are parsed (`parse_proto_tables`). Beside it, the
  node-local host read rdt_jax makes itself (`process_vm_readv`) is tried on the
  same buffer;
* on a GPU host, whether XLA's preallocation leaves room for the other jax
  processes on a GPU (docs/gpu.md, "The memory rule").

Each check ends in a `Finding`: `ok`, `warn` or `fail`, with why and the fix.
`run` returns 0 if no finding is `fail`, 1 otherwise. What is a fail (the
configuration is broken, or slow enough to lose to Ray's object store):

* Ray, jax or numpy missing; `register()` raising (an untested Ray minor
  without `RDT_JAX_ALLOW_UNTESTED_RAY=1`, or Ray internals changed); an
  invalid `RDT_JAX_*` setting;
* the loopback READ failing, timing out, or delivering wrong bytes;
* host memory that moves between two processes on this host only through
  TCP: UCX's host READ emulated over TCP *and* no node-local read;
* on a GPU host: `device_read_problem()` (CUDA IPC READs turned off), a device
  READ that UCX emulates or sends over TCP, or one slower than
  `DEVICE_READ_MIN_GBPS`;
* on a GPU host shared by `--jax-processes-per-gpu` N > 1 jax processes:
  preallocation on with N x fraction >= 1 (the second process runs out of memory).

What is a warning (it works, with less or with a caveat): NIXL missing
(`jax_nixl` unavailable, the other transports work); torch missing (no
`jax_gloo`/`jax_nccl`, no Ray built-ins); an untested Ray allowed by
`RDT_JAX_ALLOW_UNTESTED_RAY=1`; node-local reads refused or off while UCX reads
host memory by CMA; UCX's host READ over TCP while node-local reads work (only
reads between hosts or after a refusal use it); a protocol UCX's log did not
show; GPUs no framework sees, or pairs without peer access; jax on the CPU of
a GPU host; a NIXL CUDA build other than torch's. On a host without a GPU the
device checks do not apply (`device_read_problem()` is still shown).

It needs no running Ray and starts none; it runs on hosts without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib
import importlib.metadata
import json
import multiprocessing
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal

__all__ = [
  "DEVICE_READ_MIN_GBPS",
  "Finding",
  "ProtoRow",
  "ProtoTable",
  "ReadPath",
  "ReadResult",
  "active_nvlinks",
  "add_arguments",
  "collect",
  "exit_status",
  "jax_nixl_ucx_env",
  "judge_device_read",
  "judge_device_read_settings",
  "judge_gpus",
  "judge_host_read",
  "judge_node_local",
  "judge_packages",
  "judge_ray",
  "judge_xla_memory",
  "parse_proto_tables",
  "ray_builtin_usable",
  "read_path",
  "render_text",
  "run",
  "ucx_errors",
  "ucx_version",
]

Severity = Literal["ok", "warn", "fail"]

#: A READ of device memory slower than this (GB/s, median of the loopback's
#: timed READs) is a fail: UCX's emulated READ ran at 0.4-0.6 GB/s on an H200,
#: a CUDA IPC READ at hundreds of GB/s, a PCIe peer READ at tens.
DEVICE_READ_MIN_GBPS: Final = 2.0
#: XLA's default share of each GPU when it preallocates (jaxlib's default).
XLA_DEFAULT_FRACTION: Final = 0.75
#: Values of `XLA_PYTHON_CLIENT_PREALLOCATE` that turn preallocation off,
#: exactly as jaxlib's `xla_client` reads it (anything else leaves it on).
XLA_PREALLOCATE_OFF: Final = frozenset({"false", "False", "0"})
#: Ray's own transports (Ray 2.59-2.60 register them in a process on its first
#: RDT use, only where torch imports) and what each needs besides torch.
RAY_BUILTIN: Final = {
    "nixl": "the `nixl` meta package (pip install --no-deps nixl)",
    "gloo": "nothing more",
    "nccl": "a GPU torch sees",
    "cuda_ipc": "a GPU torch sees",
}
GPU_DOC: Final = "docs/gpu.md#the-memory-rule"
UCX_LOG_ENV: Final = {"UCX_LOG_LEVEL": "info", "UCX_PROTO_INFO": "used"}


@dataclasses.dataclass(frozen=True)
class Finding:
  """One conclusion of the doctor.

  Attributes:
    severity: "ok", "warn" (works, with less or a caveat) or "fail" (broken,
      or slow enough to lose to Ray's object store).
    what: the conclusion, one line.
    why: the evidence or the consequence.
    fix: what to do (empty for "ok").
  """

  severity: Severity
  what: str
  why: str = ""
  fix: str = ""


def exit_status(findings: list[Finding]) -> int:
  """1 if any finding is a fail, else 0."""
  return int(any(f.severity == "fail" for f in findings))


# --------------------------------------------------------------------------
# UCX's log: the protocol tables `UCX_PROTO_INFO=used` prints.


@dataclasses.dataclass(frozen=True)
class ProtoRow:
  """One row of a UCX protocol table: how often (`count`, -1 where the table
  has no Count column) a message size `range` used protocol `description`
  (`zero-copy`, `software emulation`, ...) over `config` (`cma/memory`,
  `tcp/lo`, `cuda_ipc/cuda`, ...)."""

  count: int
  range: str
  description: str
  config: str


@dataclasses.dataclass(frozen=True)
class ProtoTable:
  """One protocol table: `context` ("probe-initiator intra-node cfg#2"),
  `title` ("remote memory read by ucp_get*(multi) into host memory from
  host"), the operation ("remote memory read") and the memory kinds on
  this side and the remote one ("host", "cuda"; None if not said)."""

  context: str
  title: str
  operation: str
  local_memory: str | None
  remote_memory: str | None
  rows: tuple[ProtoRow, ...]


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\[[^\]]*\]\s*")
_READ_TITLE = re.compile(r"^(?P<op>.+?) by \S+ into (?P<local>\S+)(?: memory)? from (?P<remote>\S+)")
_WRITE_TITLE = re.compile(r"^(?P<op>.+?) by \S+ from (?P<local>\S+)(?: memory)? to (?P<remote>\S+)")
_OTHER_TITLE = re.compile(r"^(?P<op>.+?) by \S+(?: from (?P<local>\S+))?")


def _memory_kind(token: str | None) -> str | None:
  """"cuda/GPU0" -> "cuda", "host" -> "host"."""
  return token.split("/")[0].lower() if token else None


def _title_parts(title: str) -> tuple[str, str | None, str | None]:
  for pattern in (_READ_TITLE, _WRITE_TITLE, _OTHER_TITLE):
    m = pattern.match(title)
    if m:
      groups = m.groupdict()
      return m.group("op"), _memory_kind(groups.get("local")), _memory_kind(groups.get("remote"))
  return title, None, None


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_proto_tables(text: str) -> list[ProtoTable]:
  """Every protocol table in a UCX log (`UCX_PROTO_INFO=used` or `y`).

  A table is a context line and a title line, each one cell wide, then a
  header row naming the columns (Count, Range, Description, Config) and the
  rows; lines may carry UCX's `[time] [host:pid:thread]` prefix. Columns are
  matched by their header name, so a table without a Count column parses
  with `count=-1`. Lines that are not table lines are ignored.
  """
  tables: list[ProtoTable] = []
  headings: list[str] = []
  header: list[str] | None = None
  rows: list[ProtoRow] = []

  def close() -> None:
    nonlocal header, rows
    if header is not None and len(headings) >= 2:
      context, title = headings[-2], headings[-1]
      op, local, remote = _title_parts(title)
      tables.append(ProtoTable(context, title, op, local, remote, tuple(rows)))
    header, rows = None, []

  for raw in text.splitlines():
    line = _LOG_PREFIX.sub("", raw).strip()
    if not line.startswith(("|", "+")) or line.startswith("+"):
      continue
    cells = _cells(line)
    if len(cells) == 1:
      if header is not None:
        close()
        headings.clear()
      headings.append(cells[0])
    elif {"Range", "Description", "Config"} <= set(cells):
      close()
      header = cells
    elif header is not None and len(cells) == len(header):
      row = dict(zip(header, cells))
      count = row.get("Count", "-1")
      rows.append(ProtoRow(
          int(count) if count.lstrip("-").isdigit() else -1,
          row.get("Range", ""), row.get("Description", ""), row.get("Config", ""),
      ))
  close()
  return tables


@dataclasses.dataclass(frozen=True)
class ReadPath:
  """How UCX moved a READ into `memory` ("host", "cuda") from the same kind:
  the protocol descriptions and transport configs of the rows it used (all
  rows where the table has no counts), each joined with "; "."""

  memory: str
  protocol: str
  transport: str
  count: int

  @property
  def emulated(self) -> bool:
    """True if UCX emulated the READ in software (messages, not a one-sided copy)."""
    return "emulation" in self.protocol

  @property
  def over_tcp(self) -> bool:
    """True if the bytes went over TCP (loopback on one host)."""
    return any(t.strip().startswith("tcp") for t in self.transport.split(";"))


def read_path(tables: list[ProtoTable], memory: str) -> ReadPath | None:
  """The `ReadPath` of READs into `memory` from `memory` in `tables`, or None
  if UCX logged no such table. Rows of several tables (one per endpoint
  configuration) are combined; rows with a zero count are left out."""
  rows = [
      r for t in tables
      if t.operation == "remote memory read" and t.local_memory == memory and t.remote_memory == memory
      for r in t.rows
  ]
  used = [r for r in rows if r.count != 0]
  if not used:
    return None

  def joined(values: list[str]) -> str:
    return "; ".join(dict.fromkeys(v for v in values if v))

  return ReadPath(
      memory, joined([r.description for r in used]), joined([r.config for r in used]),
      sum(max(r.count, 0) for r in used),
  )


def ucx_errors(text: str) -> list[str]:
  """UCX's ERROR and WARN messages in a log, without their prefixes, each once."""
  found = re.findall(r"UCX\s+(?:ERROR|WARN)\s+(.*)$", text, re.MULTILINE)
  return list(dict.fromkeys(m.strip() for m in found))


def ucx_version(text: str) -> str | None:
  """The UCX version a log says was loaded ("1.23.0"), or None."""
  m = re.search(r"UCX\s+INFO\s+Version (\S+)", text)
  return m.group(1) if m else None


# --------------------------------------------------------------------------
# Decisions: pure functions of what was measured.


@dataclasses.dataclass
class ReadResult:
  """One memory kind's loopback READ.

  Attributes:
    memory: "host" or "cuda".
    nbytes: bytes per READ.
    seconds: each READ's time, the first one (connection set-up) included.
    state: "DONE", or what went wrong (NIXL's state or the exception).
    bytes_ok: the READ delivered the target's bytes.
    allocator: what allocated the buffers ("numpy", "torch", "jax").
    devices: the initiator's and the target's device, "cpu" or "cuda:N".
  """

  memory: str
  nbytes: int
  seconds: list[float] = dataclasses.field(default_factory=list)
  state: str = "not run"
  bytes_ok: bool = False
  allocator: str = ""
  devices: str = ""

  @property
  def gbps(self) -> float | None:
    """Median rate of the READs after the first, in GB/s (None if none ran)."""
    timed = self.seconds[1:] or self.seconds
    return self.nbytes / statistics.median(timed) / 1e9 if timed else None


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
  bytes, or one slower than `DEVICE_READ_MIN_GBPS`, is a fail; one that
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
  if rate is not None and rate < DEVICE_READ_MIN_GBPS:
    return Finding("fail", f"{what}{where}: {how}",
                   f"slower than {DEVICE_READ_MIN_GBPS} GB/s: a device transfer this slow loses to Ray's object store.",
                   "Check the GPU topology below and the UCX_* variables; docs/gpu.md says what is known.")
  if path is None:
    return Finding("warn", f"{what}{where}: {how}, protocol unknown",
                   "UCX logged no protocol table for the READ (its log format may have changed).")
  if "cuda_ipc" not in path.transport:
    return Finding("warn", f"{what}{where}: {how}",
                   "the READ does not use CUDA IPC: it is staged through host memory.",
                   "Unset UCX_TLS (or add cuda_ipc to it).")
  return Finding("ok", f"{what}{where}: {how}")


def judge_ray(version: str | None, tested: bool, allow_untested: bool, supported: str, allow_env: str) -> Finding:
  """The verdict on the installed Ray against rdt_jax's tested range.

  Args:
    version: Ray's version, None if Ray is not installed.
    tested: the minor is one rdt_jax tests (`rdt_jax._seam.ray_version_tested`).
    allow_untested: the user set `allow_env` to 1.
    supported: the tested range ("`>=2.59,<2.61`").
    allow_env: the variable's name (`RDT_JAX_ALLOW_UNTESTED_RAY`).
  """
  if version is None:
    return Finding("fail", "Ray is not installed", "rdt_jax's transports plug into Ray",
                   f"pip install 'ray{supported}'")
  if tested:
    return Finding("ok", f"Ray {version} is in the tested range ray{supported}")
  if allow_untested:
    return Finding("warn", f"Ray {version} is outside the tested range ray{supported}",
                   f"{allow_env}=1: register() runs on it with a warning; its behaviour is untested.",
                   f"pip install 'ray{supported}'")
  return Finding("fail", f"Ray {version} is outside the tested range ray{supported}",
                 "register() refuses it (Ray's RDT API is alpha and changes between minor versions).",
                 f"pip install 'ray{supported}', or set {allow_env}=1 in every process to try it.")


def _xla_fraction(env: Mapping[str, str]) -> tuple[float | None, str | None]:
  """XLA's preallocated share of a GPU as jaxlib reads `env`, or an error."""
  new, old = env.get("XLA_CLIENT_MEM_FRACTION", ""), env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
  if new and old:
    return None, "both XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are set (jax refuses that)"
  text = new or old
  if not text:
    return XLA_DEFAULT_FRACTION, None
  try:
    value = float(text)
  except ValueError:
    return None, f"the memory fraction {text!r} is not a number"
  if not 0 < value <= 1:
    return None, f"the memory fraction {text} is not in (0, 1]"
  return value, None


def judge_xla_memory(env: Mapping[str, str], gpu_count: int, processes_per_gpu: int) -> Finding:
  """Whether XLA's preallocation leaves room for `processes_per_gpu` jax
  processes sharing each GPU, with the XLA variables of `env`.

  Read as jaxlib reads them: preallocation is on unless
  `XLA_PYTHON_CLIENT_PREALLOCATE` is false, False or 0, or
  `XLA_PYTHON_CLIENT_ALLOCATOR=platform`; each process then takes
  `XLA_CLIENT_MEM_FRACTION` (or the older `XLA_PYTHON_CLIENT_MEM_FRACTION`)
  of the GPU, 0.75 by default. N processes fit if N x fraction < 1. Without
  a GPU it does not apply.
  """
  what = "XLA GPU memory preallocation"
  if not gpu_count:
    return Finding("ok", f"{what}: does not apply (no GPU)")
  fraction, error = _xla_fraction(env)
  fix_text = (f"Set XLA_PYTHON_CLIENT_PREALLOCATE=false in every jax process's environment (an actor's "
              f"runtime_env env_vars), or XLA_PYTHON_CLIENT_MEM_FRACTION so that the fractions add up to less "
              f"than 1; see {GPU_DOC}.")
  if error:
    return Finding("fail", f"{what}: invalid setting", error, fix_text)
  assert fraction is not None
  prealloc_var = env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "")
  if prealloc_var in XLA_PREALLOCATE_OFF or env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
    return Finding("ok", f"{what}: off (each jax process allocates on demand)")
  shown = f"XLA_PYTHON_CLIENT_PREALLOCATE={prealloc_var}" if prealloc_var else "XLA_PYTHON_CLIENT_PREALLOCATE unset"
  total = processes_per_gpu * fraction
  if processes_per_gpu > 1 and total >= 1:
    return Finding(
        "fail", f"{what}: {processes_per_gpu} jax processes per GPU each preallocate {fraction:.0%}",
        f"{shown}: together they ask for {total:.0%} of each GPU, so the later ones fail to allocate.",
        f"{fix_text} For {processes_per_gpu} processes: XLA_PYTHON_CLIENT_MEM_FRACTION="
        f"{int(0.9 / processes_per_gpu * 100) / 100:g} at most.",
    )
  if processes_per_gpu > 1:
    return Finding("ok", f"{what}: {processes_per_gpu} jax processes per GPU take {total:.0%} of it")
  return Finding(
      "ok", f"{what}: on, {fraction:.0%} of each GPU per jax process",
      f"{shown}. Several jax processes on one GPU (fractional num_gpus) need it off or smaller fractions: "
      f"run `rdt-jax doctor --jax-processes-per-gpu N` to check; see {GPU_DOC}.",
  )


def active_nvlinks(text: str) -> int:
  """Active links in `nvidia-smi nvlink -s` output (lines "Link N: <rate> GB/s")."""
  return len(re.findall(r"Link \d+:\s*[0-9.]+\s*GB/s", text))


def judge_gpus(count: int, names: list[str], seen_by: str, smi_count: int | None,
               peer_access: dict[str, bool], nvlinks: int | None) -> Finding:
  """The verdict on the GPUs: none (ok), visible but to no framework (warn),
  pairs without peer access (warn), else ok with their names."""
  if not count:
    if smi_count:
      return Finding("warn", f"nvidia-smi lists {smi_count} GPU(s) but neither torch nor jax sees one",
                     "rdt_jax moves only what the frameworks put on a device; every array stays in host memory.",
                     "Install CUDA builds of torch and jax (docs/install.md).")
    return Finding("ok", "no GPU visible: the device paths are not checked")
  listed = ", ".join(names)
  no_peer = sorted(k for k, v in peer_access.items() if not v)
  if no_peer:
    return Finding("warn", f"{count} GPU(s) ({listed}); no peer access for {', '.join(no_peer)}",
                   "transfers between those GPUs are staged through host memory.",
                   "Check `nvidia-smi topo -m`; docs/gpu.md says what is known.")
  links = "" if nvlinks is None else f", {nvlinks} active NVLink(s)"
  return Finding("ok", f"{count} GPU(s) seen by {seen_by}: {listed}{links}")


def judge_packages(versions: dict[str, dict[str, Any]], gpu_count: int) -> list[Finding]:
  """Verdicts on what is installed: jax or numpy missing is a fail; NIXL or
  torch missing a warning; on a GPU host, jax without a GPU backend or a
  NIXL build for another CUDA major than torch's a warning."""
  found: list[Finding] = [
      Finding("fail", f"{name} is not installed", "rdt_jax needs it", "pip install -e . (docs/install.md)")
      for name in ("jax", "numpy") if not versions.get(name, {}).get("version")
  ]
  nixl = versions.get("nixl", {})
  if not nixl.get("version"):
    found.append(Finding("warn", "NIXL is not installed: the jax_nixl transport is unavailable",
                         nixl.get("error", ""), "pip install nixl-cu12 (CUDA 13 hosts: nixl-cu13)"))
  if not versions.get("torch", {}).get("version"):
    found.append(Finding("warn", "torch is not installed",
                         "jax_gloo, jax_nccl and Ray's built-in transports need it; jax_nixl and jax_transfer do not.",
                         "pip install -e '.[torch]' (docs/install.md)"))
  if gpu_count:
    backend = versions.get("jax", {}).get("backend")
    if backend and backend != "gpu":
      found.append(Finding("warn", f"jax runs on {backend} on this GPU host",
                           "jax arrays live in host memory; no CUDA plugin for jax is installed or working.",
                           "pip install 'jax[cuda12]' or 'jax[cuda13]' (docs/install.md)"))
    torch_cuda, nixl_cuda = versions.get("torch", {}).get("cuda"), nixl.get("cuda")
    if torch_cuda and nixl_cuda and torch_cuda.split(".")[0] != nixl_cuda.split(".")[0]:
      major = torch_cuda.split(".")[0]
      found.append(Finding("warn", f"NIXL is the CUDA {nixl_cuda} build, torch the CUDA {torch_cuda} one",
                           "UCX's CUDA transports may not load against another CUDA major.",
                           f"pip install nixl-cu{major}"))
  return found


# --------------------------------------------------------------------------
# What is installed.


def _dist_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def _dists_matching(pattern: str) -> dict[str, str]:
  """{distribution name: version} of installed distributions whose
  normalized name matches `pattern`."""
  out: dict[str, str] = {}
  for dist in importlib.metadata.distributions():
    name = (dist.name or "").lower().replace("_", "-")
    if re.fullmatch(pattern, name):
      out[name] = dist.version
  return dict(sorted(out.items()))


def _import_error(module: str) -> str | None:
  """None if `module` imports, else the error, one line."""
  try:
    importlib.import_module(module)
  except Exception as e:  # a broken install raises more than ImportError
    return f"{type(e).__name__}: {e}".splitlines()[0]
  return None


def collect_versions() -> dict[str, dict[str, Any]]:
  """{package: {"version": str | None, "cuda": str | None, ...}} for what
  rdt_jax uses; a missing package has version None (and "error" where an
  installed one fails to import). Imports torch and jax where installed,
  initializes jax's backend (with preallocation off: see `_quiet_xla`)."""
  out: dict[str, dict[str, Any]] = {"python": {"version": platform.python_version()}}
  for name in ("ray", "numpy", "ml_dtypes"):
    out[name] = {"version": _dist_version(name)}
  jax: dict[str, Any] = {"version": _dist_version("jax"), "jaxlib": _dist_version("jaxlib")}
  plugins = _dists_matching(r"jax-cuda\d+-(plugin|pjrt)")
  jax["plugins"] = plugins
  cuda_majors = sorted({re.sub(r"jax-cuda(\d+)-.*", r"\1", p) for p in plugins})
  jax["cuda"] = ",".join(cuda_majors) or None
  if jax["version"]:
    error = _import_error("jax")
    if error:
      jax["error"] = error
    else:
      try:
        import jax as jax_module

        jax["backend"] = jax_module.default_backend()
        jax["devices"] = [str(d) for d in jax_module.devices()]
      except Exception as e:
        jax["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
  out["jax"] = jax
  torch: dict[str, Any] = {"version": _dist_version("torch")}
  if torch["version"]:
    error = _import_error("torch")
    if error:
      torch["error"] = error
    else:
      import torch as torch_module

      torch["cuda"] = torch_module.version.cuda
  out["torch"] = torch
  cupy = _dists_matching(r"cupy(-cuda\d+x)?")
  out["cupy"] = {
      "version": next(iter(cupy.values()), None),
      "cuda": next((re.sub(r"cupy-cuda(\d+)x", r"\1", n) for n in cupy if n != "cupy"), None),
  }
  out["nixl"] = _nixl_version()
  return out


def _nixl_version() -> dict[str, Any]:
  """NIXL as rdt_jax imports it (`rdt_jax._compat.nixl_api`): the module,
  its distribution's version and CUDA build."""
  from rdt_jax import _compat

  try:
    api = _compat.nixl_api()
  except ImportError as e:
    return {"version": None, "error": str(e)}
  except Exception as e:  # installed, but its libraries fail to load
    return {"version": _dist_version("nixl-cu12") or _dist_version("nixl-cu13"), "error": f"{type(e).__name__}: {e}"}
  module = api.__name__  # "nixl_cu12._api" also when reached through the `nixl` meta package
  package = module.split(".")[0]
  m = re.fullmatch(r"nixl_cu(\d+)", package)
  return {
      "version": _dist_version(package.replace("_", "-")) or _dist_version("nixl"),
      "module": module,
      "cuda": m.group(1) if m else None,
      "meta_package": _dist_version("nixl"),
  }


def ray_builtin_usable(torch_cuda: bool, nixl_meta: bool) -> dict[str, bool]:
  """Which of Ray's built-in transports (`RAY_BUILTIN`) can run here: all
  need torch; `nixl` the `nixl` meta package, `nccl` and `cuda_ipc` a GPU
  torch sees (`torch_cuda`). Pass `torch_cuda=False` without torch."""
  return {"nixl": nixl_meta, "gloo": True, "nccl": torch_cuda, "cuda_ipc": torch_cuda}


def collect_transports(versions: dict[str, dict[str, Any]],
                       gpus: dict[str, Any]) -> tuple[dict[str, Any], list[Finding]]:
  """What `rdt_jax.register()` registers here (it needs no running Ray), and
  which of Ray's built-in transports can run here."""
  has_torch = bool(versions["torch"].get("version")) and not versions["torch"].get("error")
  usable = ray_builtin_usable(gpus["seen_by"] == "torch", _import_error("nixl") is None) if has_torch else {}
  info: dict[str, Any] = {
      "ray_builtin": {name: {"usable": usable.get(name, False), "needs": f"torch, {needs}"}
                      for name, needs in RAY_BUILTIN.items()},
  }
  try:
    import rdt_jax

    names = rdt_jax.register()
  except Exception as e:
    info["rdt_jax"] = []
    info["error"] = f"{type(e).__name__}: {e}"
    return info, [Finding("fail", "rdt_jax.register() failed", info["error"],
                          "Fix what the error names (docs/troubleshooting.md).")]
  info["rdt_jax"] = names
  return info, [Finding("ok", f"registered: {', '.join(names)}")]


def collect_ray() -> tuple[dict[str, Any], Finding]:
  """The installed Ray against the tested range (`rdt_jax._seam`)."""
  try:
    import ray

    from rdt_jax import _seam, _settings
  except ImportError as e:
    return {"version": None, "error": str(e)}, judge_ray(None, False, False, ">=2.59,<2.61", "")
  info: dict[str, Any] = {
      "version": ray.__version__, "tested_range": _seam.SUPPORTED_RAY, "tested": _seam.ray_version_tested(),
  }
  try:
    allow = bool(_settings.value(_seam.ALLOW_UNTESTED_ENV))
  except ValueError as e:  # SettingError: not a bool
    return info, Finding("fail", f"invalid {_seam.ALLOW_UNTESTED_ENV}", str(e), "Set it to 0 or 1.")
  info["allow_untested"] = allow
  return info, judge_ray(ray.__version__, info["tested"], allow, _seam.SUPPORTED_RAY, _seam.ALLOW_UNTESTED_ENV)


def _run_tool(args: list[str], timeout_s: float = 10.0) -> str | None:
  """A command's stdout (stderr appended on failure), or None if the tool is missing."""
  if shutil.which(args[0]) is None:
    return None
  try:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return f"(`{' '.join(args)}` did not answer within {timeout_s:.0f} s)"
  except OSError as e:
    return f"(`{' '.join(args)}` failed: {e})"
  return proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr


def collect_gpus() -> dict[str, Any]:
  """GPUs as torch (else jax) sees them: count, names, peer access between
  each ordered pair (torch), and `nvidia-smi`'s list, NVLink status and
  topology where the tool exists (each call under a 10 s timeout)."""
  info: dict[str, Any] = {"count": 0, "names": [], "seen_by": "", "peer_access": {}}
  try:
    import torch

    if torch.cuda.is_available():
      n = torch.cuda.device_count()
      info.update(count=n, seen_by="torch", names=[torch.cuda.get_device_name(i) for i in range(n)])
      info["peer_access"] = {
          f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j))
          for i in range(n) for j in range(n) if i != j
      }
  except Exception as e:  # no torch, or a broken CUDA
    info["torch_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
  if not info["count"]:
    try:
      import jax

      gpus = jax.devices("gpu")
      info.update(count=len(gpus), seen_by="jax", names=[d.device_kind for d in gpus])
    except Exception:  # no jax GPU backend
      pass
  listing = _run_tool(["nvidia-smi", "-L"])
  info["nvidia_smi"] = listing is not None
  if listing is not None:
    info["smi_count"] = len(re.findall(r"^GPU \d+:", listing, re.MULTILINE))
    info["smi_list"] = listing.strip()
    nvlink = _run_tool(["nvidia-smi", "nvlink", "-s"]) or ""
    info["nvlink"] = nvlink.strip()
    info["active_nvlinks"] = active_nvlinks(nvlink)
    info["topology"] = (_run_tool(["nvidia-smi", "topo", "-m"]) or "").strip()
  return info


# --------------------------------------------------------------------------
# The loopback READ: two NIXL agents in two spawned processes.


def _pattern(nbytes: int) -> Any:
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
  from rdt_jax import _dlpack

  if memory == "host":
    import numpy as np

    host = _pattern(nbytes) if fill else np.zeros(nbytes, np.uint8)
    return host, _dlpack.host_pointer(host), "DRAM", "numpy", "cpu"
  if _dlpack.cuda_available("torch"):
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
    return bool(np.array_equal(received, _pattern(nbytes)))
  host = received.cpu().numpy() if hasattr(received, "cpu") else np.asarray(received)  # torch, else jax
  return bool(np.array_equal(host.reshape(-1), np.arange(nbytes // 4, dtype=np.int32)))


def _loopback_target(conn: Any, env: dict[str, str], api_module: str, memories: list[str], nbytes: int,
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


def _loopback_initiator(conn: Any, env: dict[str, str], api_module: str, memories: list[str], nbytes: int,
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


@dataclasses.dataclass
class Loopback:
  """What the loopback found: each memory kind's READ, the node-local read's
  state and rate, UCX's logs, and the children's output where something
  went wrong."""

  reads: dict[str, ReadResult]
  error: str | None = None
  node_local: str = "not run"
  node_local_gbps: float | None = None
  log: str = ""
  output: str = ""


def _node_local_read(identity: Any, remote_ptr: int, nbytes: int) -> tuple[str, float | None]:
  """rdt_jax's node-local read of the target's host buffer into this
  process: ("ok", GB/s), ("off", None) or (the error, None)."""
  import numpy as np

  from rdt_jax import _dlpack
  from rdt_jax import _node_local as node_local

  if not node_local.enabled():
    return "off", None
  if not node_local.can_read(identity):
    return "not on this host's pid namespace", None
  buf = np.zeros(nbytes, np.uint8)
  pairs = [(_dlpack.host_pointer(buf), remote_ptr, nbytes)]
  seconds = []
  try:
    for _ in range(3):  # the first one also faults the fresh buffer's pages in
      start = time.perf_counter()
      node_local.read(identity, pairs)
      seconds.append(time.perf_counter() - start)
  except OSError as e:
    return f"{type(e).__name__}: {e}", None
  if not np.array_equal(buf, _pattern(nbytes)):
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
  """Runs the loopback READ (see the module docstring) and returns what it found.

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
    target = ctx.Process(target=_loopback_target, args=(t_child, child_env, api_module, memories, nbytes, gpus, out),
                         daemon=True)
    initiator = ctx.Process(
        target=_loopback_initiator,
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


# --------------------------------------------------------------------------
# The whole check.


@contextlib.contextmanager
def _quiet_xla() -> Iterator[None]:
  """XLA preallocation off in this process while the doctor initializes
  jax's backend (on a GPU it would take 75% of each GPU from the processes
  it reports on); the user's value is restored after."""
  name = "XLA_PYTHON_CLIENT_PREALLOCATE"
  before = os.environ.get(name)
  os.environ[name] = "false"
  try:
    yield
  finally:
    if before is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = before


def jax_nixl_ucx_env(user_env: Mapping[str, str], cuda: bool | None = None) -> tuple[dict[str, str], dict[str, str]]:
  """(the `UCX_*` variables a jax_nixl process has when started with
  `user_env`, those of them rdt_jax sets itself): `ucx.apply_defaults`
  applied to a copy, as `register()` and the agent's creation apply it.

  Args:
    cuda: whether the host has a CUDA driver (default: `ucx.cuda_driver_present()`).

  Raises:
    SettingError: if `RDT_JAX_UCX_DEFAULTS` is not a bool.
  """
  from rdt_jax.transports.nixl import ucx

  env = dict(user_env)
  applied = ucx.apply_defaults(env, cuda=cuda)
  return {k: v for k, v in sorted(env.items()) if k.startswith("UCX_")}, applied


def collect(mb: int = 16, timeout_s: float = 60.0, processes_per_gpu: int = 1) -> dict[str, Any]:
  """Every check (see the module docstring), as a JSON-ready dict with the
  findings under "findings" and the exit status under "exit_status"."""
  user_env = dict(os.environ)  # before register(), which sets the UCX defaults here
  findings: list[Finding] = []
  report: dict[str, Any] = {"schema": "rdt-jax-doctor/1"}
  with _quiet_xla():
    versions = collect_versions()
    gpus = collect_gpus()
  report["versions"] = versions
  report["ray"], ray_finding = collect_ray()
  findings.append(ray_finding)
  report["transports"], transport_findings = collect_transports(versions, gpus)
  findings += transport_findings
  findings += judge_packages(versions, gpus["count"])
  report["gpus"] = gpus
  findings.append(judge_gpus(gpus["count"], gpus["names"], gpus["seen_by"], gpus.get("smi_count"),
                             gpus["peer_access"], gpus.get("active_nvlinks")))
  try:
    report["ucx"], ucx_findings = _check_ucx(user_env, versions["nixl"], gpus, mb, timeout_s)
  except Exception as e:  # a broken install can raise anything: the doctor reports it instead of crashing
    report["ucx"] = {"error": f"{type(e).__name__}: {e}"}
    ucx_findings = [Finding("fail", "the UCX checks could not run", report["ucx"]["error"],
                            "Fix what the error names (a broken NIXL, Ray or rdt_jax install), then run it again.")]
  findings += ucx_findings
  xla_prefixes = ("XLA_PYTHON_CLIENT_", "XLA_CLIENT_")
  report["xla_memory"] = {k: v for k, v in sorted(user_env.items()) if k.startswith(xla_prefixes)}
  findings.append(judge_xla_memory(user_env, gpus["count"], processes_per_gpu))
  report["findings"] = [dataclasses.asdict(f) for f in findings]
  report["exit_status"] = exit_status(findings)
  return report


def _check_ucx(user_env: Mapping[str, str], nixl: dict[str, Any], gpus: dict[str, Any], mb: int,
               timeout_s: float) -> tuple[dict[str, Any], list[Finding]]:
  """The UCX part: the environment a jax_nixl process has, the loopback
  READs and their verdicts."""
  info: dict[str, Any] = {}
  try:
    env, applied = jax_nixl_ucx_env(user_env)
    from rdt_jax.transports.nixl import ucx

    problem = ucx.device_read_problem(env)
  except ValueError as e:  # SettingError: RDT_JAX_UCX_DEFAULTS is not a bool
    return info, [Finding("fail", "invalid RDT_JAX_UCX_DEFAULTS", str(e), "Set it to 0 or 1.")]
  info.update(env=env, set_by_rdt_jax=applied, device_read_problem=problem)
  findings = [judge_device_read_settings(problem, gpus["count"])]
  if not nixl.get("module"):
    findings.append(judge_host_read(None, None, False, []))
    return info, findings
  memories = ["host", "cuda"] if gpus["count"] else ["host"]
  gpu_pair = (0, min(1, gpus["count"] - 1)) if gpus["count"] else (0, 0)
  loop = run_loopback(env, nixl["module"], memories, mb << 20, gpu_pair, timeout_s)
  tables = parse_proto_tables(loop.log)
  errors = ucx_errors(loop.log)
  if loop.error and not errors and loop.output:
    errors = [loop.output.strip().splitlines()[-1]]
  paths = {m: read_path(tables, m) for m in memories}
  reads = {}
  for memory, result in loop.reads.items():
    path = paths.get(memory)
    reads[memory] = {**dataclasses.asdict(result), "gbps": result.gbps,
                     "path": dataclasses.asdict(path) if path else None}
  info.update(
      version=ucx_version(loop.log), nbytes=mb << 20, error=loop.error, errors=errors, reads=reads,
      node_local={"state": loop.node_local, "gbps": loop.node_local_gbps},
  )
  if loop.output:
    info["children_output"] = loop.output
  findings.append(judge_host_read(loop.reads["host"], paths["host"], loop.node_local == "ok", errors))
  findings.append(judge_node_local(loop.node_local, loop.node_local_gbps))
  if gpus["count"]:
    findings.append(judge_device_read(loop.reads["cuda"], paths["cuda"], errors))
  return info, findings


# --------------------------------------------------------------------------
# Output and the command line.


def _version_line(name: str, v: dict[str, Any]) -> str:
  version = v.get("version") or "missing"
  notes = []
  if name == "jax":
    notes.append(f"jaxlib {v.get('jaxlib') or 'missing'}")
    if v.get("plugins"):
      notes.append("plugins " + ", ".join(f"{k} {x}" for k, x in v["plugins"].items()))
    if v.get("backend"):
      notes.append(f"backend {v['backend']}")
  elif name == "torch" and v.get("version"):
    notes.append(f"CUDA {v['cuda']}" if v.get("cuda") else "CPU build")
  elif name == "cupy" and v.get("cuda"):
    notes.append(f"CUDA {v['cuda']}")
  elif name == "nixl" and v.get("module"):
    notes.append(f"{v['module'].split('.')[0]}" + (f", CUDA {v['cuda']} build" if v.get("cuda") else ""))
  if v.get("error") and v.get("version"):  # installed, but fails to import
    notes.append(v["error"].splitlines()[0][:160])
  if name == "ray" and v.get("tested_range"):
    notes.append(f"tested range ray{v['tested_range']}")
  return f"  {name:<10} {version}" + (f"  ({'; '.join(notes)})" if notes else "")


def render_text(report: dict[str, Any]) -> str:
  """The report as a person reads it: sections, then the findings with their
  why and fix, then the exit status."""
  lines = ["rdt-jax doctor", "", "Versions"]
  versions = {**report["versions"], "ray": {**report["versions"]["ray"], **report["ray"]}}
  lines += [_version_line(k, v) for k, v in versions.items()]
  t = report["transports"]
  lines += ["", "Transports",
            f"  rdt_jax    {', '.join(t['rdt_jax']) or 'none'}" + (f"  ({t['error']})" if t.get("error") else ""),
            "  Ray        " + ", ".join(k for k, v in t["ray_builtin"].items() if v["usable"]) + " usable here"]
  lines += [f"  {'':<10} {k}: needs {v['needs']}" for k, v in t["ray_builtin"].items() if not v["usable"]]
  g = report["gpus"]
  lines += ["", "GPUs"]
  if g["count"]:
    lines += [f"  {i}: {name}" for i, name in enumerate(g["names"])]
    if g["peer_access"]:
      lines.append("  peer access: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in g["peer_access"].items()))
    for key in ("nvlink", "topology"):
      if g.get(key):
        lines += [f"  nvidia-smi {'nvlink -s' if key == 'nvlink' else 'topo -m'}:"]
        lines += [f"    {line}" for line in g[key].splitlines()]
  else:
    lines.append("  none visible" + (" to torch or jax; nvidia-smi: " + g["smi_list"] if g.get("smi_list") else ""))
  u = report["ucx"]
  lines += ["", "UCX"]
  if u.get("error") and "reads" not in u:
    lines.append(f"  could not run: {u['error']}")
  if "env" in u:
    lines.append("  environment of a jax_nixl process: " + (" ".join(
        f"{k}={v}" + (" (set by rdt_jax)" if k in u["set_by_rdt_jax"] else "") for k, v in u["env"].items())
        or "no UCX_* variables"))
  if "reads" in u:
    lines.append(f"  loopback READ of {u['nbytes'] >> 20} MiB between two processes, UCX {u.get('version') or '?'}:")
    for memory, r in u["reads"].items():
      path = r["path"]
      how = f"{path['protocol']} over {path['transport']}" if path else "protocol not logged"
      rate = f"{r['gbps']:.2f} GB/s" if r["gbps"] else "no rate"
      state = "" if r["state"] == "DONE" else f", {r['state'].splitlines()[0][:200]}"
      lines.append(f"    {memory:<5} {how}, {rate}{state}")
    nl = u["node_local"]
    lines.append(f"  node-local host read (process_vm_readv): {nl['state']}"
                 + (f", {nl['gbps']:.2f} GB/s" if nl.get("gbps") else ""))
  if report["xla_memory"]:
    lines += ["", "XLA", *(f"  {k}={v}" for k, v in report["xla_memory"].items())]
  lines += ["", "Findings"]
  for f in report["findings"]:
    lines.append(f"  {f['severity']:<4}  {f['what']}")
    if f["severity"] != "ok" or f["why"]:
      lines += [f"        {label}: {f[label]}" for label in ("why", "fix") if f[label]]
  fails = sum(f["severity"] == "fail" for f in report["findings"])
  warns = sum(f["severity"] == "warn" for f in report["findings"])
  lines += ["", f"{fails} fail, {warns} warn: exit status {report['exit_status']}"]
  return "\n".join(lines)


def _positive(kind: type) -> Any:
  """An argparse type: a `kind` number above 0."""

  def parse(text: str) -> Any:
    try:
      value = kind(text)
    except ValueError:
      value = 0
    if value <= 0:
      raise argparse.ArgumentTypeError(f"{text!r} is not a positive {kind.__name__}")
    return value

  return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The `rdt-jax doctor` options."""
  parser.add_argument("--json", action="store_true", help="print the report as JSON (for bug reports and tools)")
  parser.add_argument("--mb", type=_positive(int), default=16, help="MiB per loopback READ (default 16)")
  parser.add_argument("--timeout", type=_positive(float), default=60.0,
                      help="seconds the loopback READ may take before it counts as failed (default 60)")
  parser.add_argument("--jax-processes-per-gpu", type=_positive(int), default=1, metavar="N",
                      help="jax processes that will share each GPU (actors with fractional num_gpus); "
                           "checks that XLA's preallocation leaves room for them (default 1)")


def run(args: argparse.Namespace) -> int:
  """Runs every check, prints the report (text, or JSON with `--json`) on
  stdout and returns the exit status: 1 if any finding is a fail, else 0."""
  report = collect(args.mb, args.timeout, args.jax_processes_per_gpu)
  print(json.dumps(report, indent=2) if args.json else render_text(report))
  sys.stdout.flush()
  return int(report["exit_status"])
