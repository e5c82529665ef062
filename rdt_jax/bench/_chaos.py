"""`rdt-jax soak --chaos`: several producers and consumers under forced faults.

Producers put values mixing jax, torch and numpy leaves (sizes drawn per
step, a few bytes to several MiB) over the transport and report a sha256
digest of each value's ordered bytes (and of the value with its large leaf
sliced). Consumers fetch random live refs, in turn into a new value, into
targets (numpy and torch arrays, `rdt_jax.set_target_for_ref`) and with the
large leaf sliced into a numpy buffer (`rdt_jax.Slice(into=)`),
and return the digest of what arrived; every arrival is compared. Meanwhile
refs are freed at random, a producer or a consumer is killed at random (and
replaced), some gets carry a short timeout while the consumers' waits are
delayed by fault injection (`RDT_JAX_FAULTS`), so timeouts fire mid-transfer.
Every setting is the default. Half the consumers read node-locally (the
default on one host); the others have node-local reads refused (the
`cma.read` fault point, as a kernel that forbids them does) so that they read
through NIXL as from another host.

Every fetch ends one of three ways: the exact value; a Ray error within
`ERROR_BOUND_S`; or a hang (no answer within the bound), which fails the run.
After a failed fetch into targets the consumer fills them with a sentinel and
checks it at every later round and at the end: a changed byte is a late
write, which fails the run. At the end every ref is dropped and each live
actor must be back to its baseline on every counter of its transport's
`counters()` (registrations, objects, READs in flight or parked, views of
other agents, producers tracked, the progress poll, abort marks) and hold no
pooled host memory; producers are forgotten once idle
(`RDT_JAX_NIXL_PRODUCER_IDLE_S`, 60 s by default), so the end waits that long.
Exit status 1 on any wrong value, hang, non-Ray error, late write or leak.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import sys
import time
from typing import Any

import numpy as np
import ray

import rdt_jax
from rdt_jax import _dlpack, _settings
from rdt_jax.bench import _env

#: A fetch that has neither arrived nor failed by then counts as a hang.
ERROR_BOUND_S = 60.0
#: Fault rules for consumers: 10% of waits see their READ in flight 0.5 s longer.
CONSUMER_FAULTS = "nixl.wait:delay=0.5~0.1"
#: A get with a timeout (sometimes shorter than the injected delay).
SHORT_TIMEOUT_S = 0.3
#: Consumers reading as from another host: node-local reads refused.
REMOTE_CONSUMER_FAULTS = CONSUMER_FAULTS + ",cma.read:fail"
#: How a consumer receives a value: a new value, into targets, a slice into a buffer.
MODES = ("new", "targets", "slice")
#: The byte that fills the targets of a failed fetch.
SENTINEL = 0x5A
#: Counters that must return to zero at the end (`DlpackTransport.counters`).
BASELINE_KEYS = ("registrations", "stuck", "inflight", "parked", "objects", "views", "producers", "polling",
                 "pool_in_use")


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


def sliced(value: dict) -> dict:
  """`value` with its large leaf cut to the part a "slice" fetch asks for."""
  n = value["jax"].shape[0]
  return {**value, "jax": value["jax"][n // 4 : n // 2]}


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

  from rdt_jax import _faults, _memory

  gc.collect()  # delivered values can sit in reference cycles until the next collection
  t: Any = get_tensor_transport_manager("JAX_NIXL")
  return {
      **t.counters(),
      "pool_in_use": _memory.host_pool.bytes_in_use(),
      "faults": sum(_faults.injected().values()),
  }


def _targets_for(shapes: dict, mode: str) -> tuple[Any, list[np.ndarray]]:
  """A target tree for a value of `shapes` (`_Producer.put`), and the host
  bytes of each buffer in it."""
  import torch

  if mode == "slice":
    n = shapes["jax"]
    into = np.empty(n // 2 - n // 4, np.uint8)
    tree: dict[str, Any] = {
        "jax": rdt_jax.Slice((slice(n // 4, n // 2),), into),
        "torch": torch.empty(shapes["torch"], dtype=torch.float32),
        "numpy": np.empty(shapes["numpy"], np.int32),
        "small": [np.empty(m, np.float32) for m in shapes["small"]],
    }
  else:
    tree = {
        "jax": np.empty(shapes["jax"], np.uint8),
        "torch": torch.empty(shapes["torch"], dtype=torch.float32),
        "numpy": np.empty(shapes["numpy"], np.int32),
        "small": [torch.empty(m, dtype=torch.float32) for m in shapes["small"]],
    }
  buffers = []
  for leaf in (tree["jax"], tree["torch"], tree["numpy"], *tree["small"]):
    buf = leaf.into if isinstance(leaf, rdt_jax.Slice) else leaf
    buffers.append(np.asarray(rdt_jax.to_numpy(buf)).view(np.uint8).reshape(-1))
  return tree, buffers


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Producer:
  def put(self, seed: int, transport: str) -> tuple[list, dict[str, str], int, dict[str, Any]]:
    value = make_value(seed)
    ref = ray.put(value, _tensor_transport=transport)
    nbytes = sum(x.nbytes for x in (value["jax"], value["numpy"], *value["small"])) + value["torch"].numel() * 4
    shapes = {
        "jax": value["jax"].shape[0], "torch": value["torch"].numel(), "numpy": value["numpy"].shape[0],
        "small": [x.shape[0] for x in value["small"]],
    }
    return [ref], {"new": digest(value), "targets": digest(value), "slice": digest(sliced(value))}, int(nbytes), shapes

  def counters(self) -> dict:
    return _counters()


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Consumer:
  def __init__(self) -> None:
    self.failed: list[np.ndarray] = []  # host bytes of the targets of failed fetches, sentinel-filled

  def fetch(self, refs: list, timeout: float | None, mode: str, shapes: dict) -> str:
    buffers: list[np.ndarray] = []
    if mode != "new":
      tree, buffers = _targets_for(shapes, mode)
      rdt_jax.set_target_for_ref(refs[0], tree)
    try:
      return digest(ray.get(refs[0], timeout=timeout))
    except BaseException:
      for b in buffers:  # the caller may reuse them at once: nothing may write them now
        b.fill(SENTINEL)
      self.failed = [*self.failed, *buffers][-64:]
      raise

  def counters(self) -> dict:
    late = sum(1 for b in self.failed if bool((b != SENTINEL).any()))
    return {**_counters(), "late_writes": late}


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
    # Kinds in turn, not at random: a short run on a loaded host still fetches
    # each kind once in its first three fetches.
    mode = MODES[sum(stats["fetches_" + m] for m in MODES) % len(MODES)]
    stats["fetches_" + mode] += 1
    calls.append((item, mode, c.fetch.remote(item[0], timeout, mode, item[3]), time.monotonic()))
  for (_refs, wants, nbytes, _shapes), mode, call, t0 in calls:
    want = wants[mode]
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

  def consumer_env(i: int) -> dict:
    faults = CONSUMER_FAULTS if i % 2 == 0 else REMOTE_CONSUMER_FAULTS
    return {"env_vars": {"RDT_JAX_FAULTS": faults, "RDT_JAX_FAULTS_ENABLE": "1"}}

  # A Ray of its own, never a cluster another process started here.
  ray.init(
      address="local", num_cpus=args.producers + args.consumers + 4, include_dashboard=False,
      logging_level=logging.ERROR,
  )
  rng = random.Random(args.seed)
  producers = [_Producer.remote() for _ in range(args.producers)]  # type: ignore[attr-defined]
  consumers = [
      _Consumer.options(runtime_env=consumer_env(i)).remote() for i in range(args.consumers)  # type: ignore[attr-defined]
  ]
  live: list[tuple[list, dict, int, dict]] = []  # (refs, digest per mode, nbytes, shapes) of refs still held
  stats = {"steps": 0, "transfers": 0, "bytes": 0, "wrong_values": 0, "ray_errors": 0, "timeouts": 0,
           "hangs": 0, "other_errors": 0, "kills": 0, "frees": 0, "max_error_s": 0.0,
           **{"fetches_" + m: 0 for m in MODES}}
  errors: list[str] = []
  start = time.monotonic()
  deadline = start + args.minutes * 60
  # The first kill comes in the run's first half at the latest, so that a short
  # run has one (a long run's draw is almost never capped).
  next_kill = start + min(rng.expovariate(1 / args.kill_every), args.minutes * 30)
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
        consumers[i] = _Consumer.options(runtime_env=consumer_env(i)).remote()  # type: ignore[attr-defined]
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

  # Producers are forgotten once idle for RDT_JAX_NIXL_PRODUCER_IDLE_S.
  settle_until = time.monotonic() + float(_settings.value("RDT_JAX_NIXL_PRODUCER_IDLE_S")) + 30
  counters = leaks()
  while any(c[k] for c in counters for k in BASELINE_KEYS) and time.monotonic() < settle_until:
    time.sleep(1.0)
    counters = leaks()
  leaked = sum(1 for c in counters for k in BASELINE_KEYS if c[k])
  late_writes = sum(c["late_writes"] for c in counters if "late_writes" in c)
  report = {
      "config": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in vars(args).items()},
      "seconds": round(time.monotonic() - start, 1),
      **stats,
      "faults_injected": sum(c["faults"] for c in counters) + stats["kills"],
      "parked_reads": sum(c["parked_total"] for c in counters),
      "leaks": leaked,
      "late_writes": late_writes,
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
      f"{stats['other_errors']}, late writes {late_writes}, leaks {leaked}"
  )
  print(
      f"fetches: new {stats['fetches_new']}, into targets {stats['fetches_targets']}, "
      f"sliced into a buffer {stats['fetches_slice']}"
  )
  if args.out is not None:
    _env.write_json(args.out, report)
  bad = stats["wrong_values"] or stats["hangs"] or stats["other_errors"] or leaked or late_writes
  return 1 if bad else 0
