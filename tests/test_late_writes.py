"""No write into caller memory after its fetch failed, in the default configuration.

Every fault a fetch can meet (an error mid-transfer, a `ray.get` timeout,
Ray's abort, the producer's death mid-read, a batched get dropping its other
fetches, the consumer's death) is forced while the fetch receives into a
numpy target, a torch target or a `Slice(into=...)` buffer. After the failure
the consumer fills the target with a sentinel, waits until none of its READs
is in flight or parked (and a second more), and checks the sentinel is whole.

Settings are the defaults (node-local reads on). A producer on another host
is stood for by refusing node-local reads
(`cma.read:fail`, as a kernel that forbids them does) and reading over TCP
(`UCX_TLS=tcp`: on one host UCX's shared-memory transport finishes a READ
inside the call that posts it, so no READ would ever be in flight).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import ray
import torch

import rdt_jax
from conftest import wait_for, wait_meta, worker_env

rdt_jax.register()

#: Bytes of the object (out of band: over RDT_JAX_INLINE_MAX_BYTES).
NBYTES = 64 << 20
#: Every forced fault must surface as a Ray error within this many seconds.
ERROR_BOUND_S = 30.0
#: Node-local reads refused, READs over TCP: the path a remote producer takes.
REMOTE = {"RDT_JAX_FAULTS": "cma.read:fail", "UCX_TLS": "tcp"}

RAY_NUM_CPUS = 16
pytestmark = pytest.mark.usefixtures("ray_session")


def payload(seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 255, NBYTES, dtype=np.uint8)


def transport():
  from ray.experimental.rdt.util import get_tensor_transport_manager

  return get_tensor_transport_manager("JAX_NIXL")


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, seed: int):
    return {"x": payload(seed)}

  def ready(self) -> bool:
    return True


def make_target(kind: str):
  """(target tree for `set_target_for_ref`, the buffer caller memory lies in)."""
  if kind == "numpy":
    buf = np.zeros(NBYTES, np.uint8)
    return {"x": buf}, buf
  if kind == "torch":
    t = torch.zeros(NBYTES, dtype=torch.uint8)
    return {"x": t}, t.numpy()
  buf = np.zeros(NBYTES // 2, np.uint8)
  return {"x": rdt_jax.Slice((slice(NBYTES // 4, 3 * NBYTES // 4),), buf)}, buf


def expected(kind: str, seed: int) -> np.ndarray:
  full = payload(seed)
  return full[NBYTES // 4 : 3 * NBYTES // 4] if kind == "slice" else full


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def ready(self) -> bool:
    return True

  def fetch(self, refs, kind: str, timeout: float | None = None, abort: bool = False) -> dict:
    """Fetches every ref into a target of `kind` filled with 0xA1; after the
    outcome, fills them with 0xB2, waits until no READ is in flight or parked,
    and reports whether any byte changed since."""
    buffers = []
    for ref in refs:
      tree, buf = make_target(kind)
      buf.fill(0xA1)
      rdt_jax.set_target_for_ref(ref, tree)
      buffers.append(buf)
    outcome, values = "ok", None
    try:
      if abort:
        values = [self._fetch_aborted(refs[0])]
      else:
        values = ray.get(refs, timeout=timeout)
    except Exception as e:
      outcome = f"{type(e).__name__}: {e}"
    arrived = None
    if values is not None:
      arrived = all(
          np.array_equal(rdt_jax.to_numpy(v["x"]), b) for v, b in zip(values, buffers)
      )
    # Touched at all: a NIXL READ lands in rdt_jax's memory, never in a
    # target of a fetch that failed.
    touched = [bool((b != 0xA1).any()) for b in buffers]
    for b in buffers:
      b.fill(0xB2)
    t = transport()
    wait_for(lambda: t.num_inflight() == 0 and t.num_parked() == 0, timeout=60)
    time.sleep(1.0)
    return {
        "outcome": outcome,
        "arrived": arrived,
        "touched": touched,
        "late_write": [bool((b != 0xB2).any()) for b in buffers],
        "parked_total": t.parked_total,
        "inflight": t.num_inflight(),
    }

  def _fetch_aborted(self, ref):
    """Starts a fetch, has Ray's abort reach it mid-transfer, then waits."""
    manager = ray._private.worker.global_worker.rdt_manager
    obj_id = ref.hex()
    meta = manager.wait_for_tensor_transport_metadata(obj_id, timeout=30)
    t = transport()
    request = t.fetch_multiple_tensors(obj_id, meta, None)
    t.abort_transport(obj_id, None)
    return {"x": t.wait_fetch_complete(request)[0]}


def faulted(cls, **env: str):
  actor = cls.options(runtime_env=worker_env(**env)).remote()
  ray.get(actor.ready.remote())
  return actor


@pytest.fixture(scope="module")
def producer():
  p = Producer.remote()
  ray.get(p.ready.remote())
  yield p
  ray.kill(p)


KINDS = ["numpy", "torch", "slice"]


def check_no_late_write(report: dict, failed: bool = True) -> None:
  print(report)
  assert not any(report["late_write"]), f"a target was written after its fetch ended: {report}"
  assert report["inflight"] == 0
  if failed:
    assert report["outcome"] != "ok", report
    assert not any(report["touched"]), f"a failed NIXL READ wrote into caller memory: {report}"


@pytest.mark.parametrize("kind", KINDS)
def test_error_mid_transfer(producer, kind):
  consumer = faulted(Consumer, **{**REMOTE, "RDT_JAX_FAULTS": "cma.read:fail,nixl.wait:fail*1"})
  ref = producer.make.remote(1)
  wait_meta(ref)
  report = ray.get(consumer.fetch.remote([ref], kind), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  assert "injected fault at nixl.wait" in report["outcome"]
  # The same consumer, no fault left: the value arrives in the target.
  report = ray.get(consumer.fetch.remote([ref], kind))
  assert report["outcome"] == "ok" and report["arrived"], report
  ray.kill(consumer)


@pytest.mark.parametrize("kind", KINDS)
def test_get_timeout_mid_transfer(producer, kind):
  consumer = faulted(Consumer, **{**REMOTE, "RDT_JAX_FAULTS": "cma.read:fail,nixl.wait:delay=3*1"})
  ref = producer.make.remote(2)
  wait_meta(ref)
  report = ray.get(consumer.fetch.remote([ref], kind, 1.0), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  assert "Timeout" in report["outcome"] or "timed out" in report["outcome"]
  ray.kill(consumer)


def test_batched_get_timeout_drops_every_fetch(producer):
  # Ray gives up every other fetch of a batch at the first timeout.
  consumer = faulted(Consumer, **{**REMOTE, "RDT_JAX_FAULTS": "cma.read:fail,nixl.wait:delay=3"})
  refs = [producer.make.remote(10 + i) for i in range(3)]
  for ref in refs:
    wait_meta(ref)
  report = ray.get(consumer.fetch.remote(refs, "numpy", 1.0), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  ray.kill(consumer)


@pytest.mark.parametrize("kind", KINDS)
def test_abort_mid_transfer(producer, kind):
  consumer = faulted(Consumer, **{**REMOTE, "RDT_JAX_FAULTS": "cma.read:fail,nixl.wait:delay=3*1"})
  ref = producer.make.remote(3)
  wait_meta(ref)
  report = ray.get(consumer.fetch.remote([ref], kind, None, True), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  assert "aborted" in report["outcome"]
  ray.kill(consumer)


@pytest.mark.parametrize("kind", KINDS)
def test_producer_dies_mid_read(kind):
  # The producer is stopped (SIGSTOP) so that the READ over TCP, which needs
  # its progress, stays in flight; then it is killed.
  producer = Producer.remote()
  pid = ray.get(producer.__ray_call__.remote(lambda self: os.getpid()))
  consumer = faulted(Consumer, **REMOTE)
  first = producer.make.remote(40)
  wait_meta(first)
  # Connected, node-local reads refused: the next fetch posts its READ at once.
  assert ray.get(consumer.fetch.remote([first], kind))["outcome"] == "ok"
  ref = producer.make.remote(4)
  wait_meta(ref)
  os.kill(pid, signal.SIGSTOP)
  pending = consumer.fetch.remote([ref], kind, 30.0)
  time.sleep(2.0)
  os.kill(pid, signal.SIGKILL)
  report = ray.get(pending, timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  ray.kill(consumer)


@pytest.mark.parametrize("kind", KINDS)
def test_node_local_read_failure(producer, kind):
  # The default path on one host: the copy ends inside the fetch, so even a
  # failure leaves nothing that could write later.
  consumer = faulted(Consumer, RDT_JAX_FAULTS="nixl.post:fail*1")
  ref = producer.make.remote(5)
  wait_meta(ref)
  report = ray.get(consumer.fetch.remote([ref], kind), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  report = ray.get(consumer.fetch.remote([ref], kind))
  assert report["outcome"] == "ok" and report["arrived"], report
  stats = ray.get(consumer.__ray_call__.remote(lambda self: transport().receive_stats()))
  assert stats["direct"] >= 1, "the fetch was not read node-locally"
  ray.kill(consumer)


def test_consumer_dies_mid_read_with_a_target():
  # The caller's memory dies with the consumer; the producer frees the object
  # and holds nothing for it.
  producer = Producer.remote()
  consumer = faulted(Consumer, **{**REMOTE, "RDT_JAX_FAULTS": "cma.read:fail,nixl.complete:kill"})
  ref = producer.make.remote(6)
  wait_meta(ref)
  with pytest.raises(ray.exceptions.RayActorError):
    ray.get(consumer.fetch.remote([ref], "torch"), timeout=ERROR_BOUND_S * 4)
  del ref

  def freed() -> bool:
    t = ray.get(producer.__ray_call__.remote(lambda self: (transport().num_objects(), transport().num_registrations())))
    return t == (0, 0)

  assert wait_for(freed, timeout=ERROR_BOUND_S)
  ray.kill(producer)


def test_targets_arrive_exact_on_both_paths(producer):
  # Node-local reads write straight into the target; NIXL READs are staged.
  for env in ({}, REMOTE):
    consumer = faulted(Consumer, **env)
    ref = producer.make.remote(7)
    wait_meta(ref)
    report = ray.get(consumer.fetch.remote([ref], "numpy"))
    assert report["outcome"] == "ok" and report["arrived"], (env, report)
    ray.kill(consumer)
