"""Facts about the environment a benchmark ran in, recorded with its results."""

from __future__ import annotations

import pathlib
import platform
from typing import Any


def versions() -> dict[str, str | None]:
  """The versions of the packages a benchmark result depends on, and Python's."""
  from importlib import metadata

  out: dict[str, str | None] = {}
  for name in ("ray", "jax", "jaxlib", "numpy", "torch", "nixl", "nixl-cu12", "rdt-jax"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  out["nixl"] = out["nixl"] or out.pop("nixl-cu12", None)
  out.pop("nixl-cu12", None)
  out["python"] = platform.python_version()
  return out


def git_state() -> dict[str, Any]:
  """The commit of the rdt_jax being measured, and its uncommitted files."""
  import subprocess

  root = pathlib.Path(__file__).resolve().parents[2]

  def git(*args: str) -> str | None:
    try:
      out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
      return None
    return out.stdout.strip() if out.returncode == 0 else None

  status = git("status", "--porcelain", "--", "rdt_jax")
  return {
      "commit": git("rev-parse", "HEAD"),
      "uncommitted_rdt_jax_files": status.splitlines() if status else [],
  }
