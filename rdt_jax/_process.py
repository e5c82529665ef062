"""Which process this is, and whether another one still runs (Linux /proc).

An rdt_jax object's bytes live in its producer's process. Where a consumer
shares the producer's host it can tell, from the producer's identity in the
metadata, whether that process still runs: a node-local read
(`rdt_jax.transports.nixl.node_local`) never reads a pid that now names
another process. Imports nothing outside the standard library.
"""

from __future__ import annotations

import os

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


def alive(other: Identity) -> bool:
  """True if process `other` (on this host: check `same_host` first) still
  runs, and its pid has not been reused by another process."""
  return start_time(other[2]) == other[3]
