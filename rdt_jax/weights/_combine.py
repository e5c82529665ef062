"""`WeightsHandle.combine`: one handle for a version published by every
process of a multi-controller trainer.

Each process's handle is one part (`rdt_jax.weights._parts.ShardedPart`);
`combine` checks that the parts are one version of one structure from every
process and, once per combination of part structures, asks each part's
publisher for its part's layout (`PartLayout`, in its answer to a structure
question: one call per process, all at once) and checks that the pieces
cover every element of every leaf exactly once. Installed into
`WeightsHandle.combine` when `rdt_jax.weights` is imported (this module asks
publishers, a room above the handle's).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import ray

from rdt_jax import _limits, _ray
from rdt_jax._errors import ArgumentTypeError
from rdt_jax.weights import _handle
from rdt_jax.weights._handle import WeightsHandle, label
from rdt_jax.weights._parts import PartLayout, check_coverage, check_part_layout
from rdt_jax.weights._protocol import check_answer, query

__all__ = ["combine", "layouts_of"]


_checked_lock = threading.Lock()
#: Combinations of part structures already checked (their coverage holds for every version of them).
_checked: OrderedDict[tuple[str, ...], None] = OrderedDict()


def combine(handles: Sequence[WeightsHandle]) -> WeightsHandle:
  """One handle for the parts of a version published by every process of a
  multi-controller trainer (see `WeightsHandle.combine`); asks each
  process for its part's layout once per structure.

  Raises:
    ArgumentTypeError: (a `TypeError`) for a value that is not a `WeightsHandle`.
    ValueError: for no handles, a handle of a single-process publish, parts
      of different versions, structures or streams, a process missing or
      given twice, or pieces that leave part of a leaf uncovered or give
      one element twice (naming the leaf and the processes).
    RuntimeError, MetadataError, ray.exceptions.RayError: as `layouts_of`.
  """
  parts = list(handles)
  if not parts:
    raise ValueError("WeightsHandle.combine needs the handles of every trainer process; it got none.")
  for h in parts:
    if not isinstance(h, WeightsHandle):
      raise ArgumentTypeError(f"WeightsHandle.combine takes WeightsHandles (from WeightPublisher.publish), got "
                      f"{type(h).__name__}.")
    if h.shards is None:
      raise ValueError(
          f"The handle of version {h.version} from publisher {h.publisher} is not part of a multi-process "
          "version (no leaf of what it published spans processes): pull it as it is.")
  first = parts[0]
  assert first.shards is not None
  for h in parts[1:]:
    assert h.shards is not None
    if h.version != first.version:
      raise ValueError(f"The parts are of different versions: process {first.shards.process} published version "
                       f"{first.version}, process {h.shards.process} version {h.version}. Combine the handles "
                       "of one version.")
    if h.shards.digest != first.shards.digest or h.shards.processes != first.shards.processes:
      raise ValueError(f"Processes {first.shards.process} and {h.shards.process} published version {h.version} "
                       "with different structures (leaf paths, global shapes or dtypes, or process counts).")
    if h.stream != first.stream:
      raise ValueError(f"Processes {first.shards.process} and {h.shards.process} publish different streams "
                       f"({first.stream!r} and {h.stream!r}).")
  by_process: dict[int, WeightsHandle] = {}
  for h in parts:
    assert h.shards is not None
    if h.shards.process in by_process:
      raise ValueError(f"Process {h.shards.process} gave two parts of version {h.version}: combine one handle "
                       "per trainer process.")
    by_process[h.shards.process] = h
  missing = sorted(set(range(first.shards.processes)) - set(by_process))
  if missing:
    raise ValueError(f"Version {first.version} lacks the parts of trainer processes {missing} (of "
                     f"{first.shards.processes}): combine the handles of every process.")
  ordered = tuple(by_process[i] for i in range(first.shards.processes))
  key = tuple(h.structure for h in ordered)
  with _checked_lock:
    known = key in _checked
  if not known:
    check_coverage(layouts_of(ordered, _limits.WEIGHTS_COMBINE_ASK_S))
    with _checked_lock:
      _checked[key] = None
      while len(_checked) > 8:
        _checked.popitem(last=False)
  # The parts' digests cover the global structure already (through their pieces' keys); it is named here too.
  structure = hashlib.blake2b("|".join((first.shards.digest, *key)).encode(), digest_size=12).hexdigest()
  return WeightsHandle(first.version, None, first.publisher, first.actor, structure, None, first.stream,
                       parts=ordered)


def layouts_of(parts: Sequence[WeightsHandle], timeout: float | None) -> list[PartLayout]:
  """Each part's `PartLayout`, asked of its publisher (all at once), checked.

  Raises:
    RuntimeError: a publisher no longer knows the part's structure (none of
      its versions of it is kept).
    MetadataError: an answer that is not the part's layout.
    ray.exceptions.GetTimeoutError, ray.exceptions.RayError: as `ray.get`
      (a publisher's actor died, say).
  """
  refs = [_ray.state.call_on_system_group(h.actor, query, h.publisher, h.structure) for h in parts]
  out = []
  for h, answer in zip(parts, ray.get(refs, timeout=timeout)):
    where = label(h)
    _, published = check_answer(answer, where)
    shards = h.shards
    assert shards is not None
    if published is None:
      raise RuntimeError(f"The publisher of {where} no longer knows its structure: combine the handles of a version "
                         "it still keeps.")
    out.append(check_part_layout(published.shards, shards, where))
  return out


_handle._COMBINE.append(combine)
