"""The errors rdt_jax raises about its set-up and about Ray objects.

Each subclasses the exception type Ray raised (or would raise) in the same
situation, so code that catches Ray's `ValueError` keeps working; the message
says what happened and what to do. Errors about a value's leaves are
`rdt_jax.UnsupportedLeafError` (`rdt_jax._dlpack`). This module imports
nothing outside the standard library.
"""

from __future__ import annotations

__all__ = ["TransportNotRegisteredError", "UnknownObjectError", "UnsupportedRayError"]


# Public as `rdt_jax.<name>`: tracebacks and pickles name the public path.
_PUBLIC_MODULE = "rdt_jax"


class UnsupportedRayError(RuntimeError):
  """The installed Ray lacks an internal rdt_jax relies on, or is untested.

  Raised by `rdt_jax.register()` (and `register_transport()`) before anything
  of Ray is wrapped. The message names the Ray version, what is missing or
  changed, and the supported range (`pip install 'ray>=2.59,<2.61'`); for a
  Ray minor outside the range whose internals all check out, it also names
  the setting `RDT_JAX_ALLOW_UNTESTED_RAY=1`, which turns the refusal into a
  warning.
  """


class TransportNotRegisteredError(ValueError):
  """A `tensor_transport` name that is not registered in this process.

  Raised where Ray checks the name: `@ray.method(tensor_transport=...)` when
  the class is defined, `.options(tensor_transport=...)`, and
  `ray.put(..., _tensor_transport=...)`; and by `rdt_jax.receive_stats` for an
  unknown name. Raised instead of Ray's bare `ValueError: Invalid tensor
  transport: NAME` when the name is an rdt_jax transport's or close to a
  registered one; the message starts with Ray's text and then says why the
  name is missing here (`rdt_jax.register()` not called yet in this process,
  an actor created without `@ray.remote(enable_tensor_transport=True)`, a
  missing dependency) or which registered name was meant.

  Attributes:
    transport: the name as given.
    suggestion: the closest registered (or rdt_jax) transport name, or None.
  """

  def __init__(self, message: str, transport: str = "", suggestion: str | None = None):
    super().__init__(message)
    self.transport = transport
    self.suggestion = suggestion

  def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
    # Ray pickles an actor's exception to its caller: keep the attributes.
    return type(self), (str(self), self.transport, self.suggestion)


class UnknownObjectError(AssertionError):
  """`ray.get` of an RDT ref whose object this process knows nothing about.

  Raised instead of Ray's bare `AssertionError: No metadata found for ...`
  (hence the base class): the object was freed (every ref to it went out of
  scope, or its producer released it) before this fetch, or the ref was not
  obtained from Ray (rebuilt from its id, or kept from an earlier Ray
  session). Keep the ref that the method or `ray.put` returned alive until
  every consumer has fetched the object.

  Attributes:
    object_id: the object's hex id.
  """

  def __init__(self, message: str, object_id: str = ""):
    super().__init__(message)
    self.object_id = object_id

  def __reduce__(self) -> tuple[type, tuple[str, str]]:
    return type(self), (str(self), self.object_id)


for _cls in (TransportNotRegisteredError, UnknownObjectError, UnsupportedRayError):
  _cls.__module__ = _PUBLIC_MODULE
