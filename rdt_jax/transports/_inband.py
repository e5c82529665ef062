"""In-band delivery: small host objects carried inside their metadata.

An object whose leaves are all host memory and hold at most
`inline_max_bytes()` bytes in all is copied into its metadata
(`DlpackTransportMetadata.inline`: every chunk in leaf order), which Ray
already carries from producer to owner to consumer. No backend takes part:
the producer registers nothing, the consumer copies the bytes out of the
metadata into the receive memory its `ReceivePlan` took (`copy_out`), after
refusing an object whose producer is known to have exited (`check_origin`),
and Ray's free of the
object has nothing to undo. `DlpackTransport` routes an object here or to its
backend on one test, `carried(meta)`.

The threshold is a measured policy (docs/performance.md), the setting
`RDT_JAX_INLINE_MAX_BYTES` (`rdt_jax._settings`; 0 turns in-band delivery
off), read at each object; only the producer's value matters.
"""

from __future__ import annotations

from rdt_jax import _dlpack, _process, _settings
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports._plan import Destination, memory_kind

__all__ = ["carried", "check_origin", "copy_out", "fits", "inline_max_bytes", "pack"]


def inline_max_bytes() -> int:
  """The largest object (payload bytes, all leaves) sent in band, 0 for
  none: the setting `RDT_JAX_INLINE_MAX_BYTES`, read at each call.

  Raises:
    rdt_jax.SettingError: if the variable holds a value it does not allow.
  """
  return _settings.value("RDT_JAX_INLINE_MAX_BYTES")


def fits(device: str | None, meta: DlpackTransportMetadata) -> bool:
  """Producer: True if an object of leaves on `device` (one kind for all)
  described by `meta` travels in band."""
  if device is None or memory_kind(_dlpack.Device(device)) != "host":  # type: ignore[arg-type]
    return False
  return meta.nbytes <= inline_max_bytes()


def carried(meta: DlpackTransportMetadata | None) -> bool:
  """True if the object `meta` describes travels in band (its bytes are in
  `meta.inline`); False for objects a backend exported."""
  return meta is not None and meta.inline is not None


def pack(leaves: list[_dlpack.DescribedLeaf], meta: DlpackTransportMetadata) -> None:
  """Producer: copies every chunk of `leaves` into `meta.inline` and records
  this process as the object's origin (see `check_origin`)."""
  meta.inline = _dlpack.pack_host_chunks(leaves)
  meta.origin = _process.identity()


def check_origin(obj_id: str, origin: _process.Identity | None) -> None:
  """Refuses an in-band object whose producer process is known to be gone.

  An object read out of band fails when its producer died (its memory went
  with it); an in-band one keeps that behaviour wherever the consumer can
  tell, on the producer's host (same boot id and pid namespace). Elsewhere
  the bytes are delivered (docs/performance.md).

  Raises:
    RuntimeError: naming the object and the producer's pid.
  """
  if origin is not None and _process.same_host(origin) and not _process.alive(origin):
    raise RuntimeError(
        f"The producer of in-band object {obj_id} (pid {origin[2]}) has exited: "
        "the object died with it. Keep the producing actor alive until every "
        "consumer has fetched the object."
    )


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
      _dlpack.copy_from_host(d.pointer, view[begin : begin + d.nbytes], d.device)
