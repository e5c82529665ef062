"""The one error type of the DLPack layer."""

from __future__ import annotations

from typing import Any

from rdt_jax._error_base import RdtJaxError


class UnsupportedLeafError(RdtJaxError, ValueError):
  """A leaf that rdt_jax cannot send or rebuild as asked.

  The message names the leaf by its pytree path (as `jax.tree_util.keystr`
  prints it), its dtype or device, and what to do instead.

  Attributes:
    path: the offending leaf's pytree path ("" if unknown).
  """

  path: str

  def __init__(self, path: str, problem: str, fix: str):
    self.path = path
    where = f"Leaf {path}" if path else "A leaf"
    super().__init__(f"{where} {problem}. {fix}")

  def __reduce__(self) -> tuple[Any, ...]:
    # Crosses processes inside Ray's task errors.
    return _restore_leaf_error, (type(self), self.path, self.args[0])


# Public as `rdt_jax.UnsupportedLeafError`: tracebacks and pickles name that path.
UnsupportedLeafError.__module__ = "rdt_jax"


def _restore_leaf_error(
    cls: type[UnsupportedLeafError], path: str, message: str
) -> UnsupportedLeafError:
  err = cls.__new__(cls)
  ValueError.__init__(err, message)
  err.path = path
  return err
