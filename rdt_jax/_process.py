"""Which process this is, and whether another one still runs (Linux /proc).

An rdt_jax object's bytes live in its producer's process. Where a consumer
shares the producer's host it can tell, from the producer's identity in the
metadata, whether that process still runs: a node-local read
(`rdt_jax._node_local`) never reads a pid that now names
another process. Imports nothing outside the standard library.

Whether a process still runs is asked several times per read (before and
after every copy). Reading `/proc/<pid>/stat` each time was most of a small
weight pull's time on the publisher's host; so a process found running is
watched through a pidfd (Linux 5.3 and later), which names that process and
no other whatever happens to its pid, and turns readable when it exits:
later checks are one `poll` of it. At most `WATCHED_MAX` processes are
watched, least recently asked about dropped first.
"""

from __future__ import annotations

import errno
import os
import select
import threading
from collections import OrderedDict

from rdt_jax import _limits

#: (host boot id, pid namespace inode, pid, start time in clock ticks after boot).
Identity = tuple[str, int, int, int]

_IDENTITY: list[Identity | None] = []


def start_time(pid: int) -> int | None:
  """Start time (clock ticks after boot) of process `pid`, or None if it has
  exited (a zombie not yet reaped counts as exited) or never was."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
  except OSError:
    return None
  fields = stat[stat.rindex(b")") + 2 :].split()
  return None if fields[0] in (b"Z", b"X") else int(fields[19])


def identity() -> Identity | None:
  """This process: unique on its host across pid reuse; None where /proc
  does not say (not Linux). Computed once per process."""
  if not _IDENTITY:
    try:
      with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
      namespace = os.stat("/proc/self/ns/pid").st_ino
      started = start_time(os.getpid())
      _IDENTITY.append(None if started is None else (boot, namespace, os.getpid(), started))
    except OSError:
      _IDENTITY.append(None)
  return _IDENTITY[0]


def same_host(other: Identity | None) -> bool:
  """True if `other` is a process this one can see by pid: same host (boot
  id) and same pid namespace."""
  here = identity()
  return other is not None and here is not None and tuple(other[:2]) == here[:2]


_watch_lock = threading.Lock()
#: identity -> pidfd of that process, least recently asked about first.
_watched: OrderedDict[Identity, int] = OrderedDict()
#: False once `os.pidfd_open` turned out missing here (then /proc alone is asked).
_pidfd_works: list[bool] = [hasattr(os, "pidfd_open")]


def alive(other: Identity) -> bool:
  """True if process `other` (on this host: check `same_host` first) still
  runs, and its pid has not been reused by another process.

  The first check of a process reads its start time from /proc; once found
  running it is watched through a pidfd, and later checks poll that (see
  the module docstring). A process that exited is forgotten."""
  with _watch_lock:
    fd = _watched.get(other)
    if fd is not None:
      if not _exited(fd):
        _watched.move_to_end(other)
        return True
      del _watched[other]
      os.close(fd)
      return False
    fd = _open_pidfd(other[2])
    if start_time(other[2]) != other[3]:
      if fd is not None:
        os.close(fd)
      return False
    if fd is not None:
      # Opened before the start time matched: it names this very process (a
      # process started after the pidfd was opened has a later start time).
      _watched[other] = fd
      while len(_watched) > _limits.WATCHED_MAX:
        os.close(_watched.popitem(last=False)[1])
    return True


def _after_fork_in_child() -> None:
  """A forked child gets a lock of its own (the parent's may have been held
  by another thread at the fork); the pidfds it inherited still name the
  same processes."""
  global _watch_lock
  _watch_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_after_fork_in_child)


def watched() -> tuple[Identity, ...]:
  """The processes watched through a pidfd now, least recently asked about
  first (at most `_limits.WATCHED_MAX`)."""
  with _watch_lock:
    return tuple(_watched)


def forget_watched() -> None:
  """Stops watching every process (closes their pidfds); the next check of
  each reads /proc again."""
  with _watch_lock:
    while _watched:
      os.close(_watched.popitem()[1])


def _open_pidfd(pid: int) -> int | None:
  """A pidfd of process `pid`, or None (no such process, or no pidfds here)."""
  if not _pidfd_works[0]:
    return None
  try:
    return os.pidfd_open(pid)
  except OSError as e:
    if e.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES):  # no pidfds here: ask /proc every time
      _pidfd_works[0] = False
    return None  # no such process, an invalid pid, no descriptor left: /proc decides this time


def _exited(fd: int) -> bool:
  """True if the process of pidfd `fd` has exited (the pidfd is readable)."""
  poller = select.poll()
  poller.register(fd, select.POLLIN)
  return bool(poller.poll(0))
