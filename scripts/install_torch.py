"""Installs torch into the running Python's environment by one rule.

Every environment the set-up and test scripts build takes torch through this
script (run it with that environment's python):

* torch 2.13.0 already installed: nothing to do.
* A host with an NVIDIA GPU (or ``RDT_JAX_TORCH=cuda``): ``pip install
  torch==2.13.0``, which on Linux x86_64 is PyPI's CUDA build.
* A host without one: a CPU build, never the CUDA build's several GB.
  1. What pip's own configuration offers, if that is a CPU build (a wheel
     file or an index that a machine's pip configuration names).
  2. Otherwise PyTorch's CPU index (``RDT_JAX_TORCH_CPU_INDEX``, default
     https://download.pytorch.org/whl/cpu), if it answers.
  3. Otherwise stop before any download (exit status 3) with the exact command
     that installs a CPU build, or, with ``--optional``, go on without torch.

Whether a candidate is the CUDA build is read from pip's own resolution
(``pip install --dry-run --no-deps --report``, which reads the wheel's
metadata, not the wheel): the CUDA build requires ``nvidia-*`` packages, a CPU
build none.

    python scripts/install_torch.py            # torch is required
    python scripts/install_torch.py --optional # without a CPU build, no torch

``RDT_JAX_TORCH``: ``auto`` (default) as above, ``cpu`` as on a host without a
GPU, ``cuda`` to take PyPI's default (CUDA) build on any host.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile

TORCH = "torch==2.13.0"
DEFAULT_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Exit status when the CUDA build is all pip could get and no GPU is here.
STOPPED = 3


def installed_torch() -> str | None:
  """The installed torch's version, or None."""
  try:
    return importlib.metadata.version("torch")
  except importlib.metadata.PackageNotFoundError:
    return None


def has_nvidia_gpu() -> bool:
  """Whether this host has an NVIDIA GPU that its driver sees."""
  gpus = pathlib.Path("/proc/driver/nvidia/gpus")
  if gpus.is_dir() and any(gpus.iterdir()):
    return True
  if shutil.which("nvidia-smi") is None:
    return False
  try:
    out = subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
    )
  except (OSError, subprocess.TimeoutExpired):
    return False
  return out.returncode == 0 and "GPU" in out.stdout


def pip(*args: str) -> list[str]:
  return [sys.executable, "-m", "pip", *args]


def resolve(index_args: list[str]) -> list[str] | None:
  """The requirements of the torch wheel pip would pick with ``index_args``,
  or None if it finds none. Reads the wheel's metadata only (an index serves
  it apart from the wheel), about 2 s."""
  with tempfile.TemporaryDirectory() as tmp:
    report = pathlib.Path(tmp, "report.json")
    cmd = pip(
        "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
        "--report", str(report), *index_args, TORCH,
    )
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not report.exists():
      return None
    data = json.loads(report.read_text())
  for item in data.get("install", []):
    if item["metadata"]["name"].lower() == "torch":
      return list(item["metadata"].get("requires_dist") or [])
  return None


def is_cuda_build(requires: list[str]) -> bool:
  """Whether a torch wheel is a CUDA build: it requires nvidia-* packages."""
  return any(r.strip().lower().startswith("nvidia-") for r in requires)


def install(index_args: list[str]) -> None:
  subprocess.run(pip("install", "--quiet", "--no-compile", *index_args, TORCH), check=True)


def stop_message(cpu_index: str) -> str:
  python = shlex.quote(sys.executable)
  return (
      f"rdt_jax set-up stopped before downloading torch's CUDA build.\n"
      f"  This host has no NVIDIA GPU, pip offers only the CUDA build of {TORCH}\n"
      f"  (several GB with its nvidia-* packages), and PyTorch's CPU index\n"
      f"  ({cpu_index}) did not answer or offered no CPU build.\n"
      f"  Install a CPU build into this environment, then run the same command again:\n"
      f"\n"
      f"    {python} -m pip install {TORCH} --index-url {DEFAULT_CPU_INDEX}\n"
      f"\n"
      f"  (or, from a CPU wheel you have: {python} -m pip install "
      f"/path/to/torch-2.13.0+cpu-*.whl).\n"
      f"  To take the CUDA build anyway, set RDT_JAX_TORCH=cuda."
  )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--optional", action="store_true",
      help="without a CPU build to take, go on without torch instead of stopping",
  )
  args = parser.parse_args(argv)
  mode = os.environ.get("RDT_JAX_TORCH", "auto")
  if mode not in ("auto", "cpu", "cuda"):
    print(f"RDT_JAX_TORCH={mode!r}: expected auto, cpu or cuda", file=sys.stderr)
    return 2
  version = installed_torch()
  if version is not None and version.split("+")[0] == TORCH.split("==")[1]:
    return 0
  if mode == "cuda" or (mode == "auto" and has_nvidia_gpu()):
    print(f"installing {TORCH} (PyPI's CUDA build: several GB)", flush=True)
    install([])
    return 0
  # No GPU: a CPU build or nothing.
  requires = resolve([])
  if requires is not None and not is_cuda_build(requires):
    install([])
    return 0
  cpu_index = os.environ.get("RDT_JAX_TORCH_CPU_INDEX", DEFAULT_CPU_INDEX)
  index_args = ["--index-url", cpu_index, "--timeout", "15", "--retries", "1"]
  requires = resolve(index_args)
  if requires is not None and not is_cuda_build(requires):
    print(f"installing {TORCH}, CPU build, from {cpu_index}", flush=True)
    install(index_args)
    return 0
  if args.optional:
    print(
        f"no CPU build of {TORCH} for this Python here, and no GPU: "
        "going on without torch (tests that need it skip)",
        file=sys.stderr,
    )
    return 0
  print(stop_message(cpu_index), file=sys.stderr)
  return STOPPED


if __name__ == "__main__":
  sys.exit(main())
