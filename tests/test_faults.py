"""Faults, timeouts, aborts, load, leaks and stale descriptors on jax_nixl.

Every death case is bounded: the surviving side must see a Ray error within
`DEATH_BOUND_S` seconds, keep working for later transfers, and hold no
registered memory for the failed transfer.

The actors a case does not kill are shared by the module: one producer, and
eight consumers (the fan-out case uses all of them; the first is the
consumer most cases read with). A case that kills an actor starts that actor
itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import ray

import rdt_jax
from _helpers import (
    digest,
    jax_bytes,
    nixl_counts,
    process_rss,
    race,
    random_bytes,
    transport_manager,
    wait_for,
    wait_meta,
)
from conftest import OUT_OF_BAND_ENV, WORKER_PYTHONPATH, worker_env

rdt_jax.register()

DEATH_BOUND_S = 30.0


def expected_digest(nbytes: int, seed: int = 0) -> str:
  """The digest of what `Producer.make(nbytes, seed)` holds."""
  return digest(random_bytes(nbytes, seed))


def transfers_exactly(producer, consumer, nbytes: int, seed: int) -> bool:
  """One new object from `producer`, read by `consumer`: are the bytes exact?"""
  ref = producer.make.remote(nbytes, seed)
  return ray.get(consumer.digest.remote(ref), timeout=60) == expected_digest(nbytes, seed)


def nixl_transport():
  return transport_manager("jax_nixl")


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, nbytes: int, seed: int = 0):
    return {"x": jax_bytes(nbytes, seed)}

  @ray.method(tensor_transport="jax_nixl")
  def make_many(self, sizes: list[int], seed: int):
    return [jax_bytes(n, seed + i) for i, n in enumerate(sizes)]

  def stats(self):
    return nixl_counts()

  def rss(self) -> int:
    return process_rss()

  def ping(self) -> str:
    return "ok"


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def __init__(self):
    self.old_meta = None

  def digest(self, value) -> str:
    return digest(value["x"])

  def digest_within(self, refs, timeout: float) -> str:
    return digest(ray.get(refs[0], timeout=timeout)["x"])

  def digests(self, value) -> list[str]:
    return [digest(x) for x in value]

  def stats(self) -> int:
    return nixl_counts()[0]


  def rss(self) -> int:
    return process_rss()

  def faults(self, spec: str | None) -> None:
    """Replaces this process's fault rules (`RDT_JAX_FAULTS`'s syntax)."""
    from rdt_jax import _faults

    _faults.configure(spec)

  def keep_metadata(self, refs) -> None:
    """Keeps a copy of a ref's transport metadata (descriptors included)."""
    manager = ray._private.worker.global_worker.rdt_manager
    meta = manager.wait_for_tensor_transport_metadata(refs[0].hex(), timeout=30)
    self.old_meta = meta
    ray.get(refs[0])

  def stale_read(self) -> str:
    """Reads with the kept descriptors after their object was freed."""
    transport = nixl_transport()
    try:
      request = transport.fetch_multiple_tensors("stale", self.old_meta, None)
      transport.wait_fetch_complete(request, timeout=10)
    except Exception as e:
      return f"{type(e).__name__}: {e}"
    return "read succeeded"

  def fetch_then_abort(self, refs) -> tuple[str, int]:
    """Starts a fetch, has it aborted (as Ray does on failure), then waits."""
    manager = ray._private.worker.global_worker.rdt_manager
    obj_id = refs[0].hex()
    meta = manager.wait_for_tensor_transport_metadata(obj_id, timeout=30)
    transport = nixl_transport()
    request = transport.fetch_multiple_tensors(obj_id, meta, None)
    transport.abort_transport(obj_id, None)
    try:
      transport.wait_fetch_complete(request)
      outcome = "completed"
    except Exception as e:
      outcome = f"{type(e).__name__}: {e}"
    del request
    return outcome, transport.counters()["registrations"]


# One local Ray session for the module (conftest.ray_session): faults of
# NIXL's READ path, at every size.
RAY_ENV = OUT_OF_BAND_ENV
RAY_NUM_CPUS = 24
pytestmark = pytest.mark.usefixtures("ray_session")


#: Consumers of the fan-out case, shared with the other cases.
FAN_OUT = 8


@pytest.fixture(scope="module")
def consumers():
  started = [Consumer.remote() for _ in range(FAN_OUT)]
  ray.get([c.stats.remote() for c in started])
  return started


@pytest.fixture(scope="module")
def consumer(consumers):
  return consumers[0]


@pytest.fixture(scope="module")
def producer():
  return Producer.remote()


#: The slow consumer's rule: its next wait sees the READ in flight 5 s longer.
SLOW_WAIT = "nixl.wait:delay=5*1"
#: How long the get-timeout case holds its READ in flight.
HELD_S = 30.0


@pytest.fixture(scope="module")
def slow_consumer():
  """A consumer whose first wait keeps its READ looking in flight for 5 s
  (`RDT_JAX_FAULTS`); `slow(...)` arms the rule again for the next case."""
  c = Consumer.options(runtime_env=worker_env(RDT_JAX_FAULTS=SLOW_WAIT)).remote()
  ray.get(c.stats.remote())  # started: the bounds below time the fetch only
  return c


def slow(consumer):
  """`consumer` with the slow rule armed afresh (none of it acted yet)."""
  ray.get(consumer.faults.remote(SLOW_WAIT))
  return consumer


def test_producer_killed_before_fetch(consumer, producer):
  doomed = Producer.remote()
  ref = doomed.make.remote(8 << 20)
  ray.wait([ref])
  ray.kill(doomed)
  t0 = time.monotonic()
  with pytest.raises(ray.exceptions.RayError):
    ray.get(consumer.digest.remote(ref), timeout=DEATH_BOUND_S * 2)
  elapsed = time.monotonic() - t0
  print(f"producer killed before fetch: consumer's error after {elapsed:.2f} s")
  assert elapsed < DEATH_BOUND_S
  with pytest.raises(ray.exceptions.RayError):
    ray.get(ref, timeout=DEATH_BOUND_S)
  # The consumer keeps working, and holds nothing for the failed transfer.
  assert transfers_exactly(producer, consumer, 1 << 20, 1)
  assert ray.get(consumer.stats.remote()) == 0


def test_producer_killed_during_a_large_fetch(consumer):
  producer = Producer.remote()
  ref = producer.make.remote(512 << 20)
  ray.wait([ref])
  outcome, elapsed = race(
      lambda: ray.get(consumer.digest.remote(ref), timeout=DEATH_BOUND_S * 2),
      lambda: ray.kill(producer),
      DEATH_BOUND_S * 2,
  )
  print(f"producer killed during a 512 MiB fetch: {sorted(outcome)[0]} after {elapsed:.2f} s")
  assert elapsed < DEATH_BOUND_S
  # Either the read finished first (then it is exact) or it failed with a Ray error.
  if "value" in outcome:
    assert outcome["value"] == expected_digest(512 << 20)
  else:
    assert isinstance(outcome["error"], ray.exceptions.RayError)
  assert ray.get(consumer.stats.remote()) == 0


def test_consumer_killed_during_a_fetch(producer, consumers):
  doomed = Consumer.remote()
  ref = producer.make.remote(256 << 20)
  ray.wait([ref])
  result = doomed.digest.remote(ref)
  time.sleep(0.05)
  ray.kill(doomed)
  t0 = time.monotonic()
  with pytest.raises(ray.exceptions.RayError):
    ray.get(result, timeout=DEATH_BOUND_S)
  print(f"consumer killed during a fetch: driver's error after {time.monotonic() - t0:.2f} s")
  del ref, result
  # The producer frees the object and keeps serving others.
  assert wait_for(lambda: ray.get(producer.stats.remote()) == (0, 0))
  assert transfers_exactly(producer, consumers[1], 1 << 20, 2)


DRIVER_SCRIPT = """
import os, sys, time, ray
sys.path[:0] = os.environ["WORKER_PYTHONPATH"].split(os.pathsep)
import rdt_jax
rdt_jax.register()
from test_faults import Consumer, Producer
ray.init(
    address=os.environ["RAY_ADDRESS_FOR_TEST"],
    namespace="exiting-driver",
    runtime_env={"env_vars": {"PYTHONPATH": os.environ["WORKER_PYTHONPATH"]}},
)
p, c = Producer.remote(), Consumer.remote()
ray.get(c.digest.remote(p.make.remote(1 << 20)))
refs = [c.digest.remote(p.make.remote(64 << 20, i)) for i in range(4)]
time.sleep(0.1)
print("exiting with transfers in flight", flush=True)
os._exit(0)
"""


def test_driver_exits_with_transfers_in_flight(consumer, producer):
  env = dict(os.environ)
  env["RAY_ADDRESS_FOR_TEST"] = ray.get_runtime_context().gcs_address
  env["WORKER_PYTHONPATH"] = WORKER_PYTHONPATH
  out = subprocess.run(
      [sys.executable, "-c", DRIVER_SCRIPT], env=env, capture_output=True, text=True, timeout=120
  )
  assert "exiting with transfers in flight" in out.stdout, out.stderr[-2000:]
  # This driver's cluster and actors are unaffected.
  t0 = time.monotonic()
  assert transfers_exactly(producer, consumer, 1 << 20, 3)
  print(f"after a driver exited mid-transfer: next transfer done in {time.monotonic() - t0:.2f} s")


def test_get_timeout_is_honoured(slow_consumer):
  # The object exists and its READ is posted; fault injection keeps the READ
  # looking in flight for 5 s, so the transport's own 1 s timeout fires
  # mid-transfer (test_fault_injection.py checks what it leaves behind).
  # A producer of its own, as for the abort below and the fan-out case: the
  # cases checking that the shared producer holds nothing must not depend on
  # when this one's consumer lets its refs go.
  producer = Producer.remote()
  try:
    ref = producer.make.remote(64 << 20)
    wait_meta(ref)
    # The READ looks in flight for HELD_S: a timeout that was not honoured
    # would end only with it. Half of it tells the two apart on any machine;
    # the hold ends with the fetch, so its length costs nothing.
    consumer = slow_consumer
    ray.get(consumer.faults.remote(f"nixl.wait:delay={HELD_S}*1"))
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayError, match="timed out"):
      ray.get(consumer.digest_within.remote([ref], 1.0), timeout=2 * HELD_S)
    elapsed = time.monotonic() - t0
    print(f"1 s get timeout with the READ in flight: error after {elapsed:.2f} s")
    assert elapsed < HELD_S / 2, f"the 1 s timeout fired after {elapsed:.1f} s, with the READ held {HELD_S} s"
    assert ray.get(consumer.digest_within.remote([ref], 30.0)) == expected_digest(64 << 20)
  finally:
    ray.kill(producer)


def test_a_consumer_whose_get_timed_out_keeps_no_ref_to_the_object(slow_consumer):
  """Once the last ref is dropped, the producer frees an object whose fetch
  timed out in a consumer. The consumer's failed fetch used to leave a
  reference cycle (rdt_jax's frame naming the error it raised, and the
  error's traceback through the consumer's frames), which kept the ref the
  consumer borrowed counted until its cyclic collector ran: the producer
  held the object meanwhile (15 s and more in an idle actor)."""
  producer = Producer.remote()
  try:
    ref = producer.make.remote(64 << 20)
    wait_meta(ref)
    consumer = slow(slow_consumer)
    try:
      ray.get(consumer.digest_within.remote([ref], 1.0), timeout=DEATH_BOUND_S)
    except ray.exceptions.RayError as e:
      assert "timed out" in str(e), e
      e.__traceback__ = None  # the driver's own cycle (docs/ray_integration.md, "Known issues")
    else:
      pytest.fail("the fetch did not time out")
    del ref
    assert wait_for(lambda: ray.get(producer.stats.remote()) == (0, 0), timeout=10), (
        f"(registrations, objects) still held: {ray.get(producer.stats.remote())}")
  finally:
    ray.kill(producer)


def test_abort_interrupts_the_wait_and_releases(slow_consumer):
  # A producer of its own, as for the timeout above.
  producer = Producer.remote()
  # A READ on one host may be DONE as soon as it is posted (UCX copies with
  # process_vm_readv at once): the injected delay keeps it looking in flight,
  # so the abort is what ends the wait.
  consumer = slow(slow_consumer)
  ref = producer.make.remote(64 << 20)
  wait_meta(ref)
  outcome, registrations = ray.get(consumer.fetch_then_abort.remote([ref]))
  assert "aborted" in outcome
  assert registrations == 0
  assert ray.get(consumer.digest.remote(ref)) == expected_digest(64 << 20)
  ray.kill(producer)


def test_many_consumers_on_one_producer(consumers):
  # A producer of its own (see test_get_timeout_is_honoured).
  producer = Producer.remote()
  try:
    assert len(set(consumers)) == FAN_OUT
    ref = producer.make.remote(4 << 20, 16)
    t0 = time.monotonic()
    got = ray.get([c.digest.remote(ref) for c in consumers], timeout=120)
    elapsed = time.monotonic() - t0
    assert got == [expected_digest(4 << 20, 16)] * FAN_OUT
    print(f"{FAN_OUT} consumers x 4 MiB: {elapsed:.3f} s")
  finally:
    ray.kill(producer)


def test_sixty_four_refs_in_one_get():
  """64 refs in one `ray.get`, all exact; once they are dropped the producer
  holds nothing. A producer of its own: what the module's shared producer
  still frees from earlier cases does not count against this one."""
  producer = Producer.remote()
  try:
    refs = [producer.make.remote(256 << 10, i) for i in range(64)]
    t0 = time.monotonic()
    values = ray.get(refs, timeout=120)
    elapsed = time.monotonic() - t0
    assert [digest(v["x"]) for v in values] == [expected_digest(256 << 10, i) for i in range(64)]
    print(f"64 refs x 256 KiB in one ray.get: {elapsed:.3f} s")
    del refs, values
    assert wait_for(lambda: ray.get(producer.stats.remote()) == (0, 0), timeout=60), (
        f"(registrations, objects) still held: {ray.get(producer.stats.remote())}")
  finally:
    ray.kill(producer)


def test_two_thousand_mixed_transfers_leave_nothing_behind(producer, consumers):
  consumer = consumers[2]
  sizes = [4 << 10, 64 << 10, 300 << 10, 1 << 20]
  for i in range(40):  # warm up agents, connections and the buffer pools
    ray.get(consumer.digests.remote(producer.make_many.remote(sizes, i)))
  rss_p, rss_c = ray.get(producer.rss.remote()), ray.get(consumer.rss.remote())
  for i in range(500):  # 4 arrays per object: 2,000 transfers of mixed sizes
    ref = producer.make_many.remote(sizes, i)
    got = ray.get(consumer.digests.remote(ref))
    if i % 100 == 0:
      assert got == [expected_digest(n, i + k) for k, n in enumerate(sizes)]
    del ref
  assert wait_for(lambda: ray.get(producer.stats.remote()) == (0, 0))
  assert ray.get(consumer.stats.remote()) == 0
  growth_p = ray.get(producer.rss.remote()) - rss_p
  growth_c = ray.get(consumer.rss.remote()) - rss_c
  print(f"RSS growth over 2,000 transfers: producer {growth_p >> 20} MiB, "
        f"consumer {growth_c >> 20} MiB")
  assert growth_p < 64 << 20 and growth_c < 64 << 20


@pytest.mark.parametrize("nbytes", [2 << 20, 4 << 10], ids=["in-place", "staged"])
def test_stale_descriptor_read_fails(consumer, producer, nbytes):
  # With the default settings. 2 MiB is read where it lies; 4 KiB is packed
  # into a pooled staging buffer, which the next object reuses: a stale read
  # there would return the next object's bytes.
  ref = producer.make.remote(nbytes, 5)
  wait_meta(ref)
  ray.get(consumer.keep_metadata.remote([ref]))
  del ref
  assert wait_for(lambda: ray.get(producer.stats.remote()) == (0, 0))
  # Any later fetch from the producer tells the consumer what is still live.
  assert ray.get(consumer.digest.remote(producer.make.remote(nbytes, 6))) == expected_digest(nbytes, 6)
  outcome = ray.get(consumer.stale_read.remote())
  assert outcome != "read succeeded" and "freed by its producer" in outcome, outcome
  assert ray.get(consumer.stats.remote()) == 0
