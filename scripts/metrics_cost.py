"""What rdt_jax's Ray metrics cost a weight pull: the microbenchmark.

Measures, in one run:
* the cost of counting one pull (`rdt_jax._metrics.count_pull`, the whole
  per-pull work of the metrics: a few dict additions under a lock), as the
  mean of 200,000 calls, in this process;
* a 4 KiB pull (node-local, torch template) with metrics on and with
  `RDT_JAX_METRICS=0`, by two generator actors pulling each version of one
  trainer in turn (medians of `--pulls` pulls each);

and prints the figures as markdown; with `--out PATH` it also writes
`PATH.json` and `PATH.md`. Exit status 1 if counting costs 1% of a 4 KiB
pull or more (the target: under 1%).

Run:  python scripts/metrics_cost.py [--pulls 400] [--out docs/benchmarks/metrics-cost]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import timeit

import numpy as np
import ray

import rdt_jax


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self):
    self.pub = rdt_jax.WeightPublisher(keep=2)

  def publish(self, version: int):
    import jax.numpy as jnp

    return self.pub.publish({"w": jnp.full((64, 16), version, jnp.float32)}, version=version)


@ray.remote(enable_tensor_transport=True)
class Generator:
  def __init__(self):
    import torch

    self.sub = rdt_jax.WeightSubscriber({"w": torch.zeros(64, 16)})

  def pull(self, handle) -> float:
    t0 = time.perf_counter()
    self.sub.pull(handle)
    return time.perf_counter() - t0


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pulls", type=int, default=400)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  from rdt_jax import _metrics

  n = 200_000
  count_s = timeit.timeit(lambda: _metrics.count_pull("weights", "node_local", "ok", 4096, 1e-3, 0), number=n) / n
  rdt_jax.register()
  ray.init(address="local", include_dashboard=False, num_cpus=3, log_to_driver=False)
  trainer = Trainer.remote()
  gens = {on: Generator.options(runtime_env={"env_vars": {"RDT_JAX_METRICS": on}}).remote() for on in ("1", "0")}
  times: dict[str, list[float]] = {"1": [], "0": []}
  for version in range(1, args.pulls + 2):
    handle = ray.get(trainer.publish.remote(version))
    for on, g in gens.items():
      s = ray.get(g.pull.remote(handle))
      if version > 1:  # the first pull makes the plan
        times[on].append(s)
  ray.shutdown()
  on_ms, off_ms = (statistics.median(times[k]) * 1e3 for k in ("1", "0"))
  share = count_s * 1e3 / off_ms * 100
  result = {
      "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pulls": args.pulls, "calls": n,
      "count_us": round(count_s * 1e6, 3), "pull_on_ms": round(on_ms, 4), "pull_off_ms": round(off_ms, 4),
      "share_pct": round(share, 3),
  }
  text = (
      f"Metrics cost ({result['when']}, `python scripts/metrics_cost.py --pulls {args.pulls}`):\n\n"
      "| measure | value |\n| --- | --- |\n"
      f"| counting one pull (`_metrics.count_pull`, mean of {n:,} calls) | {result['count_us']} us |\n"
      f"| 4 KiB pull, metrics on (median of {args.pulls}) | {result['pull_on_ms']} ms |\n"
      f"| 4 KiB pull, `RDT_JAX_METRICS=0` (median of {args.pulls}) | {result['pull_off_ms']} ms |\n"
      f"| counting as a share of the 4 KiB pull | {result['share_pct']}% (target: under 1%) |\n"
  )
  if args.out:
    from rdt_jax.bench._env import write_json

    out = pathlib.Path(args.out)
    write_json(out.with_suffix(".json"), result)
    out.with_suffix(".md").write_text(text)
  print(text)
  return 0 if share < 1.0 and np.isfinite(share) else 1


if __name__ == "__main__":
  sys.exit(main())
