"""Forced faults on jax_nixl (`RDT_JAX_FAULTS`): every error path, bounded, leak-free.

Each test faults an actor at a chosen point of a real transfer: the actor is
started with `RDT_JAX_FAULTS` in its runtime_env, or, for the consumer-side
faults that need no setting of their own, is the module's shared consumer
with the test's rules set first (`_faults.configure`, the same rules; it was
started with the first test's rules in its runtime_env). Each
asserts that the caller sees a Ray error within `ERROR_BOUND_S` (or, for a
fault the transport absorbs, the exact value), and that afterwards the faulted
process is back to its baseline: no registrations, no READ in flight or
parked, no pooled host memory held.
"""

from __future__ import annotations

import hashlib
import time

import jax.numpy as jnp
import numpy as np
import pytest
import ray

import rdt_jax
from conftest import OUT_OF_BAND_ENV, wait_for, wait_meta, worker_env
from rdt_jax import _faults, _limits, _memory

rdt_jax.register()

#: Every forced fault must surface as a Ray error within this many seconds.
ERROR_BOUND_S = 30.0


def sha(x) -> str:
  a = np.ascontiguousarray(rdt_jax.to_numpy(x))
  return hashlib.sha256(f"{a.shape}|{a.dtype.name}|".encode() + a.tobytes()).hexdigest()


def payload(nbytes: int, seed: int):
  return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def transport():
  from ray.experimental.rdt.util import get_tensor_transport_manager

  return get_tensor_transport_manager("JAX_NIXL")


def counters() -> dict:
  import gc

  gc.collect()  # delivered values can sit in reference cycles until the next collection
  c = transport().counters()
  return {
      "registrations": c["registrations"],
      "inflight": c["inflight"],
      "parked": c["parked"],
      "pool_in_use": _memory.host_pool.bytes_in_use(),
  }


BASELINE = {"registrations": 0, "inflight": 0, "parked": 0, "pool_in_use": 0}


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, nbytes: int, seed: int = 0):
    return {"x": jnp.asarray(payload(nbytes, seed))}

  @ray.method(tensor_transport="jax_nixl")
  def make_two(self, nbytes: int, seed: int = 0):
    return [jnp.asarray(payload(nbytes, seed)), jnp.asarray(payload(nbytes, seed + 1))]

  def counters(self) -> dict:
    return {**counters(), "objects": transport().counters()["objects"]}

  def ready(self) -> bool:
    return True


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def sha(self, value) -> str:
    return sha(value["x"])

  def get_sha(self, refs, timeout: float | None = None) -> str:
    return sha(ray.get(refs[0], timeout=timeout)["x"])

  def counters(self) -> dict:
    return {**counters(), "parked_total": transport().counters()["parked_total"]}

  def ready(self) -> bool:
    return True

  def faults(self, spec: str | None) -> None:
    """Replaces this process's fault rules (`RDT_JAX_FAULTS`'s syntax)."""
    _faults.configure(spec)


def faulted(cls, spec: str, **env_vars: str):
  """A started actor of `cls` whose process injects the faults of `spec`."""
  actor = cls.options(runtime_env=worker_env(RDT_JAX_FAULTS=spec, **env_vars)).remote()
  ray.get(actor.ready.remote())  # bounds below time the fault, not the start
  return actor


# One local Ray session for the module (conftest.ray_session): faults of
# NIXL's READ path, at every size.
RAY_ENV = OUT_OF_BAND_ENV
RAY_NUM_CPUS = 16
pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def producer():
  p = Producer.remote()
  yield p
  ray.kill(p)


#: The first shared-consumer test's rules, given in the consumer's runtime_env.
POST_FAIL = "nixl.post:fail*1"


@pytest.fixture(scope="module")
def shared_consumer():
  c = faulted(Consumer, POST_FAIL)
  yield c
  ray.kill(c)


def armed(consumer, spec: str):
  """`consumer` with exactly the fault rules of `spec`, none acted yet."""
  ray.get(consumer.faults.remote(spec))
  return consumer


def settled(actor) -> dict:
  """Waits until `actor`'s counters are back to the baseline; returns them."""

  def at_baseline():
    c = ray.get(actor.counters.remote())
    return all(c[k] == v for k, v in BASELINE.items())

  wait_for(at_baseline, timeout=ERROR_BOUND_S)
  return ray.get(actor.counters.remote())


def expect_ray_error(call):
  t0 = time.monotonic()
  with pytest.raises(ray.exceptions.RayError) as info:
    ray.get(call, timeout=ERROR_BOUND_S * 2)
  elapsed = time.monotonic() - t0
  assert elapsed < ERROR_BOUND_S, f"error after {elapsed:.1f} s"
  return info.value, elapsed


# ---- the injection module itself


def test_rules_parse_and_act_deterministically():
  _faults.configure("nixl.post:fail@2*1,nixl.wait:delay=0.25~0.5", seed=3)
  try:
    assert _faults.ON
    _faults.hit("nixl.post")  # the first hit is skipped (@2)
    with pytest.raises(_faults.InjectedFault, match=r"nixl\.post"):
      _faults.hit("nixl.post")
    _faults.hit("nixl.post")  # acted once already (*1)
    delays = [_faults.hit("nixl.wait", sleep=False) for _ in range(20)]
    assert set(delays) == {0.0, 0.25}
    _faults.configure("nixl.wait:delay=0.25~0.5", seed=3)
    assert [_faults.hit("nixl.wait", sleep=False) for _ in range(20)] == delays  # seeded
    assert _faults.injected() == {"nixl.wait": delays.count(0.25)}
  finally:
    _faults.configure(None)
  assert not _faults.ON
  assert _faults.hit("nixl.post") == 0.0


@pytest.mark.parametrize("spec", ["nixl.nowhere:fail", "nixl.post:explode", "nixl.wait:delay", "post"])
def test_bad_rules_are_refused(spec):
  with pytest.raises(ValueError, match="RDT_JAX_FAULTS rule"):
    _faults.configure(spec)
  assert not _faults.ON


# ---- consumer-side faults


def test_post_failure_is_a_ray_error_and_leaves_nothing(producer, shared_consumer):
  consumer = armed(shared_consumer, POST_FAIL)
  ref = producer.make.remote(8 << 20, 1)
  err, elapsed = expect_ray_error(consumer.sha.remote(ref))
  assert "injected fault at nixl.post" in str(err)
  print(f"post failure: Ray error after {elapsed:.2f} s")
  assert settled(consumer) | {"parked_total": 0} == {**BASELINE, "parked_total": 0}
  # The consumer keeps working (the rule acted once).
  assert ray.get(consumer.sha.remote(ref)) == sha(payload(8 << 20, 1))


def test_registration_failure_on_the_consumer_leaves_nothing_in_flight(producer):
  # A new consumer: a shared one may hold a pooled receive buffer, registered
  # already, that the fetch reuses without a registration.
  consumer = faulted(Consumer, "nixl.register:fail*1")
  ref = producer.make.remote(4 << 20, 2)
  err, _ = expect_ray_error(consumer.sha.remote(ref))
  assert "injected fault at nixl.register" in str(err)
  c = settled(consumer)
  assert c["inflight"] == 0 and c["registrations"] == 0
  assert ray.get(consumer.sha.remote(ref)) == sha(payload(4 << 20, 2))
  ray.kill(consumer)


def test_failure_mid_transfer_parks_the_read_until_nixl_ends_it(producer):
  # The wait fails right after the READ of 256 MiB is posted: the READ is
  # still writing into the receive buffer, which must stay out of the pool
  # until NIXL reports the READ ended. Over TCP: on one host UCX's default
  # (CMA) copies the whole READ inside the post, so it is never in flight.
  consumer = faulted(Consumer, "nixl.wait:fail*1", UCX_TLS="tcp")
  ref = producer.make.remote(256 << 20, 3)
  err, elapsed = expect_ray_error(consumer.sha.remote(ref))
  assert "injected fault at nixl.wait" in str(err)
  print(f"failure mid-transfer: Ray error after {elapsed:.2f} s")
  c = settled(consumer)
  assert c["parked_total"] >= 1, "the READ was not in flight when the wait failed"
  assert {k: c[k] for k in BASELINE} == BASELINE
  assert ray.get(consumer.sha.remote(ref)) == sha(payload(256 << 20, 3))
  del ref
  ray.kill(consumer)


def test_a_parked_read_that_never_ends_is_ended_by_removing_the_agent(producer):
  # The READ given up mid-transfer keeps looking in flight (injected), so only
  # the removal of the producer's agent after RDT_JAX_NIXL_PARK_END_S ends it.
  consumer = faulted(
      Consumer, "nixl.wait:fail*1,nixl.park:delay=600*1", UCX_TLS="tcp", RDT_JAX_NIXL_PARK_END_S="1"
  )
  ref = producer.make.remote(64 << 20, 30)
  expect_ray_error(consumer.sha.remote(ref))
  c = settled(consumer)
  assert c["parked_total"] == 1 and {k: c[k] for k in BASELINE} == BASELINE
  # The agent is added again for the next read from that producer.
  assert ray.get(consumer.sha.remote(ref)) == sha(payload(64 << 20, 30))
  ray.kill(consumer)


def test_release_failure_parks_then_reclaims_and_the_value_is_exact(producer, shared_consumer):
  consumer = armed(shared_consumer, "nixl.release:fail*1")
  parked_before = settled(consumer)["parked_total"]
  ref = producer.make.remote(4 << 20, 4)
  assert ray.get(consumer.sha.remote(ref)) == sha(payload(4 << 20, 4))
  del ref
  c = settled(consumer)
  assert c["parked_total"] - parked_before == 1
  assert {k: c[k] for k in BASELINE} == BASELINE


def test_get_timeout_fires_mid_transfer_and_releases(producer, shared_consumer):
  # The object exists and its READ is posted; the wait sees it in flight for
  # 30 s (injected), so the 1 s ray.get timeout fires inside the transport.
  # Mid-transfer, on any machine: well before the READ's hold would end (the
  # hold ends with the fetch, so its length costs nothing).
  held_s = 30.0
  consumer = armed(shared_consumer, f"nixl.wait:delay={held_s}*1")
  ref = producer.make.remote(16 << 20, 5)
  wait_meta(ref)
  t0 = time.monotonic()
  with pytest.raises(ray.exceptions.RayError) as info:
    ray.get(consumer.get_sha.remote([ref], 1.0), timeout=2 * held_s)
  elapsed = time.monotonic() - t0
  assert "GetTimeoutError" in repr(info.value) or "timed out" in str(info.value)
  assert elapsed < held_s / 2, f"the 1 s timeout fired after {elapsed:.1f} s, with the READ held {held_s} s"
  print(f"1 s timeout mid-transfer: error after {elapsed:.2f} s")
  assert {k: v for k, v in settled(consumer).items() if k in BASELINE} == BASELINE
  assert ray.get(consumer.get_sha.remote([ref])) == sha(payload(16 << 20, 5))


def test_consumer_killed_at_completion():
  producer = Producer.remote()
  consumer = faulted(Consumer, "nixl.complete:kill")
  ref = producer.make.remote(8 << 20, 6)
  err, elapsed = expect_ray_error(consumer.sha.remote(ref))
  assert isinstance(err, ray.exceptions.RayActorError)
  print(f"consumer killed at completion: Ray error after {elapsed:.2f} s")
  other = Consumer.remote()
  assert ray.get(other.sha.remote(ref)) == sha(payload(8 << 20, 6))
  ray.kill(other)
  del ref
  assert wait_for(lambda: ray.get(producer.counters.remote())["objects"] == 0)
  assert ray.get(producer.counters.remote())["registrations"] == 0
  ray.kill(producer)


# ---- producer-side faults


def test_partial_export_failure_unregisters_what_it_registered():
  producer = faulted(Producer, "nixl.register:fail@2*1")  # the second leaf's registration fails
  err, _ = expect_ray_error(producer.make_two.remote(2 << 20, 7))
  assert "injected fault at nixl.register" in str(err)
  c = ray.get(producer.counters.remote())
  assert c["registrations"] == 0 and c["objects"] == 0
  ref = producer.make_two.remote(2 << 20, 8)
  assert sha(ray.get(ref)[1]) == sha(payload(2 << 20, 9))
  ray.kill(producer)


def test_deregistration_failure_keeps_memory_then_retries():
  producer = faulted(Producer, "nixl.deregister:fail*1")
  consumer = Consumer.remote()
  ref = producer.make.remote(4 << 20, 10)
  assert ray.get(consumer.sha.remote(ref)) == sha(payload(4 << 20, 10))
  del ref
  # The failed deregistration is retried by the progress thread.
  assert wait_for(lambda: ray.get(producer.counters.remote())["objects"] == 0)
  assert wait_for(lambda: ray.get(producer.counters.remote())["registrations"] == 0)
  ray.kill(consumer)
  ray.kill(producer)


def test_producer_killed_while_exporting():
  producer = faulted(Producer, "nixl.export:kill")
  err, elapsed = expect_ray_error(producer.make.remote(1 << 20, 11))
  assert isinstance(err, ray.exceptions.RayActorError)
  print(f"producer killed while exporting: Ray error after {elapsed:.2f} s")


# ---- bounded bookkeeping


def test_abort_marks_are_bounded_and_forgotten_on_free():
  from rdt_jax.transports.nixl import NixlTransport

  t = NixlTransport()
  for i in range(_limits.MAX_ABORTED + 10):
    t.abort_transport(f"obj{i}", None)
  assert t.counters()["abort_marks"] == _limits.MAX_ABORTED
  assert not t.aborted("obj0")  # the oldest were forgotten
  last = f"obj{_limits.MAX_ABORTED + 9}"
  t.garbage_collect(last, None, [])
  assert not t.aborted(last)
  assert t.counters()["abort_marks"] == _limits.MAX_ABORTED - 1


def test_unused_targets_are_dropped_once_their_object_is_freed(producer):
  from rdt_jax import _targets

  first = producer.make.remote(1 << 10, 12)
  wait_meta(first)
  rdt_jax.set_target_device_for_ref(first, "cpu")
  assert _targets.num_targets() == 1
  del first
  second = producer.make.remote(1 << 10, 13)
  wait_meta(second)

  def only_second():
    rdt_jax.set_target_device_for_ref(second, "cpu")
    return _targets.num_targets() == 1

  assert wait_for(only_second)
  assert sha(ray.get(second)["x"]) == sha(payload(1 << 10, 13))
  assert _targets.num_targets() == 0
