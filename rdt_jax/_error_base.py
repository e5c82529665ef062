"""`RdtJaxError`, the base of every public rdt_jax error.

Imports nothing, so every layer can derive from it, the DLPack layer
included. The family as a tree is in `docs/errors.md` (tested against the
code).
"""

from __future__ import annotations

__all__ = ["RdtJaxError"]


class RdtJaxError(Exception):
  """The base of every error rdt_jax raises on purpose about what it sends,
  receives, pulls or is set up for (a leaf, a transfer, an object, a
  transport, a handle, a template, a mapping, a version, an actor's set-up).

  ``except rdt_jax.RdtJaxError`` catches them all. A call's check of one of
  its own argument values (`receive_as("tensorflow")`,
  `WeightPublisher(keep=0)`) raises Python's plain `ValueError` or
  `TypeError`. Each error also keeps the
  builtin or Ray parent that code caught before the family existed (a
  `ValueError` for a value rdt_jax cannot take, `RuntimeError` for a failed
  operation, Ray's `ActorDiedError` or `RayError` where Ray's own behaviour
  sets what code catches), so no ``except`` clause written for those breaks.
  Never raised itself.
  """

  #: Parents kept only so that older ``except`` clauses still catch the
  #: error, listed in `docs/errors.md` as deprecated; a later release drops
  #: them. Each subclass with such a parent names it here.
  _deprecated_parents: tuple[type[BaseException], ...] = ()


RdtJaxError.__module__ = "rdt_jax"
