"""A publisher's kept versions, and its end.

`Kept` is what a `WeightPublisher` holds of each version it keeps readable.
`end_publisher` is the one rule by which a publisher ends, whichever way it
ends: `close()`, or its finalizer when its last reference goes (a trainer
that replaces it without closing it, the garbage collector, the
interpreter's exit). Its kept-versions table is retired first (a
subscriber holding one of its handles then finds it foreign: stale), and
only then can the memory of its versions be reused: the finalizer holds
that memory until it has retired the table. A process that exits takes the
table with it: a read of it fails, and the pull names the dead publisher.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any

from rdt_jax import _ray
from rdt_jax.weights._device import DeviceBuffer, DeviceBuffers
from rdt_jax.weights._packed import Stream
from rdt_jax.weights._protocol import publishers

__all__ = ["Kept", "end_publisher", "free_objects"]


@dataclass
class Kept:
  """A version its publisher keeps readable."""

  version: int
  ref: Any  # a pytree version's RDT object (None for a packed version)
  digest: str  # its structure's
  buffer: Any  # a packed version's buffer, else None
  buckets: list[Any] | None = None  # a packed version's bucket objects, made at the first request
  bucket_bytes: int = 0  # their size (the last may be shorter)
  value: Any = None  # a pytree version's value, as its RDT object holds it (for subscribers in this process)
  frameworks: tuple[str, ...] = ()  # a version packed in device memory: each array leaf's framework
  rest: tuple[Any, ...] = ()  # and its non-array leaves


_ender: list[concurrent.futures.ThreadPoolExecutor] = []
_ender_lock = threading.Lock()


def end_publisher(publisher: str, stream: Stream | None, kept: list[Kept], lock: threading.Lock,
                  device_buffers: DeviceBuffers, *, collected: bool) -> None:
  """Ends publisher `publisher`, on every path by which a publisher ends
  (`close()`, or `collected`: its finalizer, run when its last reference
  went). First its kept-versions table is retired and its versions leave
  it, so a subscriber's read of the table finds it foreign from here on;
  only then can the versions' memory be reused: their RDT objects are freed
  and their device buffers closed (from a thread of rdt_jax's when
  `collected`, as a finalizer may run inside any Ray call; at the
  interpreter's exit not at all: the process takes them with it), and their
  host buffers go back to the pool once nothing holds them."""
  with lock:
    dropped = kept[:]
    del kept[:]
    if stream is not None:
      stream.table.retire()
  publishers.pop(publisher, None)

  def release() -> None:
    free_objects(dropped)
    device_buffers.close([k.buffer for k in dropped if isinstance(k.buffer, DeviceBuffer)])

  if not collected:
    release()
    return
  try:
    with _ender_lock:
      if not _ender:
        _ender.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rdt-jax-publisher-end"))
      _ender[0].submit(release)
  except RuntimeError:  # the interpreter is exiting: no new thread, and nothing left to free
    pass


def free_objects(dropped: list[Kept]) -> None:
  """Frees the RDT objects of versions that left the window (those made)."""
  for k in dropped:
    for ref in ([k.ref] if k.ref is not None else []) + (k.buckets or []):
      _ray.state.free_now(ref.hex())

