"""No write into caller memory after its fetch failed, in the default configuration.

Every fault a fetch can meet (an error mid-transfer, a `ray.get` timeout,
Ray's abort, the producer's death mid-read, a batched get dropping its other
fetches, the consumer's death) is forced while the fetch receives into
caller memory of every kind at once: the object has three leaves, and its
target tree holds a numpy target, a torch target and a `Slice(into=...)`
buffer, one per leaf (every leaf is planned on its own; the READ covers the
whole object). After the failure the consumer fills each target with a
sentinel, waits until none of its READs is in flight or parked (and a second
more), and checks each sentinel is whole; every check names the kind.

Settings are the defaults (node-local reads on). A producer on another host
is stood for by refusing node-local reads
(`cma.read:fail`, as a kernel that forbids them does) and reading over TCP
(`UCX_TLS=tcp`: on one host UCX's shared-memory transport finishes a READ
inside the call that posts it, so no READ would ever be in flight).

The consumers that survive their case are shared by the module: each case
sets its consumer's fault rules first (`_faults.configure`, the same rules
`RDT_JAX_FAULTS` would hold), and every fetch returns only after the
consumer's READs ended, so no case inherits another's transfer.
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

#: Bytes of each leaf (out of band: over RDT_JAX_INLINE_MAX_BYTES).
NBYTES = 16 << 20
#: The leaves of every object (in leaf order), each received into caller
#: memory of this kind.
KINDS = ("numpy", "slice", "torch")
#: Every forced fault must surface as a Ray error within this many seconds.
ERROR_BOUND_S = 30.0
#: Node-local reads refused, READs over TCP: the path a remote producer takes.
REMOTE = {"RDT_JAX_FAULTS": "cma.read:fail", "UCX_TLS": "tcp"}

RAY_NUM_CPUS = 16
pytestmark = pytest.mark.usefixtures("ray_session")


def payload(seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 255, NBYTES, dtype=np.uint8)


def value(seed: int) -> dict:
  """The object: one leaf per kind of target, each with its own bytes."""
  return {kind: payload(seed * len(KINDS) + i) for i, kind in enumerate(KINDS)}


def transport():
  from ray.experimental.rdt.util import get_tensor_transport_manager

  return get_tensor_transport_manager("JAX_NIXL")


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, seed: int):
    return value(seed)

  def ready(self) -> bool:
    return True


def make_targets() -> tuple[dict, dict[str, np.ndarray]]:
  """(target tree for `set_target_for_ref`, the buffer caller memory lies in, per kind)."""
  buf = np.zeros(NBYTES, np.uint8)
  t = torch.zeros(NBYTES, dtype=torch.uint8)
  into = np.zeros(NBYTES // 2, np.uint8)
  tree = {"numpy": buf, "torch": t, "slice": rdt_jax.Slice((slice(NBYTES // 4, 3 * NBYTES // 4),), into)}
  return tree, {"numpy": buf, "torch": t.numpy(), "slice": into}


def expected(kind: str, seed: int) -> np.ndarray:
  full = value(seed)[kind]
  return full[NBYTES // 4 : 3 * NBYTES // 4] if kind == "slice" else full


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def ready(self) -> bool:
    return True

  def faults(self, spec: str | None) -> None:
    """Replaces this process's fault rules (`RDT_JAX_FAULTS`'s syntax)."""
    from rdt_jax import _faults

    _faults.configure(spec)

  def fetch(self, refs, seeds: list[int], timeout: float | None = None, abort: bool = False) -> dict:
    """Fetches every ref into targets of every kind filled with 0xA1; after
    the outcome, fills them with 0xB2, waits until no READ is in flight or
    parked, and reports, per kind, whether any byte changed since."""
    buffers = []
    for ref in refs:
      tree, bufs = make_targets()
      for b in bufs.values():
        b.fill(0xA1)
      rdt_jax.set_target_for_ref(ref, tree)
      buffers.append(bufs)
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
      # The very target objects come back, holding the producer's bytes.
      arrived = {
          kind: all(
              np.array_equal(rdt_jax.to_numpy(v[kind]), b[kind])
              and np.array_equal(b[kind], expected(kind, seed))
              for v, b, seed in zip(values, buffers, seeds)
          )
          for kind in KINDS
      }
    # Touched at all: a NIXL READ lands in rdt_jax's memory, never in a
    # target of a fetch that failed.
    touched = {kind: any(bool((b[kind] != 0xA1).any()) for b in buffers) for kind in KINDS}
    for bufs in buffers:
      for b in bufs.values():
        b.fill(0xB2)
    t = transport()
    wait_for(lambda: t.counters()["inflight"] == 0 and t.counters()["parked"] == 0, timeout=60)
    # Not a synchronization: a grace second in which a late write (one the
    # counters above no longer see) would land in the sentinel-filled buffers.
    time.sleep(1.0)
    return {
        "outcome": outcome,
        "arrived": arrived,
        "touched": touched,
        "late_write": {kind: any(bool((b[kind] != 0xB2).any()) for b in buffers) for kind in KINDS},
        "parked_total": t.counters()["parked_total"],
        "inflight": t.counters()["inflight"],
    }

  def _fetch_aborted(self, ref):
    """Starts a fetch, has Ray's abort reach it mid-transfer, then waits."""
    manager = ray._private.worker.global_worker.rdt_manager
    obj_id = ref.hex()
    meta = manager.wait_for_tensor_transport_metadata(obj_id, timeout=30)
    t = transport()
    request = t.fetch_multiple_tensors(obj_id, meta, None)
    t.abort_transport(obj_id, None)
    return dict(zip(KINDS, t.wait_fetch_complete(request)))

  def direct_reads(self) -> int:
    return transport().receive_stats()["direct"]


def start(cls, **env: str):
  return cls.options(runtime_env=worker_env(**env)).remote()


@pytest.fixture(scope="module")
def producer():
  p = start(Producer)
  yield p
  ray.kill(p)


@pytest.fixture(scope="module")
def remote_consumer():
  """Reads as from another host: node-local reads refused, READs over TCP."""
  c = start(Consumer, **REMOTE)
  yield c
  ray.kill(c)


@pytest.fixture(scope="module")
def local_consumer():
  """Reads node-locally, the default on one host."""
  c = start(Consumer)
  yield c
  ray.kill(c)


def with_faults(consumer, spec: str | None):
  """`consumer`, started, with exactly the fault rules of `spec`."""
  ray.get(consumer.faults.remote(spec))
  return consumer


def remote_with(rules: str | None, consumer):
  """The remote consumer with `rules` on top of its refused node-local reads."""
  return with_faults(consumer, ",".join(filter(None, [REMOTE["RDT_JAX_FAULTS"], rules])))


def check_no_late_write(report: dict, failed: bool = True) -> None:
  print(report)
  for kind in KINDS:
    assert not report["late_write"][kind], f"the {kind} target was written after its fetch ended: {report}"
  assert report["inflight"] == 0
  if failed:
    assert report["outcome"] != "ok", report
    for kind in KINDS:
      assert not report["touched"][kind], f"a failed NIXL READ wrote into the {kind} target: {report}"


def check_arrived(report: dict) -> None:
  assert report["outcome"] == "ok", report
  for kind in KINDS:
    assert report["arrived"][kind], f"the {kind} target does not hold the value: {report}"


def test_error_mid_transfer(producer, remote_consumer):
  consumer = remote_with("nixl.wait:fail*1", remote_consumer)
  ref = producer.make.remote(1)
  wait_meta(ref)
  report = ray.get(consumer.fetch.remote([ref], [1]), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  assert "injected fault at nixl.wait" in report["outcome"]
  # The same consumer, no fault left: the value arrives in the targets.
  check_arrived(ray.get(consumer.fetch.remote([ref], [1])))


def test_get_timeout_mid_transfer(producer, remote_consumer):
  consumer = remote_with("nixl.wait:delay=3*1", remote_consumer)
  ref = producer.make.remote(2)
  wait_meta(ref)
  report = ray.get(consumer.fetch.remote([ref], [2], 1.0), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  assert "Timeout" in report["outcome"] or "timed out" in report["outcome"]


def test_batched_get_timeout_drops_every_fetch(producer, remote_consumer):
  # Ray gives up every other fetch of a batch at the first timeout.
  consumer = remote_with("nixl.wait:delay=3", remote_consumer)
  refs = [producer.make.remote(10 + i) for i in range(3)]
  for ref in refs:
    wait_meta(ref)
  report = ray.get(consumer.fetch.remote(refs, [10, 11, 12], 1.0), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)


def test_abort_mid_transfer(producer, remote_consumer):
  consumer = remote_with("nixl.wait:delay=3*1", remote_consumer)
  ref = producer.make.remote(3)
  wait_meta(ref)
  report = ray.get(consumer.fetch.remote([ref], [3], None, True), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  assert "aborted" in report["outcome"]


def test_producer_dies_mid_read(remote_consumer):
  # The producer is stopped (SIGSTOP) so that the READ over TCP, which needs
  # its progress, stays in flight; then it is killed.
  producer = start(Producer)
  consumer = remote_with(None, remote_consumer)
  pid = ray.get(producer.__ray_call__.remote(lambda self: os.getpid()))
  first = producer.make.remote(40)
  wait_meta(first)
  # Connected, node-local reads refused: the next fetch posts its READ at once.
  check_arrived(ray.get(consumer.fetch.remote([first], [40])))
  ref = producer.make.remote(4)
  wait_meta(ref)
  os.kill(pid, signal.SIGSTOP)
  pending = consumer.fetch.remote([ref], [4], 30.0)
  # Not a synchronization: the kill lands 2 s into the fetch, its READ posted
  # (or, on a host too loaded to post it by then, before it: a producer that
  # dies before the read, which must not write late either).
  time.sleep(2.0)
  os.kill(pid, signal.SIGKILL)
  report = ray.get(pending, timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)


def test_node_local_read_failure(producer, local_consumer):
  # The default path on one host: the copy ends inside the fetch, so even a
  # failure leaves nothing that could write later.
  consumer = with_faults(local_consumer, "nixl.post:fail*1")
  ref = producer.make.remote(5)
  wait_meta(ref)
  report = ray.get(consumer.fetch.remote([ref], [5]), timeout=ERROR_BOUND_S * 4)
  check_no_late_write(report)
  assert "injected fault at nixl.post" in report["outcome"]
  before = ray.get(consumer.direct_reads.remote())
  check_arrived(ray.get(consumer.fetch.remote([ref], [5])))
  assert ray.get(consumer.direct_reads.remote()) > before, "the fetch was not read node-locally"


def test_consumer_dies_mid_read_with_a_target():
  # The caller's memory dies with the consumer; the producer frees the object
  # and holds nothing for it.
  producer = start(Producer)
  consumer = start(Consumer, **{**REMOTE, "RDT_JAX_FAULTS": "cma.read:fail,nixl.complete:kill"})
  ref = producer.make.remote(6)
  wait_meta(ref)
  with pytest.raises(ray.exceptions.RayActorError):
    ray.get(consumer.fetch.remote([ref], [6]), timeout=ERROR_BOUND_S * 4)
  del ref

  def freed() -> bool:
    c = ray.get(producer.__ray_call__.remote(lambda self: transport().counters()))
    return (c["objects"], c["registrations"]) == (0, 0)

  assert wait_for(freed, timeout=ERROR_BOUND_S)
  ray.kill(producer)


@pytest.mark.parametrize("path", ["node-local", "nixl-read"])
def test_targets_arrive_exact_on_both_paths(producer, local_consumer, remote_consumer, path):
  # Node-local reads write straight into the targets; NIXL READs are staged.
  consumer = with_faults(local_consumer, None) if path == "node-local" else remote_with(None, remote_consumer)
  ref = producer.make.remote(7)
  wait_meta(ref)
  check_arrived(ray.get(consumer.fetch.remote([ref], [7])))
