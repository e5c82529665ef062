"""Weight sync: a trainer publishes versions of its parameters; generators pull
them into live parameters.

`WeightPublisher` (in the trainer's actor) keeps each version readable and
hands out a `WeightsHandle`: the version, the publisher's actor, a digest of
the value's structure and, for a version sent as a pytree, the ref of its RDT
object.
`WeightSubscriber` (in a generator) pulls a handle's version into its
template: torch and numpy leaves are written in place, jax leaves arrive
with the template's sharding, `rdt_jax.Slice` leaves receive one index range.

Two ways a version travels, chosen by the publisher per structure:

* packed (`jax_nixl`, every array leaf in host memory): the leaves are
  copied into one pooled buffer per version, and subscribers copy their
  leaves out of it, node-locally straight from the publisher's memory or
  through NIXL READs of the buffer as RDT objects of at most
  `RDT_JAX_WEIGHT_BUCKET_BYTES` each, which the publisher makes when the
  first subscriber elsewhere asks for them (`rdt_jax._weights_packed`); per
  step each side pays a copy per leaf and no per-leaf registration,
  metadata or plan;
* as a pytree (device leaves, or `jax_transfer`): one RDT object of the
  tree, pulled with `rdt_jax.set_target_for_ref` and `ray.get`.

The rules of the stream, in one place:

* versions published by one publisher strictly increase;
* the publisher keeps at most `keep` versions readable and frees older ones at
  once (`rdt_jax._seam.free_now`), whatever handles to them remain;
* a pull asks the publisher which versions it keeps before it starts and again
  after its bytes arrived: a version that is not newer than the subscriber's,
  or that is not kept, is refused with `StaleWeightsError` before any byte
  moves; one freed while it was read is refused after (its bytes may be
  another version's);
* `sub.version` names a version only while the template holds exactly its
  bytes (`atomic=False`: `None` from the moment a pull may write into the
  template until it succeeds; `atomic=True`: the pull lands in staging
  buffers and is copied into the template only once it succeeded).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import hashlib
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import ray

from rdt_jax import _dlpack, _faults, _seam, _settings, _targets
from rdt_jax import _weights_packed as _packed
from rdt_jax._metadata import MetadataError

__all__ = ["StaleWeightsError", "WeightPublisher", "WeightSubscriber", "WeightsHandle"]

#: One leaf of a published value: (pytree path, kind, shape, dtype or key
#: implementation). `kind` is "array" or "key" (a typed PRNG key array).
LeafEntry = tuple[str, str, tuple[int, ...], str]


class StaleWeightsError(RuntimeError):
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


StaleWeightsError.__module__ = "rdt_jax"


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
    packed: for a packed version (see `rdt_jax._weights_packed`), where its
      bytes lie in the publisher's process and the value's non-array
      leaves; None for a version sent as a pytree.
  """

  version: int
  ref: Any
  publisher: str
  actor: Any
  structure: str
  packed: _packed.PackedSource | None = None


def _label(handle: WeightsHandle) -> str:
  """How errors name `handle`'s version: its RDT object's id, or for a
  packed version without one, the version and its publisher."""
  if handle.ref is not None:
    return str(handle.ref.hex())
  return f"v{handle.version} of publisher {handle.publisher}"


# --------------------------------------------------------------------------
# Structure: what a template is checked against.


def _is_template_leaf(x: Any) -> bool:
  return _dlpack.is_array(x) or isinstance(x, _dlpack.Slice) or _dlpack.is_sharding(x)


def _flatten(tree: Any) -> list[tuple[str, Any]]:
  """(pytree path as `jax.tree_util.keystr` prints it, leaf) of every array,
  `Slice` or sharding leaf of `tree`."""
  import jax

  if _is_template_leaf(tree):
    return [("", tree)]
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_template_leaf)
  return [(jax.tree_util.keystr(p), x) for p, x in flat if _is_template_leaf(x)]


def _entry(path: str, x: Any) -> LeafEntry:
  shape = tuple(int(n) for n in x.shape)
  if _dlpack.is_prng_key(x):
    return path, "key", shape, _dlpack.prng_key_parts(x)[1]
  return path, "array", shape, _dlpack.dtype_of(x).name


def structure_of(tree: Any) -> tuple[LeafEntry, ...]:
  """Every array leaf of a value to publish, as `LeafEntry`s in leaf order."""
  return tuple(_entry(path, x) for path, x in _flatten(tree) if _dlpack.is_array(x))


def _array_paths(tree: Any) -> list[str]:
  """The pytree path of every array leaf of `tree`, in leaf order."""
  return [path for path, x in _flatten(tree) if _dlpack.is_array(x)]


def _digest(structure: tuple[LeafEntry, ...], tree: Any) -> str:
  """The digest of a value's structure: its array leaves (`structure`) and
  its pytree structure, non-array leaves included, so a value that gains,
  loses or moves a non-array leaf is a new structure."""
  import jax

  treedef = jax.tree_util.tree_structure(tree, is_leaf=_is_template_leaf)
  return hashlib.blake2b(f"{structure!r}|{treedef}".encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class _Published:
  """What a publisher tells a subscriber of one structure: its array leaves
  and, for a structure published packed, its layout."""

  entries: tuple[LeafEntry, ...]
  packed: _packed.PackedLayoutInfo | None = None


@dataclass(frozen=True)
class _Answer:
  """The publisher's answer to a subscriber's question (`_query`): the
  versions it keeps (None: closed or gone) and the structure asked for
  (None: not asked, or not known)."""

  kept: tuple[int, ...] | None
  structure: _Published | None = None


@dataclass(frozen=True)
class _ObjectAnswer:
  """The publisher's answer to a request for a packed version's bucket
  objects (`_object_query`): their refs (None: the version is not kept),
  their size, and the versions kept (None: closed or gone)."""

  refs: tuple[Any, ...] | None
  bucket_bytes: int
  kept: tuple[int, ...] | None


#: At most this many versions in a publisher's answer (a bound on what is trusted).
MAX_KEPT: Final = 1 << 16


def _check_kept(kept: Any, label: str) -> tuple[int, ...] | None:
  if kept is None:
    return None
  if not (isinstance(kept, tuple) and len(kept) <= MAX_KEPT and all(type(v) is int for v in kept)):
    raise MetadataError(label, "kept versions", f"are {type(kept).__name__}, not a tuple of at most {MAX_KEPT} ints")
  return kept


def _check_answer(answer: Any, label: str) -> tuple[tuple[int, ...] | None, _Published | None]:
  """(kept versions, structure) of a publisher's `_Answer`, checked.

  Raises:
    MetadataError: naming the field that does not hold together.
  """
  if not isinstance(answer, _Answer):
    raise MetadataError(label, "publisher answer", f"is a {type(answer).__name__}, not an answer of rdt_jax's")
  structure = answer.structure
  if structure is not None and not (
      isinstance(structure, _Published) and isinstance(structure.entries, tuple)
      and (structure.packed is None or isinstance(structure.packed, _packed.PackedLayoutInfo))
  ):
    raise MetadataError(label, "structure", "is not a published structure")
  return _check_kept(answer.kept, label), structure


def _describe(entry: LeafEntry) -> str:
  _, kind, shape, what = entry
  return f"a typed PRNG key array (impl {what}, shape {shape})" if kind == "key" else f"shape {shape}, dtype {what}"


def check_template(template: list[tuple[str, Any]], structure: tuple[LeafEntry, ...]) -> None:
  """Checks a subscriber's flattened template against a published structure,
  before any byte moves.

  Raises:
    ValueError: naming the first leaf path the template lacks or has in
      excess, or whose template leaf has another shape, dtype or key
      implementation than the published leaf.
    UnsupportedLeafError: naming the leaf, for a `Slice` outside its shape.
  """
  by_path = dict(template)
  published = {entry[0] for entry in structure}
  extra = [p for p in by_path if p not in published]
  if extra:
    raise ValueError(
        f"The template has a leaf at {extra[0] or '(the value itself)'} that the published value lacks "
        f"(published leaves: {', '.join(sorted(published)[:8])}{', ...' if len(published) > 8 else ''}). "
        "Build the template with the published value's structure."
    )
  for entry in structure:
    path, kind, shape, _ = entry
    name = path or "(the value itself)"
    if path not in by_path:
      raise ValueError(
          f"The template has no leaf at {name}; the published value has {_describe(entry)} there. "
          "Build the template with the published value's structure."
      )
    leaf = by_path[path]
    if isinstance(leaf, _dlpack.Slice):
      if kind == "key":
        raise ValueError(f"The template leaf at {name} is a Slice; the published leaf is {_describe(entry)}.")
      leaf.box(shape, path)  # raises, naming the leaf
      continue
    if _dlpack.is_sharding(leaf):
      continue
    got = _entry(path, leaf)
    if got != entry:
      raise ValueError(
          f"The template leaf at {name} has {_describe(got)}, but the published leaf has {_describe(entry)}. "
          "Pass a template leaf of the published shape and dtype (or an rdt_jax.Slice, or a sharding)."
      )


# --------------------------------------------------------------------------
# Publisher


@dataclass
class _Kept:
  """A version its publisher keeps readable."""

  version: int
  ref: Any  # a pytree version's RDT object (None for a packed version)
  digest: str  # its structure's
  buffer: Any  # a packed version's buffer, else None
  buckets: list[Any] | None = None  # a packed version's bucket objects, made at the first request
  bucket_bytes: int = 0  # their size (the last may be shorter)
  value: Any = None  # a pytree version's value, as its RDT object holds it (for subscribers in this process)


def bucket_bytes() -> int:
  """The bucket size of packed versions read through Ray: the setting
  `RDT_JAX_WEIGHT_BUCKET_BYTES` (default 256 MiB), rounded down to a multiple
  of 64 bytes so every bucket starts aligned."""
  return int(_settings.value("RDT_JAX_WEIGHT_BUCKET_BYTES")) // _dlpack.ALIGNMENT * _dlpack.ALIGNMENT


#: The publishers of this process by id, for the queries subscribers send.
_publishers: Final[weakref.WeakValueDictionary[str, WeightPublisher]] = weakref.WeakValueDictionary()


def _query(_actor: Any, publisher: str, structure: str | None) -> _Answer:
  """Runs in the publisher's process (Ray's system concurrency group): the
  versions publisher `publisher` keeps (None if it is closed or gone) and,
  if asked, the structure behind digest `structure` (its `LeafEntry`s and,
  if it is published packed, its `PackedLayoutInfo`)."""
  pub = _publishers.get(publisher)
  if pub is None:
    return _Answer(None)
  return pub._answer(structure)


def _object_query(_actor: Any, publisher: str, version: int) -> _ObjectAnswer:
  """Runs in the publisher's process (Ray's system concurrency group): the
  refs of `version`'s bucket objects (made now if this is the first request:
  `WeightPublisher._object_of`), or None if the version is not kept; their
  size; and the versions kept (None if the publisher is closed or gone)."""
  pub = _publishers.get(publisher)
  if pub is None:
    return _ObjectAnswer(None, 0, None)
  return pub._object_of(version)


def _device_copies(tree: Any) -> Any:
  """`tree` with each jax array in device memory replaced by a copy on its
  devices (same sharding), so the version holds no buffer of the trainer's:
  XLA refuses, on a GPU, to donate a buffer another library holds. Without a
  GPU visible to jax here no leaf can be in device memory: `tree` itself,
  with no per-leaf work."""
  if not _dlpack.cuda_available("jax"):
    return tree
  import jax

  def copy(x: Any) -> Any:
    if isinstance(x, jax.Array) and _dlpack.device_of(x).kind != "cpu":
      return x.copy()
    return x

  return jax.tree_util.tree_map(copy, tree)


class WeightPublisher:
  """Publishes versions of a trainer's parameters for `WeightSubscriber`s.

  Lives in the trainer's actor (an actor with
  `@ray.remote(enable_tensor_transport=True)`; `rdt_jax.register()` called
  in the driver before the actor was created).

  Each `publish` makes the value readable until `keep` newer versions
  exist, in one of two ways:

  * packed (`jax_nixl` with `pack=True`, every array leaf in host memory):
    the leaves are copied into one pooled host buffer per version (one copy
    of the parameters per kept version, `keep` buffers in all), read by
    subscribers without per-leaf work; the trainer's arrays are not held, so
    it may change or donate them at once;
  * as a pytree (`pack=False`, a leaf in device memory, or `jax_transfer`):
    one RDT object of the tree, held by rdt_jax while the version is kept.
    Host arrays are sent from where they are (nothing copied at publish); a
    held host jax array is not donated (jax copies it into a new buffer,
    without an error): the published bytes never change, and the step pays
    one allocation and copy of each donated leaf while its version is kept.
    jax arrays in device memory are copied on their device at publish (one
    device copy of those leaves per kept version): on a GPU, XLA refuses to
    donate a buffer that another library holds ("Donation requested for
    buffer with external reference"), so holding the trainer's own arrays
    would fail its next donating step.

  docs/weight_sync.md gives the measured cost of each.

  Args:
    transport: a one-sided rdt_jax transport (`"jax_nixl"`, or
      `"jax_transfer"`).
    keep: how many versions stay readable (at least 1). A version leaves the
      window when the `keep`-th newer one is published; its memory is freed
      then, and pulls of it raise `StaleWeightsError`.
    pack: publish host-resident versions packed (`jax_nixl` only).

  Raises:
    ValueError: for `keep` < 1 or a two-sided transport.
    RuntimeError: outside a Ray actor.
  """

  def __init__(self, transport: str = "jax_nixl", keep: int = 2, pack: bool = True):
    keep = int(keep)
    if keep < 1:
      raise ValueError(f"keep={keep}: a publisher keeps at least one version readable.")
    if transport in ("jax_gloo", "jax_nccl"):
      raise ValueError(
          f"transport={transport!r} is two-sided: its bytes move only as a task's argument, so a subscriber "
          "cannot pull them. Use 'jax_nixl' (or 'jax_transfer')."
      )
    actor = ray.get_runtime_context().current_actor if ray.is_initialized() and _seam.in_ray_worker() else None
    if actor is None:
      raise RuntimeError(
          "WeightPublisher lives in a Ray actor (the trainer's, with @ray.remote(enable_tensor_transport=True)): "
          "subscribers ask that actor which versions it keeps. Create it in the actor's __init__ or a method."
      )
    self.transport = transport
    self.keep = keep
    self._actor = actor
    self._id = uuid.uuid4().hex
    self._lock = threading.Lock()
    self._kept: list[_Kept] = []
    # digest -> (structure, packed layout or None)
    self._structures: dict[str, _Published] = {}
    self.pack = bool(pack)
    self._stream = _packed.Stream(keep, self._id) if transport == "jax_nixl" and self.pack else None
    self._closed = False
    _publishers[self._id] = self

  @property
  def versions(self) -> tuple[int, ...]:
    """The versions kept readable, oldest first."""
    with self._lock:
      return tuple(k.version for k in self._kept)

  @property
  def version(self) -> int | None:
    """The newest published version, or None before the first."""
    with self._lock:
      return self._kept[-1].version if self._kept else None

  def publish(self, tree: Any, version: int) -> WeightsHandle:
    """Publishes `tree` (a pytree of jax, torch or numpy arrays, typed PRNG
    keys included) as `version`.

    Returns once the version is readable; frees the version that leaves the
    `keep` window. With `jax_nixl` and every array leaf in host memory the
    version is packed: its leaves are copied into one pooled host buffer
    (the publisher keeps `keep` such buffers; docs/weight_sync.md). Leaves
    in device memory, or `jax_transfer`, send the tree as it is, except that
    jax arrays in device memory are copied on their device.

    Args:
      tree: the parameters. A packed version is a copy, and so is every jax
        array in device memory: the trainer may change or donate them at
        once. Otherwise their bytes must not change while the version is
        kept: jax arrays never do (donating them is safe, see the class
        docstring); torch or numpy arrays must not be written in place.
      version: an int greater than every version published before.

    Returns:
      The version's `WeightsHandle`.

    Raises:
      ValueError: if `version` is not greater than the newest one.
      RuntimeError: if the publisher is closed.
      UnsupportedLeafError: naming the leaf, for a leaf the transport cannot
        send (nothing is published).
    """
    version = int(version)
    newest = self.version
    if self._closed:
      raise RuntimeError("This WeightPublisher is closed; create a new one to publish again.")
    if newest is not None and version <= newest:
      raise ValueError(f"Version {version} is not newer than the last published version {newest}: versions increase.")
    if not _packed.EMPTY < version <= np.iinfo(np.int64).max:
      raise ValueError(f"Version {version} is outside the int64 range versions take.")
    packed = None
    buffer = None
    if self._stream is not None:
      new_structure: list[tuple[LeafEntry, ...]] = []

      def digest_of(t: Any) -> str:
        new_structure.append(structure_of(t))
        return _digest(new_structure[0], t)

      info, digest, arrays, rest = self._stream.structure(tree, digest_of, _array_paths)
      if new_structure:
        with self._lock:
          self._structures[digest] = _Published(new_structure[0], None if info is None else info.info)
      if info is not None:
        buffer = _dlpack.host_pool.acquire(info.info.layout.total)
        try:
          info.packer.pack(arrays, _dlpack.host_pointer(buffer))
        except _dlpack.NotHostMemory:
          buffer = None  # a leaf moved to device memory since: send this version as a pytree
        else:
          packed = self._stream.source(version, buffer, rest)
    else:
      structure = structure_of(tree)
      digest = _digest(structure, tree)
      with self._lock:
        self._structures.setdefault(digest, _Published(structure))
    if packed is None and self._stream is not None and digest not in self._structures:
      with self._lock:
        self._structures[digest] = _Published(structure_of(tree))
    # A packed version becomes an RDT object only when a subscriber that
    # cannot read it node-locally asks (`_object_of`): a put costs a few ms.
    value = None if packed is not None else _device_copies(tree)
    ref = None if value is None else ray.put(value, _tensor_transport=self.transport)
    with self._lock:
      dropped = self._drop_oldest(self.keep - 1)
      self._kept.append(_Kept(version, ref, digest, buffer, value=value))
      if self._stream is not None and packed is not None:
        self._stream.table.add(version)
      live = {k.digest for k in self._kept}
      for d in [d for d in self._structures if d not in live]:
        del self._structures[d]
    _free(dropped)
    return WeightsHandle(version, ref, self._id, self._actor, digest, packed)

  def _object_of(self, version: int) -> _ObjectAnswer:
    """`_object_query`'s answer for a packed version: the refs of its bucket
    objects (consecutive byte ranges of its buffer of `bucket_bytes()` each,
    the last one shorter), put at the first request for the version (under
    the lock, so once) and shared by later ones; or None if it is not kept.
    Then the bucket size, and the versions kept (None once closed)."""
    with self._lock:
      if self._closed:
        return _ObjectAnswer(None, 0, None)
      kept = tuple(k.version for k in self._kept)
      entry = next((k for k in self._kept if k.version == version), None)
      if entry is None or entry.buffer is None:
        return _ObjectAnswer(None, 0, kept)
      if entry.buckets is None:
        size, buffer = bucket_bytes(), entry.buffer
        entry.buckets = [
            ray.put(buffer[at : at + size], _tensor_transport=self.transport) for at in range(0, buffer.nbytes, size)
        ]
        entry.bucket_bytes = size
      return _ObjectAnswer(tuple(entry.buckets), entry.bucket_bytes, kept)

  def _drop_oldest(self, room: int) -> list[_Kept]:
    """Drops the oldest kept versions until at most `room` are left (lock
    held): out of the kept-versions table first, so no subscriber reads a
    version whose buffer may be reused; the caller frees their objects."""
    dropped = self._kept[: max(0, len(self._kept) - room)]
    del self._kept[: len(dropped)]
    if self._stream is not None:
      for k in dropped:
        self._stream.table.drop(k.version)
    return dropped

  def close(self) -> None:
    """Frees every kept version; later pulls of them raise `StaleWeightsError`."""
    with self._lock:
      self._closed = True
      dropped = self._drop_oldest(0)
      if self._stream is not None:
        self._stream.table.retire()
    _free(dropped)
    _publishers.pop(self._id, None)

  def _answer(self, structure: str | None) -> _Answer:
    """The versions kept (None once closed) and, if asked, the structure
    behind digest `structure`."""
    with self._lock:
      if self._closed:
        return _Answer(None)
      return _Answer(tuple(k.version for k in self._kept),
                     None if structure is None else self._structures.get(structure))

  def _local_value(self, version: int) -> Any:
    """A kept pytree version's value, for a subscriber in this process; None
    if the version is not kept (or is packed)."""
    with self._lock:
      if self._closed:
        return None
      entry = next((k for k in self._kept if k.version == version), None)
      return None if entry is None else entry.value


def _free(dropped: list[_Kept]) -> None:
  """Frees the RDT objects of versions that left the window (those made)."""
  for k in dropped:
    for ref in ([k.ref] if k.ref is not None else []) + (k.buckets or []):
      _seam.free_now(ref.hex())


# --------------------------------------------------------------------------
# Subscriber


_fetch_pool: list[concurrent.futures.ThreadPoolExecutor] = []
_fetch_lock = threading.Lock()


def _fetcher() -> concurrent.futures.ThreadPoolExecutor:
  """The threads that fetch a pull's next bucket while the caller copies the
  last one out (created at the first bucketed pull)."""
  with _fetch_lock:
    if not _fetch_pool:
      _fetch_pool.append(concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="rdt-jax-bucket"))
    return _fetch_pool[0]


_async_pool: list[concurrent.futures.ThreadPoolExecutor] = []


def _async_executor() -> concurrent.futures.ThreadPoolExecutor:
  """The threads `pull_async` runs pulls in (created at the first one)."""
  with _fetch_lock:
    if not _async_pool:
      _async_pool.append(concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="rdt-jax-pull"))
    return _async_pool[0]


class _PullCancelled(Exception):
  """A `pull_async` whose task was cancelled, stopped at its next step."""


def _cancelled(cancel: threading.Event | None, handle: WeightsHandle) -> None:
  """Stops a pull whose `pull_async` was cancelled (at a step where that
  leaves the state of a failed pull)."""
  if cancel is not None and cancel.is_set():
    raise _PullCancelled(f"The pull of version {handle.version} was cancelled.")


def _local_copy(value: Any, target: Any) -> Any:
  """`value`, a version kept by a publisher in this process, with each array
  leaf copied as the template (or atomic staging) `target` says: into its
  in-place arrays (on their device: no host staging for device memory), as
  new jax arrays with its placements, cut by its `Slice`s. Nothing returned
  aliases `value`'s arrays, so writing into the pulled tree (or donating it)
  never changes the kept version."""
  import jax

  wanted = dict(_flatten(target))
  flat, treedef = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_template_leaf)
  copies: list[tuple[Any, Any]] = []
  out = []
  for p, x in flat:
    if not _dlpack.is_array(x):
      out.append(x)
      continue
    path = jax.tree_util.keystr(p)
    out.append(_local_leaf(path, x, wanted.get(path), copies))
  _dlpack.copy_into_many(copies)
  _dlpack.mark_written_many([t for t, _ in copies])
  return treedef.unflatten(out)  # type: ignore[attr-defined]


def _local_leaf(path: str, x: Any, want: Any, copies: list[tuple[Any, Any]]) -> Any:
  """One leaf of `_local_copy`: what the pulled tree holds for kept array
  `x` at `path`, given the template leaf `want`; copies into caller arrays
  are appended to `copies` (made together, one wait per device)."""
  if isinstance(want, _dlpack.Slice):
    box = want.box(tuple(int(n) for n in x.shape), path)
    x = x[tuple(slice(a, b) for a, b in box)]
    want = want.into
    if want is None:
      return _own_copy(x)
  if want is None:
    return _own_copy(x)
  if _dlpack.is_sharding(want) or _dlpack.framework_of(want) == "jax":
    import jax

    sharding = want if _dlpack.is_sharding(want) else want.sharding
    if _dlpack.framework_of(x) != "jax":
      x = _dlpack.convert_leaf(x, "jax", path)
    return jax.device_put(x, sharding, may_alias=False)
  copies.append((want, x))
  return want


def _own_copy(x: Any) -> Any:
  """A copy of array `x` in its own framework and device."""
  fw = _dlpack.framework_of(x)
  if fw == "jax":
    import jax

    return jax.device_put(x, x.sharding, may_alias=False)
  if fw == "torch":
    return x.clone()
  return x.copy()


def _empty_like(x: Any) -> Any:
  """A new array of `x`'s framework, shape, dtype and device (atomic staging)."""
  fw = _dlpack.framework_of(x)
  if fw == "numpy":
    import numpy as np

    return np.empty_like(x)
  if fw == "torch":
    import torch

    return torch.empty_like(x)
  import cupy

  return cupy.empty_like(x)


def _staged(leaf: Any) -> Any:
  """The staging counterpart of one template leaf: in-place leaves (numpy,
  torch, cupy, a Slice's `into` array) get a new array; templates of new
  arrays (jax, shardings, a Slice without `into`) are their own."""
  if isinstance(leaf, _dlpack.Slice):
    return leaf if leaf.into is None or _dlpack.framework_of(leaf.into) in (None, "jax") else (
        dataclasses.replace(leaf, into=_empty_like(leaf.into)))
  fw = _dlpack.framework_of(leaf)
  return leaf if fw in (None, "jax") else _empty_like(leaf)


def _in_place(leaf: Any) -> Any:
  """The array a template leaf is written into in place, or None."""
  if isinstance(leaf, _dlpack.Slice):
    leaf = leaf.into
  fw = _dlpack.framework_of(leaf)
  return None if fw in (None, "jax") else leaf


def _unflatten(info: _packed.PackedLayoutInfo, arrays: list[Any], rest: tuple[Any, ...]) -> Any:
  """The pulled value: the published tree with `arrays` at its array leaves
  and `rest` at the others."""
  positions = set(info.array_positions)
  it_arrays, it_rest = iter(arrays), iter(rest)
  leaves = [next(it_arrays) if i in positions else next(it_rest) for i in range(len(positions) + len(rest))]
  return info.treedef.unflatten(leaves)


class WeightSubscriber:
  """Pulls published versions into a generator's parameters.

  Args:
    template: a pytree of the published value's structure whose leaves say
      where each leaf lands, as for `rdt_jax.set_target_for_ref`: numpy or
      torch arrays are written in place (the pulled tree holds those very
      objects), jax arrays and `jax.sharding.Sharding`s are placements (the
      leaf arrives as a new jax array with that sharding), `rdt_jax.Slice`
      receives one index range, a typed PRNG key receives a typed key of its
      implementation. Checked against a version's structure at its first
      pull (errors name the leaf path); later pulls of the same structure
      skip the check.
    atomic: False (default): pulls write into the template's arrays in
      place, with no extra memory. A pull that fails once its fetch started
      raises and leaves `version` None (the template is torn: some leaves may
      hold the new version's bytes) until the next successful pull. True:
      pulls land in staging arrays of the template's in-place leaves (one
      more copy of those leaves in memory, allocated at the first pull and
      reused), and a successful pull then copies them into the template (one
      memcpy of those bytes per pull). A failed pull leaves the template's
      arrays bit for bit as they were and `version` unchanged.

  A pull refused before its fetch started (`StaleWeightsError`, a template
  that does not match, a publisher that is gone) changes nothing in either
  mode.
  """

  def __init__(self, template: Any, atomic: bool = False):
    self.template = template
    self.atomic = bool(atomic)
    self._flat = _flatten(template)
    if not self._flat:
      raise ValueError("The template holds no jax, torch or numpy arrays, rdt_jax.Slice or sharding leaves.")
    self._version: int | None = None
    self._reached: int | None = None  # the newest version a pull reached (see `pull`)
    self._lock = threading.Lock()  # one pull at a time, whoever calls
    self._checked: set[str] = set()  # structures the template was checked against
    self._fits: set[str] = set()  # structures a pull of which succeeded with this target
    self._flat_target: dict[str, Any] = {}
    self._staging: Any = None
    self._plans: dict[str, _packed.PackedPlan] = {}  # packed structures pulled, by digest

  @property
  def version(self) -> int | None:
    """The version the template holds, or None (none pulled yet, or torn)."""
    return self._version

  def pull(self, handle: WeightsHandle, timeout: float | None = None) -> Any:
    """Pulls `handle`'s version into the template.

    Pulls of one subscriber run one at a time, whoever calls them (threads,
    `pull_async`, Ray's concurrency groups): a pull waits for the one
    running, then checks its version against the newest version a pull
    reached. `version` never decreases, except to None for a torn
    `atomic=False` pull.

    A publisher in this very process (a colocated trainer and generator)
    is pulled from like any other: the template receives the bytes in place
    (in device memory, a copy on the device), and the pulled tree never
    holds the publisher's kept arrays.

    Args:
      handle: a `WeightsHandle` from `WeightPublisher.publish`.
      timeout: seconds the whole pull may take, waiting for a pull running
        in another thread included (None: no limit).

    Returns:
      The pulled tree: the template's in-place arrays themselves holding the
      new bytes, new jax arrays for jax leaves. `version` is then
      `handle.version`.

    Raises:
      TypeError: if `handle` is not a `WeightsHandle`.
      StaleWeightsError: for a version not newer than the newest version a
        pull of this subscriber reached (`version`, or the one before a torn
        pull), or not kept by the publisher (before anything moves), or
        freed while it was read; for a handle of a publisher that was
        closed or replaced since.
      ValueError, UnsupportedLeafError: at the first pull of a structure,
        naming the leaf path where template and published value differ.
      MetadataError: for a handle or layout that does not hold together
        (naming the field); nothing is read.
      ray.exceptions.GetTimeoutError: the pull (or the wait for the pull
        running) ran out of time; `version` is then as the class docstring
        says for a failed pull.
      ray.exceptions.RayError: the publisher's actor died.
    """
    self._check_handle(handle)
    deadline = None if timeout is None else time.monotonic() + timeout
    return self._serialized(handle, deadline, None)

  async def pull_async(self, handle: WeightsHandle, timeout: float | None = None) -> Any:
    """`pull`, awaitable: for async actors and drivers, whose event loop it
    does not block (the pull runs in a worker thread). Same arguments,
    result, errors and serialization as `pull`.

    Cancelling the awaiting task ends the pull like a failed one: the
    template is unchanged with `atomic=True`, and with `atomic=False`
    `version` is None if bytes may have reached the template. The
    cancellation returns only once the pull has stopped: nothing writes into
    the template after it.
    """
    import asyncio

    self._check_handle(handle)
    deadline = None if timeout is None else time.monotonic() + timeout
    cancel = threading.Event()
    future = asyncio.get_running_loop().run_in_executor(_async_executor(), self._serialized, handle, deadline, cancel)
    try:
      return await asyncio.shield(future)
    except asyncio.CancelledError:
      cancel.set()
      while not future.done():  # the pull stops at its next step; wait for it, whatever cancels us again
        try:
          await asyncio.shield(future)
        except asyncio.CancelledError:
          continue
        except BaseException:
          break
      if not future.cancelled():
        future.exception()  # retrieved: the pull's own error is superseded by the cancellation
      raise

  @staticmethod
  def _check_handle(handle: Any) -> None:
    if not isinstance(handle, WeightsHandle):
      raise TypeError(f"Expected an rdt_jax.WeightsHandle (from WeightPublisher.publish), got {type(handle).__name__}.")

  def _serialized(self, handle: WeightsHandle, deadline: float | None, cancel: threading.Event | None) -> Any:
    """Runs one pull once no other pull of this subscriber runs."""
    wait = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
    if not self._lock.acquire(timeout=wait):
      raise ray.exceptions.GetTimeoutError(
          f"The pull of version {handle.version} ran out of time waiting for another pull of this subscriber.")
    try:
      _cancelled(cancel, handle)
      value = self._pull(handle, deadline, cancel)
      self._reached = handle.version if self._reached is None else max(self._reached, handle.version)
      return value
    finally:
      self._lock.release()

  def _pull(self, handle: WeightsHandle, deadline: float | None, cancel: threading.Event | None) -> Any:
    """One pull (`pull`), the subscriber's lock held."""
    current = self._version
    newest = self._reached if self._reached is not None else current
    if newest is not None and handle.version <= newest:
      held = f"version {current}, which this subscriber holds" if current == newest else (
          f"version {newest}, which a pull of this subscriber reached (it holds {current})")
      raise StaleWeightsError(
          f"Version {handle.version} is not newer than {held}; pull a newer handle.",
          handle.version, current,
      )
    if handle.packed is not None:
      return self._pull_packed(handle, deadline, current, cancel)
    local = _publishers.get(handle.publisher)
    if local is not None:
      return self._pull_local(local, handle, current, cancel)
    structure = self._ask(handle, deadline, want_structure=handle.structure not in self._checked, current=current)
    if handle.structure not in self._checked:
      if structure is None:
        raise RuntimeError(f"The publisher no longer knows the structure of version {handle.version}.")
      check_template(self._flat, structure.entries)
      self._checked.add(handle.structure)
    target = self._target()
    _cancelled(cancel, handle)
    if not self.atomic:
      self._version = None  # torn from here until the pull succeeds
    try:
      if handle.structure in self._fits:
        _targets.set_flat_target_for_ref(handle.ref, self._flat_target)
      else:
        _targets.set_target_for_ref(handle.ref, target)
      value = ray.get(handle.ref, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
      self._ask(handle, deadline, want_structure=False, current=current, after_read=True)
      _cancelled(cancel, handle)
    except BaseException as e:
      if not self.atomic:
        e.add_note(f"rdt_jax: the pull of version {handle.version} failed after it started: the template may "
                   "hold some of its bytes, and the subscriber's version is None until the next successful pull.")
      raise
    if handle.structure not in self._fits:
      self._fits.add(handle.structure)  # later versions of it skip set_target_for_ref's checks
      self._flat_target = _targets.flatten_target(target)
    if self.atomic:
      value = self._commit(value)
    self._version = handle.version
    return value

  def _pull_local(self, pub: WeightPublisher, handle: WeightsHandle, current: int | None,
                  cancel: threading.Event | None) -> Any:
    """A pull of a pytree version whose publisher lives in this process.

    Ray would hand back the publisher's own stored arrays here (a process
    reading its own RDT object gets the stored objects, and no transport
    runs), leaving the template unwritten. So the kept value is copied: into
    the template's in-place arrays (on their device), and into new jax
    arrays with the template's placements; nothing returned aliases it."""
    answer = pub._answer(handle.structure if handle.structure not in self._checked else None)
    kept, structure = answer.kept, answer.structure
    if kept is None or handle.version not in kept:
      raise self._stale(handle, set(kept or ()), current, after_read=False)
    if handle.structure not in self._checked:
      if structure is None:
        raise RuntimeError(f"The publisher no longer knows the structure of version {handle.version}.")
      check_template(self._flat, structure.entries)
      self._checked.add(handle.structure)
    value = pub._local_value(handle.version)
    if value is None:
      raise self._stale(handle, set(pub.versions), current, after_read=False)
    _cancelled(cancel, handle)
    if not self.atomic:
      self._version = None  # torn from here until the pull succeeds
    try:
      out = _local_copy(value, self._target())
      kept = pub._answer(None).kept
      if kept is None or handle.version not in kept:
        raise self._stale(handle, set(kept or ()), current, after_read=True)
      _cancelled(cancel, handle)
    except BaseException as e:
      if not self.atomic:
        e.add_note(f"rdt_jax: the pull of version {handle.version} failed after it started: the template may "
                   "hold some of its bytes, and the subscriber's version is None until the next successful pull.")
      raise
    if self.atomic:
      out = self._commit(out)
    self._version = handle.version
    return out

  def _ask(self, handle: WeightsHandle, deadline: float | None, want_structure: bool,
           current: int | None, after_read: bool = False) -> _Published | None:
    """Asks the publisher whether `handle`'s version is kept (and for its
    structure, if `want_structure`); raises `StaleWeightsError`, naming
    `current` (the version held when the pull began), if not."""
    ref = _seam.call_on_system_group(handle.actor, _query, handle.publisher,
                                     handle.structure if want_structure else None)
    answer = ray.get(ref, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    kept, structure = _check_answer(answer, _label(handle))
    if kept is None or handle.version not in kept:
      when = "was freed while it was being read (its bytes may be another version's)" if after_read else (
          "is no longer kept by its publisher")
      raise StaleWeightsError(
          f"Version {handle.version} {when}; the publisher keeps versions "
          f"{list(kept) if kept else 'none (closed)'}, this subscriber held version {current}. "
          "Pull a newer handle (or publish with a larger keep).",
          handle.version, current, tuple(kept or ()),
      )
    return structure

  # ---- packed versions (rdt_jax._weights_packed)

  def _plan(self, handle: WeightsHandle, deadline: float | None, current: int | None) -> _packed.PackedPlan:
    """The plan of `handle`'s structure: made at its first pull, after the
    publisher says the version is kept and sends the structure's layout, and
    the template is checked against it."""
    plan = self._plans.get(handle.structure)
    if plan is not None:
      return plan
    answer = self._ask(handle, deadline, want_structure=True, current=current)
    if answer is None or answer.packed is None:
      raise RuntimeError(f"The publisher no longer knows the packed structure of version {handle.version}.")
    _packed.check_layout(answer.packed, answer.entries, _label(handle))
    check_template(self._flat, answer.entries)
    self._checked.add(handle.structure)
    plan = _packed.PackedPlan(answer.packed, answer.entries, dict(self._flat), self.atomic)
    if len(self._plans) >= 4:  # structures change rarely: keep the last few
      self._plans.pop(next(iter(self._plans)))
    self._plans[handle.structure] = plan
    return plan

  def _pull_packed(self, handle: WeightsHandle, deadline: float | None, current: int | None,
                   cancel: threading.Event | None) -> Any:
    """A pull of a packed version (`WeightSubscriber.pull`)."""
    source = handle.packed
    assert source is not None
    _packed.check_source(source, _label(handle))
    plan = self._plan(handle, deadline, current)
    plan.check_targets()
    if source.digest != source.expected_digest(handle.version):
      raise MetadataError(_label(handle), "packed", "does not match its digest (the handle was corrupted)")
    if source.nbytes != plan.info.layout.total:
      raise MetadataError(_label(handle), "packed.nbytes",
                          f"is {source.nbytes}, but the structure's layout takes {plan.info.layout.total} bytes")
    if len(plan.info.array_positions) + len(source.rest) != plan.info.treedef.num_leaves:
      raise MetadataError(_label(handle), "packed.rest",
                          f"holds {len(source.rest)} leaves; the structure has "
                          f"{plan.info.treedef.num_leaves - len(plan.info.array_positions)} non-array leaves")
    staging = _dlpack.host_pool.acquire(plan.staging_bytes) if plan.staging_bytes else None
    if deadline is not None and time.monotonic() > deadline:
      raise ray.exceptions.GetTimeoutError(f"The pull of version {handle.version} ran out of time before it began.")
    _cancelled(cancel, handle)
    if not (_packed.can_read_directly(source) and self._pull_directly(handle, plan, staging, current)):
      self._pull_through_ray(handle, plan, staging, deadline, current, cancel)
    _cancelled(cancel, handle)
    leaves = plan.commit(staging)
    value = _unflatten(plan.info, leaves, source.rest)
    self._version = handle.version
    return value

  def _pull_directly(self, handle: WeightsHandle, plan: _packed.PackedPlan, staging: Any,
                     current: int | None) -> bool:
    """Copies a version from its publisher's memory on this host, checking
    its kept-versions table before and after. False if the kernel refused
    the copy (nothing was written; read through Ray instead)."""
    source = handle.packed
    assert source is not None
    obj_id = _label(handle)
    try:
      kept = _packed.read_table(source, handle.publisher)
    except PermissionError:
      return False
    except _packed.ForeignTable:
      raise self._replaced(handle, current) from None
    except OSError as e:
      raise _packed.dead_publisher_error(obj_id, handle.actor, e) from None
    if handle.version not in kept:
      raise self._stale(handle, kept, current, after_read=False)
    writes_template = not self.atomic and plan.writes_in_place
    if writes_template:
      self._version = None  # torn from here until the pull succeeds
    try:
      try:
        _packed.read_version(plan, source, staging)
      except PermissionError:
        if writes_template:
          self._version = current  # refused before a byte moved
        return False
      if _faults.ON:
        _faults.hit("weights.copied")
      kept = _packed.read_table(source, handle.publisher)
      if handle.version not in kept:
        raise self._stale(handle, kept, current, after_read=True)
    except BaseException as e:
      error = e
      if isinstance(e, _packed.ForeignTable):
        error = self._replaced(handle, current)
      elif isinstance(e, OSError) and not isinstance(e, ProcessLookupError):
        now = _packed.read_table_or_empty(source, handle.publisher)
        # A version larger than the host pool keeps is unmapped when dropped:
        # a read of it then fails instead of reading reused memory.
        error = self._stale(handle, now, current, after_read=True) if handle.version not in now else (
            _packed.dead_publisher_error(obj_id, handle.actor, e))
      elif isinstance(e, ProcessLookupError):
        error = _packed.dead_publisher_error(obj_id, handle.actor, e)
      if writes_template:
        error.add_note(f"rdt_jax: the pull of version {handle.version} failed while it copied into the template: "
                       "the template may hold some of its bytes, and the subscriber's version is None until the "
                       "next successful pull.")
      if error is e:
        raise
      raise error from None
    return True

  def _pull_through_ray(self, handle: WeightsHandle, plan: _packed.PackedPlan, staging: Any,
                        deadline: float | None, current: int | None, cancel: threading.Event | None) -> None:
    """Fetches a packed version through Ray, in the buckets its publisher
    cuts it into (`bucket_bytes()`): asks the publisher for the buckets' RDT
    objects (made at the first request for the version), then fetches them
    one after the other (one NIXL READ each), the next one while the last
    one is copied out, so at most two are held at once.

    Leaves written in place (`atomic=False`) are copied into the template as
    each bucket arrives: `version` is None from the first such copy until
    the pull succeeds. Every other byte goes to `staging`, committed by the
    caller. Once the last bucket is copied the publisher is asked whether it
    still keeps the version (a version freed meanwhile is a failed pull)."""

    def left() -> float | None:
      return None if deadline is None else max(0.0, deadline - time.monotonic())

    answer = _seam.call_on_system_group(handle.actor, _object_query, handle.publisher, handle.version)
    reply = ray.get(answer, timeout=left())
    refs_ok = reply.refs is None or (
        isinstance(reply.refs, tuple) and all(isinstance(r, ray.ObjectRef) for r in reply.refs)
    ) if isinstance(reply, _ObjectAnswer) else False
    if not refs_ok or type(reply.bucket_bytes) is not int:
      raise MetadataError(_label(handle), "publisher answer", "is not a bucket answer of rdt_jax's")
    refs, size, kept = reply.refs, reply.bucket_bytes, _check_kept(reply.kept, _label(handle))
    if refs is None:
      raise self._stale(handle, set(kept or ()), current, after_read=False)
    total = plan.info.layout.total
    if size <= 0 or len(refs) != -(-total // size):
      raise MetadataError(_label(handle), "buckets", f"are {len(refs)} of {size} bytes, for a version of {total} bytes")
    runs = _packed.bucket_runs(plan.pairs(0 if staging is None else _dlpack.host_pointer(staging)), size, len(refs))
    writes_template = not self.atomic and plan.writes_in_place
    memmove = ctypes.memmove
    began = False  # a bucket was copied into the template
    try:
      pending: concurrent.futures.Future[Any] = _fetcher().submit(ray.get, refs[0], timeout=left())
      for i, ref in enumerate(refs):
        try:
          bucket: Any = pending.result()
        except ray.exceptions.GetTimeoutError:
          raise
        except Exception:
          self._ask(handle, deadline, want_structure=False, current=current, after_read=True)
          raise
        if cancel is not None and cancel.is_set():
          raise _PullCancelled(f"The pull of version {handle.version} was cancelled.")
        if i + 1 < len(refs):
          pending = _fetcher().submit(ray.get, refs[i + 1], timeout=left())
        if _dlpack.framework_of(bucket) != "numpy" or bucket.nbytes != min(size, total - i * size):
          raise MetadataError(ref.hex(), "value", f"is not bucket {i} of the version's packed buffer")
        if writes_template:
          self._version, began = None, True  # torn from here until the pull succeeds
        base = _dlpack.host_pointer(bucket)
        for local, offset, n in runs[i]:
          memmove(local, base + offset, n)
        del bucket
        if _faults.ON:
          _faults.hit("weights.bucket")
      self._ask(handle, deadline, want_structure=False, current=current, after_read=True)
    except BaseException as e:
      if began:
        e.add_note(f"rdt_jax: the pull of version {handle.version} failed after it began writing the template: "
                   "the template may hold some of its bytes, and the subscriber's version is None until the "
                   "next successful pull.")
      raise

  def _replaced(self, handle: WeightsHandle, current: int | None) -> StaleWeightsError:
    return StaleWeightsError(
        f"Version {handle.version}'s publisher {handle.publisher} was closed or replaced (its table of kept "
        f"versions now belongs to no publisher, or to another one); this subscriber held version {current}. "
        "Pull a handle of the publisher that runs now.",
        handle.version, current,
    )

  def _stale(self, handle: WeightsHandle, kept: set[int], current: int | None, after_read: bool) -> StaleWeightsError:
    when = "was freed while it was being read (its bytes may be another version's)" if after_read else (
        "is no longer kept by its publisher")
    versions = sorted(kept)
    return StaleWeightsError(
        f"Version {handle.version} {when}; the publisher keeps versions {versions or 'none'}, this subscriber "
        f"held version {current}. Pull a newer handle (or publish with a larger keep).",
        handle.version, current, tuple(versions),
    )

  def _target(self) -> Any:
    if not self.atomic:
      return self.template
    if self._staging is None:
      import jax

      self._staging = jax.tree_util.tree_map(_staged, self.template, is_leaf=_is_template_leaf)
    return self._staging

  def _commit(self, value: Any) -> Any:
    """Copies a successful atomic pull from the staging arrays into the
    template; returns the pulled tree with the template's arrays in place.

    Leaves are matched by pytree path, so the pulled value may hold
    non-array leaves the template lacks. One wait per device before and
    after: a CUDA template is written after work queued against it on any
    stream, and holds the version on return."""
    import jax

    in_place = {path: into for path, leaf in self._flat if (into := _in_place(leaf)) is not None}
    flat, treedef = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_template_leaf)
    copies: list[tuple[Any, Any]] = []
    out = []
    for p, arrived in flat:
      into = in_place.get(jax.tree_util.keystr(p)) if _dlpack.is_array(arrived) else None
      if into is None:
        out.append(arrived)
        continue
      copies.append((into, arrived))
      out.append(into)
    _dlpack.copy_into_many(copies)
    return treedef.unflatten(out)  # type: ignore[attr-defined]

