"""The trainer's side of weight sync: `WeightPublisher` and its kept versions.

A publisher keeps at most `keep` versions readable, each either packed (one
pooled host buffer, `rdt_jax.weights._packed.Stream`, or one CUDA allocation
of its own, `rdt_jax.weights._device`) or as one RDT object of the tree,
and answers its subscribers' questions (`rdt_jax.weights._protocol`) about
them. A version leaves the kept-versions table before its memory can
be reused; its objects are freed after.

A publisher ends by one rule (`rdt_jax.weights._kept.end_publisher`),
whichever way it ends: `close()`, or its last reference gone.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
import weakref
from typing import Any

import numpy as np
import ray

from rdt_jax import _dlpack, _layout, _limits, _memory, _metrics, _ray, _settings
from rdt_jax.weights import _latest
from rdt_jax.weights._device import DeviceBuffer, DeviceBuffers, device_arrays
from rdt_jax.weights._handle import STREAM_NAME, LeafEntry, WeightsHandle, array_paths, structure_of
from rdt_jax.weights._handle import digest as structure_digest
from rdt_jax.weights._kept import Kept, end_publisher, free_objects
from rdt_jax.weights._packed import EMPTY, PublishedStructure, Stream
from rdt_jax.weights._packed_plan import unflatten
from rdt_jax.weights._protocol import Answer, ObjectAnswer, Published, publishers, serving_actor
from rdt_jax.weights._shards import Splitter
from rdt_jax.weights._stats import PublishStats

logger = logging.getLogger(__name__)

__all__ = ["WeightPublisher", "bucket_size"]


def bucket_size(given: int | None = None) -> int:
  """A weight stream's bucket size: `given` (a `bucket_bytes=` argument:
  an int from 4 KiB to 1 TiB), or where it is None the setting
  `RDT_JAX_WEIGHT_BUCKET_BYTES` (default 256 MiB); rounded down to a multiple
  of 64 bytes so every bucket starts aligned.

  Raises:
    TypeError: `given` is not an int (a bool is not one).
    ValueError: `given` is outside 4 KiB to 1 TiB.
    SettingError: `given` is None and the setting holds a bad value.
  """
  size = int(_settings.argument("RDT_JAX_WEIGHT_BUCKET_BYTES", given, "bucket_bytes"))
  return size // _limits.HOST_ALIGNMENT * _limits.HOST_ALIGNMENT


def _device_copies(tree: Any) -> Any:
  """`tree` with each jax array in device memory replaced by a copy on its
  devices (same sharding), so the version holds no buffer of the trainer's:
  XLA refuses, on a GPU, to donate a buffer another library holds. Without a
  GPU visible to jax here no leaf can be in device memory: `tree` itself,
  with no per-leaf work."""
  if not _memory.cuda_available("jax"):
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

  * packed (`jax_nixl` with `pack=True`, every array leaf in host memory,
    or every array leaf on one CUDA device): the leaves are copied into one
    pooled host buffer, or one CUDA allocation of the publisher's own, per
    version (one copy of the parameters per kept version), read by
    subscribers without per-leaf work (device versions: through CUDA IPC by
    subscribers on this host whose templates are CUDA tensors written in
    place; through Ray by the others); the trainer's arrays are not held, so
    it may change or donate them at once;
  * as a pytree (`pack=False`, leaves in device memory on several devices
    or with `device_pack=False`, or `jax_transfer`):
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
    name: the weight stream's name (letters, digits, `_.-`, at most 64):
      the `stream` tag of rdt_jax's Ray metrics on both sides, and
      `WeightsHandle.stream`. Give each stream its own (`"policy"`,
      `"lora"`).
    bucket_bytes: the size of the RDT objects ("buckets") a packed host
      version is read in by subscribers that read it through Ray (off this
      host): an int from 4 KiB to 1 TiB, rounded down to a multiple of 64
      bytes. Such a subscriber holds at most two buckets at once, and each
      costs one more fetch. None (default): the setting
      `RDT_JAX_WEIGHT_BUCKET_BYTES` (256 MiB unless set), read here.
    device_pack: pack a version whose array leaves all live on one CUDA
      device into device memory of the publisher's own, copied through CUDA
      IPC by subscribers on this host whose templates are CUDA tensors
      (`jax_nixl` with `pack=True` only); False sends such versions as a
      pytree. None (default): the setting `RDT_JAX_WEIGHT_DEVICE_PACK` (on
      unless set to 0), read here.

    announce: tell rdt_jax's board of newest versions each version
      published (one Ray actor call, not waited for), so that any process
      of this Ray namespace gets the stream's newest handle by its `name`
      (`rdt_jax.latest_handle`, `WeightSubscriber.pull_latest`) without the
      trainer routing handles to it; `close()` withdraws it. Give each
      announcing stream of a namespace its own `name` (the processes of one
      multi-process trainer share theirs). Default False.

  Both `bucket_bytes` and `device_pack` are this stream's own: publishers in
  one process may differ. The values in use are the attributes
  `bucket_bytes` and `device_pack`.

  A publisher checks at construction that its process can serve every
  subscriber, on its own host and on others: it registers rdt_jax's
  transports in this process (`rdt_jax.register()`, idempotent: what the
  driver's call gives an actor it creates), and refuses an actor created
  without `enable_tensor_transport=True`.

  Raises:
    ValueError: for `keep` < 1, a two-sided transport, another `name`, or
      `bucket_bytes` outside its range; the message names the argument.
    TypeError: a `bucket_bytes` that is not an int, a `device_pack` or
      `announce` that is not a bool.
    SettingError: an argument left out whose setting holds a bad value.
    SetupError: (a `RuntimeError`) outside a Ray actor, or in an actor
      created without `@ray.remote(enable_tensor_transport=True)`; the
      message names the fix.
    TransportNotRegisteredError: `transport` cannot run in this process
      (its dependency is missing here); the message names it.
  """

  def __init__(self, transport: str = "jax_nixl", keep: int = 2, pack: bool = True, name: str = "weights",
               bucket_bytes: int | None = None, device_pack: bool | None = None, announce: bool = False):
    # jax is imported here, once, rather than at the first publish: the first
    # import of jax from two threads at once (a threaded actor publishing from
    # several) can fail inside jax's own circular imports (`_DeadlockError`).
    import jax  # noqa: F401

    keep = int(keep)
    if keep < 1:
      raise ValueError(f"keep={keep}: a publisher keeps at least one version readable.")
    if not (isinstance(name, str) and STREAM_NAME.fullmatch(name)):
      raise ValueError(f"name={name!r}: a stream's name is 1 to 64 letters, digits, '_', '.' or '-'.")
    if type(announce) is not bool:
      raise TypeError(f"announce={announce!r}: give True or False.")
    if transport in ("jax_gloo", "jax_nccl"):
      raise ValueError(
          f"transport={transport!r} is two-sided: its bytes move only as a task's argument, so a subscriber "
          "cannot pull them. Use 'jax_nixl' (or 'jax_transfer')."
      )
    bucket = bucket_size(bucket_bytes)
    on_device = bool(_settings.argument("RDT_JAX_WEIGHT_DEVICE_PACK", device_pack, "device_pack"))
    actor = serving_actor(transport)
    self.transport = transport
    self.keep = keep
    self.name = name
    #: Bytes of each bucket object a packed host version is read in through Ray.
    self.bucket_bytes = bucket
    #: Whether versions on one CUDA device are packed in device memory.
    self.device_pack = on_device
    #: Whether each version is announced as the stream's newest (`rdt_jax.latest_handle`).
    self.announce = announce
    self._actor = actor
    self._id = uuid.uuid4().hex
    self._lock = threading.Lock()
    self._kept: list[Kept] = []
    # digest -> (structure, packed layout or None)
    self._structures: dict[str, Published] = {}
    self.pack = bool(pack)
    self._stream = Stream(keep, self._id, on_device) if transport == "jax_nixl" and self.pack else None
    self._device_buffers = DeviceBuffers()
    self._stats = PublishStats()
    self._sizes: dict[str, int] = {}  # array bytes of each pytree structure published, by digest
    self._splitter = Splitter()  # this process's part of a multi-process version (rdt_jax.weights._shards)
    self._closed = False
    publishers[self._id] = self
    # Runs `_end` when this publisher is collected without close(): it holds
    # the table and every kept version's memory, never the publisher itself.
    self._finalizer = weakref.finalize(self, end_publisher, self._id, self._stream, self._kept, self._lock,
                                       self._device_buffers, collected=True)

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

  @property
  def stats(self) -> PublishStats:
    """What this publisher did since it was created (`rdt_jax.PublishStats`:
    versions published; the newest one's version, kind, size and publish
    time; questions answered; RDT objects made)."""
    with self._lock:
      return self._stats

  def publish(self, tree: Any, version: int) -> WeightsHandle:
    """Publishes `tree` (a pytree of jax, torch or numpy arrays, typed PRNG
    keys included) as `version`.

    Returns once the version is readable; frees the version that leaves the
    `keep` window. With `jax_nixl` and every array leaf in host memory, or
    every array leaf on one CUDA device, the version is packed: its leaves
    are copied into one pooled host buffer or one CUDA allocation of the
    publisher's own (docs/weight_sync.md). Other versions, or `jax_transfer`,
    send the tree as it is, except that jax arrays in device memory are
    copied on their device.

    In a multi-controller JAX trainer (`jax.distributed`: global arrays
    whose shards span processes), every process publishes the same version
    of the same tree, and each publishes only what it holds: the shards of
    each global array whose `replica_id` is 0, and, in process 0 only, the
    leaves that are not global arrays (taken to be the same in every
    process). Its handle is that process's part; `WeightsHandle.combine`
    makes one version of every process's handles.

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
        send, or a typed PRNG key array in a tree that spans processes
        (nothing is published).
    """
    started = time.perf_counter()
    version = int(version)
    newest = self.version
    if self._closed:
      raise RuntimeError("This WeightPublisher is closed; create a new one to publish again.")
    if newest is not None and version <= newest:
      raise ValueError(f"Version {version} is not newer than the last published version {newest}: versions increase.")
    if not EMPTY < version <= np.iinfo(np.int64).max:
      raise ValueError(f"Version {version} is outside the int64 range versions take.")
    part = self._splitter.split(tree)  # global arrays of a multi-controller trainer: publish this process's pieces
    shards, layout = (None, None) if part is None else part[1:]
    if part is not None:
      tree = part[0]
    packed = None
    buffer: Any = None
    info: PublishedStructure | None = None
    rest: tuple[Any, ...] = ()
    if self._stream is not None:
      new_structure: list[tuple[LeafEntry, ...]] = []

      def digest_of(t: Any) -> str:
        new_structure.append(structure_of(t))
        return structure_digest(new_structure[0], t)

      info, digest, arrays, rest = self._stream.structure(tree, digest_of, array_paths)
      if new_structure:
        with self._lock:
          self._structures[digest] = Published(new_structure[0], None if info is None else info.info)
      if info is not None and info.device >= 0:
        buffer = self._pack_on_device(info, arrays)
        if buffer is not None:
          packed = self._stream.source(version, buffer, rest)
      elif info is not None:
        buffer = _memory.host_pool.acquire(info.info.layout.total)
        try:
          info.packer.pack(arrays, _memory.host_pointer(buffer))
        except _layout.NotHostMemory:
          buffer = None  # a leaf moved to device memory since: send this version as a pytree
        else:
          packed = self._stream.source(version, buffer, rest)
    else:
      structure = structure_of(tree)
      digest = structure_digest(structure, tree)
      with self._lock:
        self._structures.setdefault(digest, Published(structure))
    if packed is None and self._stream is not None and digest not in self._structures:
      with self._lock:
        self._structures[digest] = Published(structure_of(tree))
    # A packed version becomes an RDT object only when a subscriber that
    # cannot read it node-locally asks (`_object_of`): a put costs a few ms.
    value = None if packed is not None else _device_copies(tree)
    ref = None if value is None else ray.put(value, _tensor_transport=self.transport)
    with self._lock:
      if self._closed:  # closed while this version was packed: its memory goes back, nothing is kept
        if isinstance(buffer, DeviceBuffer):
          self._device_buffers.release(buffer)
        if ref is not None:
          _ray.state.free_now(ref.hex())
        raise RuntimeError("This WeightPublisher was closed while it published; create a new one to publish again.")
      if layout is not None and self._structures[digest].shards is None:
        self._structures[digest] = dataclasses.replace(self._structures[digest], shards=layout)
      dropped = self._drop_oldest(self.keep - 1)
      self._kept.append(Kept(version, ref, digest, buffer, value=value,
                              frameworks=info.frameworks if packed is not None and info is not None else (),
                              rest=rest if packed is not None else ()))
      if self._stream is not None and packed is not None:
        self._stream.table.add(version)
      live = {k.digest for k in self._kept}
      for d in [d for d in self._structures if d not in live]:
        del self._structures[d]
      for d in [d for d in self._sizes if d not in live]:
        del self._sizes[d]
      kind = "pytree" if packed is None else ("packed" if packed.device < 0 else "packed_device")
      nbytes = self._size_of(digest, tree, info.info.layout if packed is not None and info is not None else None)
      st = self._stats
      self._stats = dataclasses.replace(
          st, published=st.published + 1, last_version=version, last_kind=kind, last_nbytes=nbytes,
          last_seconds=time.perf_counter() - started, objects=st.objects + (ref is not None))
    free_objects(dropped)
    self._reuse(dropped)
    _metrics.count_publish(self.name, kind, nbytes, time.perf_counter() - started)
    handle = WeightsHandle(version, ref, self._id, self._actor, digest, packed, self.name, shards)
    if self.announce:
      _latest.announce(handle)
    return handle

  def _count(self, answered: int = 0, objects: int = 0) -> None:
    """Adds to `stats` (lock held)."""
    st = self._stats
    self._stats = dataclasses.replace(st, answered=st.answered + answered, objects=st.objects + objects)

  def _size_of(self, digest: str, tree: Any, layout: Any) -> int:
    """The array bytes of a version, counted once per structure (lock
    held): from its packed `layout`, or from the tree's array leaves."""
    size = self._sizes.get(digest)
    if size is None:
      import jax

      if layout is not None:
        size = sum(layout.sizes)
      else:
        size = sum(int(getattr(x, "nbytes", 0) or 0) for x in jax.tree_util.tree_leaves(tree) if _dlpack.is_array(x))
      self._sizes[digest] = size
    return size

  def _pack_on_device(self, info: PublishedStructure, arrays: list[Any]) -> DeviceBuffer | None:
    """A device buffer holding `arrays` packed, or None where this version
    goes as a pytree: a leaf left the structure's device, or device buffers
    cannot be made here (said once; later structures are not packed on a
    device)."""
    assert self._stream is not None
    try:
      buf = self._device_buffers.acquire(info.info.layout.total, info.device)
    except _memory.IpcError as e:
      logger.warning("rdt_jax: WeightPublisher cannot pack versions in device memory here (%s); they are sent "
                     "as a pytree, one RDT object each.", e)
      self._stream.no_device()
      return None
    try:
      info.packer.pack(arrays, buf.pointer)
    except _layout.NotOnDevice:
      self._device_buffers.release(buf)
      return None
    except BaseException:
      self._device_buffers.release(buf)
      raise
    return buf

  def _reuse(self, dropped: list[Kept]) -> None:
    """Returns the device buffers of versions that left the window (and
    the kept-versions table) to be packed into again."""
    for k in dropped:
      if isinstance(k.buffer, DeviceBuffer):
        self._device_buffers.release(k.buffer)

  def _object_of(self, version: int) -> ObjectAnswer:
    """`object_query`'s answer for a packed version: for one in device
    memory the ref of its tree's one object (`device_arrays`, made at the
    first request, bucket size 0); else the refs of its bucket
    objects (consecutive byte ranges of its buffer of `bucket_bytes` each,
    the last one shorter), put at the first request for the version (under
    the lock, so once) and shared by later ones; or None if it is not kept.
    Then the bucket size, and the versions kept (None once closed)."""
    with self._lock:
      if self._closed:
        return ObjectAnswer(None, 0, None)
      kept = tuple(k.version for k in self._kept)
      self._count(answered=1)
      entry = next((k for k in self._kept if k.version == version), None)
      if entry is None or entry.buffer is None:
        return ObjectAnswer(None, 0, kept)
      if isinstance(entry.buffer, DeviceBuffer):
        if entry.buckets is None:
          published = self._structures[entry.digest]
          assert published.packed is not None
          arrays = device_arrays(published.packed, entry.frameworks, published.entries, entry.buffer)
          value = unflatten(published.packed, arrays, entry.rest)
          entry.buckets = [ray.put(value, _tensor_transport=self.transport)]
          self._count(objects=1)
        return ObjectAnswer(tuple(entry.buckets), 0, kept)
      if entry.buckets is None:
        size, buffer = self.bucket_bytes, entry.buffer
        entry.buckets = [
            ray.put(buffer[at : at + size], _tensor_transport=self.transport) for at in range(0, buffer.nbytes, size)
        ]
        self._count(objects=len(entry.buckets))
        entry.bucket_bytes = size
      return ObjectAnswer(tuple(entry.buckets), entry.bucket_bytes, kept)

  def _drop_oldest(self, room: int) -> list[Kept]:
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
    """Frees every kept version; later pulls of them raise `StaleWeightsError`.

    A publisher that is not closed ends the same way when its last
    reference goes (replaced by a new one, collected, or at the process's
    exit): its handles are stale from then on, never another publisher's
    bytes. Closing says when.
    """
    with self._lock:
      already = self._closed
      self._closed = True
    if self.announce and not already:
      _latest.withdraw(self.name, self._id)
    ending = self._finalizer.detach()
    if ending is not None:  # not ended yet
      args: tuple[Any, ...] = ending[2]
      end_publisher(*args, collected=False)

  def _answer(self, structure: str | None) -> Answer:
    """The versions kept (None once closed) and, if asked, the structure
    behind digest `structure`."""
    with self._lock:
      if self._closed:
        return Answer(None)
      self._count(answered=1)
      return Answer(tuple(k.version for k in self._kept),
                     None if structure is None else self._structures.get(structure))

  def _local_value(self, version: int) -> Any:
    """A kept pytree version's value, for a subscriber in this process; None
    if the version is not kept (or is packed)."""
    with self._lock:
      if self._closed:
        return None
      entry = next((k for k in self._kept if k.version == version), None)
      return None if entry is None else entry.value
