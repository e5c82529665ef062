"""This process's NIXL agent, and the adaptive poll that progresses it.

One agent per process, with NIXL's progress thread off: idle, that thread
spins a core. The agent is progressed instead by a `Poller` thread that calls
`get_new_notifs()`, and only while the transport says it is needed (it
exports objects, is connected to another agent, or has parked READs or
deregistrations to retry); otherwise the thread sleeps on a condition and
costs nothing.

Between polls it sleeps `PollPolicy.idle_s` (10 ms) while the agent is
quiet, and `PollPolicy.busy_s` (1 ms) for `PollPolicy.hold_s` after a poll
that showed transfer activity: a notification (every READ of rdt_jax carries
`READ_NOTIF`, which the producer's agent receives when the READ completes), or
a poll that used more than `PollPolicy.work_cpu_s` of its thread's CPU time
(UCX moved bytes inside it; an idle poll takes a few microseconds). Over TCP,
UCX emulates a READ with messages the producer answers inside its polls, so
the producer's poll period is on the data path of every READ; over RDMA or
CMA it is not. The first READ of a burst waits for the producer's next quiet
poll; the READs after it, for its next busy one. docs/performance.md has the
measurements.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rdt_jax import _compat, _memory
from rdt_jax.transports.nixl import ucx

__all__ = [
    "PROGRESS_INTERVAL_S", "READ_NOTIF", "PollPolicy", "Poller",
    "create_agent", "poll_counts", "poll_policy", "set_poll_policy",
]


@dataclasses.dataclass(frozen=True)
class PollPolicy:
  """When a `Poller` polls.

  Attributes:
    idle_s: seconds between polls while the agent is quiet.
    busy_s: seconds between polls while it moves data.
    hold_s: polls stay `busy_s` apart this long after the last poll that did work.
    work_cpu_s: a poll that used more of its thread's CPU time than this did work.
  """

  idle_s: float = 0.01
  busy_s: float = 0.001
  hold_s: float = 0.5
  work_cpu_s: float = 200e-6

  def __post_init__(self) -> None:
    for f in dataclasses.fields(self):
      if not getattr(self, f.name) >= 0:
        raise ValueError(f"PollPolicy.{f.name} must be >= 0, got {getattr(self, f.name)!r}")


#: The notification every READ of rdt_jax carries to the producer's agent.
READ_NOTIF = b"rdt-jax-read"

#: Seconds between progress polls of a quiet process that needs them.
PROGRESS_INTERVAL_S = PollPolicy().idle_s

_policy = PollPolicy()
#: Failed polls and ticks of this process's pollers, by kind.
_failures: dict[str, int] = {}
logger = logging.getLogger(__name__)
#: Polls made by this process's pollers, and how many of them were followed by a busy sleep.
_counts = {"polls": 0, "busy_polls": 0}


def poll_policy() -> PollPolicy:
  """The policy every `Poller` of this process follows."""
  return _policy


def set_poll_policy(policy: PollPolicy) -> PollPolicy:
  """Makes every `Poller` of this process follow `policy` from its next poll;
  returns the previous policy. The benchmark compares policies with it."""
  global _policy
  previous, _policy = _policy, policy
  return previous


def poll_counts() -> dict[str, int]:
  """Polls made by this process's pollers so far, and how many were busy."""
  return dict(_counts)


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

  ucx.apply_defaults()  # UCX reads its environment when the agent is created
  ucx.warn_once(_has_gpu())

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


def _has_gpu() -> bool:
  """True if torch or jax, where this process imported it, sees a CUDA device."""
  return any(fw in sys.modules and _memory.cuda_available(fw) for fw in ("torch", "jax"))


class Poller:
  """Progresses an agent's target side, and runs `tick` after each poll.

  Polls as `poll_policy()` says while `set_active(True)`; otherwise it sleeps
  on a condition. Stopped at interpreter exit (`atexit`), before Python
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
    busy_until = 0.0
    while True:
      with self._cond:
        while not self._active and not self._stopped:
          self._cond.wait()
        if self._stopped:
          return
      policy = _policy
      if self._poll(policy):
        busy_until = time.monotonic() + policy.hold_s
      busy = time.monotonic() < busy_until
      _counts["polls"] += 1
      _counts["busy_polls"] += busy
      time.sleep(policy.busy_s if busy else policy.idle_s)

  def _poll(self, policy: PollPolicy) -> bool:
    """One poll and tick; True if the poll did work (see the module docstring).

    The poll and the tick fail apart: an agent whose polls keep raising (a
    broken peer) still has its parked READs retired, failed
    deregistrations retried and idle producers forgotten. Failures are
    logged, the first of each kind at warning level."""
    worked = False
    try:
      cpu = time.thread_time()
      notifs = self._agent.get_new_notifs()
      worked = bool(notifs) or time.thread_time() - cpu > policy.work_cpu_s
    except Exception as e:  # a broken peer must not stop progress for the others
      self._failed("poll", e)
    if self._tick is not None:
      try:
        self._tick()
      except Exception as e:
        self._failed("tick", e)
    return worked

  def _failed(self, what: str, error: Exception) -> None:
    """Logs a failed poll or tick: the first of each kind as a warning, the
    others at debug level (a failure that repeats every poll must not flood
    the log)."""
    _failures[what] = _failures.get(what, 0) + 1
    level = logging.WARNING if _failures[what] == 1 else logging.DEBUG
    logger.log(level, "rdt_jax NIXL progress %s failed (%d so far): %s: %s", what, _failures[what],
               type(error).__name__, error)
