"""rdt_jax's own per-object and per-leaf costs, stage by stage, without Ray.

One process plays producer and consumer of `jax_nixl` (two NIXL agents) and
times each stage of moving a pytree of jax arrays: describe every leaf (what
the serializer does), extract (metadata and NIXL export), the metadata's
pickle round trip (Ray pickles it twice on the way to a consumer), fetch
(receive plan, buffers, posting the READ), wait (the READ and building the
consumer's arrays) and release.

With `--compare REV` it also extracts rdt_jax at git revision REV into a
temporary directory and runs the same measurement there, alternating the two
versions in separate processes rep by rep, and prints the ratio of medians
per stage (below 1: this tree is faster). Timings on a shared host are noisy;
the ratios of interleaved medians are what to read.

Usage:
  python scripts/overhead_micro.py [--leaves 1,1000,10000] [--bytes 67108864]
      [--reps 9] [--compare REV] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

STAGES = ("describe", "extract", "pickle", "fetch", "wait", "release")


def measure(counts: list[int], nbytes: int, reps: int) -> dict[str, dict[str, list[float]]]:
  """In this process: seconds per stage per leaf count, `reps` samples each."""
  import pickle
  import time

  os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
  import jax
  import numpy as np
  from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

  from rdt_jax import _dlpack

  try:
    from rdt_jax import _handoff
  except ImportError:  # a revision before the hand-off had a module of its own (--compare)
    from rdt_jax import _state as _handoff  # type: ignore[no-redef]
  try:
    from rdt_jax.transports.nixl import NixlTransport
  except ImportError:  # a revision (--compare) from before transports/nixl/
    from rdt_jax.transports._nixl import NixlTransport  # type: ignore[no-redef]

  prod, cons = NixlTransport(), NixlTransport()
  trees = {}
  for n in counts:
    size = 4096 if n == 1 else max(8, nbytes // n // 8 * 8)
    trees[n] = [jax.device_put(np.arange(size // 4, dtype=np.int32) + i) for i in range(n)]
    jax.block_until_ready(trees[n])
  out: dict[str, dict[str, list[float]]] = {str(n): {s: [] for s in STAGES} for n in counts}
  serial = 0
  for rep in range(-2, reps):
    for n in counts:
      tree = trees[n]
      serial += 1
      obj = f"obj{serial}"
      t = [time.perf_counter()]
      for i, x in enumerate(tree):
        _handoff.record_described(x, _dlpack.describe(x, f"['l{i:05d}']"))
      t.append(time.perf_counter())
      meta = prod.extract_tensor_transport_metadata(obj, tree)
      t.append(time.perf_counter())
      meta = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(meta))))
      t.append(time.perf_counter())
      request = cons.fetch_multiple_tensors(obj, meta, CommunicatorMetadata())
      t.append(time.perf_counter())
      got = cons.wait_fetch_complete(request, 60)
      t.append(time.perf_counter())
      del got, request
      prod.garbage_collect(obj, meta, tree)
      t.append(time.perf_counter())
      if rep >= 0:
        for s, a, b in zip(STAGES, t, t[1:]):
          out[str(n)][s].append(b - a)
  return out


def _child(args: argparse.Namespace) -> None:
  counts = [int(x) for x in args.leaves.split(",")]
  json.dump(measure(counts, args.bytes, args.reps), sys.stdout)


def _run_tree(root: str, args: argparse.Namespace, reps: int) -> dict:
  env = {**os.environ, "PYTHONPATH": root, "NIXL_LOG_LEVEL": "WARN"}
  cmd = [sys.executable, os.path.abspath(__file__), "--child", "--leaves", args.leaves,
         "--bytes", str(args.bytes), "--reps", str(reps)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
  return json.loads(proc.stdout)


def _merge(into: dict, part: dict) -> None:
  for n, stages in part.items():
    for s, v in stages.items():
      into.setdefault(n, {}).setdefault(s, []).extend(v)


def _medians(d: dict) -> dict:
  return {n: {s: statistics.median(v) for s, v in st.items()} for n, st in d.items()}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--leaves", default="1,1000,10000")
  p.add_argument("--bytes", type=int, default=64 << 20)
  p.add_argument("--reps", type=int, default=9)
  p.add_argument("--compare", default=None, help="git revision to compare against")
  p.add_argument("--rounds", type=int, default=3, help="alternations of the two trees")
  p.add_argument("--json", default=None, help="also write the medians here")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return _child(args)
  here = str(pathlib.Path(__file__).resolve().parents[1])
  trees = {"this": here}
  tmp = None
  if args.compare:
    tmp = tempfile.TemporaryDirectory()
    archive = subprocess.run(["git", "-C", here, "archive", args.compare, "rdt_jax"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp.name], input=archive, check=True)
    trees["base"] = tmp.name
  samples: dict[str, dict] = {k: {} for k in trees}
  per_round = max(1, args.reps // args.rounds)
  for r in range(args.rounds):
    order = list(trees) if r % 2 == 0 else list(trees)[::-1]
    for name in order:
      _merge(samples[name], _run_tree(trees[name], args, per_round))
  med = {k: _medians(v) for k, v in samples.items()}
  print(f"# rdt_jax stages in one process (jax_nixl, two agents), medians of "
        f"{args.rounds * per_round} samples; load average {os.getloadavg()}")
  if args.compare:
    print(f"# 'this' = working tree, 'base' = {args.compare}; ratio = this / base")
  for n in med["this"]:
    print(f"\n{n} leaves ({4096 if n == '1' else args.bytes} bytes)")
    print(f"{'stage':<9}" + "".join(f"{k + ' (ms)':>13}" for k in trees) + ("    ratio" if args.compare else ""))
    for s in (*STAGES, "total"):
      vals = {k: (sum(med[k][n].values()) if s == "total" else med[k][n][s]) for k in trees}
      line = f"{s:<9}" + "".join(f"{vals[k] * 1e3:>13.3f}" for k in trees)
      if args.compare and vals["base"] > 0:
        line += f"{vals['this'] / vals['base']:>9.2f}"
      print(line)
  counts = list(med["this"])
  if len(counts) >= 2 and counts[-2] != "1":
    a, b = counts[-2], counts[-1]
    for k in trees:
      slope = {s: (med[k][b][s] - med[k][a][s]) / (int(b) - int(a)) * 1e6 for s in STAGES}
      print(f"\nper added leaf, {k} ({a} -> {b} leaves, same bytes), us: "
            + ", ".join(f"{s} {v:.2f}" for s, v in slope.items())
            + f", total {sum(slope.values()):.2f}")
  if args.json:
    from rdt_jax.bench import _results

    _results.write(args.json, {"medians": med, "args": vars(args)})
  if tmp is not None:
    tmp.cleanup()


if __name__ == "__main__":
  main()
