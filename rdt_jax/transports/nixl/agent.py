"""This process's NIXL agent, and the periodic poll that progresses it.

One agent per process, with NIXL's progress thread off: idle, that thread
spins a core. The agent is progressed instead by a `Poller` thread that calls
`get_new_notifs()` every `PROGRESS_INTERVAL_S`, and only while the transport
says it is needed (it exports objects, is connected to another agent, or has
parked READs or deregistrations to retry); otherwise the thread sleeps on a
condition and costs nothing. docs/performance.md has the measurements.
"""

from __future__ import annotations

import atexit
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

from rdt_jax import _compat

__all__ = ["PROGRESS_INTERVAL_S", "Poller", "create_agent"]

#: Seconds between progress polls of a process that needs them.
PROGRESS_INTERVAL_S: Final = 0.01


def create_agent() -> Any:
  """A new NIXL agent for this process (UCX backend, no progress thread),
  named after the actor it runs in.

  Raises:
    ImportError: if NIXL is not installed here, saying what to install.
    RuntimeError: if NIXL cannot create the agent (UCX finds no usable
      transport), with NIXL's error and what to check.
  """
  api = _compat.nixl_api()
  import ray

  actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
  name = f"rdt-jax-{actor_id or 'driver'}-{uuid.uuid4().hex[:8]}"
  config = api.nixl_agent_config(
      enable_prog_thread=False,
      backends=["UCX"],
      sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
  )
  try:
    return api.nixl_agent(name, config)
  except Exception as e:
    raise RuntimeError(
        f"jax_nixl could not create this process's NIXL agent {name} (UCX backend): NIXL reported "
        f"{type(e).__name__}: {e}. Check that UCX finds a transport here (UCX_TLS, UCX_NET_DEVICES; "
        "`ucx_info -d` lists them)."
    ) from None


class Poller:
  """Progresses an agent's target side, and runs `tick` after each poll.

  Polls every `PROGRESS_INTERVAL_S` while `set_active(True)`; otherwise it
  sleeps on a condition. Stopped at interpreter exit (`atexit`), before Python
  finalizes: a daemon thread caught inside a NIXL call while the interpreter
  shuts down is unwound through C++ frames, which aborts the process.
  """

  def __init__(self, agent: Any, tick: Callable[[], None] | None = None):
    self._agent = agent
    self._tick = tick
    self._cond = threading.Condition()
    self._active = False
    self._stopped = False
    self._thread = threading.Thread(target=self._run, name="rdt-jax-nixl-progress", daemon=True)
    self._thread.start()
    atexit.register(self.stop)

  def set_active(self, active: bool) -> None:
    """Polls from now on if `active`, else sleeps after the current poll."""
    with self._cond:
      self._active = active
      self._cond.notify()

  def stop(self, timeout: float = 5.0) -> None:
    """Ends the thread after its current poll (waits up to `timeout` s)."""
    with self._cond:
      self._stopped = True
      self._cond.notify()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout)

  def _run(self) -> None:
    while True:
      with self._cond:
        while not self._active and not self._stopped:
          self._cond.wait()
        if self._stopped:
          return
      try:
        self._agent.get_new_notifs()
        if self._tick is not None:
          self._tick()
      except Exception:  # a broken peer must not stop progress for the others
        pass
      time.sleep(PROGRESS_INTERVAL_S)
