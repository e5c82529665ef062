"""Facts about the environment a benchmark ran in, recorded with its results."""

from __future__ import annotations

import os
import pathlib
import platform
from collections.abc import Mapping
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


def write_json(path: pathlib.Path, doc: dict[str, Any]) -> dict[str, Any]:
  """Writes a result `doc` as compact JSON at `path` (`_results.write`), with
  the commit it measured (`git_state`: `commit` and `uncommitted_rdt_jax_files`)
  added where the writer did not record it. Every benchmark and soak writes
  through here, or through `_results.write` where it records the commit itself.

  Returns:
    The document written.
  """
  from rdt_jax.bench import _results

  doc = {**git_state(), **doc}
  _results.write(path, doc)
  return doc


def nixl_actor_env() -> dict[str, str]:
  """The UCX variables of every benchmark actor that may create a NIXL agent.

  rdt_jax sets `rdt_jax.transports.nixl.ucx.DEVICE_READ_DEFAULTS` in a
  process before its first NIXL agent (in `rdt_jax.register()`); a process
  that creates Ray's own `nixl` agent need not call it first. Passing these
  in each actor's runtime_env gives rdt_jax's transports and Ray's `nixl`
  the same UCX settings: each variable with this process's value where it
  has one (the user's, or the one `register()` set here), else the default
  `ucx.device_read_env()` gives (none on a host without a CUDA driver, or
  with `RDT_JAX_UCX_DEFAULTS=0`).

  Raises:
    SettingError: if `RDT_JAX_UCX_DEFAULTS` holds a value that is not a bool.
  """
  from rdt_jax.transports.nixl import ucx

  mine = {k: os.environ[k] for k in ucx.DEVICE_READ_DEFAULTS if os.environ.get(k, "").strip()}
  return {**ucx.device_read_env(), **mine}


def ucx_record(actor_env: Mapping[str, str], group_env: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
  """The UCX settings a benchmark ran with, for its results.

  Args:
    actor_env: the variables every NIXL-capable actor got (`nixl_actor_env`).
    group_env: per actor group, the variables of that group's own environment
      (only the `UCX_*` ones are kept; groups without any are left out).

  Returns:
    `{"actors": ..., "groups": ..., "driver": ...}`: the `UCX_*` variables
    passed to every actor, per group on top of them, and set in this
    process's environment (which a Ray started here passes to its workers).
  """
  groups = {
      name: {k: v for k, v in env.items() if k.startswith("UCX_")}
      for name, env in group_env.items()
  }
  return {
      "actors": {k: v for k, v in actor_env.items() if k.startswith("UCX_")},
      "groups": {name: env for name, env in groups.items() if env},
      "driver": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
  }


def ucx_text(record: Mapping[str, Any]) -> str:
  """One sentence naming the UCX settings in `record` (from `ucx_record`)."""

  def names(env: Mapping[str, str]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in env.items()) or "none"

  text = (
      "UCX variables passed to every actor that may create a NIXL agent (Ray's nixl included): "
      + names(record["actors"])
  )
  groups = record.get("groups") or {}
  if groups:
    text += "; besides, " + "; ".join(f"{name} actors: {names(env)}" for name, env in groups.items())
  driver = {k: v for k, v in (record.get("driver") or {}).items() if record["actors"].get(k) != v}
  if driver:
    text += f"; set in the driver's environment too: {names(driver)}"
  return text + "."
