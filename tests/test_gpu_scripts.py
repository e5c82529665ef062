"""scripts/gpu.sh and scripts/gpu_wheels.sh: what can run without a GPU.

The set-up and run steps need a GPU host; here: argument handling, the
dry-run plan, and the clear refusal on a host without CUDA.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  return subprocess.run(
      ["bash", str(REPO / "scripts" / script), *args],
      capture_output=True, text=True, timeout=300, cwd=REPO,
      env=None if env is None else {**os.environ, **env},
  )


@pytest.mark.slow  # imports torch and jax in a subprocess to look for CUDA
def test_gpu_sh_refuses_a_host_without_cuda_clearly():
  # Every GPU hidden, so the refusal is checked on any host, GPU hosts included.
  out = run("gpu.sh", "--dry-run", "--python", sys.executable, env={"CUDA_VISIBLE_DEVICES": ""})
  assert out.returncode == 3, out.stderr
  assert "no CUDA GPU found: torch.cuda.is_available() is False" in out.stderr
  assert "+ " not in out.stdout  # nothing planned, nothing run


def test_gpu_sh_rejects_unknown_arguments():
  out = run("gpu.sh", "--frobnicate")
  assert out.returncode == 2 and "unknown argument --frobnicate" in out.stderr


def test_gpu_sh_help():
  out = run("gpu.sh", "--help")
  assert out.returncode == 0 and "--wheels DIR" in out.stdout


def test_gpu_wheels_dry_run_prints_the_plan(tmp_path):
  target = tmp_path / "wheels"
  out = run("gpu_wheels.sh", "--dry-run", "--out", str(target), "--python-version", "3.12")
  assert out.returncode == 0, out.stderr
  assert "--only-binary=:all: --python-version 3.12" in out.stdout
  assert "ray==2.60.0" in out.stdout and "nixl-cu13==1.5.1" in out.stdout
  assert "jsonschema" in out.stdout  # Ray needs it; GPU images often lack it
  assert "+ strip" in out.stdout and "ray/jars/*" in out.stdout and "nixl_ep_cu13/*" in out.stdout
  assert not target.exists()  # a dry run creates nothing


def test_gpu_wheels_rejects_unknown_arguments():
  out = run("gpu_wheels.sh", "--nope")
  assert out.returncode == 2 and "unknown argument --nope" in out.stderr


def _bench_commands() -> dict[str, list[str]]:
  """The arguments gpu.sh passes to `rdt_jax bench`, by step ("weight-sync",
  "bench"): a variable with a default in the script (`${NAME:-default}`)
  replaced by its default, other shell expansions by 1."""
  import re
  import shlex

  text = (REPO / "scripts" / "gpu.sh").read_text().replace("\\\n", " ")
  defaults = dict(re.findall(r"(\w+)=\$\{\1:-([^}]*)\}", text))
  out = {}
  for line in text.splitlines():
    m = re.search(r"-m rdt_jax bench (.*?) 2>&1", line)
    if m:
      args = [defaults.get(token.lstrip("$"), "1") if "$" in token else token for token in shlex.split(m.group(1))]
      out["weight-sync" if "--weight-sync" in args else "bench"] = args
  return out


def test_gpu_sh_bench_commands_parse_and_name_known_paths():
  """What gpu.sh runs on the GPU, checked here: every option exists, every
  path and case is one the benchmark knows, and the weight-sync step covers
  1, 2 and 4 generators, one leaf, 1,000 and 10,000 leaves, within a budget."""
  import argparse

  from rdt_jax import bench

  commands = _bench_commands()
  assert set(commands) == {"weight-sync", "bench"}
  parser = argparse.ArgumentParser()
  bench.add_arguments(parser)
  weights = parser.parse_args(commands["weight-sync"])
  assert weights.device == "gpu" and weights.budget == 1.0  # passed through from the step's share
  assert weights.weight_sync_generators == "1,2,4" and weights.weight_sync_leaves == "1000,10000"
  assert weights.weight_sync_big_mb > 0 and weights.weight_sync_small_kb > 0  # the one-leaf trees
  args = parser.parse_args(commands["bench"])
  assert {"ray_nixl_torch", "ray_cuda_ipc_torch", "object_store_jax", "device_memcpy"} <= set(args.paths)
  assert {"jax_nixl", "jax_nixl_cuda_ipc"} <= set(args.paths)  # the plain-return path, off and on
  assert args.budget == 1.0
  bench.validate(bench.config_from_args(args))  # raises for an unknown path or case


def test_gpu_sh_plan_splits_the_budget_over_every_step_by_default():
  """The default run fits one lend of a GPU machine: its four steps share
  500 s, tests/gpu the largest part, and each benchmark ends within 85% of
  its share."""
  out = run("gpu.sh", "--plan")
  assert out.returncode == 0, out.stderr
  shares = {line.split(":")[0]: int(line.split()[1]) for line in out.stdout.splitlines()}
  assert list(shares) == ["bench", "tests", "weight-sync", "profile"]
  assert sum(shares.values()) <= 500 and max(shares, key=shares.get) == "tests" and shares["tests"] >= 200
  assert f"own --budget {shares['bench'] * 85 // 100} s" in out.stdout


def test_gpu_sh_plan_shares_the_budget_among_the_steps_asked_for():
  out = run("gpu.sh", "--plan", "--steps", "tests,bench", "--budget", "300")
  assert out.returncode == 0, out.stderr
  shares = {line.split(":")[0]: int(line.split()[1]) for line in out.stdout.splitlines()}
  assert set(shares) == {"bench", "tests"} and 290 <= sum(shares.values()) <= 300
  assert run("gpu.sh", "--plan", "--steps", "tests,nope").returncode == 2
