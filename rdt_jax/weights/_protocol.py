"""The subscriber's questions to its publisher, and their typed answers.

A subscriber asks two questions, each a call on the publisher's actor in
Ray's system concurrency group (so a trainer busy with a step still answers):

* `query`: which versions do you keep, and (at a structure's first pull)
  what is the structure behind this digest? Answered with an `Answer`.
* `object_query`: the RDT objects of a packed version's buckets (made at the
  first request), or of a version packed in device memory the one RDT
  object of its tree. Answered with an `ObjectAnswer`.

Both run in the publisher's process and find the publisher by id in
`publishers` (a publisher registers itself there), on the actor that
`serving_actor` checked, when the publisher was made, can serve subscribers
on any host. On the subscriber's side
`ask` and `ask_buckets` send them and check the answer before anything of it
is used: nothing from the publisher is trusted until its type and bounds
hold, and a version the publisher does not keep is `StaleWeightsError`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import ray

from rdt_jax import _errors, _limits, _ray
from rdt_jax._metadata import MetadataError
from rdt_jax.weights._handle import LeafEntry, WeightsHandle, stale_error
from rdt_jax.weights._packed import PackedLayoutInfo
from rdt_jax.weights._parts import PartLayout

__all__ = [
  "Answer",
  "Buckets",
  "ObjectAnswer",
  "Published",
  "Publisher",
  "ask",
  "ask_buckets",
  "ask_kept",
  "ask_object",
  "check_answer",
  "object_query",
  "publishers",
  "query",
  "serving_actor",
]


@dataclass(frozen=True)
class Published:
  """What a publisher tells a subscriber of one structure: its array leaves
  and, for a structure published packed, its layout; for one process's part
  of a multi-process version, which box of which global leaf each piece
  holds."""

  entries: tuple[LeafEntry, ...]
  packed: PackedLayoutInfo | None = None
  shards: PartLayout | None = None  # for one process's part of a multi-process version: what its pieces hold


@dataclass(frozen=True)
class Answer:
  """The publisher's answer to `query`: the versions it keeps (None: closed
  or gone) and the structure asked for (None: not asked, or not known)."""

  kept: tuple[int, ...] | None
  structure: Published | None = None


@dataclass(frozen=True)
class ObjectAnswer:
  """The publisher's answer to `object_query`: the refs of a packed
  version's bucket objects (None: the version is not kept), their size, and
  the versions kept (None: closed or gone)."""

  refs: tuple[Any, ...] | None
  bucket_bytes: int
  kept: tuple[int, ...] | None


@dataclass(frozen=True)
class Buckets:
  """A checked `ObjectAnswer` for a kept version: its bucket objects' refs
  and their size in bytes (the last bucket may be shorter)."""

  refs: tuple[ray.ObjectRef, ...]
  size: int


class Publisher(Protocol):
  """What the questions need of a publisher (`WeightPublisher`)."""

  def _answer(self, structure: str | None) -> Answer: ...

  def _object_of(self, version: int) -> ObjectAnswer: ...


#: The publishers of this process by id, for the questions subscribers send.
publishers: Final[weakref.WeakValueDictionary[str, Publisher]] = weakref.WeakValueDictionary()


def query(_actor: Any, publisher: str, structure: str | None) -> Answer:
  """Runs in the publisher's process: the versions publisher `publisher`
  keeps (None if it is closed or gone) and, if asked, the structure behind
  digest `structure` (its `LeafEntry`s and, if it is published packed, its
  `PackedLayoutInfo`)."""
  pub = publishers.get(publisher)
  return Answer(None) if pub is None else pub._answer(structure)


def object_query(_actor: Any, publisher: str, version: int) -> ObjectAnswer:
  """Runs in the publisher's process: the refs of `version`'s bucket objects
  (made now if this is the first request), or None if the version is not
  kept; their size; and the versions kept (None if the publisher is closed
  or gone)."""
  pub = publishers.get(publisher)
  return ObjectAnswer(None, 0, None) if pub is None else pub._object_of(version)


def _check_kept(kept: Any, where: str) -> tuple[int, ...] | None:
  if kept is None:
    return None
  if not (isinstance(kept, tuple) and len(kept) <= _limits.WEIGHTS_MAX_KEPT and all(type(v) is int for v in kept)):
    raise MetadataError(
        where, "kept versions",
        f"are {type(kept).__name__}, not a tuple of at most {_limits.WEIGHTS_MAX_KEPT} ints",
    )
  return kept


def check_answer(answer: Any, where: str) -> tuple[tuple[int, ...] | None, Published | None]:
  """(kept versions, structure) of a publisher's `Answer`, checked.

  Raises:
    MetadataError: naming the field that does not hold together.
  """
  if not isinstance(answer, Answer):
    raise MetadataError(where, "publisher answer", f"is a {type(answer).__name__}, not an answer of rdt_jax's")
  structure = answer.structure
  if structure is not None and not (
      isinstance(structure, Published) and isinstance(structure.entries, tuple)
      and (structure.packed is None or isinstance(structure.packed, PackedLayoutInfo))
      and (structure.shards is None or isinstance(structure.shards, PartLayout))
  ):
    raise MetadataError(where, "structure", "is not a published structure")
  return _check_kept(answer.kept, where), structure


def ask(handle: WeightsHandle, where: str, timeout: float | None, want_structure: bool, current: int | None,
        after_read: bool = False) -> Published | None:
  """Asks `handle`'s publisher whether its version is kept (and, if
  `want_structure`, for its structure); returns the structure (None if not
  asked or not known). Errors name the version as `where`.

  Raises:
    StaleWeightsError: the version is not kept (`current`: the version the
      subscriber held when the pull began; `after_read`: asked once the
      bytes arrived).
    MetadataError: for an answer that does not hold together.
    ray.exceptions.GetTimeoutError, ray.exceptions.RayError: as `ray.get`.
  """
  return ask_kept(handle, where, timeout, want_structure, current, after_read)[0]


def ask_kept(handle: WeightsHandle, where: str, timeout: float | None, want_structure: bool, current: int | None,
             after_read: bool = False, get: Callable[[Any, float | None], Any] | None = None,
             ) -> tuple[Published | None, tuple[int, ...]]:
  """`ask`, returning the versions the publisher keeps as well. `get(ref,
  timeout)` waits for the answer (`ray.get` by default; a pull passes its
  own, which stops when the pull is cancelled).

  Raises:
    As `ask`.
  """
  ref = _ray.state.call_on_system_group(handle.actor, query, handle.publisher,
                                   handle.structure if want_structure else None)
  answer = ray.get(ref, timeout=timeout) if get is None else get(ref, timeout)
  kept, structure = check_answer(answer, where)
  if kept is None or handle.version not in kept:
    raise stale_error(handle, kept, current, after_read)
  return structure, kept


def ask_buckets(handle: WeightsHandle, where: str, timeout: float | None, current: int | None, total: int) -> Buckets:
  """Asks `handle`'s publisher for the bucket objects of its packed version
  of `total` bytes.

  Raises:
    StaleWeightsError: the version is not kept.
    MetadataError: for an answer that does not hold together, or buckets
      that do not cover `total` bytes.
  """
  reply = ray.get(_ray.state.call_on_system_group(handle.actor, object_query, handle.publisher, handle.version),
                  timeout=timeout)
  if not (isinstance(reply, ObjectAnswer) and type(reply.bucket_bytes) is int and (
      reply.refs is None or (isinstance(reply.refs, tuple) and all(isinstance(r, ray.ObjectRef) for r in reply.refs)))):
    raise MetadataError(where, "publisher answer", "is not a bucket answer of rdt_jax's")
  kept = _check_kept(reply.kept, where)
  if reply.refs is None:
    raise stale_error(handle, kept, current, after_read=False)
  size, refs = reply.bucket_bytes, reply.refs
  if size <= 0 or len(refs) != -(-total // size):
    raise MetadataError(where, "buckets", f"are {len(refs)} of {size} bytes, for a version of {total} bytes")
  return Buckets(refs, size)


def ask_object(handle: WeightsHandle, where: str, timeout: float | None, current: int | None) -> ray.ObjectRef:
  """Asks `handle`'s publisher for the RDT object of its version packed in
  device memory: the version's tree, made at the first request.

  Raises:
    StaleWeightsError: the version is not kept.
    MetadataError: for an answer that is not one object.
  """
  reply = ray.get(_ray.state.call_on_system_group(handle.actor, object_query, handle.publisher, handle.version),
                  timeout=timeout)
  if not (isinstance(reply, ObjectAnswer) and (reply.refs is None or (
      isinstance(reply.refs, tuple) and len(reply.refs) == 1 and isinstance(reply.refs[0], ray.ObjectRef)
      and reply.bucket_bytes == 0))):
    raise MetadataError(where, "publisher answer", "is not the one object of a version in device memory")
  kept = _check_kept(reply.kept, where)
  if reply.refs is None:
    raise stale_error(handle, kept, current, after_read=False)
  return reply.refs[0]


def serving_actor(transport: str) -> Any:
  """The handle of the actor a publisher of `transport` lives in, once it
  is known to serve subscribers on any host: rdt_jax's transports are
  registered in this process, and the actor has tensor transport on.

  Raises:
    SetupError: outside an actor, or an actor without
      `enable_tensor_transport=True`.
    TransportNotRegisteredError: `transport` cannot be registered here.
  """
  from rdt_jax import _registry  # registers the transports: loaded only by a publisher

  actor = ray.get_runtime_context().current_actor if ray.is_initialized() and _ray.state.in_ray_worker() else None
  if actor is None:
    raise _errors.SetupError(
        "WeightPublisher lives in a Ray actor (the trainer's, with @ray.remote(enable_tensor_transport=True)): "
        "subscribers ask that actor which versions it keeps. Create it in the actor's __init__ or a method."
    )
  if not _ray.state.tensor_transport_enabled(actor):
    raise _errors.SetupError(
        "WeightPublisher's actor was created without enable_tensor_transport=True. Its subscribers' questions "
        "(which versions it keeps, the RDT objects of a version for a subscriber on another host) run on the "
        "actor's system concurrency group, which Ray makes only for such an actor: without it they wait "
        "behind whatever method the actor runs (a whole training step), and Ray gives the actor none of its "
        "creator's transports. Add enable_tensor_transport=True to the trainer's @ray.remote(...)."
    )
  registered = _registry.register()  # what the driver's register() gives an actor it creates, here for sure
  if transport not in registered:
    why, _ = _errors.explain_unregistered(transport, registered, in_worker=True)
    raise _errors.TransportNotRegisteredError(
        f"WeightPublisher(transport={transport!r}): the transport is not registered in this process. "
        f"{why or 'It is not an rdt_jax transport.'}", transport)
  return actor
