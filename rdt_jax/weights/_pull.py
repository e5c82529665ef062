"""One pull in progress, and the rule a failed one keeps.

`Pull` carries what every read route needs (`rdt_jax.weights._routes`): the
handle, the deadline, the version the subscriber held when it began, its
cancellation, and the call that sets the subscriber's version. A pull that
fails once bytes of the version may be in the template leaves the
subscriber's version None (`Pull.tear`), and its error says so (`torn`):
with `atomic=False` from the first byte a route may write into the
template; with either setting while the arrived bytes are copied into the
template's arrays (`committing`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from rdt_jax import _faults, _limits
from rdt_jax.weights._handle import StaleWeightsError, WeightsHandle, stale_error
from rdt_jax.weights._protocol import Published, ask_kept
from rdt_jax.weights._stats import count_failed

__all__ = ["Pull", "PullCancelled", "PullLock", "committing", "locked_pull", "pull_threads", "torn"]


class PullCancelled(Exception):
  """A `pull_async` whose task was cancelled, stopped at its next step."""


class PullLock:
  """One pull of a subscriber at a time, whoever calls (threads,
  `pull_async`, Ray's concurrency groups)."""

  def __init__(self) -> None:
    self._lock = threading.Lock()

  def acquire(self, version: int, deadline: float | None, cancel: threading.Event | None) -> None:
    """Takes the lock for a pull of `version`, waiting at most until
    `deadline`, and while `cancel` is not set: a cancelled `pull_async`
    stops waiting within `_limits.WEIGHTS_CANCEL_POLL_S`, however long the
    pull that holds the lock runs (a stalled fetch, a paused `pull_named`
    iteration).

    Raises:
      GetTimeoutError: the deadline passed first.
      PullCancelled: `cancel` was set first.
    """
    step = _limits.WEIGHTS_CANCEL_POLL_S
    while True:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      if cancel is None:
        wait = -1.0 if left is None else left
      else:
        wait = step if left is None else min(step, left)
      if self._lock.acquire(timeout=wait):
        return
      if cancel is not None and cancel.is_set():
        raise PullCancelled(f"The pull of version {version} was cancelled while it waited for another pull of "
                            "this subscriber.")
      if left is not None and left <= wait:
        raise ray.exceptions.GetTimeoutError(
            f"The pull of version {version} ran out of time waiting for another pull of this subscriber.")

  def release(self) -> None:
    self._lock.release()


_threads: list[concurrent.futures.ThreadPoolExecutor] = []
_threads_lock = threading.Lock()


def pull_threads() -> concurrent.futures.ThreadPoolExecutor:
  """The threads `pull_async` runs pulls in (created at the first one)."""
  with _threads_lock:
    if not _threads:
      _threads.append(concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="rdt-jax-pull"))
    return _threads[0]


@dataclass
class Pull:
  """One pull in progress.

  Attributes:
    handle: the version pulled.
    label: how errors name it (`rdt_jax.weights._handle.label`).
    deadline: `time.monotonic()` by which the pull must end (None: none).
    current: the version the subscriber held when the pull began.
    cancel: set when the `pull_async` awaiting the pull is cancelled.
    set_version: sets the subscriber's version (None: the template is torn).
    bucket_bytes: the subscriber's bucket size: the most bytes a
      node-local read by name (`rdt_jax.weights._named`) copies at once.
  """

  handle: WeightsHandle
  label: str
  deadline: float | None
  current: int | None
  cancel: threading.Event | None
  set_version: Callable[[int | None], None]
  bucket_bytes: int
  route: str = "ray"  # the route taken (`PullStats.route`), set by the route
  objects: int = 0  # RDT objects fetched through Ray
  kept: Any = None  # the versions the publisher kept at the last check seen
  layout: Any = None  # the packed layout of the version, where the route had one (its bytes are counted from it)

  def left(self) -> float | None:
    """Seconds left before the deadline (None: no deadline)."""
    return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

  def check_cancelled(self) -> None:
    """Stops a cancelled pull (at a step where that leaves the state of a
    failed pull)."""
    if self.cancel is not None and self.cancel.is_set():
      raise PullCancelled(f"The pull of version {self.handle.version} was cancelled.")

  def tear(self) -> None:
    """Marks the template torn: from here until the pull succeeds, bytes of
    the version may be in it."""
    self.set_version(None)

  def stale(self, kept: Any, after_read: bool) -> StaleWeightsError:
    return stale_error(self.handle, kept, self.current, after_read)

  def ask(self, want_structure: bool = False, after_read: bool = False) -> Published | None:
    """`rdt_jax.weights._protocol.ask` for this pull's version (the versions
    kept are recorded in `kept`), stopping if the pull is cancelled while
    it waits for the answer (`wait`)."""
    structure, self.kept = ask_kept(self.handle, self.label, self.left(), want_structure, self.current, after_read,
                                    self.wait)
    return structure

  def wait(self, ref: Any, timeout: float | None) -> Any:
    """`ray.get(ref, timeout=timeout)` for a question to the publisher,
    which writes nothing, so a cancelled pull may leave it: checked for
    cancellation every `_limits.WEIGHTS_CANCEL_POLL_S` while it waits.

    Raises:
      PullCancelled: the pull was cancelled first.
      GetTimeoutError: as `ray.get`.
    """
    if self.cancel is None:
      return ray.get(ref, timeout=timeout)
    end = None if timeout is None else time.monotonic() + timeout
    while True:
      step = _limits.WEIGHTS_CANCEL_POLL_S if end is None else min(_limits.WEIGHTS_CANCEL_POLL_S,
                                                                    max(0.0, end - time.monotonic()))
      try:
        return ray.get(ref, timeout=step)
      except ray.exceptions.GetTimeoutError:
        self.check_cancelled()
        if end is not None and time.monotonic() >= end:
          raise


@contextlib.contextmanager
def committing(pull: Pull, writes: bool = True) -> Iterator[None]:
  """Around the copy of a pull's arrived bytes into the template's arrays
  (an atomic pull's staging, a device template's copy, the engine tensors
  of a mapped pull): if it raises, the template may hold some of the
  version's bytes, so the subscriber's version becomes None, atomic or not,
  and the error says so. (On the host these copies are memcpys that do not
  fail; on a device a copy may.) With `writes=False` the step it wraps
  writes no template array (a packed plan that only makes new arrays), and
  it does nothing."""
  if not writes:
    yield
    return
  try:
    yield
    if _faults.ON:
      _faults.hit("weights.commit")
  except BaseException as e:
    pull.tear()
    torn(e, pull.handle.version, "while it copied the version into the template")
    raise


def torn(error: BaseException, version: int, while_: str) -> None:
  error.add_note(f"rdt_jax: the pull of version {version} failed {while_}: the template may hold some of its "
                 "bytes, and the subscriber's version is None until the next successful pull.")


@contextlib.contextmanager
def locked_pull(lock: PullLock, handle: WeightsHandle, deadline: float | None,
                cancel: threading.Event | None = None) -> Iterator[None]:
  """Holds a subscriber's pull lock (`PullLock`) for one pull; a pull that
  raises is counted in rdt_jax's metrics as stale or failed. A `pull_named`
  iteration the engine stops early (`GeneratorExit`) is neither; a
  successful pull is counted by the caller, lock released."""
  lock.acquire(handle.version, deadline, cancel)
  try:
    yield
  except GeneratorExit:
    raise
  except BaseException as e:
    count_failed(handle, e)
    raise
  finally:
    lock.release()
