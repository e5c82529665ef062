"""Reproduces the rare stalled jax_nixl READ: brand-new consumers, all at once.

Each round, one producer actor puts a fresh object (a 4 MiB leaf read in
place and 64 small leaves packed into staging), and `--consumers` actors each
connect to it with a brand-new NIXL agent (a fresh `NixlTransport`, so a new
agent name and a new UCX connection, exactly what a new consumer process
brings) and read it, all at the same moment. Then the object is freed, so the
producer's progress poller goes idle between rounds, as it does in a fan-out
benchmark. A READ that is not DONE within `--stall-s` seconds is a stall.
Every value that arrives is checked with sha256 over its ordered bytes.

With `--fresh-actors` every round starts new consumer processes instead
(slow: a Ray actor start per consumer per round).

Usage:
  PYTHONPATH=. python scripts/repro_stall.py --rounds 200 --consumers 4

Prints one line per stall and a summary line:
  rounds 200, reads 800, stalls 0, wrong values 0, errors 0, p50 .. s, max .. s
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time

import numpy as np
import ray

import rdt_jax

rdt_jax.register()  # before the actor classes: their methods name jax_nixl


def _sha(x) -> str:
  a = np.ascontiguousarray(rdt_jax.to_numpy(x))
  return hashlib.sha256(f"{a.shape}{a.dtype.name}".encode() + a.tobytes()).hexdigest()


def _value(seed: int) -> dict:
  import jax.numpy as jnp

  rng = np.random.default_rng(seed)
  return {
      "big": jnp.asarray(rng.integers(0, 255, 4 << 20, dtype=np.uint8)),
      "small": [rng.standard_normal(64 + i).astype(np.float32) for i in range(64)],
  }


def _digests(value) -> list[str]:
  import jax

  return [_sha(x) for x in jax.tree_util.tree_leaves(value)]


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, seed: int):
    return _value(seed)

  def expected(self, seed: int) -> list[str]:
    return _digests(_value(seed))


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def __init__(self):
    from rdt_jax.transports.nixl import transport as _nixl

    if hasattr(_nixl, "STALL_RETRY_S"):  # measure the stall itself, not the retry
      _nixl.STALL_RETRY_S = float("inf")

  def ready(self) -> bool:
    return True

  def read_fresh(self, refs, stall_s: float, fresh_agent: bool) -> dict:
    """Reads refs[0] with a brand-new agent; returns time, outcome, digests."""
    import jax

    from rdt_jax.transports.nixl import NixlTransport

    manager = ray._private.worker.global_worker.rdt_manager
    obj_id = refs[0].hex()
    meta = manager.wait_for_tensor_transport_metadata(obj_id, timeout=60)
    transport = NixlTransport() if fresh_agent else _shared()
    t0 = time.monotonic()
    out: dict = {"agent": None}
    try:
      request = transport.fetch_multiple_tensors(obj_id, meta, None)
      out["agent"] = transport.agent().name
      leaves = transport.wait_fetch_complete(request, timeout=stall_s)
      out["outcome"] = "ok"
      treedef = jax.tree_util.tree_structure(_value(0))
      out["digests"] = _digests(jax.tree_util.tree_unflatten(treedef, leaves))
    except TimeoutError as e:
      out["outcome"] = f"stall: {e}"
    except Exception as e:
      out["outcome"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    out["seconds"] = time.monotonic() - t0
    if fresh_agent and transport._poller is not None:
      transport._poller._agent = None  # the consumer's poller never ran; let the agent go
    return out


def _shared():
  from ray.experimental.rdt.util import get_tensor_transport_manager

  return get_tensor_transport_manager("JAX_NIXL")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rounds", type=int, default=200)
  parser.add_argument("--consumers", type=int, default=4)
  parser.add_argument("--stall-s", type=float, default=10.0, help="a READ not done by then is a stall")
  parser.add_argument("--fresh-actors", action="store_true", help="new consumer processes every round")
  parser.add_argument("--out", default=None, help="write the summary as JSON here")
  args = parser.parse_args()

  rdt_jax.register()
  ray.init(
      address="local", num_cpus=args.consumers + 2, include_dashboard=False, logging_level=logging.WARNING,
      runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
  )
  producer = Producer.remote()
  consumers = [] if args.fresh_actors else [Consumer.remote() for _ in range(args.consumers)]
  ray.get([c.ready.remote() for c in consumers])
  times: list[float] = []
  stalls = wrong = errors = 0
  start = time.monotonic()
  for r in range(args.rounds):
    if args.fresh_actors:
      consumers = [Consumer.remote() for _ in range(args.consumers)]
      ray.get([c.ready.remote() for c in consumers])
    ref = producer.make.remote(r)
    expected = ray.get(producer.expected.remote(r))
    ray.wait([ref])
    results = ray.get(
        [c.read_fresh.remote([ref], args.stall_s, not args.fresh_actors) for c in consumers]
    )
    for i, res in enumerate(results):
      times.append(res["seconds"])
      if res["outcome"] == "ok":
        if res["digests"] != expected:
          wrong += 1
          print(f"round {r} consumer {i}: WRONG VALUE", flush=True)
      elif res["outcome"].startswith("stall"):
        stalls += 1
        print(f"round {r} consumer {i}: {res['outcome']} (agent {res['agent']})", flush=True)
      else:
        errors += 1
        print(f"round {r} consumer {i}: {res['outcome']}", flush=True)
    del ref
    if args.fresh_actors:
      for c in consumers:
        ray.kill(c)
    if (r + 1) % 25 == 0:
      print(f"[{time.monotonic() - start:6.0f} s] round {r + 1}: stalls {stalls}", file=sys.stderr, flush=True)
  ok_times = sorted(times)
  summary = {
      "rounds": args.rounds, "reads": len(times), "stalls": stalls, "wrong_values": wrong,
      "errors": errors, "p50_s": round(ok_times[len(ok_times) // 2], 4),
      "max_s": round(ok_times[-1], 3), "seconds": round(time.monotonic() - start, 1),
      "consumers": args.consumers, "fresh_actors": args.fresh_actors,
  }
  print(
      f"rounds {summary['rounds']}, reads {summary['reads']}, stalls {stalls}, wrong values {wrong}, "
      f"errors {errors}, p50 {summary['p50_s']} s, max {summary['max_s']} s, run {summary['seconds']} s"
  )
  if args.out:
    from rdt_jax.bench import _results

    _results.write(args.out, summary)
  ray.shutdown()
  return 1 if stalls or wrong or errors else 0


if __name__ == "__main__":
  sys.exit(main())
