"""The errors rdt_jax raises about its set-up and about Ray objects.

Each subclasses the exception type Ray raised (or would raise) in the same
situation, so code that catches Ray's `ValueError` keeps working; the message
says what happened and what to do. Errors about a value's leaves are
`rdt_jax.UnsupportedLeafError` (`rdt_jax._dlpack`). Also here: the account of
a transport name this process has not registered (`explain_unregistered`),
which the seam and the registry both give. Imports no Ray and no array
framework (only `rdt_jax._compat`, whose checks import jax or NIXL when
called).
"""

from __future__ import annotations

import difflib
import importlib.util
from typing import Final

from rdt_jax import _compat
from rdt_jax._error_base import RdtJaxError

__all__ = [
    "ArgumentTypeError", "SetupError", "TransportNotRegisteredError", "UnknownObjectError", "UnsupportedRayError",
    "explain_unregistered",
]


# Public as `rdt_jax.<name>`: tracebacks and pickles name the public path.
_PUBLIC_MODULE = "rdt_jax"


class UnsupportedRayError(RdtJaxError, RuntimeError):
  """The installed Ray lacks an internal rdt_jax relies on, or is untested.

  Raised by `rdt_jax.register()` (and `register_transport()`) before anything
  of Ray is wrapped. The message names the Ray version, what is missing or
  changed, and the supported range (`pip install 'ray>=2.59,<2.61'`); for a
  Ray minor outside the range whose internals all check out, it also names
  the setting `RDT_JAX_ALLOW_UNTESTED_RAY=1`, which turns the refusal into a
  warning.
  """


class SetupError(RdtJaxError, RuntimeError):
  """The process or actor a call runs in is not set up for it.

  Raised by `WeightPublisher()` outside a Ray actor, or in an actor created
  without `@ray.remote(enable_tensor_transport=True)`: a publisher answers
  its subscribers' questions on the actor's system concurrency
  group, which Ray makes only with that flag (without it each question
  waits behind the method the actor runs, a whole training step), and only
  such an actor gets its creator's transports. Node-locally such a
  publisher seemed to work, and the first subscriber on another host
  failed or waited. The message names the missing flag or call and the fix.
  """


class ArgumentTypeError(RdtJaxError, TypeError):
  """An argument of a public rdt_jax call that is not of a type it takes:
  a handle that is not a `WeightsHandle` (None, say), a `source=` that is
  not a mapping or a function, a `rdt_jax.From` path that is not a str.
  The message names what was given and what is taken."""


class TransportNotRegisteredError(RdtJaxError, ValueError):
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


class UnknownObjectError(RdtJaxError, LookupError, AssertionError):
  """`ray.get` of an RDT ref whose object this process knows nothing about.

  The object was freed (every ref to it went out of scope, or its producer
  released it) before this fetch, or the ref was not obtained from Ray
  (rebuilt from its id, or kept from an earlier Ray session). Keep the ref
  that the method or `ray.put` returned alive until every consumer has
  fetched the object.

  A `LookupError`. Raised instead of Ray's bare `AssertionError: No metadata
  found for ...`, so it is an `AssertionError` too; that parent is
  deprecated (`docs/errors.md`): catch `LookupError` or this class.

  Attributes:
    object_id: the object's hex id.
  """

  _deprecated_parents = (AssertionError,)

  def __init__(self, message: str, object_id: str = ""):
    super().__init__(message)
    self.object_id = object_id

  def __reduce__(self) -> tuple[type, tuple[str, str]]:
    return type(self), (str(self), self.object_id)


for _cls in (ArgumentTypeError, SetupError, TransportNotRegisteredError, UnknownObjectError, UnsupportedRayError):
  _cls.__module__ = _PUBLIC_MODULE


#: Every rdt_jax transport, by name: what a process needs to run it.
TRANSPORT_NEEDS: Final[dict[str, str]] = {
    "jax_nixl": "NIXL (pip install nixl-cu12, or nixl-cu13 for CUDA 13)",
    "jax_gloo": "torch (Ray's collective groups move torch tensors)",
    "jax_nccl": "torch (Ray's collective groups move torch tensors)",
    "jax_transfer": "a jax with jax.experimental.transfer",
}


def _can_run(name: str) -> bool:
  """True if this process has what rdt_jax transport `name` needs, checked
  without importing the transports (which would install rdt_jax here)."""
  if name == "jax_nixl":
    return _compat.nixl_available()
  if name in ("jax_gloo", "jax_nccl"):
    return importlib.util.find_spec("torch") is not None
  return _compat.has_jax_transfer()


def explain_unregistered(name: str, registered: list[str], in_worker: bool) -> tuple[str | None, str | None]:
  """Why transport `name` is not registered in this process, and what to do.

  Args:
    name: the transport name as the user gave it.
    registered: the transports registered in this process (lower case).
    in_worker: True in an actor (or task), False in a driver.

  Returns:
    (explanation, suggestion): the explanation is None where the name is
    neither an rdt_jax transport nor close to one registered or rdt_jax
    transport (Ray's own error then stands); the suggestion is the closest
    name, or None.
  """
  wanted = name.lower()
  if wanted in TRANSPORT_NEEDS and wanted not in registered:
    return _why_missing(wanted, in_worker), None
  candidates = sorted(set(registered) | set(TRANSPORT_NEEDS))
  close = difflib.get_close_matches(wanted, candidates, n=1, cutoff=0.75)
  if not close or close[0] == wanted:
    return None, None
  suggestion = close[0]
  text = f"Did you mean {suggestion!r}? Transports registered here: {', '.join(registered) or 'none'}."
  if suggestion not in registered:
    text += " " + _why_missing(suggestion, in_worker)
  return text, suggestion


def _why_missing(name: str, in_worker: bool) -> str:
  """What to do where rdt_jax transport `name` is not registered."""
  if not _can_run(name):
    return (
        f"{name!r} is an rdt_jax transport that cannot run in this process: it needs "
        f"{TRANSPORT_NEEDS[name]}. Install that (in every process that uses the "
        "transport), then call rdt_jax.register()."
    )
  if in_worker:
    return (
        f"{name!r} is an rdt_jax transport, and this actor has none registered: an actor "
        "gets them from its creator only if its class has "
        "@ray.remote(enable_tensor_transport=True) (or a method with "
        "@ray.method(tensor_transport=...)) and the creator called rdt_jax.register() "
        "before creating it. Add enable_tensor_transport=True to the actor's class, or "
        "call rdt_jax.register() in the actor (in __init__) before this call."
    )
  return (
      f"{name!r} is an rdt_jax transport, and rdt_jax.register() has not run in this "
      "process yet. Call rdt_jax.register() first: before defining classes whose methods "
      f"name it (@ray.method(tensor_transport={name!r}) checks the name when the class is "
      f"defined), before ray.put(..., _tensor_transport={name!r}), and before creating "
      "the actors that use it."
  )
