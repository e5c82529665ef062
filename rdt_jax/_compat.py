"""Version gates for JAX and NIXL, in one place.

Every place where rdt_jax depends on a specific version of JAX or NIXL is
here, with a comment saying why; the rest of the package imports from this
module instead of testing versions itself. It imports no Ray. Ray is gated in
`rdt_jax._ray`, the one package that touches Ray's internals: the tested Ray
range (`SUPPORTED_RAY`, matching pyproject.toml), a shape check of each
internal made when `register()` installs the wrappers, and the
`RDT_JAX_ALLOW_UNTESTED_RAY` setting (docs/ray_integration.md).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: NIXL's builds, one distribution each (`nixl-cu13`, `nixl-cu12`), newest first.
NIXL_BACKENDS = ("nixl_cu13", "nixl_cu12")


def nixl_api_candidates(installed: Callable[[str], bool]) -> tuple[str, ...]:
  """The `_api` modules `nixl_api` tries, in order, given which modules are
  `installed` (a check that imports nothing).

  With one NIXL build installed, that build's `_api` alone: it is what the
  `nixl` meta package would load, and importing the meta package costs a torch
  import (1.8 s of CPU here) in every process whose torch is a CPU build (the
  meta package reads the CUDA version off torch, importing it when the build
  names none). With both builds, the meta package's choice by CUDA version
  first, then each build.
  """
  builds = [name for name in NIXL_BACKENDS if installed(name)]
  if len(builds) == 1:
    return (f"{builds[0]}._api",)
  return ("nixl._api", *(f"{name}._api" for name in NIXL_BACKENDS))


@functools.lru_cache(maxsize=1)
def nixl_api() -> ModuleType:
  """Returns NIXL's `_api` module, whichever distribution provides it.

  `nixl-cu12` / `nixl-cu13` provide `nixl_cu12` / `nixl_cu13`; the `nixl` meta
  package (both builds, ~450 MB) chooses between them by CUDA version. With
  one build installed we import it directly, without the meta package; with
  both, we take the meta package's choice (`nixl_api_candidates`).

  Raises:
    ImportError: if no NIXL distribution is installed, naming what to install.
  """
  errors = []
  for name in nixl_api_candidates(importable):
    try:
      api = importlib.import_module(name)
    except ImportError as e:
      errors.append(f"{name}: {e}")
      continue
    if "NIXL_LOG_LEVEL" not in os.environ:
      # NIXL logs every agent and backend creation at INFO on stdout; keep
      # actors' output quiet unless the user asks (NIXL_LOG_LEVEL=INFO).
      logging.getLogger("nixl").setLevel(logging.WARNING)
    return api
  raise ImportError(
      "NIXL is not installed in this process, so the `jax_nixl` transport "
      "cannot run here. Install it with `pip install nixl-cu12` (CPU and CUDA "
      "12) or `pip install nixl-cu13` (CUDA 13), in every actor's environment. "
      f"Tried: {'; '.join(errors)}"
  )


def importable(name: str) -> bool:
  """True if module `name` can be imported here (checked without importing
  it; a dotted name imports its parent packages). `rdt_jax._dlpack` looks at
  frameworks with it too."""
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False


def nixl_available() -> bool:
  """True if some NIXL distribution can be imported in this process."""
  try:
    nixl_api()
  except ImportError:
    return False
  return True


def has_jax_transfer() -> bool:
  """True if the installed jax has `jax.experimental.transfer`."""
  try:
    importlib.import_module("jax.experimental.transfer")
  except ImportError:
    return False
  return True


@functools.lru_cache(maxsize=1)
def _single_device_sharding_type() -> type:
  from jax.sharding import SingleDeviceSharding

  return SingleDeviceSharding


def sharding_key(sharding: Any) -> Any:
  """What of jax `sharding` decides how its arrays may be packed, cheap to
  hash and compare: for a `SingleDeviceSharding` its device and memory kind,
  else the sharding itself.

  `SingleDeviceSharding.__hash__` and `__eq__` are Python (about 2 us a leaf,
  the largest share of `_dlpack.packable`'s time for many leaves); its
  device (a C++ object) and memory kind mean the same. jax 0.10 to 0.12 keep
  them as `_device` and `_memory_kind`; where a jax keeps them elsewhere, the
  sharding is its own key (correct, and slower).
  """
  if type(sharding) is _single_device_sharding_type():
    try:
      return sharding._device, sharding._memory_kind  # type: ignore[attr-defined]
    except AttributeError:
      pass
  return sharding


def array_impl_type() -> type:
  """The concrete class of live `jax.Array`s (`jaxlib._jax.ArrayImpl` in 0.10).

  Ray matches serializers on the exact class, so this, not `jax.Array`, is
  what a transport's `data_type` must name.
  """
  # Imported from jax's internals rather than built with jnp.zeros(()), which
  # would start jax's backend (and its threads) before the user asked for it.
  from jax._src.array import ArrayImpl

  return ArrayImpl


@functools.lru_cache(maxsize=1)
def prng_key_array_type() -> type | None:
  """The class of `jax.random.key(...)` arrays, or None if jax moved it."""
  # jax 0.10 keeps it in jax._src.random.prng; earlier releases in jax._src.prng.
  for modname in ("jax._src.random.prng", "jax._src.prng"):
    try:
      return importlib.import_module(modname).PRNGKeyArray
    except (ImportError, AttributeError):
      continue
  return None


_fast_put_broken = False


def host_arrays_to_jax(views: list, device: Any) -> list:
  """Host numpy arrays as jax arrays on the cpu `device`, zero-copy.

  jax 0.10's `xla_client.batched_device_put` (what `jax.device_put` calls
  after its Python-level checks) makes an array in about a third of
  `jax.device_put`'s time per leaf, which dominates objects of many small
  leaves. It aliases 64-byte aligned host memory, as `jax.device_put` does.
  It is private API: on any other signature we fall back to `jax.device_put`.
  """
  global _fast_put_broken
  import jax

  if not _fast_put_broken:
    try:
      from jax._src import core
      from jax._src.lib import xla_client
      from jax.sharding import SingleDeviceSharding

      sharding = SingleDeviceSharding(device)
      put = xla_client.batched_device_put
      devices = [device]
      avals: dict[tuple, Any] = {}  # one aval per (shape, dtype): leaves repeat them
      out = []
      for v in views:
        key = (v.shape, v.dtype)
        aval = avals.get(key)
        if aval is None:
          aval = avals[key] = core.ShapedArray(v.shape, v.dtype)
        out.append(put(aval, sharding, [v], devices, True, False))
      return settled(out)
    except (ImportError, AttributeError, TypeError):
      _fast_put_broken = True
  return settled(jax.device_put(views, device))


def settled(arrays: Any) -> Any:
  """`arrays` (a jax array or a list of them) once every copy jax made from
  host memory to build them has finished.

  jax aliases 64-byte aligned host memory on cpu devices, but copies other
  buffers (unaligned, or to a gpu) and returns before a large copy is done:
  a caller that writes or reuses the host buffer afterwards would change
  what the array holds. An aliasing array is ready at once, so this waits
  only for the copies (`is_ready` is a cheap check per array).
  """
  pending = [a for a in (arrays if isinstance(arrays, list) else [arrays]) if not a.is_ready()]
  for a in pending:
    a.block_until_ready()
  return arrays


#: True once `host_shards_to_jax` found the private call missing or changed.
_fast_shards_broken = False


def host_shards_to_jax(views: list, devices: list, sharding: Any, shape: tuple[int, ...]) -> Any:
  """A jax array of global `shape` with `sharding`, each device's shard
  made from its host numpy view (`views[i]` for `devices[i]`, in the
  sharding's addressable-devices order), zero-copy where jax aliases host
  memory (64-byte aligned views on cpu devices).

  One `xla_client.batched_device_put` call, as `jax.device_put` makes after
  its Python-level checks; on any other signature of that private API,
  `jax.make_array_from_single_device_arrays` over one `jax.device_put` per
  shard.
  """
  return host_shards_putter(devices, sharding, shape, views[0].dtype)(views)


def host_shards_putter(devices: list, sharding: Any, shape: tuple[int, ...], dtype: Any) -> Callable[[list], Any]:
  """`host_shards_to_jax` prepared for one global shape, dtype and sharding:
  a function of the shard views alone, for a caller that makes arrays of one
  kind again and again (a weight subscriber's leaf at every pull). It does
  per call only the private call; the abstract value and the device list
  are made once here."""
  global _fast_shards_broken
  import jax

  devices = list(devices)

  def slow(views: list) -> Any:
    shards = settled([jax.device_put(v, d) for v, d in zip(views, devices)])
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards)

  if not _fast_shards_broken:
    try:
      from jax._src import core
      from jax._src.lib import xla_client

      aval = core.ShapedArray(tuple(shape), dtype)
      put = xla_client.batched_device_put

      def fast(views: list) -> Any:
        global _fast_shards_broken
        try:
          return settled(put(aval, sharding, views, devices, True, False))
        except TypeError:
          _fast_shards_broken = True  # the private signature changed: the public path from now on
          return slow(views)

      return fast
    except (ImportError, AttributeError):
      _fast_shards_broken = True

  return slow

