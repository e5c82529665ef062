"""Tree-level conversion between jax, torch and numpy: `to_jax` and friends.

Each function maps the DLPack layer's leaf converter (`_dlpack.convert_leaf`)
over a pytree, keeping the structure and every non-array leaf as it is.
"""

from __future__ import annotations

from typing import Any

from rdt_jax import _dlpack


def _convert_tree(tree: Any, framework: _dlpack.Framework) -> Any:
  import jax

  if _dlpack.is_array(tree):
    return _dlpack.convert_leaf(tree, framework, "")
  return jax.tree_util.tree_map_with_path(
      lambda path, x: _dlpack.convert_leaf(x, framework, jax.tree_util.keystr(path)),
      tree,
      is_leaf=_dlpack.is_array,
  )


def to_jax(tree: Any) -> Any:
  """Converts every array leaf of `tree` to a `jax.Array`.

  `torch.Tensor` and `np.ndarray` leaves become jax arrays on the matching
  device (cpu tensors on jax's cpu device, cuda tensors on the gpu), without a
  copy where DLPack allows: cpu torch tensors of every dtype jax imports
  through DLPack, and numpy arrays aligned to 64 bytes (others are copied).
  jax leaves and non-array leaves (ints, strings, None) are returned as they
  are, and the structure is kept.

  Raises:
    UnsupportedLeafError: for a 64-bit leaf while `jax_enable_x64` is off (jax
      would downcast it silently), or a deleted jax array, naming the leaf.
  """
  return _convert_tree(tree, "jax")


def to_torch(tree: Any) -> Any:
  """Converts every array leaf of `tree` to a `torch.Tensor`.

  jax arrays are shared with torch through DLPack, without a copy (do not
  write into the result: jax assumes its arrays never change); numpy arrays
  through `torch.from_numpy`, also without a copy. bfloat16 and float8 leaves
  go through a byte view. Sharded jax arrays are gathered (one copy).
  Non-array leaves and the structure are kept. Needs torch installed.

  Raises:
    UnsupportedLeafError: for a dtype torch has no type for (e.g.
      float8_e3m4) or a deleted jax array, naming the leaf.
    ImportError: if torch is not installed.
  """
  return _convert_tree(tree, "torch")


def to_numpy(tree: Any) -> Any:
  """Converts every array leaf of `tree` to an `np.ndarray`.

  cpu arrays are viewed without a copy where the framework allows it; device
  arrays are copied to host memory. bfloat16 and float8 leaves get their
  `ml_dtypes` dtype. Non-array leaves and the structure are kept.

  Raises:
    UnsupportedLeafError: for a deleted jax array, naming the leaf.
  """
  return _convert_tree(tree, "numpy")
