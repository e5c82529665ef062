"""`rdt-jax soak --weight-sync`: the weight-sync contract under chaos, for N minutes.

A trainer actor publishes versions of a JAX pytree with `rdt_jax.WeightPublisher`
(`keep=2`): array leaves of float32, int32 and uint8, three structures in turn
(two to four layers, leaf sizes up to `--mb` MiB) and two non-array leaves that
change every version (the step and the publisher's incarnation). Every byte of
a version is a function of (incarnation, version), so whoever checks a version
recomputes it. Generators hold `rdt_jax.WeightSubscriber`s on torch and numpy
templates, one per structure: one generator in torch with `atomic=False`, one in
numpy with `atomic=True` reading through Ray in 1 MiB buckets (node-local reads
refused, as from another host), one mixing both, and one colocated in the
trainer's own actor, pulling the handles its publisher just made. Each round the
trainer publishes the next version while every generator pulls the last one and
up to two older ones (from a closed publisher or a dead trainer as well), from
several threads at once and with `await sub.pull_async(handle)` on an event loop
of its own, so the pulls overlap on one subscriber; some carry a short timeout,
some `pull_async` tasks are cancelled mid-pull, and fault injection holds some
copies longer, so versions are freed while they are read.

Every `--event-every` seconds (drawn from `--seed`) a chaos event, one of: a
generator killed (and replaced); the trainer killed mid-round (and replaced by a
standby trainer with a new publisher, republishing from up to 3 versions back;
a publisher recreated instead while no standby runs yet);
or the publisher recreated inside the trainer (closed, and a new one republishes
the same version numbers; one publisher in four sends pytrees, `pack=False`); or
the publisher replaced inside the trainer without `close()` (a rollback by
`self.pub = WeightPublisher(...)`: the old one ends when its last reference goes,
and the new one packs its versions into the old one's pooled buffers).

Checked, each a count that must be 0 for exit status 0:

* wrong versions: a pull that returns a tree whose step or incarnation is not
  its handle's, or a template whose bytes, once the round's pulls ended, are
  not exactly (by digest) those of the version `sub.version` names (for the
  incarnation whose handle reached it);
* versions backwards: `sub.version` seen lower than before by any thread, or
  `None` for an `atomic=True` subscriber (`None` is allowed for `atomic=False`);
* other errors: a pull that raised anything but `StaleWeightsError`, a Ray
  error (actor death, `GetTimeoutError`) or, for a cancelled `pull_async`, the
  cancellation; or a round call that failed with no kill to explain it;
* hangs: a pull (or a round call) with no answer within `--hang-bound` seconds
  (60 by default, as Ray's own bound on a stalled RDT fetch). A round waits
  `ROUND_WAIT_S` for its pulls; an actor with pulls still running then is set
  aside (replaced, and left to wait for them up to the bound), so the run goes
  on; the slowest answer is reported;
* late writes: after a pull that failed or was cancelled (other than a refusal
  before anything moved) the subscriber is retired: its template is filled with
  a sentinel byte, and a changed byte seen in the next rounds or at the end is
  a late write;
* leaks: at the end every publisher is closed, every subscriber dropped, and
  each live actor must be back to its baseline on every counter of its
  transport's `counters()` and hold no pooled host memory (as `--chaos`
  checks; consumers forget idle producers after `RDT_JAX_NIXL_PRODUCER_IDLE_S`,
  and a bucket's fetch that a refused pull left running ends at Ray's fetch
  timeout at the latest: the end waits for the longer of the two, plus 30 s).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import gc
import hashlib
import logging
import math
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

import rdt_jax
from rdt_jax import _ray, _settings
from rdt_jax.bench import _chaos
from rdt_jax.bench._env import write_json

#: A pull (or a round call) with no answer by then counts as a hang (`--hang-bound`).
HANG_BOUND_S = 60.0
#: Calls that only read or change the driver's actors' state (restart, finish, counters).
CALL_BOUND_S = 120.0
#: A round waits this long for its pulls; an actor with pulls still running then is set
#: aside (`_Puller.drain` waits for them up to the hang bound) and replaced.
ROUND_WAIT_S = 10.0
#: Versions each publisher keeps readable.
KEEP = 2
#: Bucket size of packed versions read through Ray (the trainer's setting).
BUCKET_BYTES = 1 << 20
#: The structures published, in turn, each for `VERSIONS_PER_STRUCTURE` versions.
STRUCTURES = 3
VERSIONS_PER_STRUCTURE = 5
#: How far back a new publisher starts (republishing version numbers).
MAX_ROLLBACK = 3
#: Faults of generators that read node-locally: one copied version in ten waits 50 ms
#: before its publisher's table is read again (a version may be freed meanwhile).
LOCAL_FAULTS = "weights.copied:delay=0.05~0.1"
#: Faults of generators reading through Ray: node-local reads refused, one bucket in
#: ten held 20 ms, one NIXL wait in twenty 0.2 s longer.
RAY_FAULTS = "cma.read:fail,weights.bucket:delay=0.02~0.1,nixl.wait:delay=0.2~0.05"
#: Generator kinds, in turn: (template framework, atomic: True, False or None for
#: alternating by structure, fault rules). The colocated one is `COLOCATED`.
GENERATORS = (("torch", False, LOCAL_FAULTS), ("numpy", True, RAY_FAULTS), ("mixed", None, LOCAL_FAULTS))
COLOCATED = ("mixed", None, LOCAL_FAULTS)
#: Messages of `StaleWeightsError`s raised before anything moved.
REFUSED_BEFORE = ("is not newer than", "is no longer kept")
#: Counters a round adds up (see `_Puller.sync`).
PULL_KEYS = ("pulls", "ok", "bytes", "stale", "ray_errors", "timeouts", "cancelled", "other_errors",
             "wrong_versions", "backwards", "hangs", "hangs_in_bucket_fetch", "stalled", "late_writes", "retired",
             "async_pulls", "timed_pulls")

Spec = tuple[tuple[Any, ...], tuple[int, ...], str]


def add_weight_sync_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--weight-sync", action="store_true",
                      help="run the weight-sync soak instead: WeightPublisher/WeightSubscriber under chaos "
                           "(generators and trainers killed, publishers recreated, drawn from --seed); exit status 1 "
                           "on a wrong version, a version going back, a hang, a non-Ray error, a late write or a "
                           "leak; see rdt_jax.bench._weight_soak")
  parser.add_argument("--event-every", type=float, default=4.0,
                      help="weight-sync: seconds between chaos events, on average")
  parser.add_argument("--hang-bound", type=float, default=HANG_BOUND_S,
                      help="weight-sync: a pull with no answer within this many seconds is a hang")


# --------------------------------------------------------------------------
# Versions: every byte a function of (incarnation, version).


def structure_of(version: int) -> int:
  return (version // VERSIONS_PER_STRUCTURE) % STRUCTURES


def specs(structure: int, mb: float) -> list[Spec]:
  """(pytree path, shape, dtype) of every array leaf of a structure, in leaf order."""
  big = max(4096, int(mb * (1 << 20) / 4 * (1.0 - 0.2 * structure)))
  out: list[Spec] = [(("embed",), (big // 64, 64), "float32")]
  for i in range(2 + structure):
    out.append((("layers", i, "b"), (1 + 37 * (i + structure),), "int32"))
    out.append((("layers", i, "w"), (max(1, big // (4 << i)),), "float32"))
  out.append((("mask",), (1000 + 333 * structure,), "uint8"))
  return out


def leaf(incarnation: int, version: int, index: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
  """Leaf `index` of a version: distinct at every position, version and incarnation."""
  key = hashlib.blake2b(f"{incarnation}/{version}/{index}".encode(), digest_size=4).digest()
  words = np.arange(math.prod(shape), dtype=np.uint32)
  words *= np.uint32(2654435761)
  words += np.uint32(int.from_bytes(key, "little"))
  if dtype == "float32":
    return (words >> np.uint32(8)).astype(np.float32).reshape(shape)  # exact: under 2**24
  if dtype == "int32":
    return words.view(np.int32).reshape(shape)
  return (words & np.uint32(0xFF)).astype(np.uint8).reshape(shape)


def leaves(incarnation: int, version: int, mb: float) -> list[np.ndarray]:
  return [leaf(incarnation, version, i, shape, dt) for i, (_, shape, dt) in
          enumerate(specs(structure_of(version), mb))]


def digest(arrays: list[np.ndarray]) -> str:
  h = hashlib.blake2b(digest_size=16)
  for a in arrays:
    h.update(f"{a.shape}|{a.dtype.name}|".encode())
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
  return h.hexdigest()


def build(spec_list: list[Spec], arrays: list[Any], **rest: int) -> dict:
  """The pytree of `arrays` at their spec paths, with non-array leaves `rest`."""
  tree: dict = {"layers": [], **rest}
  for (path, _, _), a in zip(spec_list, arrays):
    if path[0] == "layers":
      while len(tree["layers"]) <= path[1]:
        tree["layers"].append({})
      tree["layers"][path[1]][path[2]] = a
    else:
      tree[path[0]] = a
  return tree


def at(tree: dict, path: tuple[Any, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def version_tree(incarnation: int, version: int, mb: float) -> tuple[dict, int]:
  """The JAX pytree published as `version` by publisher `incarnation`, and its bytes."""
  import jax.numpy as jnp

  arrays = leaves(incarnation, version, mb)
  tree = build(specs(structure_of(version), mb), [jnp.asarray(a) for a in arrays],
               step=version, incarnation=incarnation)
  return tree, sum(a.nbytes for a in arrays)


def template(structure: int, mb: float, framework: str) -> tuple[dict, list[np.ndarray]]:
  """An empty template of `structure` ("mixed": torch layers, numpy for the rest),
  and a host view of each of its arrays, in spec order."""
  import torch

  spec_list = specs(structure, mb)
  arrays: list[Any] = []
  for path, shape, dt in spec_list:
    if framework == "torch" or (framework == "mixed" and path[0] == "layers"):
      arrays.append(torch.zeros(shape, dtype=getattr(torch, dt)))
    else:
      arrays.append(np.zeros(shape, np.dtype(dt)))
  views = [a.numpy() if not isinstance(a, np.ndarray) else a for a in arrays]
  return build(spec_list, arrays, step=-1, incarnation=-1), views


# --------------------------------------------------------------------------
# Subscribers (in generators and in the trainer)


@dataclasses.dataclass
class _Sub:
  """One subscriber and what its checker knows."""

  sub: rdt_jax.WeightSubscriber
  views: list[np.ndarray]
  high: int | None = None  # the highest version seen
  reached: dict[int, int] = dataclasses.field(default_factory=dict)  # version -> incarnation of a successful pull
  maybe: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # cancelled pulls: version -> incarnations
  retire: bool = False


@dataclasses.dataclass
class _Pull:
  """One pull started: into `s`, of `item` (handle, incarnation, version, nbytes)."""

  s: _Sub
  item: tuple
  future: Any
  started: float


def _describe(p: _Pull) -> str:
  """How a pull that ended ended, and when."""
  what, value, ended = p.future.result()
  how = what if what != "error" else f"{type(value).__name__}: {str(value)[:160]}"
  return f"v{p.item[2]}/{p.item[1]} answered after {ended - p.started:.1f} s: {how}"


def _expected_error(e: BaseException) -> str | None:
  """The counter an expected failed pull goes to, or None."""
  if isinstance(e, rdt_jax.StaleWeightsError):
    return "stale"
  if isinstance(e, ray.exceptions.GetTimeoutError):
    return "timeouts"
  if isinstance(e, ray.exceptions.RayError):
    return "ray_errors"
  return None


def _refused_before(e: BaseException) -> bool:
  """A `StaleWeightsError` raised before anything moved (nothing to check for late writes)."""
  return isinstance(e, rdt_jax.StaleWeightsError) and any(m in str(e) for m in REFUSED_BEFORE)


async def _awaited(s: _Sub, handle: Any, cancel_after: float | None, observe: Callable[[], None]) -> tuple:
  """`await sub.pull_async(handle)`, its task cancelled after `cancel_after` s if given.

  A function, not a method of `_Puller`: an actor class with a coroutine method
  is an async actor, whose methods would all run on one event loop."""
  task = asyncio.ensure_future(s.sub.pull_async(handle))
  if cancel_after is not None:
    await asyncio.wait({task}, timeout=cancel_after)
    task.cancel()
  try:
    out: tuple = ("ok", await task, time.monotonic())
  except asyncio.CancelledError:
    out = ("cancelled", None, time.monotonic())
  except BaseException as e:
    out = ("error", e, time.monotonic())
  observe()
  return out


def _stacks() -> dict[str, str]:
  """The stack of every thread of this process by thread name, innermost frames last (a hang's report)."""
  names = {t.ident: t.name for t in threading.enumerate()}
  return {str(names.get(ident, ident)): "".join(traceback.format_stack(frame)[-12:])
          for ident, frame in sys._current_frames().items()}


def _in_bucket_fetch(stacks: dict[str, str]) -> bool:
  """True if a thread that fetches a pull's bucket waits for its NIXL READ."""
  return any("bucket" in name and "inflight.py" in stack for name, stack in stacks.items())


class _Puller:
  """Pulls rounds of handles into subscribers, concurrently, and checks them."""

  def __init__(self, kind: tuple[str, bool | None, str], mb: float, index: int):
    import jax.numpy  # noqa: F401  (imported before any thread does: concurrent first imports deadlock)
    import torch  # noqa: F401

    self.framework, self.atomic, _ = kind
    self.mb, self.index = mb, index
    self.subs: dict[int, _Sub] = {}
    self.pending: list[_Pull] = []  # pulls still running after their round (see `drain`)
    self.slowest = 0.0  # seconds, the slowest pull that answered
    self.stall_stacks: list[str] = []  # thread stacks when pulls outlived their round
    self.retired: list[tuple[int, list[np.ndarray]]] = []  # (round retired, sentinel-filled views)
    self.rounds = 0
    self.expected: collections.OrderedDict[tuple[int, int], str] = collections.OrderedDict()
    self.lock = threading.Lock()  # `backwards`, updated from every pulling thread
    self.backwards = 0  # `sub.version` seen going back, by any pull (rounds report what is new)
    self.reported_backwards = 0
    self.threads = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="soak-pull")
    self.loop = asyncio.new_event_loop()
    threading.Thread(target=self.loop.run_forever, daemon=True, name="soak-loop").start()

  def ready(self) -> bool:
    return True

  def _sub(self, structure: int) -> _Sub:
    if structure not in self.subs:
      atomic = self.atomic if self.atomic is not None else (structure + self.index) % 2 == 0
      tree, views = template(structure, self.mb, self.framework)
      self.subs[structure] = _Sub(rdt_jax.WeightSubscriber(tree, atomic=atomic), views)
    return self.subs[structure]

  def _expected(self, incarnation: int, version: int) -> str:
    key = (incarnation, version)
    if key not in self.expected:
      self.expected[key] = digest(leaves(incarnation, version, self.mb))
      if len(self.expected) > 32:
        self.expected.popitem(last=False)
    return self.expected[key]

  def _observe(self, s: _Sub) -> None:
    """`sub.version` as a thread sees it now: never lower than before; None only for atomic=False."""
    with self.lock:
      v = s.sub.version
      if v is None:
        if s.sub.atomic and s.high is not None:
          self.backwards += 1
        return
      if s.high is not None and v < s.high:
        self.backwards += 1
      s.high = v if s.high is None else max(s.high, v)

  def _in_thread(self, s: _Sub, handle: Any, timeout: float | None) -> tuple:
    try:
      out: tuple = ("ok", s.sub.pull(handle, timeout=timeout), time.monotonic())
    except BaseException as e:
      out = ("error", e, time.monotonic())
    self._observe(s)
    return out

  def _start(self, rng: random.Random, items: list, counts: collections.Counter) -> list[_Pull]:
    """Starts every pull of a round: the newest handle from two threads and one
    task, each older one from a thread or a task."""
    started = []
    for n, item in enumerate(items):
      s = self._sub(structure_of(item[2]))
      ways = ["thread", "thread", "task"] if n == 0 else [rng.choice(["thread", "task"])]
      rng.shuffle(ways)
      for way in ways:
        counts["pulls"] += 1
        t0 = time.monotonic()
        if way == "thread":
          timeout = rng.uniform(0.001, 0.05) if rng.random() < 0.1 else None
          counts["timed_pulls"] += timeout is not None
          future: Any = self.threads.submit(self._in_thread, s, item[0], timeout)
        else:
          cancel_after = rng.uniform(0.0, 0.03) if rng.random() < 0.15 else None
          counts["async_pulls"] += 1
          pull = _awaited(s, item[0], cancel_after, functools.partial(self._observe, s))
          future = asyncio.run_coroutine_threadsafe(pull, self.loop)
          if cancel_after is not None:
            s.maybe.setdefault(item[2], set()).add(item[1])
        started.append(_Pull(s, item, future, t0))
    return started

  def _outcome(self, p: _Pull, counts: collections.Counter, errors: list[str]) -> None:
    _, incarnation, version, nbytes = p.item
    what, value, ended = p.future.result()
    self.slowest = max(self.slowest, ended - p.started)
    s = p.s
    if what == "ok":
      counts["ok"] += 1
      counts["bytes"] += nbytes
      s.reached[version] = incarnation
      if value.get("step") != version or value.get("incarnation") != incarnation:
        counts["wrong_versions"] += 1
        errors.append(f"v{version}/{incarnation}: pulled tree says step {value.get('step')}, "
                      f"incarnation {value.get('incarnation')}")
      return
    if what == "cancelled":
      counts["cancelled"] += 1
      s.retire = True
      return
    kind = _expected_error(value)
    counts[kind or "other_errors"] += 1
    if kind is None:
      errors.append(f"v{version}/{incarnation}: {type(value).__name__}: {str(value)[:300]}")
    if not _refused_before(value):
      s.retire = True

  def _check(self, s: _Sub, counts: collections.Counter, errors: list[str]) -> None:
    """With no pull running: the template holds exactly the version `sub.version` names."""
    v = s.sub.version
    if v is None:
      s.retire = True  # torn: a failed pull may have written; see that nothing writes later
      return
    candidates = {s.reached[v]} if v in s.reached else s.maybe.get(v, set())
    got = digest(s.views)
    if not any(got == self._expected(inc, v) for inc in candidates):
      counts["wrong_versions"] += 1
      errors.append(f"subscriber at version {v}: template bytes are not those of v{v} of incarnation(s) "
                    f"{sorted(candidates)}")
    elif v not in s.reached:
      s.reached[v] = next(inc for inc in candidates if got == self._expected(inc, v))
    for old in [k for k in s.reached if k < v]:
      del s.reached[old]
    s.maybe = {k: incs for k, incs in s.maybe.items() if k > v}

  def _detach(self, s: _Sub) -> None:
    """Later rounds pull into a new subscriber of `s`'s structure."""
    for structure, t in list(self.subs.items()):
      if t is s:
        del self.subs[structure]

  def _retire(self, s: _Sub, counts: collections.Counter) -> None:
    self._detach(s)
    for view in s.views:
      view.reshape(-1).view(np.uint8).fill(_chaos.SENTINEL)
    self.retired = [*self.retired, (self.rounds, s.views)][-8:]
    counts["retired"] += 1

  def _conclude(self, pulls: list[_Pull], counts: collections.Counter, errors: list[str]) -> None:
    """The outcome of each pull of `pulls` that ended; then each of their subscribers
    with no pull running is checked, and retired if a pull may have written."""
    for p in pulls:
      if p.future.done():
        self._outcome(p, counts, errors)
    for s in {id(p.s): p.s for p in pulls}.values():
      if not any(q.s is s and not q.future.done() for q in [*pulls, *self.pending]):
        self._check(s, counts, errors)
        if s.retire:
          self._retire(s, counts)

  def _new_backwards(self) -> int:
    """Versions seen going back since the last report."""
    with self.lock:
      new, self.reported_backwards = self.backwards - self.reported_backwards, self.backwards
    return new

  def _late_writes(self, every: bool) -> int:
    """Retired templates (those of the last rounds, or `every` one) with a byte not the sentinel."""
    late = 0
    for n, (when, views) in enumerate(self.retired):
      if (every or self.rounds - when <= 3) and any(bool((v.reshape(-1).view(np.uint8) != _chaos.SENTINEL).any())
                                                    for v in views):
        late += 1
        self.retired[n] = (-(1 << 30), [])  # counted once
    return late

  def sync(self, items: list, seed: int, wait_s: float) -> dict:
    """Pulls `items` ((handle, incarnation, version, nbytes), newest first) concurrently and
    checks them; returns the counts. Pulls still running after `wait_s` seconds are left
    to `drain` (their subscribers are set aside)."""
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    errors: list[str] = []
    self.rounds += 1
    started = self._start(rng, items, counts)
    concurrent.futures.wait([p.future for p in started], timeout=wait_s)
    late = [p for p in started if not p.future.done()]
    if late and len(self.stall_stacks) < 2:  # where pulls wait that outlive their round
      busy = {name: stack for name, stack in _stacks().items() if "site-packages" in stack or "rdt_jax" in stack}
      self.stall_stacks.append("\n".join(f"-- {name}\n{stack}" for name, stack in busy.items()))
    for p in late:
      self._detach(p.s)
    self.pending += late
    counts["stalled"] += len(late)
    self._conclude(started, counts, errors)
    counts["late_writes"] += self._late_writes(every=False)
    counts["backwards"] += self._new_backwards()
    return {"counts": dict(counts), "errors": errors[:5], "slowest_s": self.slowest, "stalled": len(late)}

  def drain(self, bound: float) -> dict:
    """Waits for the pulls still running after their round until `bound` seconds
    after each began: one with no answer by then is a hang (it is given half as
    long again, to tell whether and when it ends). Then the late-write check of
    every retired template."""
    counts: collections.Counter = collections.Counter()
    errors: list[str] = []
    for p in sorted(self.pending, key=lambda p: p.started):
      concurrent.futures.wait([p.future], timeout=max(0.0, p.started + bound - time.monotonic()))
    hung = [p for p in self.pending if not p.future.done()]
    counts["hangs"] += len(hung)
    if hung:
      stacks = _stacks()
      if _in_bucket_fetch(stacks):
        counts["hangs_in_bucket_fetch"] += len(hung)
      which = ", ".join(f"v{p.item[2]}/{p.item[1]}" for p in hung)
      dump = "\n".join(f"-- {name}\n{stack}" for name, stack in stacks.items())
      errors.append(f"{len(hung)} pull(s) ({which}) with no answer within {bound:.0f} s; stacks:\n{dump}")
      concurrent.futures.wait([p.future for p in hung], timeout=bound / 2)
    pending = self.pending
    self.pending = [p for p in pending if not p.future.done()]
    answered = [p for p in pending if p.future.done()]
    stalls = [_describe(p) for p in answered] + [f"v{p.item[2]}/{p.item[1]}: no answer after "
                                                 f"{time.monotonic() - p.started:.1f} s" for p in self.pending]
    self._conclude(answered, counts, errors)
    counts["late_writes"] += self._late_writes(every=True)
    counts["backwards"] += self._new_backwards()
    return {"counts": dict(counts), "errors": errors[:5], "slowest_s": self.slowest, "stalls": stalls,
            "stall_stacks": self.stall_stacks}

  def finish(self) -> dict:
    """Drops every subscriber (its staging memory); the late-write check of every retired template."""
    self.subs.clear()
    gc.collect()
    return {"late_writes": self._late_writes(every=True)}

  def counters(self) -> dict:
    rdt_jax.register()  # a standby trainer never used the transport: registered here, counting nothing
    return _chaos._counters()


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Generator(_Puller):
  pass


@ray.remote(enable_tensor_transport=True, max_concurrency=4)  # type: ignore[call-overload]
class _Trainer(_Puller):
  """Publishes versions; its colocated subscribers pull them (`_Puller`)."""

  def __init__(self, mb: float, index: int):
    super().__init__(COLOCATED, mb, index)
    self.publisher: Any = None
    self.incarnation = -1
    self.next_version = 1
    self.publish_lock = threading.Lock()

  def restart(self, incarnation: int, first_version: int, pack: bool, close: bool = True) -> None:
    """A new publisher whose first version is `first_version`; the old one
    closed, or (`close=False`) replaced without `close()`, as a trainer that
    rolls back with `self.pub = WeightPublisher(...)` does: it ends when its
    last reference goes, here at once."""
    with self.publish_lock:
      if self.publisher is not None and close:
        self.publisher.close()
      self.publisher = rdt_jax.WeightPublisher("jax_nixl", keep=KEEP, pack=pack)
      self.incarnation, self.next_version = incarnation, first_version

  def publish(self) -> tuple:
    """Publishes the next version: (handle, incarnation, version, nbytes)."""
    with self.publish_lock:
      version, incarnation = self.next_version, self.incarnation
      tree, nbytes = version_tree(incarnation, version, self.mb)
      handle = self.publisher.publish(tree, version)
      self.next_version += 1
      return handle, incarnation, version, nbytes

  def finish(self) -> dict:
    with self.publish_lock:
      if self.publisher is not None:
        self.publisher.close()
        self.publisher = None
    return super().finish()


# --------------------------------------------------------------------------
# The driver


def _env(faults: str, **more: str) -> dict:
  return {"env_vars": {"RDT_JAX_FAULTS": faults, "RDT_JAX_FAULTS_ENABLE": "1", **more}}


@dataclasses.dataclass
class _Call:
  name: str
  actor: Any
  ref: Any


class _Soak:
  """The driver's state: actors, recent handles, counts."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    self.rng = random.Random(args.seed)
    self.mb = args.mb
    self.incarnation = 0
    self.trainer = self._new_trainer()
    self.generators = [self._new_generator(i) for i in range(max(0, args.generators - 1))]
    self.ready = [g.ready.remote() for g in self.generators]
    ray.get(self.trainer.ready.remote(), timeout=300)
    ray.get(self.trainer.restart.remote(self.incarnation, 1, True), timeout=CALL_BOUND_S)
    self.spare = self._new_trainer()  # the standby, started once the first trainer runs
    self.spare_ready = self.spare.ready.remote()
    self.last_version = 0
    self.recent: collections.deque = collections.deque(maxlen=5)
    self.counts: collections.Counter = collections.Counter()
    self.errors: list[str] = []
    self.killed: set[str] = set()
    self.events: list[str] = []
    self.restarting: Any = None
    self.draining: list[_Call] = []  # actors set aside, their `drain` call
    self.stalls: list[str] = []  # pulls answered after their round, as `_describe` tells
    self.stall_stacks: list[str] = []  # the first few actors' thread stacks when their pulls outlived a round
    self.slowest = 0.0

  def _new_trainer(self) -> Any:
    env = _env(COLOCATED[2], RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET_BYTES))
    return _Trainer.options(runtime_env=env).remote(self.mb, 0)  # type: ignore[attr-defined]

  def _new_generator(self, i: int) -> Any:
    kind = GENERATORS[i % len(GENERATORS)]
    return _Generator.options(runtime_env=_env(kind[2])).remote(kind, self.mb, i + 1)  # type: ignore[attr-defined]

  def _items(self) -> list:
    """The newest handle and up to two older ones, newest first. Until a pull
    has been refused as stale, the oldest handle held is among them (from the
    third version on it has left the publisher's window of 2), so even a
    short run sees that refusal; the draw goes on as before."""
    if not self.recent:
      return []
    older = list(self.recent)[:-1]
    picked = self.rng.sample(older, self.rng.randint(0, min(2, len(older))))
    if not self.counts["stale"] and len(older) >= 2 and older[0] not in picked:
      picked = [older[0], *picked[:1]]
    return [self.recent[-1], *sorted(picked, key=lambda item: -item[2])]

  def _rollback_to(self) -> int:
    return max(1, self.last_version + 1 - self.rng.randint(0, MAX_ROLLBACK))

  def _event(self) -> None:
    kind = self.rng.choices(["generator", "trainer", "publisher", "replaced"], [0.4, 0.3, 0.15, 0.15])[0]
    if kind == "trainer" and not ray.wait([self.spare_ready], timeout=0)[0]:
      kind = "publisher"  # no standby runs yet: the rounds would wait for one to start
      self.counts["trainer_kills_deferred"] += 1
    self.events.append(f"round {self.counts['rounds']}: {kind} (newest v{self.last_version}/{self.incarnation})")
    self.counts["events"] += 1
    self.counts["event_" + kind] += 1
    if kind == "generator" and self.generators:
      self._replace(f"generator{self.rng.randrange(len(self.generators))}")
    elif kind == "trainer":
      self._replace("trainer")
    else:  # the publisher closed and created again, or replaced without close()
      self.incarnation += 1
      self.restarting = self.trainer.restart.remote(self.incarnation, self._rollback_to(), self._pack(),
                                                    kind == "publisher")

  def _replace(self, name: str, kill: bool = True) -> Any:
    """Replaces actor `name` (killed unless `kill` is False): with a new generator, or
    with the standby trainer and a new publisher. Returns the actor replaced."""
    self.killed.add(name)
    if name == "trainer":
      old, self.trainer, self.spare = self.trainer, self.spare, self._new_trainer()
      self.spare_ready = self.spare.ready.remote()
      self.incarnation += 1
      self.restarting = self.trainer.restart.remote(self.incarnation, self._rollback_to(), self._pack())
    else:
      i = int(name.removeprefix("generator"))
      old, self.generators[i] = self.generators[i], self._new_generator(i)
      self.ready[i] = self.generators[i].ready.remote()
    if kill:
      ray.kill(old)
    return old

  def _set_aside(self, name: str) -> None:
    """An actor with pulls running past their round: replaced, and left to drain them."""
    self.counts["set_aside"] += 1
    old = self._replace(name, kill=False)
    self.draining.append(_Call(name, old, old.drain.remote(self.args.hang_bound)))

  def _reap(self, block: bool) -> None:
    """Adds up the drains that ended (all of them if `block`) and kills their actors."""
    if not self.draining:
      return
    refs = [c.ref for c in self.draining]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.args.hang_bound * 1.5 + 30 if block else 0)
    for c in [c for c in self.draining if c.ref in done]:
      self.draining.remove(c)
      try:
        self._add(c.name, ray.get(c.ref))
      except Exception as e:
        self.counts["other_errors"] += 1
        self.errors.append(f"drain of {c.name}: {type(e).__name__}: {str(e)[:300]}")
      ray.kill(c.actor)
    for c in self.draining if block else []:
      self.counts["hangs"] += 1
      self.errors.append(f"drain of {c.name} gave no answer")

  def _add(self, name: str, result: dict) -> None:
    self.counts.update(result["counts"])
    self.stalls.extend(f"{name}: {m}" for m in result.get("stalls", []))
    self.stall_stacks.extend(result.get("stall_stacks", [])[: max(0, 3 - len(self.stall_stacks))])
    self.slowest = max(self.slowest, result["slowest_s"])
    self.errors.extend(f"round {self.counts['rounds']}: {name}: {m}" for m in result["errors"])

  def _pack(self) -> bool:
    return self.rng.random() >= 0.25

  def _calls(self) -> list[_Call]:
    calls = []
    for i, g in enumerate(self.generators):
      if ray.wait([self.ready[i]], timeout=0)[0]:  # a replacement still starting sits the round out
        calls.append(_Call(f"generator{i}", g, g.sync.remote(self._items(), self.rng.randrange(1 << 32),
                                                             ROUND_WAIT_S)))
    trainer = self.trainer
    calls.append(_Call("trainer", trainer, trainer.sync.remote(self._items(), self.rng.randrange(1 << 32),
                                                               ROUND_WAIT_S)))
    return calls

  def _collect(self, calls: list[_Call]) -> tuple[set[str], set[str]]:
    """Adds up the round's results; returns the names of the actors that did not
    answer, and of those with pulls still running."""
    refs = [c.ref for c in calls]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.args.hang_bound + 30)
    wedged, stalled = set(), set()
    for c in calls:
      if c.ref not in done:
        self.counts["hangs"] += 1
        self.errors.append(f"round {self.counts['rounds']}: {c.name} gave no answer")
        wedged.add(c.name)
        continue
      try:
        result = ray.get(c.ref)
      except ray.exceptions.RayActorError as e:
        self._died(c.name, e)
        continue
      except Exception as e:
        self.counts["other_errors"] += 1
        self.errors.append(f"round {self.counts['rounds']}: {c.name}: {type(e).__name__}: {str(e)[:300]}")
        continue
      self._add(c.name, result)
      if result["stalled"]:
        stalled.add(c.name)
    return wedged, stalled

  def _died(self, name: str, e: BaseException) -> None:
    if name in self.killed:
      self.counts["calls_lost_to_kills"] += 1
    else:
      self.counts["other_errors"] += 1
      self.errors.append(f"round {self.counts['rounds']}: {name} died unkilled: {str(e)[:300]}")

  def _published(self, ref: Any) -> None:
    try:
      item = ray.get(ref, timeout=self.args.hang_bound)
    except ray.exceptions.RayActorError as e:
      self._died("trainer", e)
      return
    except ray.exceptions.GetTimeoutError:
      self.counts["hangs"] += 1
      self.errors.append(f"round {self.counts['rounds']}: publish gave no answer")
      return
    self.recent.append(item)
    self.last_version = item[2]
    self.counts["versions"] += 1
    self.counts["versions_pytree"] += item[0].packed is None

  def round(self, event_due: bool) -> None:
    self.counts["rounds"] += 1
    self.killed = set()
    if self.restarting is not None:
      ray.get(self.restarting, timeout=CALL_BOUND_S)
      self.restarting = None
    publish = self.trainer.publish.remote()
    calls = self._calls()
    if event_due:
      time.sleep(self.rng.uniform(0.0, 0.05))  # mid-round
      self._event()
    wedged, stalled = self._collect(calls)
    self._published(publish)
    for name in wedged - self.killed:
      self._replace(name)
    for name in stalled - self.killed:
      self._set_aside(name)
    self._reap(block=False)

  def actors(self) -> list[tuple[str, Any]]:
    return [("trainer", self.trainer), ("spare", self.spare),
            *((f"generator{i}", g) for i, g in enumerate(self.generators))]

  def settle(self) -> list[dict]:
    """Every publisher closed, every subscriber dropped; each actor's counters once at baseline (or given up)."""
    self.recent.clear()
    self._reap(block=True)
    if self.restarting is not None:
      ray.get(self.restarting, timeout=CALL_BOUND_S)
    late = ray.get([a.finish.remote() for _, a in self.actors()], timeout=CALL_BOUND_S)
    self.counts["late_writes"] += sum(r["late_writes"] for r in late)
    # Idle producers are forgotten after RDT_JAX_NIXL_PRODUCER_IDLE_S; a bucket's fetch left running by a
    # pull that was refused meanwhile (its version freed) ends at Ray's fetch timeout at the latest.
    wait_s = max(float(_settings.value("RDT_JAX_NIXL_PRODUCER_IDLE_S")), _ray.state.rdt_fetch_timeout_s())
    settle_until = time.monotonic() + wait_s + 30
    while True:
      counters = ray.get([a.counters.remote() for _, a in self.actors()], timeout=CALL_BOUND_S)
      if not any(c[k] for c in counters for k in _chaos.BASELINE_KEYS) or time.monotonic() > settle_until:
        return [{"actor": name, **c} for (name, _), c in zip(self.actors(), counters)]
      time.sleep(1.0)


def _summary(report: dict) -> list[str]:
  c = report["counts"]
  gib = c.get("bytes", 0) / 2**30
  return [
      f"weight-sync soak: {report['seconds']} s, {c.get('versions', 0)} versions published "
      f"({c.get('versions_pytree', 0)} as pytrees), "
      f"{c.get('pulls', 0)} pulls ({c.get('ok', 0)} ok, {gib:.2f} GiB), events {c.get('events', 0)} "
      f"(generator kills {c.get('event_generator', 0)}, trainer kills {c.get('event_trainer', 0)}, publishers "
      f"closed and recreated {c.get('event_publisher', 0)}, replaced without close {c.get('event_replaced', 0)}); "
      f"wrong versions {c.get('wrong_versions', 0)}, versions backwards "
      f"{c.get('backwards', 0)}, hangs {c.get('hangs', 0)}, other errors {c.get('other_errors', 0)}, late writes "
      f"{c.get('late_writes', 0)}, leaks {report['leaks']}"
      + (f" (hangs in a bucket fetch {c['hangs_in_bucket_fetch']})" if c.get("hangs_in_bucket_fetch") else ""),
      f"expected failures: stale {c.get('stale', 0)}, Ray errors {c.get('ray_errors', 0)}, timeouts "
      f"{c.get('timeouts', 0)}, cancelled {c.get('cancelled', 0)}, round calls lost to kills "
      f"{c.get('calls_lost_to_kills', 0)}; subscribers retired {c.get('retired', 0)}; pulls unanswered after "
      f"{ROUND_WAIT_S:.0f} s {c.get('stalled', 0)} (their actors set aside {c.get('set_aside', 0)}), slowest answer "
      f"{report['slowest_s']} s; pulls awaited "
      f"{c.get('async_pulls', 0)}, with a timeout {c.get('timed_pulls', 0)}; start-up {report['startup_s']} s, "
      f"settling at the end {report['settle_s']} s",
  ]


def run_weight_sync(args: argparse.Namespace) -> int:
  """The weight-sync soak (see the module docstring); exit status 1 on any failure count."""
  rdt_jax.register()
  # A Ray of its own, never a cluster another process started here.
  ray.init(address="local", num_cpus=args.generators + 8, include_dashboard=False, logging_level=logging.ERROR)
  start = time.monotonic()
  soak = _Soak(args)
  started = time.monotonic()  # the first trainer runs: rounds begin
  deadline = time.monotonic() + args.minutes * 60
  next_event = time.monotonic() + soak.rng.uniform(0.5, 1.5) * args.event_every
  last_print = 0.0
  while time.monotonic() < deadline:
    now = time.monotonic()
    due = now >= next_event
    if due:
      next_event = now + soak.rng.uniform(0.5, 1.5) * args.event_every
    soak.round(due)
    if now - last_print > 5:
      last_print = now
      c = soak.counts
      print(f"\r[weight-sync] {now - start:6.0f} s  versions {c['versions']}  pulls {c['pulls']}  ok {c['ok']}  "
            f"events {c['events']}  wrong {c['wrong_versions']}  other {c['other_errors']}",
            end="", file=sys.stderr, flush=True)
  if not soak.counts["events"]:  # a run too short (or rounds too slow) for the drawn schedule: one event
    soak.round(True)
  ended = time.monotonic()
  actors = soak.settle()
  leaks = sum(1 for c in actors for k in _chaos.BASELINE_KEYS if c[k])
  report = {
      "config": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in vars(args).items()},
      "seconds": round(time.monotonic() - start, 1),
      "startup_s": round(started - start, 1),
      "settle_s": round(time.monotonic() - ended, 1),
      "counts": {k: soak.counts.get(k, 0) for k in sorted(set(soak.counts) | set(PULL_KEYS))},
      "leaks": leaks,
      "slowest_s": round(soak.slowest, 2),
      "actors_at_end": actors,
      "first_errors": soak.errors[:20],
      "stalls": soak.stalls[:50],
      "stall_stacks": soak.stall_stacks,
      "events": soak.events,
  }
  ray.shutdown()
  print(file=sys.stderr)
  for line in _summary(report):
    print(line)
  if args.out is not None:
    write_json(args.out, report)
  counts = soak.counts
  bad = sum(counts[k] for k in ("wrong_versions", "backwards", "hangs", "other_errors", "late_writes")) + leaks
  return 1 if bad else 0
