"""The read route of a weight version packed in device memory, on its
publisher's host: `pull_device_local` copies it through CUDA IPC straight
into the subscriber's CUDA tensors (`rdt_jax.weights._device.DevicePlan`),
with the publisher's kept-versions table read before and after, as
`rdt_jax.weights._routes.pull_node_local` does for host memory. The
overview is `rdt_jax.weights._device`.
"""

from __future__ import annotations

import contextlib
import logging

from rdt_jax import _faults, _memory, _process
from rdt_jax.weights._device import DevicePlan
from rdt_jax.weights._handle import replaced_error
from rdt_jax.weights._packed import ForeignTable, PackedSource
from rdt_jax.weights._pull import Pull, torn
from rdt_jax.weights._routes import dead_publisher_error, kept_table, read_table, read_table_or_empty

logger = logging.getLogger(__name__)

__all__ = ["pull_device_local"]

_fallback_warned: list[bool] = []


def pull_device_local(pull: Pull, plan: DevicePlan, source: PackedSource) -> bool:
  """Copies a version packed in device memory from its publisher's buffer
  on this host (mapped through CUDA IPC, or the publisher's own address in
  its own process) straight into the template's tensors, checking its
  kept-versions table before and after. False if the table or the buffer
  cannot be reached from here (nothing was written; pull it through Ray).

  Raises:
    StaleWeightsError: the version is not kept (before or after the copy),
      or its publisher was closed or replaced.
    RayDirectTransportError: the publisher's memory could not be read.
  """
  handle = pull.handle
  obj_id = pull.label
  try:
    kept_table(pull, source)
  except PermissionError:
    return False
  own = source.origin == _process.identity()
  mapping = (contextlib.nullcontext(source.buffer - source.ipc_offset) if own
             else _memory.ipc_mapped(source.ipc, plan.device))
  try:
    base = mapping.__enter__() + source.ipc_offset
  except _memory.IpcError as e:
    if not _fallback_warned:
      _fallback_warned.append(True)
      logger.warning("rdt_jax: a weight version in device memory could not be mapped through CUDA IPC (%s); "
                     "it is pulled through Ray instead, which costs an RDT fetch per pull.", e)
    return False
  try:
    pull.tear()
    try:
      plan.copy(base)
      if _faults.ON:
        _faults.hit("weights.copied")
      kept = read_table(source, handle.publisher)
      if handle.version not in kept:
        raise pull.stale(kept, after_read=True)
      pull.route, pull.kept = "cuda_ipc", kept
    except BaseException as e:
      error = e
      if isinstance(e, ForeignTable):
        error = replaced_error(handle, pull.current)
      elif isinstance(e, OSError):
        now = read_table_or_empty(source, handle.publisher)
        error = pull.stale(now, after_read=True) if handle.version not in now else (
            dead_publisher_error(obj_id, handle.actor, e))
      try:
        torn(error, handle.version, "while it copied into the template")
        if error is e:
          raise
        raise error from None
      finally:
        del error  # a local naming the raised error would hold this frame in a cycle with it
  finally:
    mapping.__exit__(None, None, None)
  return True
