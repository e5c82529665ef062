"""`rdt-jax soak --chaos`: several producers and consumers under forced faults.

Producers put values mixing jax, torch and numpy leaves (sizes drawn per
step, a few bytes to several MiB) over the transport and report a sha256
digest of each value's ordered bytes. Consumers fetch random live refs and
return the digest of what arrived; every arrival is compared. Meanwhile refs
are freed at random, a producer or a consumer is killed at random (and
replaced), some gets carry a short timeout while the consumers' waits are
delayed by fault injection (`RDT_JAX_FAULTS`), so timeouts fire mid-transfer.

Every fetch ends one of three ways: the exact value; a Ray error within
`ERROR_BOUND_S`; or a hang (no answer within the bound), which fails the run.
At the end every ref is dropped and each live actor must be back to its
baseline: no registrations outside the buffer pool, no READ in flight or
parked, no pooled host memory held. Exit status 1 on any wrong value, hang,
non-Ray error or leak.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import time
from typing import Any

import numpy as np
import ray

import rdt_jax
from rdt_jax import _dlpack

#: A fetch that has neither arrived nor failed by then counts as a hang.
ERROR_BOUND_S = 60.0
#: Fault rules for consumers: 10% of waits see their READ in flight 0.5 s longer.
CONSUMER_FAULTS = "nixl.wait:delay=0.5~0.1"
#: A get with a timeout (sometimes shorter than the injected delay).
SHORT_TIMEOUT_S = 0.3


def digest(value: Any) -> str:
  """sha256 over every array leaf's path, shape, dtype name and ordered bytes."""
  import jax

  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
    if _dlpack.is_array(leaf):
      a = np.ascontiguousarray(rdt_jax.to_numpy(leaf))
      h.update(f"{jax.tree_util.keystr(path)}|{a.shape}|{a.dtype.name}|".encode())
      h.update(a.tobytes())
  return h.hexdigest()


def make_value(seed: int) -> dict:
  """A value of mixed jax/torch/numpy leaves, drawn from `seed`."""
  import jax.numpy as jnp
  import torch

  rng = np.random.default_rng(seed)
  big = int(rng.integers(1 << 10, 8 << 20))
  return {
      "jax": jnp.asarray(rng.integers(0, 255, big, dtype=np.uint8)),
      "torch": torch.from_numpy(rng.standard_normal(int(rng.integers(1, 60_000))).astype(np.float32)),
      "numpy": rng.integers(0, 1 << 30, int(rng.integers(1, 4_000))).astype(np.int32),
      "small": [jnp.asarray(rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32)) for _ in range(3)],
      "step": seed,
  }


def _counters() -> dict:
  import gc

  from ray.experimental.rdt.util import get_tensor_transport_manager

  from rdt_jax import _dlpack, _faults

  gc.collect()  # delivered values can sit in reference cycles until the next collection
  t: Any = get_tensor_transport_manager("JAX_NIXL")
  return {
      "registrations": t.num_registrations(),
      "inflight": t.num_inflight(),
      "parked": t.num_parked(),
      "pool_in_use": _dlpack.host_pool.bytes_in_use(),
      "objects": t.num_objects(),
      "faults": sum(_faults.injected().values()),
      "parked_total": t.parked_total,
  }


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Producer:
  def put(self, seed: int, transport: str) -> tuple[list, str, int]:
    value = make_value(seed)
    ref = ray.put(value, _tensor_transport=transport)
    nbytes = sum(x.nbytes for x in (value["jax"], value["numpy"], *value["small"])) + value["torch"].numel() * 4
    return [ref], digest(value), int(nbytes)

  def counters(self) -> dict:
    return _counters()


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Consumer:
  def fetch(self, refs: list, timeout: float | None) -> str:
    return digest(ray.get(refs[0], timeout=timeout))

  def counters(self) -> dict:
    return _counters()


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--chaos", action="store_true", help="run the chaos soak instead")
  parser.add_argument("--producers", type=int, default=2, help="chaos: producer actors")
  parser.add_argument("--consumers", type=int, default=3, help="chaos: consumer actors")
  parser.add_argument("--kill-every", type=float, default=15.0, help="chaos: seconds between kills, on average")
  parser.add_argument("--seed", type=int, default=0, help="chaos: random seed")


def _fetch_round(
    rng: random.Random, consumers: list, live: list, stats: dict, errors: list[str]
) -> None:
  """Each consumer fetches a random live ref; every outcome is classified."""
  calls = []
  for c in consumers:
    item = rng.choice(live)
    timeout = SHORT_TIMEOUT_S if rng.random() < 0.2 else None
    calls.append((item, timeout, c.fetch.remote(item[0], timeout), time.monotonic()))
  for (_refs, want, nbytes), _timeout, call, t0 in calls:
    try:
      got = ray.get(call, timeout=ERROR_BOUND_S)
    except ray.exceptions.GetTimeoutError as e:
      if isinstance(e, ray.exceptions.RayTaskError):  # the consumer's own get timed out
        stats["timeouts"] += 1
        stats["max_error_s"] = max(stats["max_error_s"], round(time.monotonic() - t0, 2))
        continue
      stats["hangs"] += 1
      errors.append(f"step {stats['steps']}: no answer within {ERROR_BOUND_S} s")
      continue
    except ray.exceptions.RayError as e:
      elapsed = time.monotonic() - t0
      stats["max_error_s"] = max(stats["max_error_s"], round(elapsed, 2))
      if "GetTimeoutError" in repr(e) or "timed out" in str(e):
        stats["timeouts"] += 1
      else:
        stats["ray_errors"] += 1
        if len(errors) < 20:
          errors.append(f"step {stats['steps']}: {type(e).__name__}: {str(e)[:200]}")
      continue
    except Exception as e:  # counted: only Ray errors are allowed
      stats["other_errors"] += 1
      errors.append(f"step {stats['steps']}: {type(e).__name__}: {e}")
      continue
    stats["transfers"] += 1
    stats["bytes"] += nbytes
    if got != want:
      stats["wrong_values"] += 1
      errors.append(f"step {stats['steps']}: WRONG VALUE")


def run_chaos(args: argparse.Namespace) -> int:
  rdt_jax.register()
  env = {"env_vars": {"RDT_JAX_FAULTS": CONSUMER_FAULTS, "RDT_JAX_FAULTS_ENABLE": "1"}}
  # A Ray of its own, never a cluster another process started here.
  ray.init(
      address="local", num_cpus=args.producers + args.consumers + 4, include_dashboard=False,
      logging_level=logging.ERROR,
  )
  rng = random.Random(args.seed)
  producers = [_Producer.remote() for _ in range(args.producers)]  # type: ignore[attr-defined]
  consumers = [_Consumer.options(runtime_env=env).remote() for _ in range(args.consumers)]  # type: ignore[attr-defined]
  live: list[tuple[list, str, int]] = []  # (refs, digest, nbytes) of refs still held
  stats = {"steps": 0, "transfers": 0, "bytes": 0, "wrong_values": 0, "ray_errors": 0, "timeouts": 0,
           "hangs": 0, "other_errors": 0, "kills": 0, "frees": 0, "max_error_s": 0.0}
  errors: list[str] = []
  start = time.monotonic()
  deadline = start + args.minutes * 60
  next_kill = start + rng.expovariate(1 / args.kill_every)
  last_print = 0.0
  transport = args.transport
  while time.monotonic() < deadline:
    stats["steps"] += 1
    now = time.monotonic()
    if now >= next_kill:  # kill a producer or a consumer, and replace it
      next_kill = now + rng.expovariate(1 / args.kill_every)
      stats["kills"] += 1
      if rng.random() < 0.5:
        i = rng.randrange(len(producers))
        ray.kill(producers[i])
        producers[i] = _Producer.remote()  # type: ignore[attr-defined]
      else:
        i = rng.randrange(len(consumers))
        ray.kill(consumers[i])
        consumers[i] = _Consumer.options(runtime_env=env).remote()  # type: ignore[attr-defined]
    try:
      live.append(ray.get(rng.choice(producers).put.remote(stats["steps"], transport), timeout=ERROR_BOUND_S))
    except ray.exceptions.RayError:
      pass  # its producer was just killed
    while len(live) > 6 or (live and rng.random() < 0.3):  # free refs at random
      live.pop(rng.randrange(len(live)))
      stats["frees"] += 1
    if not live:
      continue
    _fetch_round(rng, consumers, live, stats, errors)
    if now - last_print > 5:
      last_print = now
      print(f"\r[chaos] {now - start:6.0f} s  transfers {stats['transfers']}  "
            f"errors {stats['ray_errors']}  timeouts {stats['timeouts']}  kills {stats['kills']}  "
            f"wrong {stats['wrong_values']}", end="", file=sys.stderr, flush=True)
  live.clear()
  actors = producers + consumers

  def leaks() -> list[dict]:
    out = []
    for a in actors:
      c = ray.get(a.counters.remote(), timeout=ERROR_BOUND_S)
      out.append(c)
    return out

  settle_until = time.monotonic() + 30
  counters = leaks()
  keys = ("registrations", "inflight", "parked", "pool_in_use", "objects")
  while any(c[k] for c in counters for k in keys) and time.monotonic() < settle_until:
    time.sleep(0.5)
    counters = leaks()
  leaked = sum(1 for c in counters for k in keys if c[k])
  report = {
      "config": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in vars(args).items()},
      "seconds": round(time.monotonic() - start, 1),
      **stats,
      "faults_injected": sum(c["faults"] for c in counters) + stats["kills"],
      "parked_reads": sum(c["parked_total"] for c in counters),
      "leaks": leaked,
      "actors_at_end": counters,
      "first_errors": errors[:10],
  }
  ray.shutdown()
  print(file=sys.stderr)
  gib = report["bytes"] / 2**30
  print(
      f"chaos soak: {report['seconds']} s, {report['transfers']} transfers, {gib:.2f} GiB, "
      f"faults injected {report['faults_injected']} (kills {stats['kills']}, delayed waits "
      f"{report['faults_injected'] - stats['kills']}), Ray errors {stats['ray_errors']}, timeouts "
      f"{stats['timeouts']}, slowest error {stats['max_error_s']} s (bound {ERROR_BOUND_S:.0f} s), "
      f"parked READs {report['parked_reads']}, refs freed {stats['frees']}"
  )
  print(
      f"wrong values {stats['wrong_values']}, hangs {stats['hangs']}, other errors "
      f"{stats['other_errors']}, leaks {leaked}"
  )
  if args.out is not None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
  bad = stats["wrong_values"] or stats["hangs"] or stats["other_errors"] or leaked
  return 1 if bad else 0
