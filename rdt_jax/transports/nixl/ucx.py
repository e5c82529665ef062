"""The UCX settings jax_nixl runs with, and whether UCX reads device memory at device speed.

NIXL moves bytes with UCX, which reads its `UCX_*` environment once, when a
NIXL agent (a UCP context) is created. One UCX default makes a same-host READ
of GPU memory crawl: UCX 1.23 (the one the NIXL 1.5 wheels bundle) turns the
CUDA IPC GET protocol off on a host where NVML reports no active NVLink, and
then emulates a READ of device memory through host memory and TCP. On one
H200 (docs/benchmarks/gpu/2026-11-27/) a 256 MiB READ took 467 ms
(0.57 GB/s) that way, and 0.23 ms (1,179 GB/s) with
`UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`; a WRITE used CUDA IPC either way.

So, on a host with a CUDA driver and unless `RDT_JAX_UCX_DEFAULTS=0`, `apply_defaults` sets each variable of
`DEVICE_READ_DEFAULTS` that the user did not set, in this process's
environment, before the process's first NIXL agent is created (`register()`
and the agent's creation both call it): Ray's own NIXL transport in the same
process, created later, runs with it too. A variable the user set is never
changed. `device_read_problem` says, for an environment, why a same-host READ
of device memory would still not use CUDA IPC; the agent's creation warns
once with it on a host with a GPU.

Between two GPUs with no NVLink, a CUDA IPC READ crosses PCIe as peer reads,
which some platforms serve slower than peer writes; that is why UCX turned it
off there. docs/gpu.md says what is known.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from collections.abc import MutableMapping
from typing import Final

from rdt_jax import _settings

__all__ = [
    "DEVICE_READ_DEFAULTS", "apply_defaults", "cuda_driver_present", "device_read_env", "device_read_problem",
    "warn_once",
]

#: What jax_nixl sets before an agent exists, unless the variable is set.
DEVICE_READ_DEFAULTS: Final[dict[str, str]] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}

_OFF: Final = frozenset({"n", "no", "0", "off", "false"})
_warned = False


@functools.cache
def cuda_driver_present() -> bool:
  """True if this host has a CUDA driver (`libcuda.so.1` loads): only then
  does UCX load its CUDA transports, and read their variables. Elsewhere a
  `UCX_CUDA_*` variable makes every UCX context warn that it is unused."""
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    return False
  return True


def apply_defaults(environ: MutableMapping[str, str] | None = None, cuda: bool | None = None) -> dict[str, str]:
  """Sets each `DEVICE_READ_DEFAULTS` variable missing from `environ`
  (default: this process's environment), unless `RDT_JAX_UCX_DEFAULTS` is 0
  or the host has no CUDA driver (`cuda`: whether it has one; default:
  `cuda_driver_present()`).

  Returns:
    the variables it set (empty if the user set them all, or turned this off).

  Raises:
    SettingError: if `RDT_JAX_UCX_DEFAULTS` holds a value that is not a bool.
  """
  env = os.environ if environ is None else environ
  if not _settings.value("RDT_JAX_UCX_DEFAULTS"):
    return {}
  if not (cuda_driver_present() if cuda is None else cuda):
    return {}
  applied = {k: v for k, v in DEVICE_READ_DEFAULTS.items() if not env.get(k, "").strip()}
  env.update(applied)
  return applied


def device_read_env() -> dict[str, str]:
  """The `UCX_*` variables a process needs for device-speed READs that the
  current environment does not already decide (empty on a host without a
  CUDA driver): what to pass in a Ray `runtime_env`'s env_vars for
  processes that do not import rdt_jax (Ray's own NIXL transport in a
  benchmark)."""
  return apply_defaults(dict(os.environ))


def device_read_problem(environ: MutableMapping[str, str] | None = None) -> str | None:
  """Why, with `environ` (default: this process's environment), a READ of
  another process's GPU memory on this host would not use CUDA IPC, or None.

  Looks at `UCX_CUDA_IPC_ENABLE_GET_ZCOPY` (off: the READ is emulated
  through host memory and TCP, about 0.5 GB/s) and `UCX_TLS` (a list that
  leaves out `cuda_ipc`, or excludes it).
  """
  env = os.environ if environ is None else environ
  get_zcopy = env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "").strip().lower()
  if get_zcopy in _OFF:
    return (
        f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={env['UCX_CUDA_IPC_ENABLE_GET_ZCOPY']} turns CUDA IPC READs off: a READ "
        "of GPU memory from another process on this host is emulated through host memory and TCP (about "
        "0.5 GB/s instead of hundreds). Unset it (jax_nixl then sets it to y) or set it to y."
    )
  if not get_zcopy and not _settings.value("RDT_JAX_UCX_DEFAULTS"):
    return (
        "RDT_JAX_UCX_DEFAULTS=0 and UCX_CUDA_IPC_ENABLE_GET_ZCOPY is unset: UCX 1.23 turns CUDA IPC READs "
        "off where no NVLink is active, and a READ of GPU memory is then emulated through host memory and "
        "TCP (about 0.5 GB/s). Set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, or unset RDT_JAX_UCX_DEFAULTS."
    )
  tls = [t.strip().lower() for t in env.get("UCX_TLS", "").split(",") if t.strip()]
  if tls:
    excluded = tls[0].startswith("^")
    names = {t.lstrip("^") for t in tls}
    if excluded and names & {"cuda_ipc", "cuda"}:
      return (f"UCX_TLS={env['UCX_TLS']} excludes cuda_ipc: GPU memory moves through host memory. Remove it "
              "from the list.")
    if not excluded and not names & {"all", "cuda_ipc", "cuda"}:
      return (
          f"UCX_TLS={env['UCX_TLS']} leaves out cuda_ipc: GPU memory moves through host memory. Add cuda_ipc "
          "(or unset UCX_TLS)."
      )
  return None


def warn_once(has_gpu: bool) -> str | None:
  """Warns (once per process) with `device_read_problem()` on a host with a
  GPU; returns the problem, or None."""
  global _warned
  problem = device_read_problem() if has_gpu else None
  if problem and not _warned:
    _warned = True
    warnings.warn(f"rdt_jax (jax_nixl): {problem}", RuntimeWarning, stacklevel=3)
  return problem
