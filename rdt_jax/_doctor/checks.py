"""The whole check: every collection and decision in order, as the JSON-ready
report (`collect`), with the UCX part (`jax_nixl_ucx_env`, the environment a
jax_nixl process has, then the loopback READs and their verdicts)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

from rdt_jax._doctor.gpus import collect_gpus
from rdt_jax._doctor.installed import collect_ray, collect_transports, collect_versions
from rdt_jax._doctor.judge_reads import judge_device_read, judge_device_read_settings, judge_host_read, judge_node_local
from rdt_jax._doctor.judge_setup import judge_gpus, judge_packages, judge_xla_memory
from rdt_jax._doctor.loopback import run_loopback
from rdt_jax._doctor.progress import Progress
from rdt_jax._doctor.records import Finding, exit_status
from rdt_jax._doctor.ucx_log import parse_proto_tables, read_path, ucx_errors, ucx_version


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


#: The checks `collect` runs, in order, as its progress lines name them.
CHECKS = (
    "versions of Python, Ray, jax, numpy, torch, cupy and NIXL",
    "GPUs",
    "Ray's range and the transports register() installs",
    "UCX: a loopback READ between two processes",
    "XLA's GPU memory preallocation",
)


def collect(mb: int = 16, timeout_s: float = 60.0, processes_per_gpu: int = 1,
            progress: TextIO | None = None) -> dict[str, Any]:
  """Every check (see the `rdt_jax._doctor` docstring), as a JSON-ready dict with the
  findings under "findings" and the exit status under "exit_status".

  Args:
    progress: where each check's name is written as it starts, then its result
      (`progress.Progress`); None writes nothing.
  """
  user_env = dict(os.environ)  # before register(), which sets the UCX defaults here
  findings: list[Finding] = []
  report: dict[str, Any] = {"schema": "rdt-jax-doctor/1"}
  steps = Progress(len(CHECKS), progress)
  with _quiet_xla():
    with steps.check(CHECKS[0]) as step:
      versions = collect_versions()
      step.note = ", ".join(f"{k} {versions[k].get('version') or 'missing'}" for k in ("ray", "jax", "nixl"))
    with steps.check(CHECKS[1]) as step:
      gpus = collect_gpus()
      gpu_finding = judge_gpus(gpus["count"], gpus["names"], gpus["seen_by"], gpus.get("smi_count"),
                               gpus["peer_access"], gpus.get("active_nvlinks"))
      step.findings, step.note = [gpu_finding], f"{gpus['count']} visible"
  report["versions"] = versions
  with steps.check(CHECKS[2]) as step:
    report["ray"], ray_finding = collect_ray()
    report["transports"], transport_findings = collect_transports(versions, gpus)
    step.findings = [ray_finding, *transport_findings, *judge_packages(versions, gpus["count"])]
  findings += step.findings
  report["gpus"] = gpus
  findings.append(gpu_finding)
  with steps.check(CHECKS[3]) as step:
    try:
      report["ucx"], step.findings = _check_ucx(user_env, versions["nixl"], gpus, mb, timeout_s)
    except Exception as e:  # a broken install can raise anything: the doctor reports it instead of crashing
      report["ucx"] = {"error": f"{type(e).__name__}: {e}"}
      step.findings = [Finding("fail", "the UCX checks could not run", report["ucx"]["error"],
                               "Fix what the error names (a broken NIXL, Ray or rdt_jax install), then run it again.")]
  findings += step.findings
  xla_prefixes = ("XLA_PYTHON_CLIENT_", "XLA_CLIENT_")
  report["xla_memory"] = {k: v for k, v in sorted(user_env.items()) if k.startswith(xla_prefixes)}
  with steps.check(CHECKS[4]) as step:
    step.findings = [judge_xla_memory(user_env, gpus["count"], processes_per_gpu)]
  findings += step.findings
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
