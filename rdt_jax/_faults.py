"""Deterministic fault injection, for tests: inert unless a test enables it.

Transports call `hit(point)` at the points where a real failure can happen
(before a READ is posted, while it is in flight, when it completes, in
release, registration and deregistration). With no rules (the default) `ON`
is False and callers skip the call: no cost.

Rules come from `configure()` (tests in this process) or from the
environment, read once when this module is first imported: `RDT_JAX_FAULTS`
holds them, and they are honoured only where `RDT_JAX_FAULTS_ENABLE=1` is set
too (set both in an actor's `runtime_env={"env_vars": ...}` to fault that
actor only). Rules without the enabling variable are ignored with a warning,
so a production process cannot be made to fail or kill itself by one stray
variable. `RDT_JAX_FAULTS` is a comma-separated list of rules::

    point:action[=seconds][@first][*count][~probability]

* `point`: where, e.g. `nixl.post` (the list is `POINTS`);
* `action`: `fail` (raise `InjectedFault`), `delay=S` (sleep S seconds) or
  `kill` (the process dies at once, as with SIGKILL);
* `@first`: skip the hits before the `first`-th (1-based; default 1);
* `*count`: act at most `count` times (default: every hit);
* `~probability`: act on a hit with this probability, drawn from a
  generator seeded with `RDT_JAX_FAULTS_SEED` (default 0), so a run is
  repeatable.

Example: `RDT_JAX_FAULTS="nixl.post:fail*1,nixl.wait:delay=2"` fails the first
READ post and delays every wait by 2 s.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Final

from rdt_jax import _settings

__all__ = ["ON", "POINTS", "InjectedFault", "configure", "hit", "injected"]

#: The points transports check, and what each stands for.
POINTS: Final = {
    "nixl.register": "before memory is registered with NIXL (producer or consumer)",
    "nixl.deregister": "before memory is deregistered (object release, pool eviction)",
    "nixl.export": "on the producer, after the object's memory is registered",
    "nixl.connect": "on the consumer, before it loads, reloads or removes a producer's agent "
    "(connection work, done outside every lock); a delay stands for an unreachable peer",
    "nixl.post": "on the consumer, before a READ is posted",
    "nixl.wait": "on the consumer, while the READ is in flight (each wait); a delay "
    "keeps the READ looking in flight that long, so a timeout fires mid-transfer",
    "nixl.complete": "on the consumer, when the READ is DONE, before it is released",
    "nixl.release": "on the consumer, before a READ's handle is released",
    "nixl.park": "on the consumer, when a READ is given up; a delay keeps it looking in "
    "flight that long unless it is ended by removing its producer's agent",
    "weights.copied": "on a WeightSubscriber, after a node-local pull copied a packed version's bytes, "
    "before it checks that the version is still kept",
    "weights.bucket": "on a WeightSubscriber pulling through Ray, after it copied one bucket of a packed "
    "version out, before it takes the next",
    "weights.commit": "on a WeightSubscriber, after it copied a pull's bytes into the template's arrays "
    "(an atomic pull's staging, or a template that takes a copy: device memory, engine tensors), before the "
    "pull returns; a failure stands for a device error partway through that copy",
    "cma.read": "on the consumer, before a node-local read (rdt_jax._node_local); "
    "fail stands for the kernel refusing it (EPERM, as under Yama's ptrace_scope)",
    "lifetime.check": "on the consumer, once a fetch's bytes are in place (or its move failed), "
    "before it asks Ray whether the object's producer has died; a delay lets a test kill the "
    "producer in between",
}


class InjectedFault(RuntimeError):
  """The failure a `fail` rule raises."""


@dataclass
class _Rule:
  point: str
  action: str
  seconds: float = 0.0
  first: int = 1
  count: int | None = None
  probability: float = 1.0
  hits: int = 0
  acted: int = 0


_lock = threading.Lock()
_rules: dict[str, list[_Rule]] = {}
_rng = random.Random(0)
#: True when any rule is configured; callers check it before `hit`.
ON = False


def _parse(spec: str) -> dict[str, list[_Rule]]:
  rules: dict[str, list[_Rule]] = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    point, sep, rest = item.partition(":")
    if not sep or point not in POINTS:
      raise ValueError(
          f"RDT_JAX_FAULTS rule {item!r}: expected point:action with a point in "
          f"{sorted(POINTS)}."
      )
    rule = _Rule(point, "")
    for mark, attr, cast in (("~", "probability", float), ("*", "count", int), ("@", "first", int)):
      rest, sep, value = rest.rpartition(mark) if mark in rest else (rest, "", "")
      if sep:
        setattr(rule, attr, cast(value))
    action, _, seconds = rest.partition("=")
    if action not in ("fail", "delay", "kill") or (action == "delay") != bool(seconds):
      raise ValueError(
          f"RDT_JAX_FAULTS rule {item!r}: the action must be fail, kill or delay=SECONDS."
      )
    rule.action, rule.seconds = action, float(seconds or 0)
    rules.setdefault(point, []).append(rule)
  return rules


def configure(spec: str | None, seed: int = 0) -> None:
  """Replaces the rules (`spec` in `RDT_JAX_FAULTS`'s syntax; None or "" = off).

  Raises:
    ValueError: for a rule that does not parse, naming it.
  """
  global ON, _rules, _rng
  parsed = _parse(spec or "")
  with _lock:
    _rules, _rng = parsed, random.Random(seed)
    ON = bool(parsed)


def hit(point: str, sleep: bool = True) -> float:
  """Applies the rules for `point`: may sleep, raise `InjectedFault` or die.

  With `sleep=False` a delay is returned (seconds) instead of slept, for a
  caller that simulates a slow transfer (the wait sees it in flight that long).
  """
  with _lock:
    todo = []
    for rule in _rules.get(point, ()):
      rule.hits += 1
      if rule.hits < rule.first or (rule.count is not None and rule.acted >= rule.count):
        continue
      if rule.probability < 1.0 and _rng.random() >= rule.probability:
        continue
      rule.acted += 1
      todo.append(rule)
  delay = 0.0
  for rule in todo:
    if rule.action == "delay":
      delay += rule.seconds
      if sleep:
        time.sleep(rule.seconds)
    elif rule.action == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    else:
      raise InjectedFault(f"injected fault at {point} (RDT_JAX_FAULTS)")
  return delay


def injected() -> dict[str, int]:
  """How many times each configured point acted so far (for reports)."""
  with _lock:
    out: dict[str, int] = {}
    for point, rules in _rules.items():
      out[point] = sum(r.acted for r in rules)
    return out


def rules_from_environment() -> str:
  """The rules of `RDT_JAX_FAULTS` if `RDT_JAX_FAULTS_ENABLE` allows them, else "".

  Raises:
    SettingError: for an enabling variable that is not a boolean.
  """
  spec = _settings.value("RDT_JAX_FAULTS")
  if not spec or _settings.value("RDT_JAX_FAULTS_ENABLE"):
    return spec
  logging.getLogger(__name__).warning(
      "RDT_JAX_FAULTS is set but ignored: fault injection is for rdt_jax's own tests and needs "
      "RDT_JAX_FAULTS_ENABLE=1 as well. Unset RDT_JAX_FAULTS."
  )
  return ""


configure(rules_from_environment(), _settings.value("RDT_JAX_FAULTS_SEED"))
