"""What the test modules share: sample arrays, digests, waiting, actor-side counters.

Ray workers import this module too (actor classes and builder functions in the
test modules call it; conftest puts tests/ on the workers' PYTHONPATH), so it
needs nothing from pytest. It uses only rdt_jax's public API: the tests that
import it check the contract, and run unchanged against an installed wheel.
That is also why the sample values and digests here are not imported from the
contract kit's private `rdt_jax.testing._values`, which makes the same ones: the
suite's checks stay independent of the kit it tests (tests/test_conformance.py),
and importing the kit would import Ray, which the Ray-free array-layer tests refuse.

Frameworks are imported lazily: a value can only be a `jax.Array` or a
`torch.Tensor` if that framework is already imported.
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

import rdt_jax

# ---- arrays


def np_dtype(name: str) -> np.dtype:
  """The numpy dtype named `name`, bfloat16 and the float8 types included."""
  try:
    return np.dtype(name)
  except TypeError:
    return np.dtype(getattr(ml_dtypes, name))


def framework_of(x: Any) -> str | None:
  """"jax", "torch" or "numpy" for an array of that framework, else None."""
  if isinstance(x, np.ndarray):
    return "numpy"
  jax = sys.modules.get("jax")
  if jax is not None and isinstance(x, jax.Array):
    return "jax"
  torch = sys.modules.get("torch")
  if torch is not None and isinstance(x, torch.Tensor):
    return "torch"
  return None


def is_array(x: Any) -> bool:
  return framework_of(x) is not None


def tree_map_arrays(fn: Callable[[Any], Any], tree: Any) -> Any:
  """`fn` applied to every array leaf of `tree`; other leaves stay as they are."""
  import jax

  return jax.tree_util.tree_map(lambda x: fn(x) if is_array(x) else x, tree, is_leaf=is_array)


def sample(shape: tuple, dtype_name: str, seed: int = 0) -> np.ndarray:
  """Deterministic values of any dtype, as a numpy array."""
  rng = np.random.default_rng(seed)
  dtype = np_dtype(dtype_name)
  if dtype == np.bool_:
    return rng.integers(0, 2, shape).astype(bool)
  if dtype.kind in "iu":
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)
  if dtype.kind == "c":
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
  return (rng.standard_normal(shape) * 2).astype(dtype)


def random_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
  """`nbytes` random uint8 values, the same for the same seed."""
  return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def jax_bytes(nbytes: int, seed: int = 0):
  """`random_bytes` as a jax array (a builder: runs on the producer)."""
  import jax.numpy as jnp

  return jnp.asarray(random_bytes(nbytes, seed))


def int4_leaf():
  """A sub-byte dtype, which DLPack cannot carry (a builder)."""
  import jax.numpy as jnp

  return {"q": jnp.zeros(8, jnp.int4)}


# ---- digests


def digest(x: Any) -> str:
  """sha256 of an array's dtype, shape and bytes in C order, for any framework.

  Every byte counts in its place: reordered chunks, an offset or a wrong
  shape or dtype give another digest.
  """
  host = np.ascontiguousarray(rdt_jax.to_numpy(x))
  h = hashlib.sha256(f"{host.dtype.name}{host.shape}".encode())
  h.update(host.reshape(-1).view(np.uint8))  # no copy: 512 MiB payloads are hashed
  return h.hexdigest()


def fingerprint(x: Any) -> tuple:
  """(framework, dtype name, shape, digest) of one array."""
  host = rdt_jax.to_numpy(x)
  return framework_of(x), host.dtype.name, tuple(host.shape), digest(host)


def tree_fingerprint(tree: Any) -> Any:
  """`tree` with every array leaf replaced by its fingerprint."""
  return tree_map_arrays(fingerprint, tree)


def expected(build: Callable[..., Any], *args: Any) -> Any:
  """The fingerprint of what `build(*args)` makes, built here with 64-bit jax on."""
  import jax

  with jax.enable_x64(True):
    return tree_fingerprint(build(*args))


# ---- waiting


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.2) -> bool:
  """Polls `predicate` until it is true or `timeout` seconds pass."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(interval)
  return predicate()


def wait_meta(ref):
  """Waits until this process (the owner) knows the ref's transport metadata.

  Ray lends an RDT ref inside a container (e.g. `actor.f.remote([ref])`) only
  once that is so; `ray.wait` alone returns slightly earlier.
  """
  import ray

  manager = ray._private.worker.global_worker.rdt_manager
  meta = manager.wait_for_tensor_transport_metadata(ref.hex(), timeout=60)
  assert meta is not None, f"no transport metadata for {ref} after 60 s"
  return meta


def race(fetch: Callable[[], Any], interrupt: Callable[[], Any], bound_s: float):
  """Runs `fetch()` in a thread, calls `interrupt()` 50 ms later, waits for the fetch.

  Returns ({"value": ...} or {"error": exception}, seconds from start to the
  fetch's end). Fails if the fetch is still running after `bound_s` seconds.
  """
  outcome: dict[str, Any] = {}

  def run():
    try:
      outcome["value"] = fetch()
    except Exception as e:
      outcome["error"] = e

  t0 = time.monotonic()
  thread = threading.Thread(target=run)
  thread.start()
  time.sleep(0.05)
  interrupt()
  thread.join(bound_s)
  assert not thread.is_alive(), f"the fetch still runs {bound_s} s after the interrupt"
  return outcome, time.monotonic() - t0


# ---- subprocesses


def clean_env() -> dict[str, str]:
  """This process's environment minus what pytest or the tests add.

  For commands run as a user would run them: no PYTHONPATH into tests/, and
  no RAY_ADDRESS (they start their own local Ray).
  """
  return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}


# ---- inside actors


def transport_manager(name: str):
  """This process's instance of a registered transport (`"jax_nixl"`, ...)."""
  from ray.experimental.rdt.util import get_tensor_transport_manager

  return get_tensor_transport_manager(name.upper())


def nixl_counts() -> tuple[int, int]:
  """(registered memory regions, objects held) of this process's jax_nixl."""
  t = transport_manager("jax_nixl")
  return t.counters()["registrations"], t.counters()["objects"]


def process_rss() -> int:
  """This process's resident set size in bytes, after a garbage collection."""
  import psutil

  gc.collect()
  return psutil.Process().memory_info().rss


# ---- scripts


def load_script(name: str):
  """scripts/NAME.py as a module (registered in `sys.modules`, so its dataclasses resolve)."""
  import importlib.util
  import pathlib

  spec = importlib.util.spec_from_file_location(
      f"scripts_{name}", pathlib.Path(__file__).parent.parent / "scripts" / f"{name}.py"
  )
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module
