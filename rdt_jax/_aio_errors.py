"""The errors for what Ray's `await ref` and nested refs cannot do with
rdt_jax objects (`rdt_jax._aio` has the awaitable that works, and why).

Both are raised at once, each saying what to do instead. Below the seam,
which returns or raises them: imports only `ray.exceptions` and the family's
base.
"""

from __future__ import annotations

from ray.exceptions import RayError

from rdt_jax._error_base import RdtJaxError

__all__ = ["AwaitNotSupportedError", "RefNotReadyError", "await_error", "failed_object_error", "not_ready_error"]


class AwaitNotSupportedError(RdtJaxError, RayError, ValueError):
  """`await ref` of an object of an rdt_jax transport: use `rdt_jax.get_async`.

  Raised by `await ref` (and by `asyncio.wrap_future(ref.future())`) of any
  rdt_jax object as soon as the object is ready, in the driver and in actors
  alike, whichever process holds the object: Ray runs an awaited ref's
  deserialization on its core worker's io thread, where a transfer cannot
  run. A `RayError`, so Ray's future raises it instead of returning it, and a
  `ValueError`, as Ray's own refusal of `await` on an RDT ref in the driver
  is. Use
  ``await rdt_jax.get_async(ref)`` instead (a list of refs too).

  Attributes:
    object_id: the object's hex id.
    transport: the object's transport name (lower case).
  """

  def __init__(self, message: str, object_id: str = "", transport: str = ""):
    super().__init__(message)
    self.object_id = object_id
    self.transport = transport

  def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
    return type(self), (str(self), self.object_id, self.transport)


class RefNotReadyError(RdtJaxError, ValueError, NotImplementedError):
  """An rdt_jax ref put inside a value before its object exists.

  A ref nested in a task argument, a return value or a `ray.put` value
  carries its object's transport metadata to the receiving process, and that
  metadata exists only once the producer's method has returned (and never
  where it raised). A `ValueError`. Raised at once, where the value is
  serialized, instead of Ray's `NotImplementedError`, so it is one too; that
  parent is deprecated (`docs/errors.md`): catch `ValueError` or this class.
  Wait for the object first (``ray.wait([ref])``), or pass the ref itself as
  a top-level argument: Ray delivers that once the object exists.

  Attributes:
    object_id: the object's hex id.
    transport: the object's transport name (lower case).
  """

  _deprecated_parents = (NotImplementedError,)

  def __init__(self, message: str, object_id: str = "", transport: str = ""):
    super().__init__(message)
    self.object_id = object_id
    self.transport = transport

  def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
    return type(self), (str(self), self.object_id, self.transport)


for _cls in (AwaitNotSupportedError, RefNotReadyError):
  _cls.__module__ = "rdt_jax"


def await_error(object_id: str, transport: str) -> AwaitNotSupportedError:
  """The error `await ref` of rdt_jax object `object_id` raises."""
  name = transport.lower()
  return AwaitNotSupportedError(
      f"await cannot fetch RDT object {object_id} of the rdt_jax transport {name}: Ray runs an "
      "awaited ref's deserialization on its core worker's io thread, which also delivers the "
      "object's transport metadata and every reply to this process, so no transfer can run "
      "there. Use `await rdt_jax.get_async(ref)` (or `get_async([ref, ...])`) instead: it runs "
      "ray.get in a worker thread, with ray.get's errors, receive targets and timeout.",
      object_id,
      name,
  )


def not_ready_error(object_id: str, transport: str) -> RefNotReadyError:
  """The error for rdt_jax ref `object_id` nested in a value before its object exists."""
  name = transport.lower()
  return RefNotReadyError(
      f"RDT object {object_id} of the rdt_jax transport {name} does not exist yet (its "
      "producer's method has not returned), so its ref cannot be sent inside a container "
      "(a list, dict or other value passed as an argument, returned or put): the process "
      "that receives it would have no transport metadata to fetch it with. Wait for the "
      "object first (ray.wait([ref]), or await rdt_jax.get_async(ref)), or pass the ref "
      "itself as a top-level argument, which Ray delivers once the object exists.",
      object_id,
      name,
  )


def failed_object_error(object_id: str, transport: str) -> RefNotReadyError:
  """The error for rdt_jax ref `object_id`, whose method raised, nested in a value."""
  name = transport.lower()
  return RefNotReadyError(
      f"RDT object {object_id} of the rdt_jax transport {name} is an error: its producer's "
      "method raised (ray.get(ref) raises that error), so there is no object whose ref could "
      "be sent inside a container. Check the method's result with ray.get before passing "
      "its ref on, or pass the ref itself as a top-level argument, whose task then fails "
      "with the method's error.",
      object_id,
      name,
  )
