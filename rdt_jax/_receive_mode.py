"""The process's receive mode, set by `rdt_jax.receive_as`.

Read by the transports (what a fetch rebuilds each leaf as) and by weight
sync; set only through `rdt_jax.receive_as`. Kept apart from the Ray wiring
(`_ray`) and the transports so that neither imports the other.
"""

from __future__ import annotations

from rdt_jax._dlpack import RECEIVE_MODES

_receive_mode = "source"


def set_receive_mode(mode: str) -> None:
  """Sets the process's receive mode (see `rdt_jax.receive_as`).

  Raises:
    ValueError: for a mode other than "source", "jax", "torch", "numpy".
  """
  global _receive_mode
  if mode not in RECEIVE_MODES:
    raise ValueError(
        f"Unknown receive mode {mode!r}; expected one of "
        f"{', '.join(repr(m) for m in RECEIVE_MODES)}."
    )
  _receive_mode = mode


def receive_mode() -> str:
  """The current process's receive mode (see `rdt_jax.receive_as`)."""
  return _receive_mode
