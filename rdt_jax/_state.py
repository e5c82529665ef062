"""Process state shared by the serializer, the transports and the public API.

Two things, kept apart from both the Ray wiring (`_seam`) and the transports
so that neither imports the other:

* the receive mode set by `rdt_jax.receive_as`;
* the hand-off from the serializer (which sees each leaf with its pytree
  path) to `DlpackTransport.extract_tensor_transport_metadata` (which gets the
  leaves Ray extracted): each leaf's `DescribedLeaf`, so it is described once.
"""

from __future__ import annotations

import threading
from typing import Any

from rdt_jax import _dlpack
from rdt_jax._dlpack._specs import RECEIVE_MODES

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


class _SerializationState(threading.local):
  """Per-thread state of the rdt_jax serialization in progress, if any."""

  def __init__(self) -> None:
    self.transport: str | None = None
    self.context: Any = None
    self.root: Any = None
    self.paths: dict[int, str] | None = None
    # id(leaf) -> (leaf, DescribedLeaf), handed to extract_tensor_transport_metadata.
    self.described: dict[int, tuple[Any, _dlpack.DescribedLeaf]] = {}


serializing = _SerializationState()


def begin_serialization(transport: str, context: Any, root: Any) -> None:
  """Marks this thread as serializing `root` for rdt_jax transport `transport`."""
  serializing.transport, serializing.context, serializing.root = transport, context, root
  serializing.paths, serializing.described = None, {}


def end_serialization() -> None:
  """Ends what `begin_serialization` started (the described leaves stay for
  `take_described`)."""
  serializing.transport, serializing.context, serializing.root = None, None, None
  serializing.paths = None


def leaf_path(leaf: Any) -> str:
  """The pytree path of `leaf` in the value being serialized ("" if unknown)."""
  if serializing.paths is None:
    import jax

    paths: dict[int, str] = {}
    try:
      flat, _ = jax.tree_util.tree_flatten_with_path(serializing.root)
    except Exception:  # a value jax cannot flatten: paths stay unknown
      flat = []
    for path, x in flat:
      paths.setdefault(id(x), jax.tree_util.keystr(path))
    serializing.paths = paths
  return serializing.paths.get(id(leaf), "")


def record_described(leaf: Any, described: _dlpack.DescribedLeaf) -> None:
  """Keeps `leaf`'s description for `take_described`."""
  serializing.described[id(leaf)] = (leaf, described)


def take_described(leaves: list[Any]) -> list[_dlpack.DescribedLeaf]:
  """The DescribedLeaf for each leaf of an object being stored.

  Uses what the serializer recorded on this thread, describing again (without
  a pytree path) where it has nothing, e.g. for a retried task.
  """
  described = serializing.described
  out = []
  for i, leaf in enumerate(leaves):
    hit = described.pop(id(leaf), None)
    out.append(hit[1] if hit is not None and hit[0] is leaf else _dlpack.describe(leaf, f"<leaf {i}>"))
  return out
