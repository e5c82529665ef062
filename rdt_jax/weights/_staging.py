"""A template's staging arrays: where an `atomic=True` pull lands before its
commit, one new array per leaf written in place."""

from __future__ import annotations

import dataclasses
from typing import Any

from rdt_jax import _dlpack, _layout

__all__ = ["empty_like", "in_place", "staged"]


def empty_like(x: Any) -> Any:
  """A new array of `x`'s framework, shape, dtype and device (atomic staging)."""
  fw = _dlpack.framework_of(x)
  if fw == "numpy":
    import numpy as np

    return np.empty_like(x)
  if fw == "torch":
    import torch

    return torch.empty_like(x)
  import cupy

  return cupy.empty_like(x)


def staged(leaf: Any) -> Any:
  """The staging counterpart of one template leaf: in-place leaves (numpy,
  torch, cupy, a Slice's `into` array) get a new array; templates of new
  arrays (jax, shardings, a Slice without `into`) are their own."""
  if isinstance(leaf, _layout.Slice):
    return leaf if leaf.into is None or _dlpack.framework_of(leaf.into) in (None, "jax") else (
        dataclasses.replace(leaf, into=empty_like(leaf.into)))
  fw = _dlpack.framework_of(leaf)
  return leaf if fw in (None, "jax") else empty_like(leaf)


def in_place(leaf: Any) -> Any:
  """The array a template leaf is written into in place, or None."""
  if isinstance(leaf, _layout.Slice):
    leaf = leaf.into
  fw = _dlpack.framework_of(leaf)
  return None if fw in (None, "jax") else leaf
