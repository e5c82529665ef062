"""Weight sync before and after a change, in one interleaved run.

Runs two (trainer, generator) pairs side by side on one Ray: one imports
rdt_jax from a baseline revision (`--baseline`, extracted with `git archive`
into a temporary folder), the other from this checkout. Each step publishes
a version on both sides and pulls it, the two sides in alternating order, so
load on the host falls on both alike. Prints the median publish and pull
time per side and tree, and the ratio of the medians (this checkout /
baseline).

Run:  python scripts/weights_ab.py [--baseline HEAD] [--steps 40] [--leaves 1,1000]
      [--kb 4] [--mb 64] [--atomic]

Versions are host-resident and packed (`jax_nixl`), pulled node-locally into
numpy templates: the steady state that issue 30's serialization must not slow.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import ray

REPO = pathlib.Path(__file__).resolve().parents[1]


def use_source() -> None:
  """Makes this worker import rdt_jax from `$AB_SOURCE` (before anything
  imported it): an editable install's import hook would otherwise win over
  PYTHONPATH."""
  source = os.environ.get("AB_SOURCE")
  if not source:
    return
  assert "rdt_jax" not in sys.modules, "rdt_jax was imported before the worker chose its source"
  sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in f"{type(f).__module__}.{type(f).__name__}".lower()]
  sys.path.insert(0, source)


def tree(leaves: int, nbytes: int, version: int) -> dict:
  n = max(1, nbytes // leaves // 4)
  return {f"l{i:05d}": np.full(n, version + i, np.float32) for i in range(leaves)} | {"step": version}


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self):
    use_source()
    import rdt_jax

    rdt_jax.register()
    self.pub = rdt_jax.WeightPublisher(keep=2)
    self.origin = rdt_jax.__file__

  @ray.method(num_returns=2)
  def publish(self, leaves: int, nbytes: int, version: int):
    t = tree(leaves, nbytes, version)
    start = time.perf_counter()
    handle = self.pub.publish(t, version=version)
    return handle, time.perf_counter() - start

  def where(self) -> str:
    return self.origin


@ray.remote(enable_tensor_transport=True)
class Generator:
  def __init__(self, atomic: bool):
    use_source()
    import rdt_jax

    rdt_jax.register()
    self.atomic = atomic
    self.subs: dict = {}

  def pull(self, leaves: int, nbytes: int, handle) -> float:
    import rdt_jax

    sub = self.subs.get((leaves, nbytes))
    if sub is None:
      template = {k: np.zeros_like(v) for k, v in tree(leaves, nbytes, 0).items() if k != "step"}
      sub = self.subs[(leaves, nbytes)] = rdt_jax.WeightSubscriber(template, atomic=self.atomic)
    start = time.perf_counter()
    sub.pull(handle)
    return time.perf_counter() - start


def extract(rev: str, into: pathlib.Path) -> pathlib.Path:
  """rdt_jax as of `rev`, in `into`."""
  archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "rdt_jax"], check=True, capture_output=True)
  subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
  return into


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--baseline", default="HEAD")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--leaves", default="1,1000")
  p.add_argument("--kb", type=int, default=4, help="size of the one-leaf tree")
  p.add_argument("--mb", type=int, default=64, help="size of the many-leaf trees")
  p.add_argument("--atomic", action="store_true")
  a = p.parse_args()
  with tempfile.TemporaryDirectory(prefix="rdt-jax-ab-") as tmp:
    base = extract(a.baseline, pathlib.Path(tmp))
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", a.baseline], check=True,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "rdt_jax"], check=True,
                           capture_output=True, text=True).stdout.strip()
    ray.init(num_cpus=8, include_dashboard=False, logging_level="warning")
    sides = {}
    for name, path in (("baseline", base), ("this", REPO)):
      env = {"env_vars": {"AB_SOURCE": str(path), "RDT_JAX_INLINE_MAX_BYTES": "0"}}
      sides[name] = (Trainer.options(runtime_env=env).remote(), Generator.options(runtime_env=env).remote(a.atomic))
    for name, (t, _) in sides.items():
      print(f"{name}: rdt_jax from {ray.get(t.where.remote())}")
    print(f"baseline {a.baseline} ({rev}); this checkout{' with uncommitted changes to rdt_jax' if dirty else ''}; "
          f"{os.cpu_count()} CPUs, {a.steps} steps per tree, atomic={a.atomic}")
    cases = [(int(n), a.kb << 10 if int(n) == 1 else a.mb << 20) for n in a.leaves.split(",")]
    results: dict = {}
    version = 0
    for leaves, nbytes in cases:
      for step in range(a.steps + 2):  # the first two warm up (first pull, plan)
        version += 1
        order = list(sides) if step % 2 == 0 else list(sides)[::-1]
        for name in order:
          t, g = sides[name]
          # The handle stays a ref: only the generator, which imports the
          # same rdt_jax as its trainer, unpickles it.
          handle, publish_ref = t.publish.remote(leaves, nbytes, version)
          publish_s = ray.get(publish_ref)
          pull_s = ray.get(g.pull.remote(leaves, nbytes, handle))
          if step >= 2:
            results.setdefault((leaves, nbytes, name), []).append((publish_s, pull_s))
    ray.shutdown()
  print("\n| tree | side | publish ms (median) | pull ms (median) | publish + pull ms |")
  print("| --- | --- | --- | --- | --- |")
  medians = {}
  for (leaves, nbytes, name), rows in results.items():
    pub = statistics.median(r[0] for r in rows) * 1e3
    pull = statistics.median(r[1] for r in rows) * 1e3
    both = statistics.median(r[0] + r[1] for r in rows) * 1e3
    medians[(leaves, nbytes, name)] = both
    print(f"| {leaves} x {nbytes >> 10} KiB | {name} | {pub:.3f} | {pull:.3f} | {both:.3f} |")
  print()
  for leaves, nbytes in cases:
    ratio = medians[(leaves, nbytes, "this")] / medians[(leaves, nbytes, "baseline")]
    print(f"{leaves} leaves, {nbytes >> 10} KiB: this / baseline = {ratio:.3f}x (publish + pull, medians)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
