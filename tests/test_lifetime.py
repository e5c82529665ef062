"""The lifetime contract: an RDT object lives in its producer.

Once its producer freed an object or died, every consumer gets the same
error, for every size (4 KiB and 4 MiB here), every backend (jax_nixl,
jax_gloo, jax_transfer) and every path (node-local reads, NIXL READs, in band
where it is turned on), with no race against the producer's process exit:
each test fetches right after `ray.kill` returns, while the killed process
may still be exiting. The jax_gloo cases port Ray's own GLOO tests
(`test_send_fails`, `test_send_actor_dies_before_sending`) to rdt_jax.

Actors that no case kills are shared by the module: one consumer per
environment for the killed producers, and one live pair per environment (a
jax_gloo group between them) for the freed objects, the live deliveries and
the in-place writes. A killed producer, and both actors of a failed jax_gloo
transfer (Ray kills them), are new for each object.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
import ray
from ray.exceptions import ActorDiedError, RayDirectTransportError
from ray.experimental.collective import create_collective_group, destroy_collective_group

import rdt_jax
from _helpers import digest, jax_bytes
from conftest import start_ray, worker_env

rdt_jax.register()  # the transports exist before the actor classes below name them

SIZES = [4 << 10, 4 << 20]
DIED = re.compile(r"The producer of object [0-9a-f]+ \(actor [0-9a-f]+\) has died: the object died with it\.")
IN_BAND = {"RDT_JAX_INLINE_MAX_BYTES": str(64 << 10)}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
  start_ray(num_cpus=8)
  yield
  ray.shutdown()


@ray.remote(enable_tensor_transport=True)
class Side:
  def __init__(self):
    rdt_jax.register()

  @ray.method(tensor_transport="jax_nixl")
  def nixl(self, nbytes: int):
    return {"x": jax_bytes(nbytes, 1)}

  @ray.method(tensor_transport="jax_gloo")
  def gloo(self, nbytes: int):
    return {"x": jax_bytes(nbytes, 1)}

  @ray.method(tensor_transport="jax_transfer")
  def transfer(self, nbytes: int):
    return {"x": jax_bytes(nbytes, 1)}

  def take(self, value) -> str:
    return digest(value["x"])

  def alive(self) -> bool:
    return True

  def lookups_to_get(self, refs: list, batched: bool) -> tuple[int, list[str]]:
    """Gets `refs` in one `ray.get` or one by one: how many times this
    process asked Ray about their producer, and each value's digest."""
    from rdt_jax.transports import _lifetime

    before = _lifetime.lookups()
    values = ray.get(refs) if batched else [ray.get(r) for r in refs]
    return _lifetime.lookups() - before, [digest(v["x"]) for v in values]

  def inline_fetches(self, transport: str) -> int:
    from _helpers import transport_manager

    return transport_manager(transport).receive_stats()["inline"]

  def clear_rdt_store(self) -> None:
    """What Ray's `test_send_fails` does: the producer forgets its objects."""
    store = ray._private.worker.global_worker.rdt_manager.rdt_store
    with store._lock:
      assert store._rdt_store
      store._rdt_store.clear()

  @ray.method(concurrency_group="_ray_system")
  def block_background_thread(self) -> None:
    time.sleep(100)


def _pair(transport: str, env: dict[str, str], cls=Side):
  producer = cls.options(runtime_env=worker_env(**env)).remote()
  consumer = cls.options(runtime_env=worker_env(**env)).remote()
  group = create_collective_group([producer, consumer], backend="torch_gloo") if transport == "jax_gloo" else None
  return producer, consumer, group


ENVS = {"default": {}, "nixl-read": {"RDT_JAX_NIXL_CMA": "0"}, "in-band": IN_BAND}


def _env_name(env: dict[str, str]) -> str:
  return next(name for name, e in ENVS.items() if e == env)


@pytest.fixture(scope="module")
def live():
  """`live(env, cls)`: a pair of `cls` actors in `env` (in the default
  environment with a jax_gloo group between them), shared by the module's
  cases; no case kills them."""
  pairs: dict[tuple[str, type], tuple] = {}

  def get(env: dict[str, str], cls=Side) -> tuple:
    key = (_env_name(env), cls)
    if key not in pairs:  # jax_gloo is only ever used in the default environment
      pairs[key] = _pair("jax_gloo" if not env else "jax_nixl", env, cls)
    return pairs[key][:2]

  yield get
  for producer, consumer, group in pairs.values():
    _close(group, producer, consumer)


def _close(group, *actors) -> None:
  # Actors first: a consumer still blocked in a receive would keep Ray's
  # destroy_collective_group (a task on every member) waiting for ever.
  for a in actors:
    ray.kill(a)
  if group is not None:
    try:
      destroy_collective_group(group)
    except ValueError:
      pass  # Ray destroyed it after the failed transfer


def _produce(producer, transport: str, nbytes: int):
  ref = getattr(producer, transport.removeprefix("jax_")).remote(nbytes)
  ray.wait([ref])  # created: its metadata is at the owner
  return ref


def _failure(fn: Callable[[], object]) -> BaseException:
  with pytest.raises(Exception) as info:
    fn()
  return info.value


def _died(error: BaseException) -> str:
  """The lifetime error's sentence, ids blanked, or "" if `error` is another."""
  if not isinstance(error, RayDirectTransportError):
    return ""
  found = DIED.search(str(error))
  return "" if found is None else re.sub(r"[0-9a-f]{16,}", "<id>", found.group())


Killed = tuple[BaseException, BaseException | None, int]


def _killed(transport: str, nbytes: int, env: dict[str, str], consumer=None, producer=None) -> Killed:
  """Kills the producer of a created object, then fetches it at once from a
  consumer actor and (one-sided backends) from the driver. Also returns how
  many of the consumer's fetches arrived in band meanwhile.

  A one-sided backend's consumer survives the failed fetch: pass a live one,
  and the new producer (in `env`) if it was started already. jax_gloo's pair
  is new (Ray kills both actors of a failed transfer)."""
  shared = consumer is not None
  if shared:
    producer, group = producer or Side.options(runtime_env=worker_env(**env)).remote(), None
  else:
    producer, consumer, group = _pair(transport, env)
  try:
    inline_before = 0 if transport == "jax_gloo" else ray.get(consumer.inline_fetches.remote(transport))
    ref = _produce(producer, transport, nbytes)
    ray.kill(producer)
    in_actor = _failure(lambda: ray.get(consumer.take.remote(ref), timeout=90))
    in_driver = None if transport == "jax_gloo" else _failure(lambda: ray.get(ref, timeout=90))
    inline = 0 if transport == "jax_gloo" else ray.get(consumer.inline_fetches.remote(transport)) - inline_before
    return in_actor, in_driver, inline
  finally:
    _close(group, producer, *([] if shared else [consumer]))


# ---- producer killed: one-sided backends, every path


def _new_producers(env: dict[str, str]) -> list:
  """One new producer per size, all started at once."""
  return [Side.options(runtime_env=worker_env(**env)).remote() for _ in SIZES]


@pytest.mark.parametrize(
    ("transport", "env"),
    [
        ("jax_nixl", {}),  # node-local reads (process_vm_readv) on this host
        ("jax_nixl", {"RDT_JAX_NIXL_CMA": "0"}),  # NIXL READs
        ("jax_transfer", {}),
    ],
    ids=["jax_nixl-node-local", "jax_nixl-nixl-read", "jax_transfer"],
)
def test_killed_producer_one_error_for_every_size(live, transport, env):
  sentences = set()
  consumer = live(env)[1]
  producers = _new_producers(env)
  for nbytes, producer in zip(SIZES, producers):
    in_actor, in_driver, inline = _killed(transport, nbytes, env, consumer, producer)
    assert inline == 0  # out of band: in-band sending is off by default
    for error in (in_actor, in_driver):
      sentence = _died(error)
      assert sentence, f"{nbytes} bytes: {type(error).__name__}: {error}"
      sentences.add(sentence)
  assert len(sentences) == 1, sentences


@pytest.mark.parametrize("transport", ["jax_nixl", "jax_transfer"])
def test_in_band_object_refused_like_the_others_once_its_producer_died(live, transport):
  """With in-band sending turned on, a 4 KiB object travels in band and a
  4 MiB one does not: both are refused with the same error once their
  producer is dead, whatever host the consumer is on (Ray's record of the
  actor decides, not the consumer's view of the producer's process)."""
  sentences = set()
  inlines = []
  consumer = live(IN_BAND)[1]
  producers = _new_producers(IN_BAND)
  for nbytes, producer in zip(SIZES, producers):
    in_actor, in_driver, inline = _killed(transport, nbytes, IN_BAND, consumer, producer)
    inlines.append(inline)
    for error in (in_actor, in_driver):
      sentences.add(_died(error))
  assert inlines == [1, 0]  # the 4 KiB fetch went in band, the 4 MiB one did not
  assert len(sentences) == 1 and "" not in sentences, sentences


# ---- producer killed or freed: jax_gloo, as Ray's GLOO tests

def test_gloo_send_actor_dies_before_sending():
  """Ray's `test_send_actor_dies_before_sending`: the producer's send cannot
  run before the kill; Ray kills both actors of the failed two-sided
  transfer, so the consumer's task ends with `ActorDiedError`, every size."""
  for nbytes in SIZES:
    producer, consumer, group = _pair("jax_gloo", {})
    try:
      ref = _produce(producer, "jax_gloo", nbytes)
      producer.block_background_thread.remote()
      result = consumer.take.remote(ref)
      ray.kill(producer)
      with pytest.raises(ActorDiedError):
        ray.get(result, timeout=90)
    finally:
      _close(group, producer, consumer)


def test_gloo_send_fails_once_the_producer_forgot_the_object():
  """Ray's `test_send_fails`: the producer cleared its RDT store before the
  transfer; no consumer gets a value, every size (the 4 KiB object used to
  arrive in band regardless)."""
  for nbytes in SIZES:
    producer, consumer, group = _pair("jax_gloo", {})
    try:
      ref = _produce(producer, "jax_gloo", nbytes)
      ray.get(producer.clear_rdt_store.remote())
      with pytest.raises(ActorDiedError):
        ray.get(consumer.take.remote(ref), timeout=90)
    finally:
      _close(group, producer, consumer)


def test_gloo_killed_producer_ends_like_rays_gloo():
  """A plain kill (the producer idle, its send free to run, the consumer's
  receive failing as soon as the connection closes): the same
  `ActorDiedError` as above, for every size, not an error that races it."""
  for nbytes in SIZES:
    error = _killed("jax_gloo", nbytes, {})[0]
    assert isinstance(error, ActorDiedError), f"{nbytes} bytes: {type(error).__name__}: {error}"


def test_gloo_send_that_ran_before_the_kill_ends_the_same_way():
  """`ray.kill` is asynchronous: Ray may still hand the dying producer a
  send, which it runs. The consumer's receive then completes and Ray kills
  nobody; the consumer, which asks Ray about the producer once the bytes are
  in place (held there by a fault delay while the test kills the producer),
  raises `ActorDiedError` too, naming the producer, and lives on.

  Should the kill land before the send (a host too loaded to finish the
  receive in the wait below), Ray kills both actors: the same error type, but
  not the case under test, so the case runs again, up to three times."""
  env = {"RDT_JAX_FAULTS": "lifetime.check:delay=8", "RDT_JAX_FAULTS_ENABLE": "1"}
  seen = []
  for _ in range(3):
    producer, consumer, group = _pair("jax_gloo", env)
    try:
      ref = _produce(producer, "jax_gloo", SIZES[0])
      result = consumer.take.remote(ref)
      time.sleep(3)  # the send has run and the receive completed: the consumer waits to check
      ray.kill(producer)
      error = _failure(lambda result=result: ray.get(result, timeout=90))
      assert isinstance(error, ActorDiedError), f"{type(error).__name__}: {error}"
      try:
        alive = ray.get(consumer.alive.remote(), timeout=30)
      except ActorDiedError:
        alive = False  # the kill came first: Ray killed both actors
      seen.append(alive)
      if alive:  # the receive completed before the kill: no kill followed
        assert error.actor_id == producer._actor_id.hex()
        assert DIED.search(str(error)), str(error)
        break
    finally:
      _close(group, producer, consumer)
  assert seen[-1], f"the kill landed before the send in every attempt: {seen}"


# ---- producer freed: Ray frees an object once no reference is left


@pytest.mark.parametrize("transport", ["jax_nixl", "jax_transfer"])
@pytest.mark.parametrize("env", [{}, IN_BAND], ids=["out-of-band", "in-band-on"])
def test_freed_object_is_refused_for_every_size(live, transport, env):
  """Ray's free (what runs when the last reference goes: the owner forgets
  the object, the producer drops it) leaves nothing to fetch, whatever the
  size and path: `ray.get` raises `rdt_jax.UnknownObjectError`."""
  messages = set()
  producer = live(env)[0]
  for nbytes in SIZES:
    ref = _produce(producer, transport, nbytes)
    ray._private.worker.global_worker.rdt_manager.free_object_primary_copy(ref.hex())
    error = _failure(lambda ref=ref: ray.get(ref, timeout=60))
    assert isinstance(error, rdt_jax.UnknownObjectError), f"{nbytes} bytes: {type(error).__name__}: {error}"
    messages.add(str(error).replace(ref.hex(), "<id>"))
  assert len(messages) == 1, messages


def test_live_producer_still_delivers_every_size(live):
  """The check costs a lookup, not a value: with the producer alive every
  size arrives exactly, on every backend."""
  producer, consumer = live({})
  for transport in ("jax_nixl", "jax_gloo", "jax_transfer"):
    for nbytes in SIZES:
      ref = _produce(producer, transport, nbytes)
      assert ray.get(consumer.take.remote(ref), timeout=90) == digest(jax_bytes(nbytes, 1)), (transport, nbytes)


# ---- mutation after return: what a consumer sees, per transport and size


@ray.remote(enable_tensor_transport=True)
class Mutator:
  """Returns a host leaf it keeps, and changes it in place on request."""

  def __init__(self):
    rdt_jax.register()
    self.kept = None

  def _leaf(self, framework: str, nbytes: int):
    import numpy as np

    a = np.zeros(nbytes, np.uint8)
    if framework == "torch":
      import torch

      a = torch.from_numpy(a)
    self.kept = a
    return {"x": a}

  @ray.method(tensor_transport="jax_nixl")
  def nixl(self, framework: str, nbytes: int):
    return self._leaf(framework, nbytes)

  @ray.method(tensor_transport="jax_gloo")
  def gloo(self, framework: str, nbytes: int):
    return self._leaf(framework, nbytes)

  @ray.method(tensor_transport="jax_transfer")
  def transfer(self, framework: str, nbytes: int):
    return self._leaf(framework, nbytes)

  def mutate(self) -> None:
    self.kept[:] = 7  # in place, after the method returned

  def first_byte(self, value) -> int:
    return int(rdt_jax.to_numpy(value["x"])[0])


def _seen(live, transport: str, framework: str, nbytes: int, env: dict[str, str]) -> bool:
  """True if a consumer that reads after the producer's in-place write sees it."""
  producer, consumer = live(env, Mutator)
  ref = getattr(producer, transport.removeprefix("jax_")).remote(framework, nbytes)
  ray.wait([ref])
  ray.get(producer.mutate.remote())
  return ray.get(consumer.first_byte.remote(ref), timeout=90) == 7


#: (transport, in-band on) -> whether a write is seen, for a 4 KiB and a 4 MiB leaf
#: (docs/concepts.md, Mutability, states the same table).
SEEN = {
    ("jax_nixl", False): (False, True),  # small leaves staged at return; large ones read in place
    ("jax_nixl", True): (False, True),  # 4 KiB in band: a copy at return
    ("jax_transfer", False): (False, False),  # copied into jax arrays at return
    ("jax_gloo", False): (True, True),  # read at each send
}


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize(
    ("transport", "in_band"), list(SEEN), ids=[f"{t}-{'in-band' if b else 'default'}" for t, b in SEEN]
)
def test_in_place_write_after_return(live, transport, in_band, framework):
  got = tuple(_seen(live, transport, framework, n, IN_BAND if in_band else {}) for n in SIZES)
  assert got == SEEN[(transport, in_band)], got


def test_dead_producers_remembered_are_bounded(monkeypatch):
  """The consumer remembers dead producers (one lookup each), at most
  `MAX_DEAD_REMEMBERED`: one that was forgotten is asked about again."""
  from rdt_jax import _limits, _ray
  from rdt_jax.transports import _lifetime

  asked = []
  monkeypatch.setattr(_limits, "MAX_DEAD_REMEMBERED", 3)
  monkeypatch.setattr(_lifetime, "_dead", {})
  monkeypatch.setattr(_ray.state, "actor_dead", lambda actor: asked.append(actor) or True)
  for i in range(5):
    with pytest.raises(_lifetime.ProducerDiedError, match=f"actor a{i}"):
      _lifetime.check_producer("obj", f"a{i}")
  assert _lifetime.dead_remembered() == ("a2", "a3", "a4")
  with pytest.raises(_lifetime.ProducerDiedError):
    _lifetime.check_producer("obj", "a4")  # remembered: no lookup
  assert asked == ["a0", "a1", "a2", "a3", "a4"]


def test_one_lookup_serves_a_batched_get(live):
  """Ray reads every ref of one `ray.get` before it waits for any (node-local
  reads end inside the trigger), so one lookup after the reads answers for
  all of them; one by one, each get reads after the last lookup and asks
  again. Every value arrives either way."""
  producer, consumer = live({})
  refs = [_produce(producer, "jax_nixl", 1 << 20) for _ in range(8)]
  want = [digest(jax_bytes(1 << 20, 1))] * 8
  batched, got = ray.get(consumer.lookups_to_get.remote(refs, True), timeout=120)
  assert got == want and batched == 1
  one_by_one, got = ray.get(consumer.lookups_to_get.remote(refs, False), timeout=120)
  assert got == want and one_by_one == 8


def test_a_lookup_answers_only_for_bytes_in_place_before_it_started(monkeypatch):
  """`died(..., in_place_at)`: a lookup that found the producer alive serves
  fetches whose bytes were in place when it started, never later ones; a
  death, once seen, refuses every fetch."""
  from rdt_jax import _limits, _ray
  from rdt_jax.transports import _lifetime

  answers = {"a": False}
  asked = []
  monkeypatch.setattr(_limits, "MAX_ALIVE_REMEMBERED", 2)
  monkeypatch.setattr(_lifetime, "_dead", {})
  monkeypatch.setattr(_lifetime, "_alive_at", {})
  monkeypatch.setattr(_ray.state, "actor_dead", lambda actor: asked.append(actor) or answers.get(actor, False))
  read = time.monotonic()
  assert _lifetime.died("o1", "a", read) is None and asked == ["a"]
  assert _lifetime.died("o2", "a", read) is None and asked == ["a"]  # served by the lookup after it
  later = time.monotonic()
  assert _lifetime.died("o3", "a", later) is None and asked == ["a", "a"]  # in place after: asks
  assert _lifetime.died("o4", "a") is None and asked == ["a", "a", "a"]  # no time known: asks
  for actor in ("b", "c"):  # the oldest alive answer is forgotten past the bound
    _lifetime.died("o", actor, time.monotonic())
  assert set(_lifetime._alive_at) == {"b", "c"}
  answers["b"] = True
  b_read = time.monotonic()
  assert "has died" in _lifetime.died("o5", "b", b_read)  # in place after b's last lookup: asks, dead
  assert "has died" in _lifetime.died("o6", "b", read)  # dead is remembered over any earlier lookup
