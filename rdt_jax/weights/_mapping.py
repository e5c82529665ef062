"""Weights under the engine's names and layouts: `From`, `Fuse` and the
subscriber's `MappedPlan`.

A subscriber made with `source=` pulls into an engine's own tensors (for
example `dict(model.named_parameters())`): for each template leaf, `source`
says where its bytes come from in the published tree and how they are laid
out. `From` names one published leaf, with an optional transpose, reshape
and index range; `Fuse` concatenates several of them along an axis (q/k/v
or gate/up in one tensor); a published leaf named by several template
leaves fills each (tied weights); a template leaf of another dtype gets
the values cast (between floating-point dtypes).

A mapped pull reads the version a bucket at a time
(`rdt_jax.weights._named.leaf_parts`; a leaf larger than a bucket in parts of
its rows where no reshape needs it whole) and writes each published leaf it
needs into its engine tensors at once (`rdt_jax._dlpack.region_writer`):
the transform is the copy out of the bucket, so no second copy of the
version is made. `MappedPlan` is made and checked once per published
structure, before any byte moves.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdt_jax import _dlpack, _layout, _memory
from rdt_jax._errors import ArgumentTypeError
from rdt_jax.weights._handle import MappingError
from rdt_jax.weights._named import leaf_parts
from rdt_jax.weights._packed_checks import check_layout
from rdt_jax.weights._protocol import Published
from rdt_jax.weights._pull import Pull, committing
from rdt_jax.weights._staging import empty_like

__all__ = ["From", "Fuse", "MappedPlan", "Source", "check_source_mapping", "leaf_name", "mapped_plan", "pull_mapped"]


@dataclass(frozen=True)
class From:
  """Where one engine tensor (or one part of a fused tensor) comes from: a
  leaf of the published tree, laid out as the engine wants it.

  The published leaf is transposed by `transpose`, then reshaped to
  `reshape`, then cut to `index` (each optional, in that order); the result
  must have the engine tensor's shape (for a `Fuse` part, the tensor's shape
  except on the fused axis).

  Attributes:
    path: the published leaf, as `jax.tree_util.keystr` prints its path
      (`"['params']['fc']['kernel']"`) or with its keys joined by dots
      (`"params.fc.kernel"`, where that names one leaf), as `source=`
      functions are given template paths.
    transpose: a permutation of the leaf's axes, as for `numpy.transpose`
      (`(1, 0)`: a Flax `(in, out)` kernel as a torch `(out, in)` weight).
    reshape: the shape after the transpose (same number of elements), for
      example heads folded into one axis.
    index: one index range per leading axis of the reshaped leaf, as
      `rdt_jax.Slice` takes them (`(slice(0, 128),)`: the first 128 rows, a
      tensor-parallel rank's part). An int keeps its axis, with length 1, as
      in `Slice`: `index=2` on an `(L, d, d)` stack gives `(1, d, d)`; for a
      `(d, d)` layer, write `reshape=(L * d, d), index=(slice(2 * d, 3 * d),)`.
  """

  path: str
  transpose: tuple[int, ...] | None = None
  reshape: tuple[int, ...] | None = None
  index: tuple[Any, ...] | None = None

  def __post_init__(self) -> None:
    if not isinstance(self.path, str):
      raise ArgumentTypeError(
          f"rdt_jax.From: path must be a str (a published leaf's path), got {type(self.path).__name__}.")
    for name in ("transpose", "reshape"):
      value = getattr(self, name)
      if value is not None:
        if not isinstance(value, Sequence) or not all(isinstance(n, (int, np.integer)) for n in value):
          raise ArgumentTypeError(f"rdt_jax.From({self.path!r}): {name} must be a sequence of ints, got {value!r}.")
        object.__setattr__(self, name, tuple(int(n) for n in value))
    if self.index is not None:
      index = self.index.index if isinstance(self.index, _layout.Slice) else self.index
      object.__setattr__(self, "index", tuple(index) if isinstance(index, (tuple, list)) else (index,))


@dataclass(frozen=True, init=False)
class Fuse:
  """One engine tensor made of several published leaves, concatenated along
  `axis` in the order given (a fused qkv or gate/up projection).

  Args:
    *parts: each a `From` or a published path (a str).
    axis: the engine tensor's axis the parts are concatenated along.

  For a tensor-parallel engine, give each part the rank's `index` range: the
  rank's tensor is its part of q, then of k, then of v.
  """

  parts: tuple[From, ...]
  axis: int

  def __init__(self, *parts: From | str, axis: int = 0):
    if not parts:
      raise MappingError("rdt_jax.Fuse needs at least one part.")
    made = tuple(p if isinstance(p, From) else From(p) for p in parts)
    object.__setattr__(self, "parts", made)
    object.__setattr__(self, "axis", int(axis))


#: What `WeightSubscriber(source=...)` takes: a mapping from each template
#: leaf's path to its source, or a function of the leaf's name (`leaf_name`).
Source = Mapping[str, str | From | Fuse | None] | Callable[[str], str | From | Fuse | None]

_TOKEN = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(-?\d+)\]|\.([A-Za-z_]\w*)")


def leaf_name(path: str) -> str:
  """The name of a leaf as a user writes it in `source=`: the keys of its
  path (as `jax.tree_util.keystr` prints it) joined by dots. A dict's str
  key is the string itself (dots and all: `['fc.weight']` -> `fc.weight`),
  an integer index or key its digits, an attribute its name:
  `['params']['layers'][0].kernel` -> `params.layers.0.kernel`. A path
  holding any other key (a tuple, or a str `keystr` prints in double
  quotes) has no dotted form: its name is the `keystr` path itself.

  The one rendering of paths for mappings: what a `source=` function is
  given, the second key a `source=` mapping is looked up by, and the
  dotted form of a published path `From` accepts.
  """
  keys, at = [], 0
  for m in _TOKEN.finditer(path):
    if m.start() != at:
      return path
    text, index, attribute = m.groups()
    keys.append(ast.literal_eval(f"'{text}'") if text is not None else index if index is not None else attribute)
    at = m.end()
  return ".".join(keys) if at == len(path) and keys else path


def check_source_mapping(source: Any) -> None:
  """Raises `ArgumentTypeError` (a `TypeError`) unless `source` is a mapping or a callable."""
  if not (isinstance(source, Mapping) or callable(source)):
    raise ArgumentTypeError(f"source must be a mapping from template paths to rdt_jax.From / Fuse / str / None, or a "
                    f"function of the template path; got {type(source).__name__}.")


def _spec(source: Source, path: str) -> Fuse | None:
  """The template leaf `path`'s source as a `Fuse` (a `From` is a one-part
  fuse), or None for a leaf the mapping leaves alone."""
  name = leaf_name(path)
  if isinstance(source, Mapping):
    if path in source:
      spec = source[path]
    elif name in source:
      spec = source[name]
    else:
      known = ", ".join(sorted(map(str, source))[:4])
      raise MappingError(f"The template leaf {path} has no entry in source (its keys: {known}, ...); give its "
                       "published path, rdt_jax.From or rdt_jax.Fuse, or None to leave it alone.")
  else:
    spec = source(name)
  if spec is None or isinstance(spec, Fuse):
    return spec
  if isinstance(spec, (str, From)):
    return Fuse(spec)
  raise ArgumentTypeError(f"The source of template leaf {path} is a {type(spec).__name__}; give a published path, "
                  "rdt_jax.From, rdt_jax.Fuse or None.")


def _floating(dtype: np.dtype) -> bool:
  return dtype.kind == "f" or dtype.name.startswith(("bfloat", "float8", "float6", "float4"))


@dataclass(frozen=True)
class _Write:
  """One published leaf written into (a range of) one engine tensor."""

  write: Callable[..., None]  # writes the leaf (or a part of its rows) into its range of the engine tensor
  target: str  # the template path, for errors
  chunkable: bool  # whether the leaf may come in parts of rows


class MappedPlan:
  """A mapped subscriber's plan for one published structure: which published
  leaves it reads and where each goes.

  Args:
    entries: the published structure's array leaves (`LeafEntry`s).
    template: the subscriber's flattened template (path, leaf).
    source: the subscriber's `source`: a mapping keyed by template path (as
      `keystr` prints it, or its `leaf_name`), or a function of the
      template path's `leaf_name`.
    atomic: whether writes land in staging arrays, committed after the pull.

  Raises:
    MappingError: naming the template leaf, for a source path the published
      value lacks, a transform that does not give the leaf's shape, a dtype
      that cannot be cast, or two template leaves sharing memory.
    UnsupportedLeafError: naming the leaf, for a template leaf that is not a
      numpy or torch array written in place, or an index outside the shape.
  """

  def __init__(self, entries: Sequence[tuple[str, str, tuple[int, ...], str]], template: Sequence[tuple[str, Any]],
               source: Source, atomic: bool):
    by_path = {e[0]: e for e in entries}
    aliases: dict[str, str | None] = {}
    for e in entries:
      name = leaf_name(e[0])
      if name not in by_path:
        aliases[name] = e[0] if name not in aliases else None  # None: ambiguous
    self.atomic = atomic
    #: The writes of each published leaf read, by published path.
    self.writes: dict[str, list[_Write]] = {}
    #: (engine tensor, its staging array) of every template leaf written.
    self.targets: list[tuple[Any, Any]] = []
    self._named: list[tuple[str, Any]] = []  # (template path, engine tensor) of every tensor written
    seen: dict[tuple[str, int, int], tuple[str, Fuse]] = {}
    for target, into in template:
      spec = _spec(source, target)
      if spec is None:
        continue
      _check_into(target, into)
      key = (str(_dlpack.device_of(into)), _dlpack.buffer_pointer(into),
             math.prod(into.shape) * _dlpack.dtype_of(into).itemsize)
      if not key[2]:  # an empty tensor shares no memory with another; none to write either
        key = (key[0], -len(seen) - 1, 0)
      if key in seen:
        if seen[key][1] == spec:
          continue  # the same tensor listed twice (a state dict's tied names): written once
        raise MappingError(f"The template leaves {seen[key][0]} and {target} are one tensor with different "
                         "sources: a pull would write one over the other. Map each tensor once.")
      seen[key] = (target, spec)
      dest = empty_like(into) if atomic else into
      self.targets.append((into, dest))
      self._named.append((target, into))
      for path, write in self._fused(target, into, dest, spec, by_path, aliases):
        self.writes.setdefault(path, []).append(write)
    _check_overlap(seen)
    self.devices = {_dlpack.device_of(into) for into, _ in self.targets}
    #: Published leaves every write of which takes parts of rows (read a bucket at a time however large).
    self.chunked = {path for path, ws in self.writes.items() if all(w.chunkable for w in ws)}
    self._written = [into for _, into in self._named]
    self._pointers = _dlpack.buffer_pointers(self._written)

  def _fused(self, target: str, into: Any, dest: Any, spec: Fuse, by_path: dict[str, Any],
             aliases: dict[str, str | None]) -> list[tuple[str, _Write]]:
    shape, dtype = tuple(int(n) for n in into.shape), _dlpack.dtype_of(into)
    axis = spec.axis + len(shape) if spec.axis < 0 else spec.axis
    if not 0 <= axis < max(1, len(shape)):
      raise MappingError(f"The template leaf {target} has {len(shape)} axes; its Fuse axis {spec.axis} is not one.")
    out, at = [], 0
    for part in spec.parts:
      path = part.path if part.path in by_path else aliases.get(part.path)
      if path is None:
        near = ", ".join(sorted(by_path)[:6])
        why = "names several published leaves" if part.path in aliases else "is not a published leaf"
        raise MappingError(f"The template leaf {target} maps to {part.path!r}, which {why} "
                         f"(published leaves: {near}{', ...' if len(by_path) > 6 else ''}).")
      _, kind, src_shape, what = by_path[path]
      if kind != "array":
        raise MappingError(f"The template leaf {target} maps to {path}, a typed PRNG key: map its key data "
                         "elsewhere (jax.random.key_data) or leave it out.")
      got, perm, reshape, box = _transformed(target, path, tuple(src_shape), part)
      src_dtype = _dlpack.np_dtype_from_name(what)
      if src_dtype != dtype and not (_floating(src_dtype) and _floating(dtype)):
        raise MappingError(f"The template leaf {target} has dtype {dtype.name}; its source {path} is {src_dtype.name}: "
                         "rdt_jax casts only between floating-point dtypes.")
      if len(got) != len(shape) or any(g != s for i, (g, s) in enumerate(zip(got, shape)) if i != axis or
                                       len(spec.parts) == 1):
        raise MappingError(f"The template leaf {target} has shape {shape}; its source {path} gives {got} after "
                         f"{_describe(part)}" + (f" (a Fuse part: every axis but {axis} must match)"
                                                 if len(spec.parts) > 1 else "") + ".")
      n = got[axis] if got else 1
      writer = _dlpack.region_writer(dest, axis, at, n, src_dtype, perm, reshape, box, target)
      chunkable = _dlpack.chunkable(perm, reshape, str(_dlpack.framework_of(dest)))
      out.append((path, _Write(writer, target, chunkable)))
      at += n
    if len(spec.parts) > 1 and at != shape[axis]:
      raise MappingError(f"The template leaf {target} has {shape[axis]} along axis {axis}; its Fuse parts give {at} "
                       f"({', '.join(p.path for p in spec.parts)}).")
    return out

  def write(self, path: str, view: np.ndarray, row: int | None = None) -> None:
    """Writes published leaf `path`, arrived as host array `view` (with
    `row`: its rows `row` to `row + len(view)` only), into each engine
    tensor that takes it (queued on the current stream of a CUDA tensor: see
    `finish`)."""
    for w in self.writes.get(path, ()):
      w.write(view, row)

  def begin(self) -> None:
    """Before the first write: checks that no engine tensor's memory moved
    since the plan was made (its regions would write the old memory), then
    lets work queued against a CUDA engine tensor on any stream run first.

    Raises:
      UnsupportedLeafError: naming the leaf whose memory moved.
    """
    if _dlpack.buffer_pointers(self._written) != self._pointers:
      for (target, into), pointer in zip(self._named, self._pointers):
        if _dlpack.buffer_pointer(into) != pointer:
          raise _dlpack.UnsupportedLeafError(
              target, "is a template tensor whose memory moved since the subscriber's first pull",
              "Keep the engine's tensors in place (copy into them, never rebind their storage), or create a "
              "new WeightSubscriber.")
    _memory.settle_targets(self.devices)

  def finish(self) -> None:
    """After the last write: every write has ended (atomic: the staging
    arrays are then copied into the engine tensors)."""
    _memory.settle_targets(self.devices)
    if self.atomic:
      _memory.copy_into_many(self.targets)


def _check_into(target: str, into: Any) -> None:
  fw = _dlpack.framework_of(into)
  if fw not in ("numpy", "torch", "cupy"):
    raise _dlpack.UnsupportedLeafError(
        target, f"is a {type(into).__name__}; a subscriber with source= writes the engine's numpy or torch "
        "tensors in place", "Give the tensor to write into, or pull without source= into a jax template.")
  if not (_dlpack.is_c_contiguous(into) and _dlpack.is_writable(into)):
    raise _dlpack.UnsupportedLeafError(target, "is a template array that is not C-contiguous and writable",
                                       "Give a contiguous, writable array.")


def _transformed(target: str, path: str, shape: tuple[int, ...], part: From) -> tuple[
    tuple[int, ...], tuple[int, ...] | None, tuple[int, ...] | None, Any]:
  """The shape of `part` of published leaf `path` after its transform, and
  the transform (permutation, reshape, box; None where absent or a no-op)."""
  perm = part.transpose
  if perm is not None:
    if sorted(perm) != list(range(len(shape))):
      raise MappingError(f"The template leaf {target} transposes {path} (shape {shape}) by {perm}, which is not a "
                       f"permutation of its {len(shape)} axes.")
    shape = tuple(shape[i] for i in perm)
    perm = None if perm == tuple(range(len(shape))) else perm
  reshape = part.reshape
  if reshape is not None:
    if math.prod(reshape) != math.prod(shape) or any(n < 0 for n in reshape):
      raise MappingError(f"The template leaf {target} reshapes {path} from {shape} to {reshape}, which holds "
                       "another number of elements.")
    same = reshape == shape
    shape = reshape
    reshape = None if same else reshape
  box = None
  if part.index is not None:
    box = _layout.Slice(part.index).box(shape, target)
    shape = _dlpack.box_shape(box)
  return shape, perm, reshape, box


def _describe(part: From) -> str:
  steps = [f"{name} {getattr(part, name)}" for name in ("transpose", "reshape", "index")
           if getattr(part, name) is not None]
  return ", ".join(steps) if steps else "no transform"


def _check_overlap(seen: dict[tuple[str, int, int], tuple[str, Fuse]]) -> None:
  """Raises naming both leaves if two template leaves share memory (and are
  not the same tensor with the same source)."""
  spans = sorted((device, ptr, ptr + n, target) for (device, ptr, n), (target, _) in seen.items() if n)
  for a, b in itertools.pairwise(spans):
    if a[0] == b[0] and b[1] < a[2]:
      raise MappingError(f"The template leaves {a[3]} and {b[3]} share memory with different sources: a pull "
                       "would write one over the other. Map each tensor once.")


def mapped_plan(pull: Pull, template: Sequence[tuple[str, Any]], source: Source,
                atomic: bool) -> tuple[Published, MappedPlan]:
  """The plan of a subscriber with `source=` for the structure and route of
  `pull`'s version, made at its first pull: the publisher's answer (the
  structure and, for a packed route, its layout, checked here once) and the
  mapping checked against it (`MappedPlan`)."""
  handle = pull.handle
  published = pull.ask(want_structure=True)
  if published is None:
    raise RuntimeError(f"The publisher no longer knows the structure of version {handle.version}.")
  if published.packed is not None:  # checked once here, not at every pull of the structure
    check_layout(published.packed, published.entries, pull.label)
  return published, MappedPlan(published.entries, template, source, atomic)


def pull_mapped(pull: Pull, known: tuple[Published, MappedPlan], atomic: bool) -> int:
  """One pull of a subscriber with `source=`, its lock held, with the plan
  `mapped_plan` made for the version's structure and route: each
  published leaf it needs written as it arrives. Returns the bytes read.

  With `atomic=False` the pull marks the template torn at its first write;
  with `atomic=True` the writes land in staging arrays, copied into the
  engine tensors once every leaf arrived.
  """
  published, plan = known
  plan.begin()
  nbytes, torn = 0, atomic
  for path, x, row in leaf_parts(pull, published, plan.writes, plan.chunked, layout_checked=True):
    if not torn:
      pull.tear()
      torn = True
    plan.write(path, x if isinstance(x, np.ndarray) else _dlpack.convert_leaf(x, "numpy", path), row)
    nbytes += int(x.nbytes)
    del x  # the bucket's buffer is reused once no view of it is held
    pull.check_cancelled()
  with committing(pull):
    plan.finish()
  return nbytes
