"""Decisions on the host's set-up: the Ray version against the tested range
(`judge_ray`), what is installed (`judge_packages`), the GPUs (`judge_gpus`)
and XLA's preallocation on a GPU shared by several jax processes
(`judge_xla_memory`, docs/gpu.md "The memory rule").

Pure functions of what was collected; each returns a `Finding` (a list for
`judge_packages`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from rdt_jax._doctor.records import Finding

#: XLA's default share of each GPU when it preallocates (jaxlib's default).
XLA_DEFAULT_FRACTION: Final = 0.75
#: Values of `XLA_PYTHON_CLIENT_PREALLOCATE` that turn preallocation off,
#: exactly as jaxlib's `xla_client` reads it (anything else leaves it on).
XLA_PREALLOCATE_OFF: Final = frozenset({"false", "False", "0"})
GPU_DOC: Final = "docs/gpu.md#the-memory-rule"


def judge_ray(version: str | None, tested: bool, allow_untested: bool, supported: str, allow_env: str) -> Finding:
  """The verdict on the installed Ray against rdt_jax's tested range.

  Args:
    version: Ray's version, None if Ray is not installed.
    tested: the minor is one rdt_jax tests (`rdt_jax._ray.version.ray_version_tested`).
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
