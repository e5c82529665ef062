"""scripts/gpu.sh and scripts/gpu_wheels.sh: what can run without a GPU.

The set-up and run steps need a GPU host; here: argument handling, the
dry-run plan, and the clear refusal on a host without CUDA.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  return subprocess.run(
      ["bash", str(REPO / "scripts" / script), *args],
      capture_output=True, text=True, timeout=300, cwd=REPO,
      env=None if env is None else {**os.environ, **env},
  )


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
