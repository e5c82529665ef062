"""The newest version of a named stream, for engines that hold no handle.

A generator that falls behind wants the newest version, not the next one,
and should not need its trainer to route handles to it. A publisher made
with `announce=True` tells one small Ray actor of rdt_jax's, the board,
each version it publishes (one actor call, not waited for); any process of
the Ray namespace asks the board for a stream's newest handle
(`latest_handle`, one actor call) and pulls it (`WeightSubscriber
.pull_latest`).

* The board is a named actor (`BOARD_NAME`, in the Ray namespace of the job),
  made by the first announcing publisher with no CPU of its own; it lives as
  long as the process that made it. A process that finds no board, or a dead
  one, hears "no version yet" (None) and finds the next one made.
* Never backwards: the board keeps, per stream, the announced handle of the
  highest version; a lower one is ignored. A subscriber refuses a version
  not newer than its own (`check_newer`), so `pull_latest` pulls nothing
  then.
* Versions no longer kept are skipped: a handle asked for may leave its
  publisher's `keep` window before the pull reads it; `pull_latest` then asks
  again, and pulls the newer one announced meanwhile.
* Multi-process trainers: each process announces its part of a version; once
  every process's part of one version is in, the board combines them
  (`WeightsHandle.combine`) and that is the stream's newest handle. Parts of
  versions older than the newest combined one are dropped.
* A publisher that closes withdraws its stream's handle (asks for it then
  get None until a newer version is announced).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from rdt_jax import _limits
from rdt_jax.weights._handle import StaleWeightsError, WeightsHandle, check_handle

__all__ = ["BOARD_NAME", "announce", "latest_handle", "pull_latest", "withdraw"]

#: The board's actor name, in the Ray namespace of the job.
BOARD_NAME = "rdt_jax.latest"


class _Board:
  """The newest announced handle of each stream (see the module docstring)."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._newest: dict[str, WeightsHandle] = {}
    # stream -> version -> process -> part, for multi-process trainers
    self._parts: dict[str, dict[int, dict[int, WeightsHandle]]] = {}

  def announce(self, handle: WeightsHandle) -> None:
    if handle.shards is None:
      self._offer(handle)
      return
    with self._lock:
      if self._older(handle):
        return
      versions = self._parts.setdefault(handle.stream, {})
      parts = versions.setdefault(handle.version, {})
      parts[handle.shards.process] = handle
      if len(parts) < handle.shards.processes:
        return
      complete = list(parts.values())
      del versions[handle.version]
    self._offer(WeightsHandle.combine(complete))

  def _older(self, handle: WeightsHandle) -> bool:
    known = self._newest.get(handle.stream)
    return known is not None and handle.version <= known.version

  def _offer(self, handle: WeightsHandle) -> None:
    with self._lock:
      if self._older(handle):
        return
      self._newest[handle.stream] = handle
      versions = self._parts.get(handle.stream, {})
      for version in [v for v in versions if v <= handle.version]:
        del versions[version]

  def withdraw(self, stream: str, publisher: str) -> None:
    with self._lock:
      known = self._newest.get(stream)
      if known is not None and publisher in {known.publisher, *(p.publisher for p in known.parts)}:
        del self._newest[stream]

  def latest(self, stream: str) -> WeightsHandle | None:
    with self._lock:
      return self._newest.get(stream)


_Board_remote: Any = None
_cached: list[Any] = []  # the board's handle, once found or made in this process
_cache_lock = threading.Lock()


def _board_class() -> Any:
  global _Board_remote
  if _Board_remote is None:
    _Board_remote = ray.remote(_Board)
  return _Board_remote


def _board(make: bool) -> Any:
  """The board's actor handle: found by name, or made (`make`); None where
  there is none and `make` is False."""
  with _cache_lock:
    if _cached:
      return _cached[0]
    try:
      board = ray.get_actor(BOARD_NAME)
    except ValueError:  # no actor of that name (yet)
      if not make:
        return None
      board = _board_class().options(
          name=BOARD_NAME, get_if_exists=True, num_cpus=0, max_concurrency=16
      ).remote()
    _cached.append(board)
    return board


def _forget() -> None:
  with _cache_lock:
    _cached.clear()


_last: list[Any] = []  # the ref of this process's last announcement


def announce(handle: WeightsHandle) -> None:
  """Tells the board `handle` (not waited for); makes the board if there is
  none. Where the last announcement from this process found the board dead
  (the process that made it ended), a new board is found or made first."""
  if _last:
    done, _ = ray.wait(_last, timeout=0)
    if done:
      try:
        ray.get(done[0])
      except ray.exceptions.RayActorError:
        _forget()
      except ray.exceptions.RayError:
        pass  # the board refused one announcement (a combination that failed): it still serves
      _last.clear()
  ref = _board(make=True).announce.remote(handle)
  _last[:] = [ref]


def withdraw(stream: str, publisher: str) -> None:
  """Drops `stream`'s newest handle if it is `publisher`'s (not waited for)."""
  board = _board(make=False)
  if board is None:
    return
  try:
    board.withdraw.remote(stream, publisher)
  except ray.exceptions.RayActorError:
    _forget()


def latest_handle(stream: str = "weights", timeout: float | None = _limits.LATEST_ASK_S) -> WeightsHandle | None:
  """The handle of the newest version announced on `stream` by a
  `WeightPublisher(name=stream, announce=True)` anywhere in this Ray
  namespace, on any host: for a multi-process trainer, the combination of
  every process's part of the newest version they all published. One Ray
  actor call (docs/weight_sync.md, "The newest version" gives its cost).

  Args:
    stream: the publisher's `name`.
    timeout: seconds to wait for the answer.

  Returns:
    The handle, or None where nothing was announced on `stream` yet (no
    announcing publisher has published, or the one that did closed).

  Raises:
    ValueError: `stream` is not a str.
    ray.exceptions.GetTimeoutError: no answer within `timeout`.
  """
  if not isinstance(stream, str):
    raise ValueError(f"stream={stream!r}: give a WeightPublisher's name, a str.")
  for _ in range(2):
    board = _board(make=False)
    if board is None:
      return None
    try:
      handle = ray.get(board.latest.remote(stream), timeout=timeout)
    except ray.exceptions.RayActorError:  # the board died with the process that made it: look again
      _forget()
      continue
    if handle is not None:
      check_handle(handle)
    return handle
  return None


def pull_latest(sub: Any, stream: str, timeout: float | None) -> WeightsHandle | None:
  """`WeightSubscriber.pull_latest` (see there): asks the board, pulls the
  handle if it is newer than the newest version `sub` reached, and asks
  again where the version was no longer kept, `_limits.LATEST_ATTEMPTS` times in all."""
  if sub.template is None:
    raise ValueError("pull_latest pulls into a template; this subscriber has none: pull by name with "
                     "sub.pull_named(rdt_jax.latest_handle(stream)).")
  deadline = None if timeout is None else time.monotonic() + timeout

  def left(cap: float | None) -> float | None:
    if deadline is None:
      return cap
    rest = max(0.0, deadline - time.monotonic())
    return rest if cap is None else min(cap, rest)

  for attempt in range(_limits.LATEST_ATTEMPTS):
    handle = latest_handle(stream, left(_limits.LATEST_ASK_S))
    if handle is None or (sub._reached is not None and handle.version <= sub._reached):
      return None
    try:
      sub.pull(handle, left(None))
    except StaleWeightsError:
      if attempt == _limits.LATEST_ATTEMPTS - 1 or (sub._reached is not None and handle.version <= sub._reached):
        raise
      continue
    return handle
  return None
