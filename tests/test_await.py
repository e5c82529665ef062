"""asyncio and rdt_jax refs: `await ref` of an rdt_jax ref fails at once with
`AwaitNotSupportedError` (driver and async actors), `rdt_jax.get_async` works
in both places with `ray.get`'s values, targets and errors, ordinary refs stay
awaitable, and an rdt_jax ref nested in an argument either arrives fetchable
(its object ready) or is refused at once (`RefNotReadyError`).

Every await is bounded (`asyncio.wait_for`), so a regression to Ray's silent
wait fails a test instead of hanging it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray
from ray.exceptions import GetTimeoutError, RayError

import conftest
import rdt_jax

rdt_jax.register()

pytestmark = pytest.mark.usefixtures("ray_session")

#: Bound on every await here: far above what any of them should take.
BOUND_S = 20.0
#: "At once": an await that fails must fail this quickly after its object is
#: ready. The failure it rules out is a wait: an await that blocks until
#: BOUND_S (the `asyncio.wait_for` around it) or Ray's 60 s fetch timeout. The
#: call itself takes milliseconds; the bound is half the shortest of those
#: waits, so it tells them apart however loaded the machine (a bound of a few
#: seconds measured the machine instead).
AT_ONCE_S = BOUND_S / 2
BIG = 1 << 20  # float32 elements: 4 MiB, sent out of band
SMALL = 16  # 64 bytes, sent in band


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, n: int, seed: int = 1, delay: float = 0.0):
    time.sleep(delay)
    return {"x": np.full(n, seed, np.float32), "step": seed}

  @ray.method(tensor_transport="jax_nixl")
  def fail(self):
    raise ValueError("no weights today")

  def plain(self, seed: int):
    return np.full(4, seed, np.float32)


@ray.remote(enable_tensor_transport=True)
class AsyncConsumer:
  async def await_first(self, refs):
    """Awaits `refs[0]` as Ray users write it: (error type name or "ok", seconds, message)."""
    return await _outcome(refs[0])

  async def get_async_first(self, refs, timeout=None):
    value = await rdt_jax.get_async(refs[0], timeout=timeout)
    return float(value["x"].sum()), value["step"]

  async def get_async_all(self, refs):
    return [float(v["x"].sum()) for v in await rdt_jax.get_async(refs)]

  async def get_async_into(self, refs, n: int):
    """Fetches `refs[0]` into a target array made here: (received into it, its sum)."""
    target = np.zeros(n, np.float32)
    rdt_jax.set_target_for_ref(refs[0], {"x": target})
    value = await rdt_jax.get_async(refs[0])
    return value["x"] is target, float(target.sum())

  async def get_async_made_by(self, producer, delay: float, timeout: float):
    """Calls `producer` from here and fetches the result with `timeout`."""
    value = await rdt_jax.get_async(producer.make.remote(SMALL, delay=delay), timeout=timeout)
    return float(value["x"].sum())

  async def await_plain(self, refs):
    return (await asyncio.wait_for(refs[0], BOUND_S)).tolist()

  async def ray_warned_of_blocking_get(self):
    return bool(ray._private.worker.blocking_get_inside_async_warned)


@ray.remote(enable_tensor_transport=True)
class SyncConsumer:
  def get_first(self, refs):
    return float(ray.get(refs[0])["x"].sum())


async def _outcome(awaitable) -> tuple[str, float, str]:
  start = time.monotonic()
  try:
    await asyncio.wait_for(awaitable, BOUND_S)
    return "ok", time.monotonic() - start, ""
  except Exception as e:
    return type(e).__name__, time.monotonic() - start, str(e)


def run(coro):
  return asyncio.run(coro)


@pytest.fixture(scope="module")
def producer():
  p = Producer.remote()
  ray.get(p.__ray_ready__.remote())
  yield p
  ray.kill(p)


@pytest.fixture(scope="module")
def consumer():
  c = AsyncConsumer.remote()
  ray.get(c.__ray_ready__.remote())
  yield c
  ray.kill(c)


@pytest.fixture(scope="module")
def sync_consumer():
  c = SyncConsumer.remote()
  ray.get(c.__ray_ready__.remote())
  yield c
  ray.kill(c)


# --------------------------------------------------------------------------
# `await ref` of an rdt_jax ref: at once, with the fix.


@pytest.mark.parametrize("n", [SMALL, BIG], ids=["in-band", "out-of-band"])
def test_driver_await_of_a_ready_ref_fails_at_once(producer, n):
  ref = producer.make.remote(n)
  ray.wait([ref])
  with pytest.raises(rdt_jax.AwaitNotSupportedError) as info:
    start = time.monotonic()
    run(asyncio.wait_for(_as_coroutine(ref), BOUND_S))
  assert time.monotonic() - start < AT_ONCE_S
  error = info.value
  assert isinstance(error, RayError)
  assert error.object_id == ref.hex() and error.transport == "jax_nixl"
  assert "rdt_jax.get_async(ref)" in str(error) and ref.hex() in str(error)


def test_driver_await_of_a_ref_not_ready_fails_once_the_object_is_ready(producer):
  ref = producer.make.remote(BIG, delay=1.0)
  kind, seconds, _ = run(_outcome(ref))
  assert kind == "AwaitNotSupportedError"
  assert seconds < 1.0 + AT_ONCE_S  # the method's second, then at once


def test_driver_await_of_its_own_put_fails_at_once():
  ref = ray.put({"x": np.ones(BIG, np.float32)}, _tensor_transport="jax_nixl")
  kind, seconds, _ = run(_outcome(ref))
  assert (kind, seconds < AT_ONCE_S) == ("AwaitNotSupportedError", True)


def test_driver_future_of_a_ref_fails_the_same_way(producer):
  ref = producer.make.remote(BIG)
  ray.wait([ref])
  kind, _, _ = run(_outcome(_wrapped(ref)))
  assert kind == "AwaitNotSupportedError"


def test_async_actor_await_of_a_ref_fails_at_once(producer, consumer):
  ref = producer.make.remote(BIG)
  ray.wait([ref])
  kind, seconds, message = ray.get(consumer.await_first.remote([ref]), timeout=2 * BOUND_S)
  assert kind == "AwaitNotSupportedError", message
  assert seconds < AT_ONCE_S
  assert "rdt_jax.get_async(ref)" in message


def test_ordinary_refs_stay_awaitable(producer, consumer):
  put = ray.put(np.arange(3))
  returned = producer.plain.remote(7)
  assert run(asyncio.wait_for(_as_coroutine(put), BOUND_S)).tolist() == [0, 1, 2]
  assert run(asyncio.wait_for(_as_coroutine(returned), BOUND_S)).tolist() == [7.0] * 4
  assert ray.get(consumer.await_plain.remote([producer.plain.remote(2)])) == [2.0] * 4


async def _as_coroutine(ref):
  return await ref


async def _wrapped(ref):
  return await asyncio.wrap_future(ref.future())


# --------------------------------------------------------------------------
# `rdt_jax.get_async`: `ray.get`, awaitable.


@pytest.mark.parametrize("n", [SMALL, BIG], ids=["in-band", "out-of-band"])
def test_get_async_in_the_driver(producer, n):
  refs = [producer.make.remote(n, seed) for seed in (1, 2, 3)]
  one = run(asyncio.wait_for(rdt_jax.get_async(refs[0]), BOUND_S))
  assert one["step"] == 1 and float(one["x"].sum()) == n
  many = run(asyncio.wait_for(rdt_jax.get_async(refs[1:]), BOUND_S))
  assert [v["step"] for v in many] == [2, 3]
  np.testing.assert_array_equal(many[1]["x"], np.full(n, 3, np.float32))


def test_get_async_of_a_ref_not_ready(producer):
  ref = producer.make.remote(BIG, seed=4, delay=0.5)
  value = run(asyncio.wait_for(rdt_jax.get_async(ref), BOUND_S))
  assert float(value["x"].sum()) == 4 * BIG


def test_get_async_honours_targets(producer):
  ref = producer.make.remote(BIG, seed=5)
  target = np.zeros(BIG, np.float32)
  rdt_jax.set_target_for_ref(ref, {"x": target})
  value = run(asyncio.wait_for(rdt_jax.get_async(ref), BOUND_S))
  assert value["x"] is target and float(target.sum()) == 5 * BIG


def test_get_async_times_out_as_ray_get_does(producer):
  ref = producer.make.remote(SMALL, delay=3.0)
  with pytest.raises(GetTimeoutError):
    ray.get(ref, timeout=0.2)
  with pytest.raises(GetTimeoutError):
    run(asyncio.wait_for(rdt_jax.get_async(ref, timeout=0.2), BOUND_S))


def test_get_async_raises_what_ray_get_raises_when_the_producer_died():
  doomed = Producer.remote()
  ref = doomed.make.remote(BIG)
  ray.wait([ref])
  conftest.wait_meta(ref)
  ray.kill(doomed)
  assert conftest.wait_for(lambda: _dead(doomed), timeout=30)
  # The process may outlive Ray's report of its death by a moment.
  assert conftest.wait_for(lambda: _get_error(ref) is not None, timeout=30)
  by_get = _get_error(ref)
  with pytest.raises(type(by_get)):
    run(asyncio.wait_for(rdt_jax.get_async(ref, timeout=BOUND_S), 2 * BOUND_S))
  assert not isinstance(by_get, (TimeoutError, GetTimeoutError)), by_get


def _get_error(ref) -> Exception | None:
  try:
    ray.get(ref, timeout=BOUND_S)
  except Exception as e:
    return e
  return None


def _dead(actor) -> bool:
  try:
    ray.get(actor.plain.remote(0), timeout=5)
  except ray.exceptions.ActorDiedError:
    return True
  except ray.exceptions.GetTimeoutError:
    pass
  return False


def test_get_async_in_an_async_actor(producer, consumer):
  refs = [_ready(producer.make.remote(BIG, seed)) for seed in (1, 2)]
  assert ray.get(consumer.get_async_first.remote([refs[0]]), timeout=2 * BOUND_S) == (BIG, 1)
  assert ray.get(consumer.get_async_all.remote(refs), timeout=2 * BOUND_S) == [BIG, 2.0 * BIG]
  # Its ray.get runs in a worker thread: no advice from Ray to `await` instead.
  assert ray.get(consumer.ray_warned_of_blocking_get.remote()) is False


def test_get_async_in_an_async_actor_honours_targets(producer, consumer):
  ref = _ready(producer.make.remote(BIG, seed=3))
  assert ray.get(consumer.get_async_into.remote([ref], BIG), timeout=2 * BOUND_S) == (True, 3.0 * BIG)


def test_get_async_in_an_async_actor_times_out(producer, consumer):
  with pytest.raises(GetTimeoutError):
    ray.get(consumer.get_async_made_by.remote(producer, 3.0, 0.2), timeout=2 * BOUND_S)
  assert ray.get(consumer.get_async_made_by.remote(producer, 0.0, BOUND_S), timeout=2 * BOUND_S) == SMALL


def _ready(ref):
  """`ref` once its object exists: only then can it travel inside a list."""
  ray.wait([ref])
  return ref


# --------------------------------------------------------------------------
# Refs nested in arguments.


def test_a_nested_ref_not_ready_is_refused_at_once(producer, consumer, sync_consumer):
  ref = producer.make.remote(BIG, delay=4.0)
  with pytest.raises(rdt_jax.RefNotReadyError, match=r"does not exist yet.*ray\.wait\(\[ref\]\).*top-level") as info:
    consumer.get_async_first.remote([ref])
  # At once: refused while the object is still being made, not after waiting for it.
  assert not ray.wait([ref], timeout=0)[0], "refused only once the object existed: the call waited for it"
  assert isinstance(info.value, NotImplementedError)
  assert info.value.object_id == ref.hex() and info.value.transport == "jax_nixl"
  # In a dict too, and as a top-level argument the same ref is delivered once ready.
  with pytest.raises(rdt_jax.RefNotReadyError):
    ray.put({"inner": ref})
  assert ray.get(sync_consumer.get_first.remote([_ready(ref)]), timeout=2 * BOUND_S) == BIG


def test_a_nested_ref_is_fetched_once_ready_right_after_ray_wait(producer, consumer, sync_consumer):
  # Without a wait for the transport metadata (which reaches the owner just
  # after the object), a ref sent right after ray.wait would arrive unusable.
  for seed in range(4):
    ref = producer.make.remote(BIG, seed, delay=0.2)
    ray.wait([ref])
    assert ray.get(sync_consumer.get_first.remote([ref]), timeout=2 * BOUND_S) == seed * BIG
    ref = producer.make.remote(BIG, seed, delay=0.2)
    ray.wait([ref])
    assert ray.get(consumer.get_async_first.remote([ref]), timeout=2 * BOUND_S) == (seed * BIG, seed)


def test_a_nested_ref_of_a_failed_method_is_refused_at_once(producer, consumer):
  ref = _ready(producer.fail.remote())
  start = time.monotonic()
  with pytest.raises(rdt_jax.RefNotReadyError, match=r"is an error: its producer's method raised"):
    consumer.get_async_first.remote([ref])
  assert time.monotonic() - start < AT_ONCE_S
  with pytest.raises(ValueError, match="no weights today"):
    ray.get(ref)
