"""Looking at frameworks without importing them (as `array_api_compat` does)."""

from __future__ import annotations

import sys

from rdt_jax._compat import importable as importable


def loaded_type(modname: str, attr: str) -> type | None:
  """`modname.attr` if `modname` is already imported, else None.

  A value can only be a `torch.Tensor` if torch is already imported, so the
  type checks of the layer never import a framework.
  """
  mod = sys.modules.get(modname)
  return getattr(mod, attr, None) if mod is not None else None
