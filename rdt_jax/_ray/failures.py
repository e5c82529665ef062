"""Failures: Ray's failure monitor, repaired so that one bad abort does not
end it for the process.
"""

from __future__ import annotations

import logging
from typing import Any

from rdt_jax._ray import wrapping

__all__ = ["wrap_failure_monitor"]

logger = logging.getLogger(__name__)


def _kill_quietly(actor: Any) -> None:
  import ray

  try:
    ray.kill(actor)
  except Exception as e:  # already gone, or its handle released: nothing left to stop
    logger.info("rdt_jax: could not kill actor %s after a failed transfer: %s", actor, e)


def wrap_failure_monitor() -> None:
  """Keeps Ray's failure monitor alive: an abort that raises is finished
  here, and a shutdown empties the monitor's queue.

  Touches: `RDTManager._abort_transport` and `RDTManager.shutdown` (wrapped),
    `RDTManager._unmonitored_transfers` (drained), `RDTSource` (read).
  Why: Ray's failure monitor, the driver thread that aborts a failed or
    timed-out transfer (a two-sided one by killing both actors), dies on the
    first exception it meets and is never restarted in that process: an
    abort whose `ray.kill` finds the actor's handle gone, or, after
    `ray.shutdown()` and `ray.init()`, a ref of the ended session still
    queued. Every later failed transfer then hangs.
  Retire when: Ray's monitor survives an exception in one abort (catching
    and logging it per transfer) and clears its queue at shutdown.
  """
  from ray.experimental.rdt.rdt_manager import RDTManager

  original_abort = RDTManager._abort_transport
  if wrapping.is_ours(original_abort):
    return
  original_shutdown = RDTManager.shutdown

  def _abort_transport(self: Any, failed_ref: Any, ref_info_map: dict[str, Any], exception: Exception) -> None:
    ref_info = ref_info_map.get(failed_ref.hex())
    try:
      original_abort(self, failed_ref, ref_info_map, exception)
    except Exception as e:
      # Ray's abort stopped half way (the monitor thread would die with it):
      # stop both actors of the transfer one by one, as it meant to.
      logger.warning("rdt_jax: Ray's abort of a failed transfer raised %s: %s; finishing it", type(e).__name__, e)
      if ref_info is not None:
        from ray.experimental.rdt.rdt_manager import RDTSource

        if ref_info.src_actor != RDTSource.DRIVER:
          _kill_quietly(ref_info.src_actor)
        _kill_quietly(ref_info.dst_actor)

  def shutdown(self: Any) -> None:
    original_shutdown(self)
    # The monitor thread has stopped: what it did not take yet belongs to the
    # ended session, and would end the next session's monitor.
    queue = self._unmonitored_transfers
    while not queue.empty():
      queue.get_nowait()

  wrapping.mark(_abort_transport, original_abort)
  wrapping.mark(shutdown, original_shutdown)
  RDTManager._abort_transport = _abort_transport  # type: ignore[method-assign]
  RDTManager.shutdown = shutdown  # type: ignore[method-assign]
