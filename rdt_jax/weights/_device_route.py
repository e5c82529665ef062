"""The read route of a weight version packed in device memory, on its
publisher's host: `pull_device_local` copies it through CUDA IPC straight
into the subscriber's CUDA tensors (`rdt_jax.weights._device.DevicePlan`),
with the publisher's kept-versions table read before and after, and a
failure handled by the one rule of every node-local route
(`rdt_jax.weights._routes.node_local_read`), as
`rdt_jax.weights._routes.pull_node_local` does for host memory. The
overview is `rdt_jax.weights._device`.
"""

from __future__ import annotations

import contextlib
import logging

from rdt_jax import _faults, _memory, _process
from rdt_jax.weights._device import DevicePlan
from rdt_jax.weights._packed import PackedSource
from rdt_jax.weights._pull import Pull
from rdt_jax.weights._routes import checked_after_read, kept_table, node_local_read

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
    RayDirectTransportError: the publisher's memory could not be read, or
      Ray reports its actor dead.
  """
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
    with node_local_read(pull, source, writes_template=True):
      plan.copy(base)
      if _faults.ON:
        _faults.hit("weights.copied")
      pull.kept = checked_after_read(pull, source)
      pull.route = "cuda_ipc"
  finally:
    mapping.__exit__(None, None, None)
  return True
