"""`rdt-jax bench --weight-sync`: a trainer's versions into generators' tensors.

A trainer actor makes new arrays every step (a jitted update of every leaf,
with or without `donate_argnums`) and publishes them; 1 or 2 generator
actors hold torch tensors of the same shapes and take every version into
them in place. Per tree shape (one 256 MiB leaf; 1,000 leaves of 64 MiB in
all; 10,000 leaves with `--weight-sync-leaves 10000`) and generator count,
three paths run in turn:

* `rdt`: `WeightPublisher.publish` (jax_nixl) and `WeightSubscriber.pull`
  into the torch tensors;
* `rdt_donate`: the same, the trainer's step donating its (published) input
  arrays;
* `store`: the object store with NumPy: the trainer `ray.put`s its arrays
  as NumPy, each generator `ray.get`s them and copies them into its tensors.

Per step it records the trainer's step time, the publish (or `ray.put`)
time in the trainer, and the pull: the longest of the generators' times
from the start of `pull` (or `ray.get`) until its tensors hold the version. The first step of each
run is reported apart (first pull: registration, plans, template check);
the steady state is the median of the others. Each pull is checked against
the trainer's bytes (a checksum of each leaf's first 4 KiB, taken outside
the timed part). Writes
`bench-weight-sync.json` and `bench-weight-sync.md` under `--out`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import pathlib
import platform
import statistics
import time
from typing import Any

import numpy as np
import ray

import rdt_jax

PATHS = ("rdt", "rdt_donate", "store")


def _leaf_shapes(case: str) -> list[tuple[int, ...]]:
  """Leaf shapes (float32) of a case: "1x256MiB", or "<n>x64MiB" (n leaves, 64 MiB in all)."""
  if case == "1x256MiB":
    return [((256 << 20) // 4 // 1024, 1024)]
  n = int(case.split("x")[0])
  return [((64 << 20) // 4 // n,)] * n


def _checksum(arrays: list[Any]) -> str:
  h = hashlib.blake2b(digest_size=8)
  for a in arrays:
    h.update(np.ascontiguousarray(a).view(np.uint8)[:4096].tobytes())
  return h.hexdigest()


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Trainer:
  def setup(self, case: str, path: str) -> None:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    self.params = [jnp.asarray(rng.random(s, dtype=np.float32)) for s in _leaf_shapes(case)]
    donate = (0,) if path == "rdt_donate" else ()
    self.update = jax.jit(lambda p: [x + 1.0 for x in p], donate_argnums=donate)
    self.path = path
    self.version = 0
    self.publisher = rdt_jax.WeightPublisher(transport="jax_nixl", keep=2) if path != "store" else None

  def step(self) -> tuple[Any, float, float, str]:
    """One jitted step, then publish; (handle or [ref], step s, publish s, checksum)."""
    import jax

    t0 = time.perf_counter()
    self.params = self.update(self.params)
    jax.block_until_ready(self.params)
    t1 = time.perf_counter()
    self.version += 1
    if self.publisher is not None:
      out: Any = self.publisher.publish(self.params, version=self.version)
    else:
      out = [ray.put([np.asarray(x) for x in self.params])]
    t2 = time.perf_counter()
    return out, t1 - t0, t2 - t1, _checksum([np.asarray(x) for x in self.params])


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Generator:
  def setup(self, case: str) -> None:
    import torch

    self.tensors = [torch.empty(s) for s in _leaf_shapes(case)]
    self.subscriber = rdt_jax.WeightSubscriber(self.tensors)

  def pull(self, handle: Any) -> tuple[float, str]:
    t0 = time.perf_counter()
    self.subscriber.pull(handle)
    return time.perf_counter() - t0, _checksum([t.numpy() for t in self.tensors])

  def get_copy(self, refs: list) -> tuple[float, str]:
    t0 = time.perf_counter()
    arrays = ray.get(refs[0])
    for t, a in zip(self.tensors, arrays):
      t.numpy()[...] = a  # the object store's arrays are read-only: copy through numpy
    return time.perf_counter() - t0, _checksum([t.numpy() for t in self.tensors])


def add_arguments(parser: Any) -> None:
  group = parser.add_argument_group("--weight-sync (a trainer's versions into generators' tensors)")
  group.add_argument("--weight-sync", action="store_true",
                     help="run only the weight-sync case (see rdt_jax.bench._weights)")
  group.add_argument("--weight-sync-leaves", type=int, default=1000,
                     help="leaves of the many-leaf tree, 64 MiB in all (default 1000; 10000 is slow)")
  group.add_argument("--weight-sync-generators", default="1,2", help="generator counts (default 1,2)")


def run(args: Any) -> dict[str, Any]:
  """Runs the case, writes `bench-weight-sync.{json,md}` under `args.out`."""
  steps = (args.reps or (4 if args.quick else 8)) + 1
  counts = [int(n) for n in str(args.weight_sync_generators).split(",") if n]
  cases = ["1x256MiB", f"{args.weight_sync_leaves}x64MiB"]
  rdt_jax.register()
  started = not ray.is_initialized()
  if started:
    ray.init(num_cpus=max(counts) + 2, include_dashboard=False, logging_level=logging.WARNING)
  rows: list[dict[str, Any]] = []
  t_start = time.perf_counter()
  try:
    trainer = _Trainer.remote()  # type: ignore[attr-defined]
    gens = [_Generator.remote() for _ in range(max(counts))]  # type: ignore[attr-defined]
    for case in cases:
      ray.get([g.setup.remote(case) for g in gens])
      for n in counts:
        for path in PATHS:
          ray.get(trainer.setup.remote(case, path))
          ray.get([g.setup.remote(case) for g in gens])  # a new subscriber per run
          samples = []
          for _ in range(steps):
            out, step_s, publish_s, want = ray.get(trainer.step.remote())
            if path == "store":
              got = ray.get([g.get_copy.remote(out) for g in gens[:n]])
            else:
              got = ray.get([g.pull.remote(out) for g in gens[:n]])
            pull_s = max(s for s, _ in got)
            if any(c != want for _, c in got):
              raise RuntimeError(f"{case} {path}: a generator's bytes differ from the trainer's")
            samples.append({"step_s": step_s, "publish_s": publish_s, "pull_s": pull_s})
            del out
          rows.append(_row(case, n, path, samples))
          print(_format_row(rows[-1]), flush=True)
  finally:
    if started:
      ray.shutdown()
  result = {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "host": {"platform": platform.platform(), "python": platform.python_version()},
      "steps": steps, "wall_s": round(time.perf_counter() - t_start, 1), "rows": rows,
  }
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "bench-weight-sync.json").write_text(json.dumps(result, indent=1) + "\n")
  (out_dir / "bench-weight-sync.md").write_text(markdown(result))
  print(markdown(result))
  return result


def _ms(x: float) -> float:
  return round(x * 1e3, 2)


def _row(case: str, n: int, path: str, samples: list[dict[str, float]]) -> dict[str, Any]:
  first, steady = samples[0], samples[1:]

  def med(key: str) -> float:
    return _ms(statistics.median(s[key] for s in steady))

  return {
      "case": case, "generators": n, "path": path,
      "first_publish_ms": _ms(first["publish_s"]), "first_pull_ms": _ms(first["pull_s"]),
      "step_ms": med("step_s"), "publish_ms": med("publish_s"), "pull_ms": med("pull_s"),
      "sync_ms": _ms(statistics.median(s["publish_s"] + s["pull_s"] for s in steady)),
      "samples": len(steady),
  }


def _format_row(r: dict[str, Any]) -> str:
  return (f"{r['case']:>10} x{r['generators']} {r['path']:<10} first {r['first_publish_ms']:8.1f} + "
          f"{r['first_pull_ms']:8.1f} ms  steady step {r['step_ms']:7.1f} publish {r['publish_ms']:7.1f} "
          f"pull {r['pull_ms']:7.1f} ms")


def markdown(result: dict[str, Any]) -> str:
  store = {(r["case"], r["generators"]): r["sync_ms"] for r in result["rows"] if r["path"] == "store"}
  lines = [
      "# rdt-jax bench --weight-sync",
      "",
      f"{result['when']}, {result['host']['platform']}, Python {result['host']['python']}; "
      f"{result['steps']} steps per run, the first reported apart, medians of the others; {result['wall_s']} s.",
      "",
      "| tree | generators | path | trainer step ms | first publish + pull ms | publish ms | pull ms "
      "| publish + pull ms | vs store |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in result["rows"]:
    base = store.get((r["case"], r["generators"]))
    ratio = f"{r['sync_ms'] / base:.2f}x" if base else "-"
    lines.append(
        f"| {r['case']} | {r['generators']} | {r['path']} | {r['step_ms']} | "
        f"{r['first_publish_ms']} + {r['first_pull_ms']} | {r['publish_ms']} | {r['pull_ms']} | "
        f"{r['sync_ms']} | {ratio} |"
    )
  return "\n".join(lines) + "\n"
