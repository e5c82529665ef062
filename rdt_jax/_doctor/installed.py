"""What is installed: the versions and CUDA builds of what rdt_jax uses
(`collect_versions`, NIXL as rdt_jax imports it), the transports
`rdt_jax.register()` registers and Ray's built-in ones (`collect_transports`),
and the Ray version against the tested range (`collect_ray`)."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import re
from typing import Any, Final

from rdt_jax._doctor.judge_setup import judge_ray
from rdt_jax._doctor.records import Finding

#: Ray's own transports (Ray 2.59-2.60 register them in a process on its first
#: RDT use, only where torch imports) and what each needs besides torch.
RAY_BUILTIN: Final = {
    "nixl": "the `nixl` meta package (pip install --no-deps nixl)",
    "gloo": "nothing more",
    "nccl": "a GPU torch sees",
    "cuda_ipc": "a GPU torch sees",
}


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
  initializes jax's backend (with preallocation off: see `checks._quiet_xla`)."""
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
  """The installed Ray against the tested range (`rdt_jax._ray.version`)."""
  try:
    import ray

    from rdt_jax import _settings
    from rdt_jax._ray import version
  except ImportError as e:
    return {"version": None, "error": str(e)}, judge_ray(None, False, False, ">=2.59,<2.61", "")
  info: dict[str, Any] = {
      "version": ray.__version__, "tested_range": version.SUPPORTED_RAY, "tested": version.ray_version_tested(),
  }
  try:
    allow = bool(_settings.value(version.ALLOW_UNTESTED_ENV))
  except ValueError as e:  # SettingError: not a bool
    return info, Finding("fail", f"invalid {version.ALLOW_UNTESTED_ENV}", str(e), "Set it to 0 or 1.")
  info["allow_untested"] = allow
  return info, judge_ray(ray.__version__, info["tested"], allow, version.SUPPORTED_RAY, version.ALLOW_UNTESTED_ENV)
