"""The values the transport contract sends, and how it compares them.

Builders (the functions that make the values sent: every dtype in every
framework, mixed pytrees, 0-d and empty arrays, sharded and rejected leaves)
run on the producer, pickled by reference to this module; the driver builds
the same and compares fingerprints (`fingerprint`, `expected`: a sha256 of
every leaf's bytes in order). This module imports neither pytest nor Ray.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

import rdt_jax

# The dtypes every framework's leaves round-trip in (those the framework has).
DTYPES = (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "int64", "float16", "bfloat16",
    "float32", "float64", "complex64", "float8_e4m3fn", "float8_e5m2",
)


# ---- values (builders run on the producer; the driver builds the same to compare)


def _np_dtype(name: str) -> np.dtype:
  try:
    return np.dtype(name)
  except TypeError:
    return np.dtype(getattr(ml_dtypes, name))


def _sample(shape: tuple[int, ...], name: str, seed: int) -> np.ndarray:
  """Deterministic values of dtype `name`, as a numpy array."""
  rng = np.random.default_rng(seed)
  dtype = _np_dtype(name)
  if dtype == np.bool_:
    return rng.integers(0, 2, shape).astype(bool)
  if dtype.kind in "iu":
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)
  if dtype.kind == "c":
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
  return (rng.standard_normal(shape) * 2).astype(dtype)


def _torch_dtype(name: str) -> Any:
  import torch

  return getattr(torch, name, None)


def every_dtype() -> dict[str, Any]:
  """One (3, 5) leaf per dtype and framework: jax, NumPy and (if importable) torch."""
  import jax.numpy as jnp

  tree: dict[str, Any] = {}
  for i, name in enumerate(DTYPES):
    host = _sample((3, 5), name, i)
    tree[f"jax_{name}"] = jnp.asarray(host)
    tree[f"numpy_{name}"] = host
  if torch_importable():
    import torch

    for i, name in enumerate(DTYPES):
      dtype = _torch_dtype(name)
      if dtype is None:
        continue
      host = _sample((3, 5), name, i)
      if host.dtype.kind == "V" or host.dtype.name in ("bfloat16",) or name.startswith("float8"):
        # torch takes no ml_dtypes array: the same bytes, reinterpreted.
        t = torch.from_numpy(host.view(np.uint8).copy()).view(dtype)
      else:
        t = torch.from_numpy(host.copy())
      tree[f"torch_{name}"] = t
  return tree


def mixed_tree() -> dict[str, Any]:
  """jax, NumPy and torch leaves with non-array leaves, nested."""
  import jax.numpy as jnp

  tree: dict[str, Any] = {
      "w": jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64),
      "b": jnp.ones(7, jnp.bfloat16),
      "n": np.arange(6, dtype=np.int32).reshape(2, 3),
      "step": 3,
      "name": "learner",
      "nested": [jnp.full((4,), 2, jnp.int8), (np.full((), 1.5),)],
  }
  if torch_importable():
    import torch

    tree["t"] = torch.arange(10, dtype=torch.float32)
    tree["tb"] = torch.ones(3, dtype=torch.bfloat16)
  return tree


def odd_shapes() -> dict[str, Any]:
  """0-d, empty and one-element leaves."""
  import jax.numpy as jnp

  tree: dict[str, Any] = {
      "scalar": jnp.float32(2.5) * jnp.ones(()),
      "empty": jnp.zeros((0,), jnp.float32),
      "empty3": jnp.zeros((4, 0, 3), jnp.int8),
      "one": jnp.ones((1,), jnp.float16),
      "np_empty": np.zeros((0, 2), np.float32),
  }
  if torch_importable():
    import torch

    tree["torch_scalar"] = torch.tensor(7, dtype=torch.int32)
  return tree


def float32_tree(n: int = 32, seed: int = 0) -> dict[str, Any]:
  import jax.numpy as jnp

  return {"x": jnp.asarray(_sample((n, n), "float32", seed)), "n": np.arange(n, dtype=np.float32)}


def sharded_values() -> dict[str, Any]:
  import jax.numpy as jnp

  return {"x": jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)}


def sharded_leaf() -> dict[str, Any]:
  """`sharded_values()` over a 2x2 mesh of the producer's 4 devices."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  return jax.device_put(sharded_values(), NamedSharding(mesh, PartitionSpec("a", None)))


def int64_leaf() -> dict[str, Any]:
  import jax.numpy as jnp

  return {"i": jnp.arange(5, dtype=jnp.int64)}


def int4_leaf() -> dict[str, Any]:
  import jax.numpy as jnp

  return {"q": jnp.zeros(8, jnp.int4)}


def torch_importable() -> bool:
  try:
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


# ---- fingerprints: every byte in its place


def _framework(x: Any) -> str | None:
  if isinstance(x, np.ndarray):
    return "numpy"
  jax = sys.modules.get("jax")
  if jax is not None and isinstance(x, jax.Array):
    return "jax"
  torch = sys.modules.get("torch")
  if torch is not None and isinstance(x, torch.Tensor):
    return "torch"
  return None


def _fingerprint_leaf(x: Any) -> tuple[str | None, str, tuple[int, ...], str]:
  """(framework, dtype, shape, sha256 of the bytes in C order)."""
  host = rdt_jax.to_numpy(x)
  digest = hashlib.sha256(f"{host.dtype.name}{host.shape}".encode())
  digest.update(np.ascontiguousarray(host).reshape(-1).view(np.uint8).data)  # 0-d: one element
  return _framework(x), host.dtype.name, tuple(host.shape), digest.hexdigest()


def fingerprint(tree: Any) -> Any:
  """`tree` with every array leaf replaced by its fingerprint."""
  import jax

  is_array = lambda x: _framework(x) is not None  # noqa: E731
  return jax.tree_util.tree_map(
      lambda x: _fingerprint_leaf(x) if is_array(x) else x, tree, is_leaf=is_array
  )


def expected(build: Callable[..., Any], *args: Any) -> Any:
  """The fingerprint of what `build(*args)` makes, built here with 64-bit jax."""
  import jax

  with jax.enable_x64(True):
    return fingerprint(build(*args))
