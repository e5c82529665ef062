"""A template's staging arrays: where an `atomic=True` pull lands before its
commit, one new array per leaf written in place."""

from __future__ import annotations

import dataclasses
from typing import Any

from rdt_jax import _dlpack, _layout, _memory
from rdt_jax.weights._handle import is_template_leaf

__all__ = ["commit_staged", "empty_like", "in_place", "staged", "staged_tree"]


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


def staged_tree(template: Any) -> Any:
  """The staging counterpart of a whole template (`staged` per leaf)."""
  import jax

  return jax.tree_util.tree_map(staged, template, is_leaf=is_template_leaf)


def commit_staged(template: list[tuple[str, Any]], value: Any) -> Any:
  """Copies the array leaves of `value`, a successful atomic pull into
  staging arrays, into the in-place leaves of `template` (the flattened
  template: `(path, leaf)`); returns the pulled tree with the template's
  arrays in their places.

  Leaves are matched by pytree path, so the pulled value may hold
  non-array leaves the template lacks. One wait per device before and
  after: a CUDA template is written after work queued against it on any
  stream, and holds the version on return."""
  import jax

  targets = {path: into for path, leaf in template if (into := in_place(leaf)) is not None}
  flat, treedef = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_template_leaf)
  copies: list[tuple[Any, Any]] = []
  out = []
  for p, arrived in flat:
    into = targets.get(jax.tree_util.keystr(p)) if _dlpack.is_array(arrived) else None
    if into is None:
      out.append(arrived)
      continue
    copies.append((into, arrived))
    out.append(into)
  _memory.copy_into_many(copies)
  return treedef.unflatten(out)  # type: ignore[attr-defined]
