"""Bounded state: a consumer that sees many short-lived producers returns to its baseline.

Producers are real actors, each started, read from and killed; one more
stays alive but idle. Two consumers read every object: one node-locally (the
default on one host), one through NIXL READs (node-local reads refused, as
for a producer on another host), so that both the per-producer staleness
records and the views of producers' agents (connections) are exercised.
Afterwards every counter of `NixlTransport.counters()` must return to its
baseline within `RDT_JAX_NIXL_PRODUCER_IDLE_S` (2 s here) and a margin, and
the progress poll must have stopped.

`RDT_JAX_TEST_PRODUCERS` sets the number of short-lived producers (8 by
default, two waves of four; `rdt-jax soak --churn 1000` runs the same check
at scale, docs/benchmarks/churn-1000.txt).
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest
import ray

import rdt_jax
from conftest import wait_for, wait_meta, worker_env
from rdt_jax import _limits

rdt_jax.register()

PRODUCERS = int(os.environ.get("RDT_JAX_TEST_PRODUCERS", "8"))
#: Producers alive at once.
WAVE = 4
IDLE = {"RDT_JAX_NIXL_PRODUCER_IDLE_S": "2"}
#: What a consumer holds once every producer is gone or idle.
BASELINE = {
    "objects": 0, "registrations": 0, "stuck": 0, "inflight": 0, "parked": 0, "views": 0,
    "producers": 0, "polling": 0, "exports": 0, "abort_marks": 0, "actors_known": 0,
}

RAY_NUM_CPUS = 16
pytestmark = pytest.mark.usefixtures("ray_session")


def transport():
  from ray.experimental.rdt.util import get_tensor_transport_manager

  return get_tensor_transport_manager("JAX_NIXL")


@ray.remote(enable_tensor_transport=True)
class ShortLived:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, seed: int):
    return {"x": np.full(1 << 18, seed % 251, np.uint8)}  # out of band


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def take(self, refs) -> int:
    value = ray.get(refs[0])
    return int(value["x"][0]) if bool((value["x"] == value["x"][0]).all()) else -1

  def counters(self) -> dict:
    gc.collect()
    return transport().counters()


def held(counters: dict) -> dict:
  return {k: counters[k] for k in BASELINE if counters[k] != BASELINE[k]}


def test_many_short_lived_producers_leave_nothing_behind(monkeypatch):
  monkeypatch.setattr(_limits, "ACTOR_ANSWER_IDLE_S", 2.0)  # this driver's cache of actor answers
  consumers = [
      Consumer.options(runtime_env=worker_env(**IDLE)).remote(),
      Consumer.options(runtime_env=worker_env(RDT_JAX_FAULTS="cma.read:fail", **IDLE)).remote(),
  ]
  idle_producer = ShortLived.remote()
  ref = idle_producer.make.remote(0)
  wait_meta(ref)
  assert ray.get([c.take.remote([ref]) for c in consumers]) == [0, 0]
  del ref
  t0 = time.monotonic()
  seen = []
  for start in range(0, PRODUCERS, WAVE):
    producers = [ShortLived.remote() for _ in range(min(WAVE, PRODUCERS - start))]
    refs = [p.make.remote(start + i + 1) for i, p in enumerate(producers)]
    for r in refs:
      wait_meta(r)
    got = ray.get([c.take.remote([r]) for r in refs for c in consumers], timeout=120)
    assert got == [(start + i + 1) % 251 for i in range(len(refs)) for _ in consumers]
    seen.append(ray.get([c.counters.remote() for c in consumers]))
    del refs
    for p in producers:
      ray.kill(p)
  print(f"{PRODUCERS} short-lived producers read by 2 consumers in {time.monotonic() - t0:.0f} s")
  # The state grew while producers came and went (the check below can fail).
  assert max(s[1]["views"] for s in seen) >= 2 and max(s[0]["producers"] for s in seen) >= 2

  def at_baseline() -> bool:
    return all(not held(c) for c in ray.get([c.counters.remote() for c in consumers]))

  assert wait_for(at_baseline, timeout=40), [held(c) for c in ray.get([c.counters.remote() for c in consumers])]
  # The driver's cached answers about actors expire ACTOR_ANSWER_IDLE_S after their last use.
  assert wait_for(lambda: transport().counters()["actors_known"] == 0, timeout=10), transport().counters()
  # A producer forgotten while idle is read again as usual.
  ref = idle_producer.make.remote(7)
  wait_meta(ref)
  assert ray.get([c.take.remote([ref]) for c in consumers]) == [7, 7]
  ray.kill(idle_producer)
  for c in consumers:
    ray.kill(c)
