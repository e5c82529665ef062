"""Weight sync in the set-ups real RL stacks use: `sub.version` never names
bytes the template does not hold.

* a publisher and a subscriber in one process (a colocated trainer and
  generator), for versions sent as pytrees, which Ray never hands to a
  transport there;
* a non-array leaf that appears between versions;
* pulls from several threads and from `pull_async` at once, and a cancelled
  `pull_async`;
* a publisher closed, or created again in the same process, republishing
  the same version numbers;
* a version larger than the host pool keeps, freed while a subscriber on its
  host reads it;
* a publisher's answers and a handle's packed layout: bounded and checked
  before anything is read or allocated (`check_source`, `check_layout`);
* the threads of a parallel node-local read, waited for even when the wait
  is interrupted; the NIXL progress thread's cleanup, run even when polls fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time

import numpy as np
import pytest
import ray

import rdt_jax
from _helpers import wait_for
from conftest import worker_env
from rdt_jax._metadata import MetadataError
from rdt_jax.weights import _packed as packed
from rdt_jax.weights import _packed_checks as checks
from rdt_jax.weights import _protocol

rdt_jax.register()

pytestmark = pytest.mark.usefixtures("ray_session")
N = 4096


def values(version: int, n: int = N) -> np.ndarray:
  return (np.arange(n, dtype=np.float32) % 97) + version


def params(version: int, extra: bool = False, n: int = N) -> dict:
  import jax.numpy as jnp

  tree = {"w": jnp.asarray(values(version, n)), "b": jnp.full((8,), version, jnp.float32), "step": version}
  if extra:
    tree["lr"] = 0.5
  return tree


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self, keep: int = 2, pack: bool = True, n: int = N):
    self.keep, self.pack, self.n = keep, pack, n
    self.pub = rdt_jax.WeightPublisher(keep=keep, pack=pack)

  def publish(self, version: int, extra: bool = False):
    return self.pub.publish(params(version, extra, self.n), version=version)

  def close(self) -> None:
    self.pub.close()

  def recreate(self, cycle: bool = False) -> None:
    """A trainer that rolls back: a new publisher replaces the old one, with
    no `close()`. `cycle`: the old one sits in a reference cycle, so only
    the cyclic garbage collector ends it (collected here, before the new
    publisher's first version)."""
    import gc

    if cycle:
      self.pub._self = self.pub
    self.pub = rdt_jax.WeightPublisher(keep=self.keep, pack=self.pack)
    gc.collect()


@ray.remote(enable_tensor_transport=True, concurrency_groups={"probe": 1})
class Generator:
  def __init__(self, atomic: bool = False, n: int = N):
    import torch

    self.sub = rdt_jax.WeightSubscriber({"w": torch.zeros(n), "b": torch.zeros(8)}, atomic=atomic)

  def pull(self, handle) -> dict:
    out = self.sub.pull(handle)
    return {"version": self.sub.version, "w": float(self.sub.template["w"][1]), "lr": out.get("lr"),
            "in_place": out["w"] is self.sub.template["w"]}

  def try_pull(self, handle) -> dict:
    try:
      return self.pull(handle)
    except Exception as e:
      return {"error": f"{type(e).__name__}: {e}", "stale": isinstance(e, rdt_jax.StaleWeightsError),
              "version": self.sub.version}

  def faults(self, spec: str | None) -> None:
    """Replaces this process's fault rules (`RDT_JAX_FAULTS`'s syntax)."""
    from rdt_jax import _faults

    _faults.configure(spec)

  @ray.method(concurrency_group="probe")
  def injected(self) -> dict:
    """How often each fault point acted (answered while a pull runs)."""
    from rdt_jax import _faults

    return _faults.injected()

  def template_holds(self) -> int | None:
    """The version whose bytes the template holds (None: none of them)."""
    w = self.sub.template["w"].numpy()
    version = round(float(w[0]))
    return version if np.array_equal(w, values(version, w.size)) else None

  def threads(self, handles: list) -> dict:
    """Pulls every handle at once, one thread each."""
    results: list = [None] * len(handles)

    def pull(i: int) -> None:
      try:
        self.sub.pull(handles[i])
        results[i] = "ok"
      except rdt_jax.StaleWeightsError:
        results[i] = "stale"
      except Exception as e:
        results[i] = f"{type(e).__name__}: {e}"

    workers = [threading.Thread(target=pull, args=(i,)) for i in range(len(handles))]
    for w in workers:
      w.start()
    for w in workers:
      w.join()
    return {"results": results, "version": self.sub.version, "holds": self.template_holds()}


@ray.remote(enable_tensor_transport=True)
class AsyncGenerator:
  def __init__(self, atomic: bool = False):
    import torch

    self.sub = rdt_jax.WeightSubscriber({"w": torch.zeros(N), "b": torch.zeros(8)}, atomic=atomic)

  async def pull(self, handle) -> int | None:
    await self.sub.pull_async(handle)
    return self.sub.version

  async def many(self, handles: list) -> dict:
    """`pull_async` of every handle at once, and `pull` in threads beside them."""
    loop = asyncio.get_running_loop()
    half = len(handles) // 2
    tasks = [self.sub.pull_async(h) for h in handles[:half]]
    tasks += [loop.run_in_executor(None, self.sub.pull, h) for h in handles[half:]]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "results": ["ok" if not isinstance(r, BaseException) else
                    "stale" if isinstance(r, rdt_jax.StaleWeightsError) else repr(r) for r in results],
        "version": self.sub.version, "holds": self.holds(),
    }

  def holds(self) -> int | None:
    w = self.sub.template["w"].numpy()
    version = round(float(w[0]))
    return version if np.array_equal(w, values(version)) else None

  async def cancelled(self, handle, after: float) -> dict:
    """Cancels a `pull_async` after `after` s; the state once the
    cancellation returned, and again 1.5 s later."""
    task = asyncio.ensure_future(self.sub.pull_async(handle))
    await asyncio.sleep(after)
    task.cancel()
    try:
      await task
      outcome = "finished"
    except asyncio.CancelledError:
      outcome = "cancelled"
    w = self.sub.template["w"].numpy().copy()
    state = {"outcome": outcome, "version": self.sub.version, "holds": self.holds()}
    await asyncio.sleep(1.5)
    state["unchanged_after"] = bool(np.array_equal(w, self.sub.template["w"].numpy()))
    return state


  async def cancel_waiting(self, running: object, waiting: object, after: float) -> dict:
    """Starts a pull of `running` (a long one), then one of `waiting`, which
    waits for the subscriber's lock; cancels the waiting one after `after`
    s. How long the cancellation took, and what the running pull did."""
    first = asyncio.ensure_future(self.sub.pull_async(running))
    await asyncio.sleep(0.3)
    second = asyncio.ensure_future(self.sub.pull_async(waiting))
    await asyncio.sleep(after)
    start = time.monotonic()
    second.cancel()
    try:
      await second
      outcome = "finished"
    except asyncio.CancelledError:
      outcome = "cancelled"
    took = time.monotonic() - start
    await first
    return {"outcome": outcome, "took": took, "version": self.sub.version,
            "holds": self.holds()}


@ray.remote(enable_tensor_transport=True)
class Colocated:
  """A trainer and a generator in one actor (verl's and slime's hybrid engine)."""

  def __init__(self, pack: bool):
    import jax
    import torch

    self.pub = rdt_jax.WeightPublisher(keep=2, pack=pack)
    self.subs = {
        atomic: rdt_jax.WeightSubscriber({"w": torch.zeros(N), "b": jax.numpy.zeros((8,), jax.numpy.float32)},
                                         atomic=atomic)
        for atomic in (False, True)
    }

  def step(self, version: int) -> dict:
    """Publishes `version` and pulls it into both subscribers (in place, atomic)."""
    handle = self.pub.publish(params(version), version=version)
    return {atomic: self._pull(sub, handle, version) for atomic, sub in self.subs.items()}

  def _pull(self, sub, handle, version: int) -> dict:
    out = sub.pull(handle)
    kept = self.pub._local_value(version) if handle.packed is None else None
    out["w"].add_(1000.0)  # the generator writes into its own parameters
    w = sub.template["w"].numpy()
    return {
        "version": sub.version,
        "template_held_version": bool(np.array_equal(w - 1000.0, values(version))),
        "w_is_template": out["w"] is sub.template["w"],
        "b_own_buffer": kept is None or out["b"].unsafe_buffer_pointer() != kept["b"].unsafe_buffer_pointer(),
        "b_right": bool(np.array_equal(np.asarray(out["b"]), np.full((8,), version, np.float32))),
        "kept_unchanged": kept is None or bool(np.array_equal(np.asarray(kept["w"]), values(version))),
        "step": out["step"],
    }


@ray.remote(enable_tensor_transport=True)
class ColocatedNamed:
  """A trainer and an engine that loads weights by name, in one actor."""

  def __init__(self, pack: bool):
    self.pub = rdt_jax.WeightPublisher(keep=2, pack=pack)
    self.sub = rdt_jax.WeightSubscriber(None)

  def step(self, version: int, framework: str) -> dict:
    """Publishes `version` (jax and numpy leaves), takes its pairs and
    scales each in place, as an engine quantizing what it loads may; then
    whether the kept version still holds its bytes."""
    tree = {**params(version), "n": values(version, 64)}
    handle = self.pub.publish(tree, version=version)
    names = []
    for name, x in self.sub.pull_named(handle, framework=framework):
      names.append(name)
      x *= 0
    kept = self.pub._local_value(version)
    if kept is None:  # packed: read the kept version back through a subscriber of its own
      import torch

      kept = rdt_jax.WeightSubscriber({"w": torch.zeros(N), "b": torch.zeros(8), "n": np.zeros(64, np.float32)})
      kept = kept.pull(handle)
    return {"names": sorted(names), "version": self.sub.version,
            "w": bool(np.array_equal(np.asarray(kept["w"]), values(version))),
            "n": bool(np.array_equal(np.asarray(kept["n"]), values(version, 64)))}


def generator(atomic: bool = False, **env: str):
  return Generator.options(runtime_env=worker_env(**env)).remote(atomic)


def kill(*actors) -> None:
  for a in actors:
    ray.kill(a)


# --------------------------------------------------------------------------
# Colocated


@pytest.mark.parametrize("pack", [False, True], ids=["pytree", "packed"])
def test_a_colocated_publisher_and_subscriber_move_the_bytes(pack):
  """In place and atomic: the template holds the version, the pulled tree
  holds no kept array, and writing into it leaves the kept version as it was."""
  actor = Colocated.remote(pack)
  try:
    for version in (1, 2, 3):
      r = ray.get(actor.step.remote(version), timeout=60)
      want = {"version": version, "template_held_version": True, "w_is_template": True, "b_own_buffer": True,
              "b_right": True, "kept_unchanged": True, "step": version}
      assert r == {False: want, True: want}, r
  finally:
    kill(actor)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("pack", [False, True], ids=["pytree", "packed"])
def test_a_colocated_pull_named_never_yields_the_kept_arrays(pack, framework):
  """An engine that scales the yielded tensors in place leaves the kept
  version as it was, as `pull` does."""
  actor = ColocatedNamed.remote(pack)
  try:
    for version in (1, 2):
      r = ray.get(actor.step.remote(version, framework), timeout=60)
      assert r == {"names": ["['b']", "['n']", "['w']"], "version": version, "w": True, "n": True}, r
  finally:
    kill(actor)


# --------------------------------------------------------------------------
# Changing structure


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "pytree"])
def test_a_non_array_leaf_added_between_versions_is_a_new_structure(pack):
  """Into an atomic and an in-place subscriber."""
  t, gens = Trainer.remote(pack=pack), [generator(atomic) for atomic in (True, False)]
  try:
    handle = ray.get(t.publish.remote(1))
    assert [r["version"] for r in ray.get([g.pull.remote(handle) for g in gens])] == [1, 1]
    handle = ray.get(t.publish.remote(2, True))
    for r in ray.get([g.try_pull.remote(handle) for g in gens]):
      assert r.get("error") is None, r
      assert r["version"] == 2 and r["lr"] == 0.5 and r["w"] == float(values(2)[1])
    assert ray.get([g.template_holds.remote() for g in gens]) == [2, 2]
    handle = ray.get(t.publish.remote(3))  # and back
    assert [(r["version"], r["lr"]) for r in ray.get([g.pull.remote(handle) for g in gens])] == [(3, None)] * 2
  finally:
    kill(t, *gens)


# --------------------------------------------------------------------------
# Concurrent pulls


def test_pulls_from_many_threads_are_serialized_and_never_go_back():
  t, g = Trainer.remote(keep=8), generator(atomic=True)
  try:
    for round_ in range(3):
      base = 8 * round_
      handles = ray.get([t.publish.remote(base + v) for v in range(1, 9)])
      r = ray.get(g.threads.remote(handles[::-1]), timeout=120)
      assert set(r["results"]) <= {"ok", "stale"}, r
      assert r["results"][0] == "ok"  # the newest is never stale
      assert r["version"] == base + 8 and r["holds"] == base + 8, r
  finally:
    kill(t, g)


def test_pull_async_and_threads_together():
  t = Trainer.remote(keep=8)
  g = AsyncGenerator.options(runtime_env=worker_env()).remote(atomic=False)
  try:
    handles = ray.get([t.publish.remote(v) for v in range(1, 9)])
    r = ray.get(g.many.remote(handles[::-1]), timeout=120)
    assert set(r["results"]) <= {"ok", "stale"}, r
    assert r["version"] == 8 and r["holds"] == 8, r
    assert ray.get(g.pull.remote(ray.get(t.publish.remote(9)))) == 9
  finally:
    kill(t, g)


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_a_cancelled_pull_async_ends_like_a_failed_pull_and_writes_nothing_after(atomic):
  """The pull copies the version, then waits 1.2 s (an injected delay) before
  its last check; the task is cancelled during the wait."""
  t = Trainer.remote()
  g = AsyncGenerator.options(runtime_env=worker_env(RDT_JAX_FAULTS="weights.copied:delay=1.2@2")).remote(atomic)
  try:
    assert ray.get(g.pull.remote(ray.get(t.publish.remote(1)))) == 1
    r = ray.get(g.cancelled.remote(ray.get(t.publish.remote(2)), 0.4), timeout=60)
    assert r["outcome"] == "cancelled" and r["unchanged_after"], r
    if atomic:
      assert r["version"] == 1 and r["holds"] == 1, r
    else:
      assert r["version"] is None, r  # bytes reached the template
    assert ray.get(g.pull.remote(ray.get(t.publish.remote(3)))) == 3
  finally:
    kill(t, g)


def test_cancelling_a_pull_async_that_waits_for_the_lock_returns_at_once():
  """A pull runs for 6 s (an injected delay once its bytes are copied); a
  second `pull_async` waits for the subscriber's lock and is cancelled 0.5 s
  in: the cancellation returns within 2 s, not when the first pull
  ends, and the first pull still lands."""
  t = Trainer.remote(keep=4)
  g = AsyncGenerator.options(runtime_env=worker_env(RDT_JAX_FAULTS="weights.copied:delay=6*1")).remote(False)
  try:
    running, waiting = ray.get([t.publish.remote(1), t.publish.remote(2)])
    r = ray.get(g.cancel_waiting.remote(running, waiting, 0.5), timeout=60)
    assert r["outcome"] == "cancelled" and r["took"] < 2.0, r
    assert r["version"] == 1 and r["holds"] == 1, r
  finally:
    kill(t, g)


# --------------------------------------------------------------------------
# Publishers closed or created again


def test_a_handle_of_a_closed_or_replaced_publisher_is_stale():
  t, g = Trainer.remote(), generator()
  try:
    old = ray.get(t.publish.remote(3))
    ray.get(t.recreate.remote())  # the old publisher is gone; a new one republishes version 3
    ray.get([t.publish.remote(1), t.publish.remote(2), t.publish.remote(3)])
    r = ray.get(g.try_pull.remote(old))
    assert r["stale"] and r["version"] is None, r
    assert ray.get(g.template_holds.remote()) is None  # nothing of the new publisher's version 3 arrived
    fresh = ray.get(t.publish.remote(4))
    assert ray.get(g.pull.remote(fresh))["version"] == 4
    ray.get(t.close.remote())
    r = ray.get(g.try_pull.remote(fresh))
    assert r["stale"] and r["version"] == 4, r
  finally:
    kill(t, g)


@pytest.mark.parametrize("cycle", [False, True], ids=["replaced", "collected"])
def test_a_replaced_publisher_s_handle_is_stale_for_a_generator_that_planned_its_structure(cycle):
  """A trainer rolls back without `close()`: the old publisher ends when it
  is replaced (or when the garbage collector finds it), its buffers go back
  to the pool and the new publisher packs its versions into them. A
  generator that already planned the structure pulls an old handle: stale,
  never the new publisher's bytes under the old version."""
  t, g = Trainer.remote(keep=3), generator()
  try:
    assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1  # the plan exists
    old = ray.get([t.publish.remote(2), t.publish.remote(3)])[1]
    ray.get(t.recreate.remote(cycle))
    ray.get([t.publish.remote(v) for v in (4, 5, 6)])  # into the old publisher's buffers
    r = ray.get(g.try_pull.remote(old))
    assert r["stale"] and "closed or replaced" in r["error"] and r["version"] == 1, r
    assert ray.get(g.template_holds.remote()) == 1
  finally:
    kill(t, g)


def test_a_version_larger_than_the_host_pool_freed_during_a_read_is_stale():
  """keep=1 and a host pool smaller than one version: the version's buffer
  is unmapped when the next one is published, here while the generator's
  read of it waits in an injected delay."""
  n = 1 << 24  # 64 MiB of float32: above glibc's largest mmap threshold, so freeing it unmaps it
  t = Trainer.options(runtime_env=worker_env(RDT_JAX_HOST_POOL_BYTES="65536")).remote(keep=1, n=n)
  g = Generator.options(runtime_env=worker_env(RDT_JAX_FAULTS_ENABLE="1")).remote(False, n)
  try:
    assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
    handle = ray.get(t.publish.remote(2))
    ray.get(g.faults.remote("cma.read:delay=6@2*1"))  # the pull's second read: the version's bytes
    pending = g.try_pull.remote(handle)
    # The table read is done once the version's read waits in the delay.
    assert wait_for(lambda: ray.get(g.injected.remote()).get("cma.read", 0) >= 1, 60)
    ray.get(t.publish.remote(3))  # well within the delay, even on a loaded host
    r = ray.get(pending, timeout=60)
    assert r.get("stale"), r
    assert "was freed while it was being read" in r["error"], r
  finally:
    kill(t, g)


def test_a_version_freed_while_its_buckets_are_fetched_is_stale_within_seconds():
  """Through Ray (node-local reads refused), keep=1, 1 MiB buckets: the
  trainer publishes the next version while the pull waits between buckets.
  The freed buckets' memory is deregistered, and a fetch of them would end
  only at Ray's 60 s fetch timeout; the pull asks the publisher while it
  waits and fails stale within seconds."""
  n = 3 << 18  # 3 MiB of float32: three buckets
  t = Trainer.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(1 << 20))).remote(keep=1, n=n)
  g = Generator.options(runtime_env=worker_env(RDT_JAX_NIXL_CMA="0", RDT_JAX_FAULTS_ENABLE="1")).remote(False, n)
  try:
    assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
    handle = ray.get(t.publish.remote(2))
    ray.get(g.faults.remote("weights.bucket:delay=3*1"))  # once the first bucket is copied
    start = time.monotonic()
    pending = g.try_pull.remote(handle)
    assert wait_for(lambda: ray.get(g.injected.remote()).get("weights.bucket", 0) >= 1, 60)
    ray.get(t.publish.remote(3))  # frees version 2 and its buckets during the delay
    r = ray.get(pending, timeout=120)
    assert r.get("stale") and "was freed while it was being read" in r["error"], r
    assert time.monotonic() - start < 30, r
    assert r["version"] is None  # in place: a bucket had reached the template
  finally:
    kill(t, g)


# --------------------------------------------------------------------------
# Nothing from the publisher is trusted (no actors)


def _source(**changes) -> packed.PackedSource:
  src = packed.PackedSource(None, 4096, 1024, 8192, 2, ())
  return dataclasses.replace(src, **changes)


@pytest.mark.parametrize(("field", "value"), [
    ("slots", 10**12), ("slots", 0), ("nbytes", -1), ("nbytes", 1 << 60), ("buffer", 0), ("table", -5),
    ("slots", 2.5), ("rest", [1]), ("device", -2), ("device", 1 << 20), ("device", 0.0), ("ipc", b"\x00" * 64),
    ("ipc", "x" * 64), ("ipc_offset", 64), ("ipc_offset", -1),
])
def test_a_handle_s_packed_source_is_bounded_before_any_read(field, value):
  with pytest.raises(MetadataError, match=f"packed.{field}"):
    checks.check_source(_source(**{field: value}), "v1 of publisher p")


def test_a_device_source_carries_one_ipc_handle():
  checks.check_source(_source(device=0, ipc=b"\x07" * 64, ipc_offset=512), "v1 of publisher p")
  with pytest.raises(MetadataError, match=r"packed\.ipc"):
    checks.check_source(_source(device=0, ipc=b"\x07" * 63), "v1 of publisher p")
  with pytest.raises(MetadataError, match=r"packed\.ipc"):
    checks.check_source(_source(device=0), "v1 of publisher p")


def _info(offsets=(0, 64), sizes=(16, 32), total=128, shapes=((4,), (8,)), positions=(0, 1), leaves=3):
  import jax

  treedef = jax.tree_util.tree_structure(list(range(leaves)))
  layout = rdt_jax._layout.PackedLayout(tuple(offsets), tuple(sizes), total)
  return packed.PackedLayoutInfo(layout, treedef, tuple(positions), tuple(shapes))


ENTRIES = (("['a']", "array", (4,), "float32"), ("['b']", "array", (8,), "float32"))


def test_a_sound_layout_passes():
  checks.check_layout(_info(), ENTRIES, "x")


@pytest.mark.parametrize(("info", "field"), [
    (dict(offsets=(0,)), "offsets"),
    (dict(offsets=(0, 8)), "leaf ['b']"),  # overlaps the first leaf
    (dict(offsets=(0, 120)), "leaf ['b']"),  # past the buffer
    (dict(sizes=(16, 64)), "leaf ['b']"),  # not what the shape takes
    (dict(shapes=((4,), (9,))), "leaf ['b']"),
    (dict(total=-1), "total"),
    (dict(positions=(1, 0)), "array_positions"),
    (dict(positions=(0, 5)), "array_positions"),
])
def test_a_layout_that_does_not_hold_together_is_refused_by_field(info, field):
  with pytest.raises(MetadataError, match=field.replace("[", r"\[").replace("]", r"\]")):
    checks.check_layout(_info(**info), ENTRIES, "v1 of publisher p")


def test_an_unknown_dtype_in_a_layout_is_refused():
  with pytest.raises(MetadataError, match="dtype 'float99'"):
    checks.check_layout(_info(), (ENTRIES[0], ("['b']", "array", (8,), "float99")), "x")


@pytest.mark.parametrize("answer", [(None, None), ((1, 2), None), _protocol.Answer(("1",)),
                                    _protocol.Answer((1,), structure=("entries", None))])
def test_a_publisher_answer_of_the_wrong_form_is_refused(answer):
  with pytest.raises(MetadataError):
    _protocol.check_answer(answer, "x")


def test_the_table_names_its_publisher():
  import uuid

  a, b = uuid.uuid4().hex, uuid.uuid4().hex
  assert packed.table_token(a) != packed.table_token(b)
  table = packed.KeptTable(2, a)
  header = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * 2).from_address(table.address))
  assert tuple(int(w) for w in header) == packed.table_token(a)
  table.retire()
  assert tuple(int(w) for w in header) == (0, 0)


# --------------------------------------------------------------------------
# Threads and cleanup


def test_an_interrupted_wait_still_waits_for_every_reading_thread():
  """The calling thread's share of a parallel node-local read is done and it
  waits for the others; an interrupt there must not return while they
  still write."""
  from concurrent.futures import ThreadPoolExecutor

  from rdt_jax import _node_local as node_local

  done = [False] * 3

  def slow(i: int) -> None:
    time.sleep(0.6)
    done[i] = True

  def interrupt(_signum, _frame):
    raise KeyboardInterrupt

  old = signal.signal(signal.SIGALRM, interrupt)
  pool = ThreadPoolExecutor(3)
  try:
    futures = [pool.submit(slow, i) for i in range(3)]
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    try:
      with pytest.raises(KeyboardInterrupt):
        node_local.wait_all(futures)
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
    assert all(done), done
  finally:
    pool.shutdown(wait=True)
    signal.signal(signal.SIGALRM, old)


def test_cleanup_runs_when_every_poll_fails():
  from rdt_jax.transports.nixl import agent as agent_module

  class BrokenPeer:
    """An agent whose polls raise, as NIXL's do for a broken peer."""

    def get_new_notifs(self):
      raise RuntimeError("a broken peer")

  ticks = []
  poller = agent_module.Poller(BrokenPeer(), lambda: ticks.append(1))
  try:
    poller.set_active(True)
    deadline = time.monotonic() + 5
    while len(ticks) < 3 and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    poller.stop()
  assert len(ticks) >= 3
