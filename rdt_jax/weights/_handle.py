"""What a handle names: a published version, its structure, and the errors
of pulls that may not take it.

`WeightsHandle` is what crosses from the trainer to a generator;
`structure_of` and `digest` say what a value's structure is, and
`check_template` holds a subscriber's template against it. `stale_error` and
`replaced_error` are the two `StaleWeightsError`s every read route raises.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rdt_jax import _dlpack, _layout
from rdt_jax._error_base import RdtJaxError
from rdt_jax._errors import ArgumentTypeError
from rdt_jax.weights._packed import PackedSource
from rdt_jax.weights._parts import ShardedPart

__all__ = [
  "LeafEntry",
  "MappingError",
  "StaleWeightsError",
  "TemplateError",
  "WeightsHandle",
  "array_paths",
  "check_handle",
  "check_newer",
  "check_template",
  "digest",
  "flatten",
  "label",
  "replaced_error",
  "stale_error",
  "structure_of",
]


#: One leaf of a published value: (pytree path, kind, shape, dtype or key
#: implementation). `kind` is "array" or "key" (a typed PRNG key array).
LeafEntry = tuple[str, str, tuple[int, ...], str]

class StaleWeightsError(RdtJaxError, RuntimeError):
  """A pull of a version the subscriber may not take: not newer than the
  version it holds, or no longer kept by its publisher.

  Raised by `WeightSubscriber.pull` before any byte moves (the template and
  `sub.version` are unchanged), or, for a version its publisher freed while
  it was being read, after (the state is then that of a failed pull: see
  `WeightSubscriber`).

  Attributes:
    version: the version asked for.
    current: the subscriber's version (None: none, or torn).
    kept: the versions the publisher kept when asked (empty if unknown).
  """

  def __init__(self, message: str, version: int = 0, current: int | None = None, kept: tuple[int, ...] = ()):
    super().__init__(message)
    self.version = version
    self.current = current
    self.kept = kept

  def __reduce__(self) -> tuple[type, tuple[str, int, int | None, tuple[int, ...]]]:
    # Ray pickles an actor's exception to its caller: keep the attributes.
    return type(self), (str(self), self.version, self.current, self.kept)


class TemplateError(RdtJaxError, ValueError):
  """A subscriber's template that does not fit what it pulls: a leaf path
  the published value lacks or has in excess, another shape, dtype or key
  implementation, a template that holds no array. Raised by
  `WeightSubscriber()` or at a structure's first pull, before any byte
  moves (the template and `version` are unchanged); the message names the
  leaf path."""


class MappingError(TemplateError):
  """A `source=` mapping that does not fit (a `TemplateError`): a template
  leaf with no entry, a published path that is no leaf, a transform
  (`rdt_jax.From`'s transpose, reshape, index; `rdt_jax.Fuse`'s parts) that
  does not give the template tensor's shape, a cast that is not between
  floating-point dtypes, two template leaves over one tensor's memory with
  different sources. Raised before any byte moves, naming the template
  leaf."""


for _cls in (StaleWeightsError, TemplateError, MappingError):
  _cls.__module__ = "rdt_jax"


#: `WeightsHandle.combine`'s implementation, installed by `rdt_jax.weights._combine`
#: (which asks publishers: a room above this module).
_COMBINE: list[Callable[[Sequence[WeightsHandle]], WeightsHandle]] = []


@dataclass(frozen=True)
class WeightsHandle:
  """One published version: what a subscriber needs to pull it.

  Picklable and small (under 4 KiB pickled, whatever the weights' size):
  passing it through Ray (as an argument or a return value) moves no weight
  bytes. A version sent as a pytree is one RDT object, whose ref the handle
  holds. A packed version has none at first: subscribers on the trainer's
  host read it without one, and the first subscriber elsewhere asks the
  publisher to make them (one per bucket, once per version; later ones
  share them). The publisher frees the objects when the version leaves its
  `keep` window, whether or not handles to it remain.

  Attributes:
    version: the version number given to `WeightPublisher.publish`.
    ref: the `ray.ObjectRef` of the version's RDT object; None for a packed
      version (its objects, if a subscriber needs them, are made on request).
    publisher: the publisher's id.
    actor: the handle of the actor the publisher lives in.
    structure: a digest of the value's structure (leaf paths, shapes,
      dtypes); a subscriber checks its template once per structure.
    packed: for a packed version (see `rdt_jax.weights._packed`), where its
      bytes lie in the publisher's process and the value's non-array
      leaves; None for a version sent as a pytree.
    stream: the publisher's `name`, the `stream` tag of the metrics of
      pulls of this version.
    shards: for one trainer process's part of a version published by
      every process of a multi-controller trainer, which box of which
      global leaf each of its pieces holds, and the global structure
      (`rdt_jax.weights._parts.ShardedPart`); None otherwise.
    parts: for a handle made by `combine`, the parts it combines (one per
      trainer process, in process order); empty otherwise.
  """

  version: int
  ref: Any
  publisher: str
  actor: Any
  structure: str
  packed: PackedSource | None = None
  stream: str = "weights"
  shards: ShardedPart | None = None
  parts: tuple[WeightsHandle, ...] = ()

  @staticmethod
  def combine(handles: Sequence[WeightsHandle]) -> WeightsHandle:
    """One handle for a version published by every process of a
    multi-controller JAX trainer, from each process's handle.

    Each process's `WeightPublisher.publish` of a tree of global arrays
    publishes the shards it holds (a replicated shard once, by its first
    replica); its handle is one part of the version. The combined handle is
    pulled like any other: a subscriber reads each box its template needs
    from the process that holds it, from every process at once. It carries
    no weight bytes and stays small: which box each process holds travels
    once per structure, asked of each process (at its first combination
    here, and at a subscriber's first pull).

    Args:
      handles: the handles of one version, one from every trainer process,
        in any order.

    Returns:
      The version's handle (its `parts` in process order).

    Raises:
      ArgumentTypeError: (a `TypeError`) for a value that is not a `WeightsHandle`.
      ValueError: for no handles; a handle of a publish whose leaves span
        no processes; parts of different versions, structures or streams;
        a process missing or given twice; pieces that leave part of a leaf
        uncovered or give part of it twice (naming the leaf and the
        processes).
      RuntimeError: a process no longer keeps any version of the structure.
      ray.exceptions.RayError: a trainer process could not be asked (its
        actor died, say).
    """
    return _COMBINE[0](handles)

#: A weight stream's name (`WeightPublisher(name=)`).
STREAM_NAME: Final = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def stream_of(handle: WeightsHandle) -> str:
  """The stream a pull of `handle` counts under: its `stream`, or "other"
  for a name no publisher gives (a handle changed on the way)."""
  stream = handle.stream
  return stream if isinstance(stream, str) and STREAM_NAME.fullmatch(stream) else "other"


def label(handle: WeightsHandle) -> str:
  """How errors name `handle`'s version: its RDT object's id, or for a
  packed version without one, the version and its publisher."""
  if handle.ref is not None:
    return str(handle.ref.hex())
  if handle.parts:
    return f"v{handle.version} of {len(handle.parts)} trainer processes"
  if handle.shards is not None:
    return f"v{handle.version} of publisher {handle.publisher} (trainer process {handle.shards.process})"
  return f"v{handle.version} of publisher {handle.publisher}"

# --------------------------------------------------------------------------
# Structure: what a template is checked against.


def is_template_leaf(x: Any) -> bool:
  return _dlpack.is_array(x) or isinstance(x, _layout.Slice) or _dlpack.is_sharding(x)


def flatten(tree: Any) -> list[tuple[str, Any]]:
  """(pytree path as `jax.tree_util.keystr` prints it, leaf) of every array,
  `Slice` or sharding leaf of `tree`."""
  import jax

  if is_template_leaf(tree):
    return [("", tree)]
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_template_leaf)
  return [(jax.tree_util.keystr(p), x) for p, x in flat if is_template_leaf(x)]


def entry_of(path: str, x: Any) -> LeafEntry:
  shape = tuple(int(n) for n in x.shape)
  if _dlpack.is_prng_key(x):
    return path, "key", shape, _dlpack.prng_key_parts(x)[1]
  return path, "array", shape, _dlpack.dtype_of(x).name


def structure_of(tree: Any) -> tuple[LeafEntry, ...]:
  """Every array leaf of a value to publish, as `LeafEntry`s in leaf order."""
  return tuple(entry_of(path, x) for path, x in flatten(tree) if _dlpack.is_array(x))


def array_paths(tree: Any) -> list[str]:
  """The pytree path of every array leaf of `tree`, in leaf order."""
  return [path for path, x in flatten(tree) if _dlpack.is_array(x)]


def digest(structure: tuple[LeafEntry, ...], tree: Any) -> str:
  """The digest of a value's structure: its array leaves (`structure`) and
  its pytree structure, non-array leaves included, so a value that gains,
  loses or moves a non-array leaf is a new structure."""
  import jax

  treedef = jax.tree_util.tree_structure(tree, is_leaf=is_template_leaf)
  return hashlib.blake2b(f"{structure!r}|{treedef}".encode(), digest_size=12).hexdigest()


def _describe(entry: LeafEntry) -> str:
  _, kind, shape, what = entry
  return f"a typed PRNG key array (impl {what}, shape {shape})" if kind == "key" else f"shape {shape}, dtype {what}"


def check_template(template: list[tuple[str, Any]], structure: tuple[LeafEntry, ...]) -> None:
  """Checks a subscriber's flattened template against a published structure,
  before any byte moves.

  Raises:
    TemplateError: naming the first leaf path the template lacks or has in
      excess, or whose template leaf has another shape, dtype or key
      implementation than the published leaf.
    UnsupportedLeafError: naming the leaf, for a `Slice` outside its shape.
  """
  by_path = dict(template)
  published = {entry[0] for entry in structure}
  extra = [p for p in by_path if p not in published]
  if extra:
    raise TemplateError(
        f"The template has a leaf at {extra[0] or '(the value itself)'} that the published value lacks "
        f"(published leaves: {', '.join(sorted(published)[:8])}{', ...' if len(published) > 8 else ''}). "
        "Build the template with the published value's structure."
    )
  for entry in structure:
    path, kind, shape, _ = entry
    name = path or "(the value itself)"
    if path not in by_path:
      raise TemplateError(
          f"The template has no leaf at {name}; the published value has {_describe(entry)} there. "
          "Build the template with the published value's structure."
      )
    leaf = by_path[path]
    if isinstance(leaf, _layout.Slice):
      if kind == "key":
        raise TemplateError(f"The template leaf at {name} is a Slice; the published leaf is {_describe(entry)}.")
      leaf.box(shape, path)  # raises, naming the leaf
      continue
    if _dlpack.is_sharding(leaf):
      continue
    got = entry_of(path, leaf)
    if got != entry:
      raise TemplateError(
          f"The template leaf at {name} has {_describe(got)}, but the published leaf has {_describe(entry)}. "
          "Pass a template leaf of the published shape and dtype (or an rdt_jax.Slice, or a sharding)."
      )


# --------------------------------------------------------------------------
# Publisher



def check_handle(handle: Any) -> None:
  """Raises `ArgumentTypeError` (a `TypeError`) unless `handle` is a `WeightsHandle`."""
  if not isinstance(handle, WeightsHandle):
    raise ArgumentTypeError(
        f"Expected an rdt_jax.WeightsHandle (from WeightPublisher.publish), got {type(handle).__name__}.")


def check_newer(handle: WeightsHandle, current: int | None, reached: int | None) -> None:
  """Raises `StaleWeightsError` if `handle`'s version is not newer than the
  newest one a subscriber's pulls reached (`reached`, else the version it
  holds, `current`)."""
  newest = reached if reached is not None else current
  if newest is not None and handle.version <= newest:
    held = f"version {current}, which this subscriber holds" if current == newest else (
        f"version {newest}, which a pull of this subscriber reached (it holds {current})")
    raise StaleWeightsError(
        f"Version {handle.version} is not newer than {held}; pull a newer handle.",
        handle.version, current,
    )


def stale_error(handle: WeightsHandle, kept: Iterable[int] | None, current: int | None,
                after_read: bool) -> StaleWeightsError:
  """The error of a pull whose version its publisher does not keep.

  Args:
    kept: the versions the publisher keeps (None: it is closed or gone).
    current: the version the subscriber held when the pull began.
    after_read: the version was freed while it was read (its bytes may be
      another version's), rather than before anything moved.
  """
  when = "was freed while it was being read (its bytes may be another version's)" if after_read else (
      "is no longer kept by its publisher")
  versions = sorted(kept) if kept is not None else []
  held = versions or ("none (closed)" if kept is None else "none")
  return StaleWeightsError(
      f"Version {handle.version} {when}; the publisher keeps versions {held}, this subscriber "
      f"held version {current}. Pull a newer handle (or publish with a larger keep).",
      handle.version, current, tuple(versions),
  )


def replaced_error(handle: WeightsHandle, current: int | None) -> StaleWeightsError:
  """The error of a pull whose publisher was closed or replaced: its table
  of kept versions belongs to no publisher now, or to another one."""
  return StaleWeightsError(
      f"Version {handle.version}'s publisher {handle.publisher} was closed or replaced (its table of kept "
      f"versions now belongs to no publisher, or to another one); this subscriber held version {current}. "
      "Pull a handle of the publisher that runs now.",
      handle.version, current,
  )
