"""Weights by name: the reads of `WeightSubscriber.pull_named`, bucket by bucket.

An engine that loads weights by name (vLLM's `load_weights`, which takes an
iterable of `(name, tensor)`) needs no template: it takes each published
leaf and copies it into its own parameters. `named_leaves` yields a
version's `(path, array)` pairs a bucket at a time:

* a packed version on the publisher's host: consecutive leaves of at most
  the subscriber's `bucket_bytes` in all (a larger leaf alone) are copied from the
  publisher's memory into one pooled host buffer;
* a packed version elsewhere: the publisher's bucket objects through Ray,
  the next one fetched while the last one's pairs are taken; a leaf that
  crosses a bucket boundary is assembled in a buffer of its own;
* any other version (a pytree, or packed in device memory): the version's
  one RDT object through Ray, whole (its memory is then the version's, not
  a bucket's). From a publisher in this very process Ray hands back the
  stored arrays themselves (route "colocated"): `renamed` yields copies of
  them, so an engine that changes a yielded tensor in place never changes
  the kept version.

A bucket's leaves are yielded only once the publisher still kept the
version after the bucket's bytes arrived (the kept-versions table read
after the copy, or the publisher asked), so every pair holds the version's
bytes. Each array is a view of its bucket's buffer, valid as long as it is
referenced (the pool never hands out a buffer a view holds); memory stays
bounded by the bucket size as long as the caller drops each bucket's arrays
before it asks for the next ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray

from rdt_jax import _dlpack, _memory
from rdt_jax import _node_local as node_local
from rdt_jax._metadata import MetadataError
from rdt_jax.weights._handle import StaleWeightsError, flatten
from rdt_jax.weights._packed import PackedLayoutInfo, PackedSource
from rdt_jax.weights._packed_checks import check_layout, check_source
from rdt_jax.weights._protocol import Published, ask_buckets, ask_object, publishers
from rdt_jax.weights._pull import Pull
from rdt_jax.weights._routes import (
  await_bucket,
  can_read_directly,
  checked_after_read,
  fetcher,
  kept_table,
  node_local_read,
  own_copy,
)

__all__ = ["groups", "leaf_parts", "named_leaves", "renamed"]


def groups(offsets: Sequence[int], sizes: Sequence[int], limit: int) -> list[tuple[int, int, list[int]]]:
  """(first byte, end, leaf indices) of consecutive leaves whose bytes span
  at most `limit` (a leaf larger than `limit` alone), in layout order."""
  out: list[tuple[int, int, list[int]]] = []
  start, end = 0, 0
  members: list[int] = []
  for i, (offset, size) in enumerate(zip(offsets, sizes)):
    if members and offset + size - start > limit:
      out.append((start, end, members))
      members = []
    if not members:
      start = offset
    members.append(i)
    end = offset + size
  if members:
    out.append((start, end, members))
  return out


def _typed(raw: np.ndarray, entry: Any, shape: tuple[int, ...]) -> np.ndarray:
  """A leaf's bytes as its published dtype and shape (a typed key: its
  uint32 key data)."""
  _, kind, _, what = entry
  dtype = np.dtype(np.uint32) if kind == "key" else _dlpack.np_dtype_from_name(what)
  return raw[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def named_leaves(pull: Pull, published: Published, wanted: Container[str] | None = None) -> Iterator[tuple[str, Any]]:
  """The `(path, array)` pairs of `pull`'s version, in the published order:
  host numpy arrays for a packed version, the arrays as they arrived (a
  typed key as its key data) otherwise. With `wanted`, only the leaves at
  those paths (node-locally only their bytes are read).

  Raises (from the iteration):
    StaleWeightsError: the version was not kept before a bucket was read, or
      was freed while it was read (no pair of that bucket is yielded).
    MetadataError: for a handle, layout or bucket that does not hold
      together.
    RayDirectTransportError: the publisher's memory could not be read.
  """
  for path, x, _ in leaf_parts(pull, published, wanted):
    yield path, x
    del x  # no view of a bucket is held here once the caller asks for the next pair


def leaf_parts(pull: Pull, published: Published, wanted: Container[str] | None = None,
               chunked: Container[str] = (), layout_checked: bool = False) -> Iterator[tuple[str, Any, int | None]]:
  """`named_leaves` as `(path, array, row)`: `row` None for a whole leaf; a
  packed leaf at a path in `chunked` that is larger than a bucket (or, through
  Ray, crosses a bucket boundary) comes instead in parts of whole rows of its
  first axis, `array` holding rows `row` to `row + len(array)`, so no buffer
  holds more than a bucket of it. `layout_checked`: `published` already
  passed `check_layout` (a caller that keeps it per structure checks it
  once). Raises as `named_leaves`."""
  handle = pull.handle
  source, info = handle.packed, published.packed
  if source is None or info is None or getattr(source, "device", -1) != -1:
    yield from _whole(pull, wanted)
    return
  # Nothing the publisher sent is used before it is checked: the layout
  # against the published leaves, the handle against its bounds, the layout
  # and its digest.
  if not layout_checked:
    check_layout(info, published.entries, pull.label)
  source = check_source(source, pull.label, SimpleNamespace(info=info), handle.version)  # type: ignore[arg-type]
  if can_read_directly(source):
    reader = _node_local(pull, info, published.entries, source, wanted, chunked)
    try:
      first = next(reader)
    except StopIteration:
      return
    except PermissionError:  # the kernel refused the first read: nothing was yielded
      reader = iter(())
    else:
      yield first
      del first  # its bucket's buffer goes back to the pool once the caller drops it
      yield from reader
      return
  yield from _buckets(pull, info, published.entries, wanted, chunked)


def _row_bytes(entry: Any, shape: tuple[int, ...]) -> int:
  """Bytes of one row of a leaf's first axis (0 for a leaf that has no rows
  to split: a scalar, a typed key, one row)."""
  _, kind, _, what = entry
  if kind != "array" or len(shape) == 0 or shape[0] < 2:
    return 0
  return math.prod(shape[1:]) * _dlpack.np_dtype_from_name(what).itemsize


def _node_local(pull: Pull, info: PackedLayoutInfo, entries: Sequence[Any], source: PackedSource,
                wanted: Container[str] | None, chunked: Container[str]) -> Iterator[tuple[str, Any, int | None]]:
  layout = info.layout
  after = False
  origin = source.origin
  assert origin is not None  # can_read_directly said so
  limit = pull.bucket_bytes
  read = [i for i in range(len(entries)) if wanted is None or entries[i][0] in wanted]
  for start, end, positions in groups([layout.offsets[i] for i in read], [layout.sizes[i] for i in read], limit):
    members = [read[k] for k in positions]
    row = _row_bytes(entries[members[0]], info.shapes[members[0]])
    runs: list[tuple[int | None, int]] = [(None, 0)]
    if end - start > limit and entries[members[0]][0] in chunked and row:  # one large leaf, in parts of rows
      rows, step = info.shapes[members[0]][0], max(1, limit // row)
      runs = [(r, min(step, rows - r)) for r in range(0, rows, step)]
    for first_row, count in runs:
      at = start if first_row is None else start + first_row * row
      stop = end if first_row is None else at + count * row
      kept_table(pull, source, after_read=after)
      buf = _memory.host_pool.acquire(max(1, stop - at))
      with node_local_read(pull, source, writes_template=False):
        if stop > at:  # refused (PermissionError) before the first pair: the caller reads through Ray instead
          node_local.read(origin, [(_memory.host_pointer(buf), source.buffer + at, stop - at)])
        pull.kept = checked_after_read(pull, source)
      pull.route = "node_local"
      after = True
      if first_row is not None:
        i = members[0]
        yield entries[i][0], _typed(buf, entries[i], (count, *info.shapes[i][1:])), first_row
      else:
        for i in members:
          offset = layout.offsets[i] - start
          yield entries[i][0], _typed(buf[offset : offset + layout.sizes[i]], entries[i], info.shapes[i]), None
      del buf


def _buckets(pull: Pull, info: PackedLayoutInfo, entries: Sequence[Any], wanted: Container[str] | None,
             chunked: Container[str]) -> Iterator[tuple[str, Any, int | None]]:
  layout = info.layout
  buckets = ask_buckets(pull.handle, pull.label, pull.left(), pull.current, layout.total)
  refs, size = buckets.refs, buckets.size
  needed = _needed(layout, entries, wanted, size, len(refs))  # the buckets holding a byte of a wanted leaf
  pull.route, pull.objects = "buckets", len(needed)
  n, j = len(layout.sizes), 0
  pending: np.ndarray | None = None  # a leaf crossing a bucket boundary, assembled here
  carry: np.ndarray | None = None  # a chunked leaf's row crossing a bucket boundary, assembled here
  carried = 0  # bytes of it so far
  pending_fetch = fetcher().submit(ray.get, refs[needed[0]], timeout=pull.left()) if needed else None
  for k, i in enumerate(needed):
    ref = refs[i]
    assert pending_fetch is not None  # submitted for `needed[k]` before this iteration
    try:
      bucket = await_bucket(pull, pending_fetch)  # asks every few seconds whether the version is kept
    except (ray.exceptions.GetTimeoutError, StaleWeightsError):
      raise
    except Exception:
      pull.ask(after_read=True)  # a bucket freed with its version: StaleWeightsError
      raise
    if k + 1 < len(needed):
      pending_fetch = fetcher().submit(ray.get, refs[needed[k + 1]], timeout=pull.left())
    if _dlpack.framework_of(bucket) != "numpy" or bucket.nbytes != min(size, layout.total - i * size):
      raise MetadataError(ref.hex(), "value", f"is not bucket {i} of the version's packed buffer")
    pull.ask(after_read=True)  # the bucket holds the version's bytes: it was still kept once they arrived
    b0, b1 = i * size, i * size + bucket.nbytes
    raw = bucket.view(np.uint8).reshape(-1)
    while j < n and layout.offsets[j] < b1:
      offset, nbytes = layout.offsets[j], layout.sizes[j]
      path, shape = entries[j][0], info.shapes[j]
      if pending is None and carry is None and offset < b0 and offset + nbytes <= b0:
        # Wholly in buckets before this one that were not fetched: a leaf not
        # wanted, or a wanted one with no bytes (no bucket holds a byte of it).
        if not nbytes and (wanted is None or path in wanted):
          yield path, _typed(np.empty(0, np.uint8), entries[j], shape), None
        j += 1
        continue
      if pending is None and carry is None and offset >= b0 and offset + nbytes <= b1:
        if wanted is None or path in wanted:
          yield path, _typed(raw[offset - b0 : offset - b0 + nbytes], entries[j], shape), None
        j += 1
        continue
      if wanted is not None and path not in wanted:
        if offset + nbytes > b1:
          break  # not assembled: skipped in the next bucket too
        j += 1
        continue
      lo, hi = max(offset, b0), min(offset + nbytes, b1)
      row = _row_bytes(entries[j], shape) if path in chunked else 0
      if row:  # whole rows as they come; a row across the boundary is assembled in `carry`
        if carry is not None:
          take = min(row - carried, hi - lo)
          carry[carried : carried + take] = raw[lo - b0 : lo - b0 + take]
          carried, lo = carried + take, lo + take
          if carried == row:
            yield path, _typed(carry, entries[j], (1, *shape[1:])), (lo - offset) // row - 1
            carry = None
        full = (hi - lo) // row if carry is None else 0
        if full:
          yield path, _typed(raw[lo - b0 : lo - b0 + full * row], entries[j], (full, *shape[1:])), (lo - offset) // row
          lo += full * row
        if hi > lo:
          carry, carried = np.empty(row, np.uint8), hi - lo
          carry[:carried] = raw[lo - b0 : hi - b0]
      else:
        if pending is None:
          pending = np.empty(nbytes, np.uint8)
        pending[lo - offset : hi - offset] = raw[lo - b0 : hi - b0]
      if offset + nbytes > b1:
        break  # the rest of this leaf is in the next bucket
      if not row:
        assert pending is not None
        yield path, _typed(pending, entries[j], shape), None
      pending = None
      j += 1
    del bucket, raw
  while j < n and (not layout.sizes[j] or (wanted is not None and entries[j][0] not in wanted)):
    if wanted is None or entries[j][0] in wanted:  # empty leaves at the end of the buffer
      yield entries[j][0], _typed(np.empty(0, np.uint8), entries[j], info.shapes[j]), None
    j += 1  # or leaves in buckets not fetched: none of them wanted
  if j != n:
    raise MetadataError(pull.label, "buckets", f"held {j} of the version's {n} array leaves")


def _needed(layout: Any, entries: Sequence[Any], wanted: Container[str] | None, size: int, count: int) -> list[int]:
  """The indices of the `count` buckets of `size` bytes that hold a byte of
  a wanted leaf (all of them without `wanted`), in order."""
  if wanted is None:
    return list(range(count))
  needed: set[int] = set()
  for e, offset, nbytes in zip(entries, layout.offsets, layout.sizes):
    if nbytes and e[0] in wanted:
      needed.update(range(offset // size, min(count, (offset + nbytes - 1) // size + 1)))
  return sorted(needed)


def _whole(pull: Pull, wanted: Container[str] | None) -> Iterator[tuple[str, Any, int | None]]:
  """The version's one RDT object, whole: its arrays as they arrived, or
  (route "colocated": its publisher lives in this process, and Ray hands
  back the stored objects) the kept arrays themselves, which the caller
  must not let anyone write (`renamed` copies them)."""
  handle = pull.handle
  ref = handle.ref
  if ref is None:  # packed in device memory: its tree, made by the publisher at the first request
    ref = ask_object(handle, pull.label, pull.left(), pull.current)
  colocated = publishers.get(handle.publisher) is not None
  value = ray.get(ref, timeout=pull.left())
  pull.ask(after_read=True)
  pull.route, pull.objects = ("colocated", 0) if colocated else ("ray", 1)
  for path, x in flatten(value):
    if wanted is not None and path not in wanted:
      continue
    if _dlpack.is_prng_key(x):
      yield path, _dlpack.prng_key_parts(x)[0], None
    elif _dlpack.is_array(x):
      yield path, x, None


def renamed(pairs: Iterable[tuple[str, Any]], rename: Callable[[str], str | None] | None, framework: str,
            counted: list[int], pull: Pull) -> Iterator[tuple[str, Any]]:
  """`pairs` (of `pull`'s version) under the engine's names (`rename`; a
  leaf it maps to None is skipped) as `framework`'s arrays ("torch" or
  "numpy"); `counted[0]` adds up every leaf's bytes, skipped ones included.
  Where a pair may alias memory its publisher keeps (`pull`'s route is
  "colocated"), the array yielded is a copy of its own."""
  cpu = _dlpack.Device("cpu")
  for path, x in pairs:
    counted[0] += int(x.nbytes)
    name = path if rename is None else rename(path)
    if name is None:
      continue
    if isinstance(x, np.ndarray):
      out = x if framework == "numpy" else _dlpack.rebuild_view(x, "torch", cpu, path)
    else:
      out = _dlpack.convert_leaf(x, framework, path)  # type: ignore[arg-type]
    if pull.route == "colocated":
      out = own_copy(out)
    del x
    yield name, out
    del out  # no view of a bucket is held here once the caller asks for the next pair
