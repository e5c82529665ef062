"""The read routes of a pull: how a version's bytes reach the subscriber.

* `pull_node_local`: a packed version on this host, copied straight from the
  publisher's memory (`rdt_jax._node_local`), its kept-versions table read
  before and after the copy;
* (`rdt_jax.weights._device_route.pull_device_local`: the same for a
  version packed in device memory, through CUDA IPC);
* `pull_buckets`: a packed version through Ray, one RDT object per bucket,
  the next fetched while the last is copied out;
* `pull_pytree`: a version sent as a pytree, `ray.get` into the template
  (`rdt_jax._targets`);
* `pull_colocated`: a pytree version whose publisher lives in this very
  process (Ray would hand back the publisher's own arrays: copied here).

Every route takes the pull in progress (`rdt_jax.weights._pull.Pull`: handle,
deadline, the version held when it began, its cancellation) and keeps one rule: with `atomic=False`
the subscriber's version is None (`Pull.tear`) before the first byte that
could reach the template, and a route that fails after that adds the torn
note to its error. A route that returns has checked, after its bytes
arrived, that the version was still kept.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray

from rdt_jax import _dlpack, _faults, _layout, _limits, _memory, _process, _ray, _targets
from rdt_jax import _node_local as node_local
from rdt_jax._metadata import MetadataError
from rdt_jax.transports import _lifetime
from rdt_jax.weights._handle import (
  StaleWeightsError,
  WeightsHandle,
  check_template,
  flatten,
  is_template_leaf,
  replaced_error,
)
from rdt_jax.weights._packed import EMPTY, ForeignTable, KeptTable, PackedSource, table_token
from rdt_jax.weights._packed_plan import PackedPlan, bucket_runs
from rdt_jax.weights._protocol import Published, ask_buckets
from rdt_jax.weights._publisher import WeightPublisher
from rdt_jax.weights._pull import Pull, PullCancelled, torn

__all__ = [
  "await_bucket",
  "can_read_directly",
  "check_structure_once",
  "checked_after_read",
  "dead_publisher_error",
  "fetcher",
  "kept_table",
  "node_local_read",
  "own_copy",
  "pull_buckets",
  "pull_colocated",
  "pull_node_local",
  "pull_pytree",
  "read_failure",
  "read_table",
  "read_table_or_empty",
  "torn",
]


# --------------------------------------------------------------------------
# Node-local: packed versions on this host


def read_table(source: PackedSource, publisher: str) -> set[int]:
  """The versions publisher `publisher` keeps now, read from its table.

  Raises:
    ForeignTable: the table no longer names that publisher (closed, or its
      memory reused).
    ProcessLookupError: the publisher's process exited.
    OSError: its memory could not be read.
  """
  assert source.origin is not None and 0 < source.slots <= _limits.WEIGHTS_MAX_SLOTS
  out = np.empty(source.slots + KeptTable.HEADER, np.int64)
  node_local.read(source.origin, [(_memory.host_pointer(out), source.table, out.nbytes)])
  words = out.tolist()
  if (words[0], words[1]) != table_token(publisher):
    raise ForeignTable(f"the table at {source.table:#x} no longer belongs to publisher {publisher}")
  kept = set(words[KeptTable.HEADER :])
  kept.discard(EMPTY)
  return kept


def read_table_or_empty(source: PackedSource, publisher: str) -> set[int]:
  """`read_table`, or an empty set where the table cannot be read or is
  foreign (every version then counts as not kept)."""
  try:
    return read_table(source, publisher)
  except (OSError, ForeignTable):
    return set()


def kept_table(pull: Pull, source: PackedSource, after_read: bool = False) -> set[int]:
  """The versions `pull`'s publisher keeps, read from its table on this
  host, with `pull`'s version among them.

  Raises:
    PermissionError: the kernel refused the read (nothing was read).
    StaleWeightsError: the version is not kept (`after_read`: seen once
      bytes were read), or the publisher was closed or replaced.
    RayDirectTransportError: the publisher's memory could not be read.
  """
  handle = pull.handle
  try:
    kept = read_table(source, handle.publisher)
  except PermissionError:
    raise
  except ForeignTable:
    raise replaced_error(handle, pull.current) from None
  except OSError as e:
    raise dead_publisher_error(pull.label, handle.actor, e) from None
  if handle.version not in kept:
    raise pull.stale(kept, after_read=after_read)
  return kept


def can_read_directly(source: PackedSource | None) -> bool:
  """True if this process may copy a packed version from its publisher's
  memory itself (same host, node-local reads on: `node_local.can_read`)."""
  return source is not None and node_local.can_read(source.origin)


def dead_publisher_error(obj_id: str, actor: Any, error: BaseException) -> BaseException:
  """The error of a node-local pull that failed to read the publisher's
  memory: Ray's `RayDirectTransportError` with the lifetime error (its
  cause) if the publisher's actor died, else with what the read reported."""
  from ray.exceptions import RayDirectTransportError

  try:
    _lifetime.check_producer(obj_id, _ray.state.actor_id(actor))
  except _lifetime.ProducerDiedError as e:
    out = RayDirectTransportError(str(e))
    out.__cause__ = e
    return out
  return RayDirectTransportError(
      f"The node-local read of packed object {obj_id} from its publisher's process failed: {error}. "
      "The publishing actor may be exiting; pull a newer version once it runs again."
  )


def read_failure(pull: Pull, source: PackedSource, error: BaseException) -> BaseException:
  """The error a node-local read of `pull`'s version (host memory, or
  device memory through CUDA IPC) raises when it, or a check of it, failed
  with `error`. The one rule of every node-local route, for a publisher
  that no longer is what the pull planned against:

  * its table names another publisher, or none (`ForeignTable`: closed,
    replaced, collected): `StaleWeightsError`, "closed or replaced";
  * its process is gone (`ProcessLookupError`): Ray's
    `RayDirectTransportError` with the lifetime error if Ray reports its
    actor dead;
  * its memory could not be read (another `OSError`): `StaleWeightsError`
    if the table no longer keeps the version (a version unmapped under the
    copy), else as for a process gone;
  * anything else (the kernel refusing the read, `PermissionError`, which
    the caller answers by reading through Ray; a stale version, a dead
    actor found after the read, a fault, a cancellation): `error` itself.
  """
  handle = pull.handle
  if isinstance(error, PermissionError):
    return error
  if isinstance(error, ForeignTable):
    return replaced_error(handle, pull.current)
  if isinstance(error, OSError) and not isinstance(error, ProcessLookupError):
    now = read_table_or_empty(source, handle.publisher)
    if handle.version not in now:
      return pull.stale(now, after_read=True)
  if isinstance(error, OSError):
    return dead_publisher_error(pull.label, handle.actor, error)
  return error


@contextlib.contextmanager
def node_local_read(pull: Pull, source: PackedSource, writes_template: bool) -> Iterator[None]:
  """Around a node-local read of `pull`'s version and its checks after
  (`checked_after_read`): a failure raises `read_failure`'s error, with the
  torn note if the read may have written the template (`writes_template`;
  the caller marked it torn before the first byte)."""
  try:
    yield
  except BaseException as e:
    error = read_failure(pull, source, e)
    try:
      if writes_template:
        torn(error, pull.handle.version, "while it copied into the template")
      if error is e:
        raise
      raise error from None
    finally:
      del error  # a local naming the raised error would hold this frame in a cycle with it


def checked_after_read(pull: Pull, source: PackedSource) -> set[int]:
  """After a node-local read of `pull`'s version: the versions its
  publisher keeps, read from its table again, with the version among them,
  and its actor alive by Ray's account, as for every RDT fetch
  (`rdt_jax.transports._lifetime`): bytes read from a publisher that Ray
  reports dead are refused, even while its exiting process is readable.

  Raises:
    StaleWeightsError: the version was freed while it was read.
    ForeignTable: the publisher was closed or replaced (`read_failure`
      makes it stale).
    RayDirectTransportError: the publisher's actor is dead; its cause is
      `ProducerDiedError`.
  """
  handle = pull.handle
  kept = read_table(source, handle.publisher)
  if handle.version not in kept:
    raise pull.stale(kept, after_read=True)
  if source.origin == _process.identity():
    return kept  # this very process: alive
  message = _lifetime.died(pull.label, _ray.state.actor_id(handle.actor), time.monotonic())
  if message is not None:
    from ray.exceptions import RayDirectTransportError

    died = _lifetime.ProducerDiedError(message)
    error = RayDirectTransportError(message)
    error.__cause__ = died
    raise error
  return kept


def pull_node_local(pull: Pull, plan: PackedPlan, staging: np.ndarray | None, atomic: bool) -> bool:
  """Copies a packed version from its publisher's memory on this host,
  checking its kept-versions table before and after. False if the kernel
  refused the copy (nothing was written; read through Ray instead).

  Raises:
    StaleWeightsError: the version is not kept (before or after the copy),
      or its publisher was closed or replaced.
    RayDirectTransportError: the publisher's memory could not be read, or
      Ray reports its actor dead.
  """
  source = pull.handle.packed
  assert source is not None and source.origin is not None
  try:
    kept_table(pull, source)
  except PermissionError:
    return False
  writes_template = not atomic and plan.writes_in_place
  if writes_template:
    pull.tear()
  with node_local_read(pull, source, writes_template):
    try:
      base = 0 if staging is None else _memory.host_pointer(staging)
      node_local.read(source.origin, plan.prepared(source.buffer, base))
    except PermissionError:
      if writes_template:
        pull.set_version(pull.current)  # refused before a byte moved
      return False
    if _faults.ON:
      _faults.hit("weights.copied")
    pull.kept = checked_after_read(pull, source)
    pull.route = "node_local"
  return True


# --------------------------------------------------------------------------
# Through Ray: packed versions in buckets


_fetch_pool: list[concurrent.futures.ThreadPoolExecutor] = []
_fetch_lock = threading.Lock()


def fetcher() -> concurrent.futures.ThreadPoolExecutor:
  """The threads that fetch a pull's next bucket while the caller copies the
  last one out (created at the first bucketed pull)."""
  with _fetch_lock:
    if not _fetch_pool:
      _fetch_pool.append(concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="rdt-jax-bucket"))
    return _fetch_pool[0]


def await_bucket(pull: Pull, pending: concurrent.futures.Future[Any]) -> Any:
  """The bucket `pending` fetches. While the fetch runs, every
  `_limits.WEIGHTS_STALE_CHECK_S` the pull stops if it was cancelled and asks the publisher
  whether it still keeps the version (`StaleWeightsError` if not: the fetch
  is left to end in its thread, into rdt_jax's memory, never the template)."""
  while True:
    try:
      return pending.result(timeout=_limits.WEIGHTS_STALE_CHECK_S)
    except concurrent.futures.TimeoutError:
      pull.check_cancelled()
      pull.ask(after_read=True)


def pull_buckets(pull: Pull, plan: PackedPlan, staging: np.ndarray | None, atomic: bool) -> None:
  """Fetches a packed version through Ray, in the buckets its publisher
  cuts it into: asks the publisher for the buckets' RDT objects (made at the
  first request for the version), then fetches them one after the other
  (one NIXL READ each), the next one while the last one is copied out, so at
  most two are held at once.

  Leaves written in place (`atomic=False`) are copied into the template as
  each bucket arrives: the template is torn from the first such copy until
  the pull succeeds. Every other byte goes to `staging`, committed by the
  caller. Once the last bucket is copied the publisher is asked whether it
  still keeps the version (a version freed meanwhile is a failed pull).
  """
  handle = pull.handle
  total = plan.info.layout.total
  buckets = ask_buckets(handle, pull.label, pull.left(), pull.current, total)
  refs, size = buckets.refs, buckets.size
  pull.route, pull.objects = "buckets", len(refs)
  runs = bucket_runs(plan.pairs(0 if staging is None else _memory.host_pointer(staging)), size, len(refs))
  writes_template = not atomic and plan.writes_in_place
  memmove = ctypes.memmove
  began = False  # a bucket was copied into the template
  try:
    pending: concurrent.futures.Future[Any] = fetcher().submit(ray.get, refs[0], timeout=pull.left())
    for i, ref in enumerate(refs):
      try:
        bucket: Any = await_bucket(pull, pending)
      except (ray.exceptions.GetTimeoutError, StaleWeightsError, PullCancelled):
        raise
      except Exception:
        pull.ask(after_read=True)
        raise
      pull.check_cancelled()
      if i + 1 < len(refs):
        pending = fetcher().submit(ray.get, refs[i + 1], timeout=pull.left())
      if _dlpack.framework_of(bucket) != "numpy" or bucket.nbytes != min(size, total - i * size):
        raise MetadataError(ref.hex(), "value", f"is not bucket {i} of the version's packed buffer")
      if writes_template:
        pull.tear()
        began = True
      base = _memory.host_pointer(bucket)
      for local, offset, n in runs[i]:
        memmove(local, base + offset, n)
      del bucket
      if _faults.ON:
        _faults.hit("weights.bucket")
    pull.ask(after_read=True)
  except BaseException as e:
    if began:
      torn(e, handle.version, "after it began writing the template")
    raise


# --------------------------------------------------------------------------
# Pytree versions


def pull_pytree(pull: Pull, target: Any, flat_target: dict[str, Any] | None, atomic: bool) -> Any:
  """Fetches a version sent as a pytree into `target` (the template, or
  its atomic staging): `ray.get` of its RDT object with `target` set as its
  target (`flat_target`: the target flattened by an earlier pull of the same
  structure, which skips `set_target_for_ref`'s checks). Returns the value
  as it arrived, once the publisher said it still keeps the version."""
  handle = pull.handle
  pull.check_cancelled()
  if not atomic:
    pull.tear()
  try:
    if flat_target is not None:
      _targets.set_flat_target_for_ref(handle.ref, flat_target)
    else:
      _targets.set_target_for_ref(handle.ref, target)
    value = ray.get(handle.ref, timeout=pull.left())
    pull.route, pull.objects = "ray", 1
    pull.ask(after_read=True)
    pull.check_cancelled()
  except BaseException as e:
    if not atomic:
      torn(e, handle.version, "after it started")
    raise
  return value


def check_structure_once(handle: WeightsHandle, structure: Published | None, flat: list[tuple[str, Any]],
                         checked: set[str]) -> None:
  """Checks the flattened template `flat` against `handle`'s structure
  (the publisher's answer, `structure`) at its first pull: unless its digest
  is in `checked`, to which it is added once checked.

  Raises:
    RuntimeError: the publisher no longer knows the structure.
    ValueError, UnsupportedLeafError: as `check_template`.
  """
  if handle.structure in checked:
    return
  if structure is None:
    raise RuntimeError(f"The publisher no longer knows the structure of version {handle.version}.")
  check_template(flat, structure.entries)
  checked.add(handle.structure)


def pull_colocated(pull: Pull, pub: WeightPublisher, flat: list[tuple[str, Any]], checked: set[str],
                   target: Any, atomic: bool) -> Any:
  """A pull of a pytree version whose publisher `pub` lives in this process.

  Ray would hand back the publisher's own stored arrays here (a process
  reading its own RDT object gets the stored objects, and no transport
  runs), leaving the template unwritten. So the kept value is copied: into
  the template's in-place arrays (on their device), and into new jax arrays
  with the template's placements; nothing returned aliases it. `flat` is
  the flattened template, checked against the structure unless its digest
  is in `checked` (added once checked)."""
  handle = pull.handle
  answer = pub._answer(handle.structure if handle.structure not in checked else None)
  kept, structure = answer.kept, answer.structure
  if kept is None or handle.version not in kept:
    raise pull.stale(kept, after_read=False)
  check_structure_once(handle, structure, flat, checked)
  value = pub._local_value(handle.version)
  if value is None:
    raise pull.stale(pub.versions, after_read=False)
  pull.check_cancelled()
  if not atomic:
    pull.tear()
  try:
    out = local_copy(value, target)
    kept = pub._answer(None).kept
    if kept is None or handle.version not in kept:
      raise pull.stale(kept, after_read=True)
    pull.route, pull.kept = "colocated", kept
    pull.check_cancelled()
  except BaseException as e:
    if not atomic:
      torn(e, handle.version, "after it started")
    raise
  return out


def local_copy(value: Any, target: Any) -> Any:
  """`value`, a version kept by a publisher in this process, with each array
  leaf copied as the template (or atomic staging) `target` says: into its
  in-place arrays (on their device: no host staging for device memory), as
  new jax arrays with its placements, cut by its `Slice`s. Nothing returned
  aliases `value`'s arrays, so writing into the pulled tree (or donating it)
  never changes the kept version."""
  import jax

  wanted = dict(flatten(target))
  flat, treedef = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_template_leaf)
  copies: list[tuple[Any, Any]] = []
  out = []
  for p, x in flat:
    if not _dlpack.is_array(x):
      out.append(x)
      continue
    path = jax.tree_util.keystr(p)
    out.append(_local_leaf(path, x, wanted.get(path), copies))
  _memory.copy_into_many(copies)
  _dlpack.mark_written_many([t for t, _ in copies])
  return treedef.unflatten(out)  # type: ignore[attr-defined]


def _local_leaf(path: str, x: Any, want: Any, copies: list[tuple[Any, Any]]) -> Any:
  """One leaf of `local_copy`: what the pulled tree holds for kept array
  `x` at `path`, given the template leaf `want`; copies into caller arrays
  are appended to `copies` (made together, one wait per device)."""
  if isinstance(want, _layout.Slice):
    box = want.box(tuple(int(n) for n in x.shape), path)
    x = x[tuple(slice(a, b) for a, b in box)]
    want = want.into
    if want is None:
      return own_copy(x)
  if want is None:
    return own_copy(x)
  if _dlpack.is_sharding(want) or _dlpack.framework_of(want) == "jax":
    import jax

    sharding = want if _dlpack.is_sharding(want) else want.sharding
    if _dlpack.framework_of(x) != "jax":
      x = _dlpack.convert_leaf(x, "jax", path)
    return jax.device_put(x, sharding, may_alias=False)
  copies.append((want, x))
  return want


def own_copy(x: Any) -> Any:
  """A copy of array `x` in its own framework and device (writable, and
  aliasing nothing)."""
  fw = _dlpack.framework_of(x)
  if fw == "jax":
    import jax

    return jax.device_put(x, x.sharding, may_alias=False)
  if fw == "torch":
    return x.clone()
  return x.copy()
