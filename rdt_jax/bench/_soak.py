"""`rdt-jax soak`: the trainer -> generators weight-sync loop, for N minutes.

A JAX trainer updates a pytree of parameters each step (leaf sizes vary from
step to step, a few KiB to several MiB) and puts it once over the chosen
transport; every generator receives it into its existing torch tensors
(`rdt_jax.set_target_for_ref`) and checks a checksum of every leaf. The loop
counts steps, transfers, bytes and errors (an error is counted and the loop
goes on), samples each actor's RSS for the high-water mark, and at the end
checks that no registered memory is left behind. Exit status 1 if any
transfer failed, a checksum differed or registrations leaked.

`--chaos` runs the chaos soak instead (`rdt_jax.bench._chaos`): several
producers and consumers, refs freed and actors killed at random, timeouts
firing mid-transfer, every value checked by sha256.

`--weight-sync` runs the weight-sync soak instead (`rdt_jax.bench._weight_soak`):
a trainer's `WeightPublisher` and generators' `WeightSubscriber`s (one colocated
in the trainer) pulling concurrently while generators and trainers are killed
and publishers recreated; every pulled version checked by digest, and versions
going back, hangs, late writes and leaks counted.

`--churn N` runs the producer-churn check instead: N short-lived producer
actors (a few alive at once), each read by two consumers (one node-locally,
one through NIXL READs) and killed; then every counter of each consumer's
`counters()` must return to its baseline (producers are forgotten once idle,
`RDT_JAX_NIXL_PRODUCER_IDLE_S`, 60 s by default). Exit status 1 on a wrong
value or a counter left above its baseline.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import time
from typing import Any

import numpy as np
import ray

import rdt_jax
from rdt_jax import _settings
from rdt_jax.bench import _cases, _chaos, _env, _weight_soak


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--minutes", type=float, default=5.0, help="how long to run")
  parser.add_argument("--generators", type=int, default=None,
                      help="generator actors (default 3; --weight-sync: 4, one of them the trainer itself)")
  parser.add_argument("--mb", type=float, default=None,
                      help="largest parameter size in MiB (default 64; --weight-sync: 4)")
  parser.add_argument("--transport", default="jax_nixl", help="one-sided rdt_jax transport")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="write the report as JSON here")
  _chaos.add_chaos_arguments(parser)
  _weight_soak.add_weight_sync_arguments(parser)
  parser.add_argument("--churn", type=int, default=0, help="run the producer-churn check with this many producers")


def _layer_sizes(step: int, max_mb: float) -> list[int]:
  """Leaf sizes (float32 elements) for a step: mixed, and changing per step."""
  rng = np.random.default_rng(step % 7)  # seven shapes in rotation
  big = int(max_mb * (1 << 20) / 4 * rng.uniform(0.5, 1.0))
  return [big // 2, big // 4, big // 8, 1024, 4096, 16, *rng.integers(1, 50_000, 6).tolist()]


def _checksum(x: Any) -> int:
  """CRC-32 of every byte of a leaf, in order (`_cases.ordered_checksum`)."""
  return _cases.ordered_checksum([rdt_jax.to_numpy(x)])


def _rss() -> int:
  import psutil

  return psutil.Process().memory_info().rss


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Trainer:
  def __init__(self, transport: str, max_mb: float):
    self.transport, self.max_mb, self.peak = transport, max_mb, _rss()

  def step(self, step: int) -> tuple[list, list[int], int]:
    import jax.numpy as jnp

    params = [jnp.full((n,), float(step + i), jnp.float32) for i, n in enumerate(_layer_sizes(step, self.max_mb))]
    sums = [_checksum(p) for p in params]
    ref = ray.put(params, _tensor_transport=self.transport)
    self.peak = max(self.peak, _rss())
    return [ref], sums, sum(p.nbytes for p in params)

  def report(self) -> dict:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    t: Any = get_tensor_transport_manager(self.transport.upper())
    regs = t.counters().get("registrations")
    return {"rss_peak": max(self.peak, _rss()), "registrations": regs}


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Generator:
  def __init__(self):
    self.params: dict[int, Any] = {}
    self.peak = _rss()

  def sync(self, refs: list, sums: list[int], step: int) -> bool:

    key = step % 7  # the trainer's shapes repeat every seven steps
    if key in self.params:  # receive straight into this shape's tensors
      rdt_jax.set_target_for_ref(refs[0], self.params[key])
    received = ray.get(refs[0])
    if key not in self.params:  # first step of this shape: keep torch copies
      self.params[key] = [rdt_jax.to_torch(x).clone() for x in received]
    self.peak = max(self.peak, _rss())
    return [_checksum(x) for x in received] == sums

  def report(self) -> dict:
    return {"rss_peak": max(self.peak, _rss())}


#: Counters of a consumer that must be zero once its producers are gone or idle.
CHURN_BASELINE_KEYS = ("objects", "registrations", "stuck", "inflight", "parked", "views", "producers", "polling")


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _ChurnConsumer:
  def take(self, refs: list) -> int:
    x = ray.get(refs[0])["x"]
    return int(x[0]) if bool((x == x[0]).all()) else -1

  def counters(self) -> dict:
    import gc

    from ray.experimental.rdt.util import get_tensor_transport_manager

    gc.collect()
    return get_tensor_transport_manager("JAX_NIXL").counters()  # type: ignore[attr-defined]


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _ShortLived:
  def make(self, seed: int) -> list:
    """A ref (owned here) to an out-of-band object, in a list: lent on as is."""
    return [ray.put({"x": np.full(1 << 18, seed % 251, np.uint8)}, _tensor_transport="jax_nixl")]


def run_churn(args: argparse.Namespace) -> int:
  """The producer-churn check (see the module docstring)."""
  rdt_jax.register()
  ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level=logging.ERROR)
  remote = {"env_vars": {"RDT_JAX_FAULTS": "cma.read:fail", "RDT_JAX_FAULTS_ENABLE": "1"}}
  consumers = [
      _ChurnConsumer.remote(), _ChurnConsumer.options(runtime_env=remote).remote()  # type: ignore[attr-defined]
  ]
  start = time.monotonic()
  wrong, peak = 0, dict.fromkeys(CHURN_BASELINE_KEYS, 0)
  wave = 8
  for first in range(0, args.churn, wave):
    producers = [_ShortLived.remote() for _ in range(min(wave, args.churn - first))]  # type: ignore[attr-defined]
    refs = ray.get([p.make.remote(first + i) for i, p in enumerate(producers)], timeout=300)
    got = ray.get([c.take.remote(r) for r in refs for c in consumers], timeout=300)
    wrong += sum(g != (first + i // 2) % 251 for i, g in enumerate(got))
    for c in ray.get([c.counters.remote() for c in consumers]):
      peak = {k: max(peak[k], c[k]) for k in peak}
    del refs
    for p in producers:
      ray.kill(p)
    print(f"\r[churn] {first + len(producers)} producers, {time.monotonic() - start:5.0f} s", end="",
          file=sys.stderr, flush=True)
  churned = time.monotonic() - start
  settle_until = time.monotonic() + float(_settings.value("RDT_JAX_NIXL_PRODUCER_IDLE_S")) + 30
  while True:
    final = ray.get([c.counters.remote() for c in consumers])
    held = [{k: c[k] for k in CHURN_BASELINE_KEYS if c[k]} for c in final]
    if not any(held) or time.monotonic() > settle_until:
      break
    time.sleep(1.0)
  settled = time.monotonic() - start - churned
  ray.shutdown()
  print(file=sys.stderr)
  print(f"churn: {args.churn} short-lived producers read by 2 consumers in {churned:.0f} s, wrong values {wrong}")
  print("peak while churning: " + ", ".join(f"{k} {v}" for k, v in peak.items()))
  print(f"after {settled:.0f} s: " + "; ".join(
      f"consumer {i}: " + ", ".join(f"{k} {c[k]}" for k in CHURN_BASELINE_KEYS) for i, c in enumerate(final)
  ))
  if args.out is not None:
    _env.write_json(args.out, {"producers": args.churn, "seconds": round(churned, 1), "wrong_values": wrong,
                               "peak": peak, "final": final, "settle_s": round(settled, 1)})
  return 1 if wrong or any(held) else 0


def run(args: argparse.Namespace) -> int:
  if args.weight_sync:
    args.generators = 4 if args.generators is None else args.generators
    args.mb = 4.0 if args.mb is None else args.mb
    return _weight_soak.run_weight_sync(args)
  args.generators = 3 if args.generators is None else args.generators
  args.mb = 64.0 if args.mb is None else args.mb
  if args.chaos:
    return _chaos.run_chaos(args)
  if args.churn:
    return run_churn(args)
  rdt_jax.register()
  # A Ray of its own, never a cluster another process started here.
  ray.init(address="local", num_cpus=args.generators + 2, include_dashboard=False, logging_level=logging.WARNING)
  trainer = _Trainer.remote(args.transport, args.mb)  # type: ignore[attr-defined]
  generators = [_Generator.remote() for _ in range(args.generators)]  # type: ignore[attr-defined]
  deadline = time.monotonic() + args.minutes * 60
  stats = {"steps": 0, "transfers": 0, "bytes": 0, "errors": 0, "mismatches": 0}
  errors: list[str] = []
  last_print = 0.0
  start = time.monotonic()
  while time.monotonic() < deadline:
    step = stats["steps"]
    try:
      refs, sums, nbytes = ray.get(trainer.step.remote(step))
      results = ray.get([g.sync.remote(refs, sums, step) for g in generators], timeout=120)
      stats["transfers"] += len(results)
      stats["bytes"] += nbytes * len(results)
      stats["mismatches"] += results.count(False)
    except Exception as e:
      stats["errors"] += 1
      errors.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
    stats["steps"] += 1
    now = time.monotonic()
    if now - last_print > 5:
      last_print = now
      print(
          f"\r[soak] {now - start:6.0f} s  steps {stats['steps']}  transfers {stats['transfers']}  "
          f"{stats['bytes'] / 2**30:7.2f} GiB  errors {stats['errors']}",
          end="", file=sys.stderr, flush=True,
      )
  del refs
  time.sleep(2)  # let Ray free the last object
  report = {
      "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
      "seconds": round(time.monotonic() - start, 1),
      **stats,
      "trainer": ray.get(trainer.report.remote()),
      "generators": ray.get([g.report.remote() for g in generators]),
      "first_errors": errors[:10],
  }
  ray.shutdown()
  print(file=sys.stderr)
  gib = report["bytes"] / 2**30
  print(f"soak: {report['seconds']} s, {report['steps']} steps, {report['transfers']} transfers, "
        f"{gib:.2f} GiB ({gib / max(report['seconds'], 1e-9):.2f} GiB/s), errors {report['errors']}, "
        f"checksum mismatches {report['mismatches']}")
  print(f"RSS high-water: trainer {report['trainer']['rss_peak'] >> 20} MiB, generators "
        + ", ".join(f"{g['rss_peak'] >> 20} MiB" for g in report["generators"]))
  print(f"trainer registrations left: {report['trainer']['registrations']}")
  if args.out is not None:
    _env.write_json(args.out, report)
  leaked = report["trainer"]["registrations"] not in (0, None)
  return 1 if report["errors"] or report["mismatches"] or leaked else 0
