"""In-band delivery: small host objects carried inside their metadata (opt-in).

Off by default. With the setting `RDT_JAX_INLINE_MAX_BYTES` above 0
(`rdt_jax._settings`, read at each object; only the producer's value
matters), an object of a one-sided backend (`jax_nixl`, `jax_transfer`)
whose leaves are all host memory and hold at most that many bytes in all is
copied into its metadata (`DlpackTransportMetadata.inline`: every chunk in
leaf order), which Ray already carries from producer to owner to consumer. No
backend takes part: the producer registers nothing, the consumer copies the
bytes out of the metadata into the receive memory its `ReceivePlan` took
(`copy_out`), and Ray's free of the object has nothing to undo.
`DlpackTransport` routes an object here or to its backend on one test,
`carried(meta)`.

Two-sided backends (`jax_gloo`, `jax_nccl`) never send in band: Ray runs a
send task on the producer for every transfer anyway, and that task is where
Ray's rule for a producer that freed the object or died applies.

Lifetime: the same as out of band where it matters. A consumer refuses an
in-band object once its producer actor is dead (`_lifetime`, checked on every
host the same way). What differs: the bytes are a copy taken when the method
returned, so the producer's later in-place writes to a torch or NumPy leaf
never reach a consumer (docs/concepts.md).
"""

from __future__ import annotations

from rdt_jax import _dlpack, _layout, _memory, _settings
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports._destinations import Destination, memory_kind

__all__ = ["carried", "copy_out", "fits", "inline_max_bytes", "pack"]


def inline_max_bytes() -> int:
  """The largest object (payload bytes, all leaves) sent in band, 0 for
  none (the default): the setting `RDT_JAX_INLINE_MAX_BYTES`, read at each
  call.

  Raises:
    rdt_jax.SettingError: if the variable holds a value it does not allow.
  """
  return _settings.value("RDT_JAX_INLINE_MAX_BYTES")


def fits(device: str | None, meta: DlpackTransportMetadata) -> bool:
  """Producer of a one-sided backend: True if an object of leaves on
  `device` (one kind for all) described by `meta` travels in band."""
  if device is None or memory_kind(_dlpack.Device(device)) != "host":  # type: ignore[arg-type]
    return False
  limit = inline_max_bytes()
  if limit == 0:  # off: an object without bytes still needs no export (stops at the first byte)
    return not any(leaf.nbytes for leaf in meta.leaves)
  return meta.nbytes <= limit


def carried(meta: DlpackTransportMetadata | None) -> bool:
  """True if the object `meta` describes travels in band (its bytes are in
  `meta.inline`); False for objects a backend exported."""
  return meta is not None and meta.inline is not None


def pack(leaves: list[_dlpack.DescribedLeaf], meta: DlpackTransportMetadata) -> None:
  """Producer: copies every chunk of `leaves` into `meta.inline`."""
  meta.inline = _layout.pack_host_chunks(leaves)


def copy_out(meta: DlpackTransportMetadata, destinations: list[Destination]) -> None:
  """Consumer: copies the in-band bytes of `meta` (every chunk in leaf
  order) into the receive `destinations` a `ReceivePlan` took for it.

  Raises:
    RuntimeError: if the bytes do not match the leaves (producer and
      consumer run different rdt_jax versions).
  """
  assert meta.inline is not None
  data = meta.inline
  starts = [0]
  for leaf in meta.leaves:
    for chunk in leaf.chunks:
      starts.append(starts[-1] + chunk.nbytes)
  if starts[-1] != len(data):
    raise RuntimeError(
        f"In-band object holds {len(data)} bytes but its leaves describe {starts[-1]}: "
        "the producer and consumer run different rdt_jax versions."
    )
  view = memoryview(data)
  for d in destinations:
    if d.nbytes:
      begin = starts[d.source] + d.source_offset
      _memory.copy_from_host(d.pointer, view[begin : begin + d.nbytes], d.device)
