"""How a wrap of a Ray function is marked, and the lock installs take.

Every wrapper rdt_jax puts over a Ray function is marked (`mark`): a second
install sees the mark and leaves the function alone, and the shape checks
(`version.py`) read the original through it (`unwrapped`).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["is_ours", "lock", "mark", "unwrapped"]

#: Held while anything is installed or registered with Ray in this process.
lock = threading.RLock()


def mark(wrapper: Any, original: Any) -> None:
  """Marks `wrapper` as ours, keeping `original` for the shape checks."""
  wrapper._rdt_jax = True
  wrapper._rdt_jax_original = original


def is_ours(fn: Any) -> bool:
  """True if `fn` is a wrapper rdt_jax installed (`mark`)."""
  return bool(getattr(fn, "_rdt_jax", False))


def unwrapped(fn: Any) -> Any:
  """The Ray function under our wrapper `fn` (`fn` itself if not ours)."""
  return getattr(fn, "_rdt_jax_original", fn)
