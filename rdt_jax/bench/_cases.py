"""Benchmark cases: what is sent, how often, and how to build and check it.

A case names one shape of traffic (one array of a size, a pytree of many
leaves, many refs in one `ray.get`, one ref read by several consumers, or the
plain-method check of issue 3). Case ids double as the `--cases` grammar:

* `4KiB`, `256MiB`, `1GiB`: one array of that size;
* `tree1000` (64 MiB in all) or `tree100x4KiB`: a dict of that many leaves;
* `refs8` (1 MiB each) or `refs8x4MiB`: that many refs, got in one
  `ray.get` (variant `batch`) and one by one (variant `loop`);
* `fanout4` (64 MiB) or `fanout4x1MiB`: one ref read by 1 (`x1`) and by N
  (`xN`) consumers at once;
* `plain` (64 MiB) or `plain16MiB`: a NumPy array returned by a method
  without `tensor_transport`, from a process without and with rdt_jax;
* a `gpu:` prefix (`gpu:256MiB`) moves device-to-device (cuda).

The payload functions here run on the producer and consumer; they import
nothing but NumPy (and torch or jax for device leaves, lazily).
"""

from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

KiB: Final = 1 << 10
MiB: Final = 1 << 20
GiB: Final = 1 << 30

_UNITS: Final = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}
_SIZE_RE: Final = re.compile(r"^(\d+)(B|KiB|MiB|GiB)$")

#: Cases `rdt-jax bench` runs by default, and with `--quick`.
FULL_CASES: Final = (
    "4KiB", "16KiB", "64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB",
    "256MiB", "1GiB", "tree1000", "tree10000", "refs8", "refs64", "fanout4",
    "plain",
)
# The quick set keeps every case a target needs; fan-out (6 more actors to
# start) is in the full set only.
QUICK_CASES: Final = ("4KiB", "1MiB", "64MiB", "256MiB", "tree1000", "refs8", "plain")
#: Device-to-device cases `--device gpu` adds.
FULL_GPU_CASES: Final = ("gpu:4KiB", "gpu:1MiB", "gpu:64MiB", "gpu:256MiB", "gpu:1GiB", "gpu:tree1000")
QUICK_GPU_CASES: Final = ("gpu:1MiB", "gpu:64MiB", "gpu:256MiB")

#: Total bytes of a `treeN` case without an explicit leaf size.
TREE_BYTES: Final = 64 * MiB
REF_BYTES: Final = 1 * MiB
FANOUT_BYTES: Final = 64 * MiB
PLAIN_BYTES: Final = 64 * MiB


@dataclass(frozen=True)
class Case:
  """One benchmark case.

  Attributes:
    id: the name given on the command line (`256MiB`, `tree1000`, ...).
    kind: "single", "tree", "refs", "fanout" or "plain".
    leaves: arrays per object (1 except for trees).
    leaf_nbytes: bytes of each array; a multiple of 8.
    count: refs per get ("refs") or consumers ("fanout"); 1 otherwise.
    device: "cpu" or "cuda".
  """

  id: str
  kind: str
  leaves: int
  leaf_nbytes: int
  count: int = 1
  device: str = "cpu"

  @property
  def object_nbytes(self) -> int:
    """Bytes in one object (one ref)."""
    return self.leaves * self.leaf_nbytes

  @property
  def objects(self) -> int:
    """Objects the producer holds for this case."""
    return self.count if self.kind == "refs" else 1

  @property
  def variants(self) -> tuple[str, ...]:
    """The ways each path runs this case, measured side by side."""
    if self.kind == "refs":
      return ("batch", "loop")
    if self.kind == "fanout":
      return ("x1", f"x{self.count}")
    return ("",)

  def moved_nbytes(self, variant: str) -> int:
    """Payload bytes that reach a reader in one sample of `variant`."""
    if self.kind == "refs":
      return self.count * self.object_nbytes
    if self.kind == "fanout":
      return int(variant[1:]) * self.object_nbytes
    return self.object_nbytes

  def describe(self) -> str:
    """A short human description, for tables."""
    where = "gpu " if self.device == "cuda" else ""
    if self.kind == "single":
      return f"{where}one {format_bytes(self.leaf_nbytes)} array"
    if self.kind == "tree":
      return f"{where}{self.leaves:,} leaves, {format_bytes(self.object_nbytes)}"
    if self.kind == "refs":
      return f"{where}{self.count} refs x {format_bytes(self.object_nbytes)}"
    if self.kind == "fanout":
      return f"{where}one {format_bytes(self.object_nbytes)} ref"
    return f"plain method, {format_bytes(self.object_nbytes)} NumPy"


def parse_size(text: str) -> int:
  """Bytes in a size such as `4KiB` or `1GiB`.

  Raises:
    ValueError: for anything else, naming the accepted units.
  """
  m = _SIZE_RE.match(text)
  if not m:
    raise ValueError(f"Bad size {text!r}: write an integer and a unit, e.g. 4KiB, 64MiB, 1GiB.")
  return int(m.group(1)) * _UNITS[m.group(2)]


def format_bytes(n: int) -> str:
  """`n` bytes in the largest unit that divides it (4 KiB, 64 MiB, 6,704 B)."""
  for unit in ("GiB", "MiB", "KiB"):
    if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
      return f"{n // _UNITS[unit]} {unit}"
  if n >= MiB:
    return f"{n / MiB:.1f} MiB"
  return f"{n:,} B"


def _leaf_bytes(total: int, leaves: int) -> int:
  return max(8, total // leaves // 8 * 8)


def parse_case(text: str) -> Case:
  """The Case a `--cases` item names (see the module docstring).

  Raises:
    ValueError: for an unknown case, listing the accepted forms.
  """
  device = "cpu"
  body = text
  if body.startswith("gpu:"):
    device, body = "cuda", body[4:]
  m = re.match(r"^(tree|refs|fanout)(\d+)(?:x(\w+))?$", body)
  if m:
    kind, n = m.group(1), int(m.group(2))
    if n < 1:
      raise ValueError(f"Bad case {text!r}: the count must be at least 1.")
    explicit = parse_size(m.group(3)) if m.group(3) else None
    if kind == "tree":
      return Case(text, "tree", n, explicit or _leaf_bytes(TREE_BYTES, n), 1, device)
    default = REF_BYTES if kind == "refs" else FANOUT_BYTES
    return Case(text, kind, 1, explicit or default, n, device)
  m = re.match(r"^plain(\w+)?$", body)
  if m:
    if device != "cpu":
      raise ValueError(f"Bad case {text!r}: the plain-method check runs on cpu only.")
    return Case(text, "plain", 1, parse_size(m.group(1)) if m.group(1) else PLAIN_BYTES)
  try:
    nbytes = parse_size(body)
  except ValueError:
    raise ValueError(
        f"Unknown case {text!r}. Use a size (4KiB, 256MiB, 1GiB), treeN[xSIZE], "
        "refsN[xSIZE], fanoutN[xSIZE] or plain[SIZE], optionally prefixed with gpu:."
    ) from None
  if nbytes % 8:
    raise ValueError(f"Bad case {text!r}: sizes must be a multiple of 8 bytes.")
  return Case(text, "single", 1, nbytes, 1, device)


def default_reps(case: Case, quick: bool) -> int:
  """Measured repetitions per path for `case` (after the warm-up)."""
  total = case.object_nbytes * case.objects
  if case.leaves >= 10_000:
    n = 5  # seconds per sample on the slow paths
  elif total <= 4 * MiB:
    n = 21
  elif total <= 64 * MiB:
    n = 9
  elif total <= 256 * MiB:
    n = 7
  else:
    n = 3
  return max(3, n * 3 // 5) if quick else n


# --------------------------------------------------------------------------
# Payloads (run on the producer and consumers).


def host_leaf(nbytes: int, seed: int) -> np.ndarray:
  """A deterministic int32 array of `nbytes` (a multiple of 4), freshly allocated."""
  n = nbytes // 4
  x = np.arange(n, dtype=np.uint32)
  x *= np.uint32(2654435761)
  x += np.uint32((seed * 40503 + 1) % (1 << 32))
  return x.view(np.int32)


#: 64-bit words per block of `host_checksum` (4 KiB: a page).
CHECKSUM_BLOCK_WORDS: Final = 512


def host_checksum(x: np.ndarray) -> int:
  """A position-weighted sum of every byte of `x`, modulo 2**64.

  The bytes are read as uint64 words and summed per 4 KiB block; block i's
  sum is weighted by i + 1 (the last partial block's words, then the bytes
  past the last whole word, by the next weights). A changed byte changes it,
  as does any reordering of 4 KiB blocks: chunks, shards or pages delivered
  in the wrong place. Words swapped inside one 4 KiB block do not (the
  soaks' CRC-32, `ordered_checksum`, catches those, at a quarter of the
  speed). As cheap as a plain sum: one pass over the bytes, about 8 GB/s on
  one core here.
  """
  flat = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
  block_bytes = CHECKSUM_BLOCK_WORDS * 8
  blocks = flat.size // block_bytes
  total = 0
  if blocks:
    words_by_block = flat[: blocks * block_bytes].view(np.uint64).reshape(blocks, CHECKSUM_BLOCK_WORDS)
    sums = words_by_block.sum(axis=1, dtype=np.uint64)
    total = int((sums * np.arange(1, blocks + 1, dtype=np.uint64)).sum(dtype=np.uint64))
  rest = flat[blocks * block_bytes:]
  words = rest.size // 8 * 8
  if words:
    total += int(rest[:words].view(np.uint64).sum(dtype=np.uint64)) * (blocks + 1)
  total += int(rest[words:].sum(dtype=np.uint64)) * (blocks + 2)
  return total % (1 << 64)


def ordered_checksum(arrays: list[Any], crc: int = 0) -> int:
  """CRC-32 of every byte of `arrays` (host arrays of any framework), in
  order: a missing, wrong or misplaced byte (chunks swapped, leaves
  reordered) changes it. About 2 GB/s here; the correctness checks of the
  soaks and the weight-sync benchmark use it, outside any timed part."""
  for a in arrays:
    flat = np.ascontiguousarray(host_view(a)).reshape(-1).view(np.uint8)
    crc = zlib.crc32(flat.data, crc)
  return crc


def host_view(x: Any) -> np.ndarray:
  """A NumPy view of a host array of any framework, without a copy."""
  if isinstance(x, np.ndarray):
    return x
  module = type(x).__module__
  if module.startswith("torch"):
    return x.detach().numpy()
  return np.asarray(x)


def device_checksum(x: Any) -> int:
  """`host_checksum`'s counterpart for a cuda leaf, computed on the device.

  The leaf's int32 words summed in int64 per 4 KiB block, block i's sum
  weighted by i + 1 (the words past the last whole block by the next
  weight), modulo 2**64: on the GPU (through torch when it is importable,
  else jax), so reading the data does not copy it to the host. Compared
  only with the checksums of other cuda leaves.
  """
  block = 1024  # int32 words: 4 KiB
  try:
    import torch

    t = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
    words = t.reshape(-1).view(torch.int32)
    n = words.numel() // block
    sums = words[: n * block].reshape(n, block).sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, n + 1, device=words.device, dtype=torch.int64)
    total = (sums * weights).sum() + words[n * block:].sum(dtype=torch.int64) * (n + 1)
    return int(total.item()) % (1 << 64)
  except ImportError:
    import jax.numpy as jnp

    jwords = x.reshape(-1).view(jnp.int32)
    jn = jwords.size // block
    jsums = jnp.sum(jwords[: jn * block].reshape(jn, block), axis=1, dtype=jnp.int32)
    jweights = jnp.arange(1, jn + 1, dtype=jnp.int32)
    jtotal = jnp.sum(jsums * jweights, dtype=jnp.int32) + jnp.sum(jwords[jn * block:], dtype=jnp.int32) * (jn + 1)
    return int(jtotal) % (1 << 64)


def leaf_checksum(x: Any) -> int:
  """Checksum of one leaf of any framework on any device."""
  device = getattr(x, "device", None)
  if device is not None and not isinstance(x, np.ndarray):
    kind = getattr(device, "type", None) or getattr(device, "platform", None)
    if callable(kind):
      kind = None
    if kind in ("cuda", "gpu"):
      return device_checksum(x)
  return host_checksum(host_view(x))


def value_leaves(value: Any) -> list[Any]:
  """The arrays of a benchmark value: itself, or a dict's values in key order."""
  if isinstance(value, dict):
    return [value[k] for k in sorted(value)]
  return [value]


def numpy_to_jax(value: Any) -> Any:
  """`value` with every NumPy leaf made a `jax.Array`, one `jnp.asarray` per
  leaf: what a JAX user of the object store does on the consumer, the
  fastest way jax offers here (faster than one `jax.device_put` of the list)."""
  import jax.numpy as jnp

  if isinstance(value, dict):
    return {k: jnp.asarray(v) for k, v in value.items()}
  return jnp.asarray(value)


def jax_cost_s(value: Any) -> float:
  """Seconds jax itself takes over `value`'s host `jax.Array` leaves on the
  consumer: making each from host memory the way rdt_jax makes them (one
  batched zero-copy call per device, `_dlpack.host_to_jax_many`) and
  exposing each to NumPy, as the read does. Any path that hands a consumer
  jax arrays pays it; the object store with NumPy does not."""
  import jax

  from rdt_jax import _dlpack

  by_device: dict[Any, list[np.ndarray]] = {}
  for x in value_leaves(value):
    if isinstance(x, jax.Array) and len(x.devices()) == 1 and next(iter(x.devices())).platform == "cpu":
      by_device.setdefault(next(iter(x.devices())), []).append(np.asarray(x))  # zero-copy views
  t0 = time.perf_counter()
  for device, views in by_device.items():
    for a in _dlpack.host_to_jax_many(views, _dlpack.parse_device(device)):
      np.asarray(a)
  return time.perf_counter() - t0


def value_checksum(value: Any) -> int:
  """Checksum of a whole benchmark value: its leaves' checksums, leaf i's
  weighted by i + 1 (so leaves swapped change it too), modulo 2**64."""
  return sum((i + 1) * leaf_checksum(x) for i, x in enumerate(value_leaves(value))) % (1 << 64)
