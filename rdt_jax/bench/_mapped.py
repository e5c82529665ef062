"""`rdt-jax bench --weight-sync-mapped`: a pull into an engine's own layout
against the plain pull plus a transpose, and the memory a pull by name holds.

Time (paths interleaved in one run, medians over the steps after the first):
a trainer actor publishes Flax-style `(in, out)` kernels (jax_nixl, host
memory, so packed), one 256 MiB leaf (`1x256MiB`) or 1,000 leaves of 64 MiB
in all (`1000x64MiB`, every three leaves a layer's q, k and v). Each step it
updates every leaf and publishes; two generator actors pull the version in
turn, one after the other:

* `unmapped`: `WeightSubscriber(template)` into torch tensors of the
  published shapes, then one local transpose of the same bytes into torch
  tensors of the engine's layout (`(out, in)`, q/k/v fused per layer):
  `unmapped_ms` and `transpose_ms`;
* `mapped`: `WeightSubscriber(engine tensors, source=)` with
  `From(transpose=(1, 0))` on every leaf and one `Fuse` per layer:
  `mapped_ms`.

The ratio is `mapped_ms / (unmapped_ms + transpose_ms)` (target: at most
1.2). Both generators' engine tensors are checked equal (CRC-32, outside the
timed part) every step.

Memory: a 512 MiB version of 64 leaves, published with 64 MiB buckets, is
pulled once by a fresh generator actor per row, after its engine tensors are
allocated and written: `pull_named` (each pair copied into the engine's
tensor, then dropped) node-locally and through Ray buckets, and the mapped
pull node-locally; then one 512 MiB leaf, mapped (transposed) node-locally
and through Ray buckets (read in parts of its rows), each after a pull of a
small version by the same route
(imports, the NIXL agent, Ray's first fetch). The row is the process's peak
RSS during the pull minus its RSS before, in MiB and in buckets (target: at
most 2).

Writes `bench-weight-sync-mapped.{json,md}` under `--out`.
"""

from __future__ import annotations

import datetime
import logging
import pathlib
import platform
import resource
import statistics
import time
from typing import Any

import numpy as np
import ray

import rdt_jax
from rdt_jax.bench import _cases, _env

#: Bytes of the buckets of the memory rows.
MEMORY_BUCKET = 64 << 20
#: The memory rows' version: leaves x bytes per leaf (512 MiB).
MEMORY_LEAVES, MEMORY_LEAF = 64, 8 << 20
#: Node-local reads off: packed versions come through Ray in buckets.
THROUGH_RAY = {"RDT_JAX_NIXL_CMA": "0"}


def _shapes(case: str) -> list[tuple[int, int]]:
  """The published `(in, out)` kernels of a case ("1x<M>MiB": one square-ish
  leaf; "<n>x<M>MiB": n leaves of 128 rows, M MiB in all)."""
  count, size = case.split("x")
  n, nbytes = int(count), int(size.removesuffix("MiB")) << 20
  if n == 1:
    rows = int(np.sqrt(nbytes // 4))
    return [(rows, nbytes // 4 // rows)]
  return [(128, nbytes // 4 // n // 128)] * n


def _tree(arrays: list[Any]) -> dict[str, Any]:
  """The published tree: `l{i}` = {q, k, v} per whole layer, `x{j}` for the rest."""
  layers, rest = divmod(len(arrays), 3)
  tree: dict[str, Any] = {f"l{i}": dict(zip("qkv", arrays[3 * i : 3 * i + 3])) for i in range(layers)}
  tree.update({f"x{j}": arrays[3 * layers + j] for j in range(rest)})
  return tree


def _engine(shapes: list[tuple[int, int]]) -> tuple[dict[str, Any], dict[str, Any]]:
  """The engine's tensors (`(out, in)`, q/k/v fused) and the `source` mapping into them."""
  import torch

  layers, rest = divmod(len(shapes), 3)
  tensors: dict[str, Any] = {}
  source: dict[str, Any] = {}
  for i in range(layers):
    fan_in, fan_out = shapes[3 * i]
    tensors[f"l{i}.qkv"] = torch.zeros(3 * fan_out, fan_in)
    source[f"['l{i}.qkv']"] = rdt_jax.Fuse(*(rdt_jax.From(f"l{i}.{p}", transpose=(1, 0)) for p in "qkv"))
  for j in range(rest):
    fan_in, fan_out = shapes[3 * layers + j]
    tensors[f"x{j}"] = torch.zeros(fan_out, fan_in)
    source[f"['x{j}']"] = rdt_jax.From(f"x{j}", transpose=(1, 0))
  return tensors, source


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Trainer:
  def setup(self, shapes: list[tuple[int, int]]) -> None:
    import jax

    rng = np.random.default_rng(0)
    self.params = _tree([jax.numpy.asarray(rng.random(s, dtype=np.float32)) for s in shapes])
    self.update = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x + 1.0, p))
    self.pub = rdt_jax.WeightPublisher(keep=2)
    self.version = 0

  def step(self) -> Any:
    import jax

    self.params = self.update(self.params)
    jax.block_until_ready(self.params)
    self.version += 1
    return self.pub.publish(self.params, version=self.version)


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Generator:
  def setup(self, shapes: list[tuple[int, int]], mapped: bool) -> None:
    import torch

    self.engine, source = _engine(shapes)
    self.mapped = mapped
    if mapped:
      self.sub = rdt_jax.WeightSubscriber(self.engine, source=source)
    else:
      self.published = _tree([torch.zeros(s) for s in shapes])
      self.sub = rdt_jax.WeightSubscriber(self.published)

  def pull(self, handle: Any) -> tuple[float, float, int]:
    """(pull s, local transpose s, CRC-32 of the engine tensors)."""
    t0 = time.perf_counter()
    self.sub.pull(handle)
    t1 = time.perf_counter()
    if not self.mapped:
      for name, t in self.engine.items():
        parts = list(self.published[name.split(".")[0]].values()) if name.endswith(".qkv") else [self.published[name]]
        at = 0
        for p in parts:
          t.narrow(0, at, p.shape[1]).copy_(p.T)
          at += p.shape[1]
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, _cases.ordered_checksum(list(self.engine.values()))


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Memory:
  """A fresh engine: one pull, its peak RSS over the RSS before it."""

  def warm(self, handle: Any) -> None:
    """A pull of a small version by the same route first: imports, the NIXL
    agent and Ray's first fetch are not counted."""
    for _ in rdt_jax.WeightSubscriber(None).pull_named(handle):
      pass

  def pull(self, handle: Any, how: str, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    import torch
    engine, source = _engine(shapes)
    for t in engine.values():  # written once: every page resident before the pull
      t.fill_(1.0)
    before = _rss_mib()
    t0 = time.perf_counter()
    if how == "mapped":
      sub = rdt_jax.WeightSubscriber(engine, source=source)
      sub.pull(handle)
    else:  # an engine's load_weights: each published leaf copied, transposed, into its part of a tensor
      sub = rdt_jax.WeightSubscriber(None)
      targets = _named_targets(engine, shapes)
      with torch.no_grad():
        for name, x in sub.pull_named(handle):
          targets[name].copy_(x.T)
          del x
    route = sub.last_pull.route if sub.last_pull else ""
    seconds = time.perf_counter() - t0
    return {"extra_mib": round(_peak_mib() - before, 1), "seconds": round(seconds, 3), "route": route}


def _named_targets(engine: dict[str, Any], shapes: list[tuple[int, int]]) -> dict[str, Any]:
  """Each published path's part of the engine's tensors (`pull_named`'s names)."""
  out = {}
  for name, t in engine.items():
    if name.endswith(".qkv"):
      layer, fan_out = name.split(".")[0], t.shape[0] // 3
      out.update({f"['{layer}']['{p}']": t.narrow(0, k * fan_out, fan_out) for k, p in enumerate("qkv")})
    else:
      out[f"['{name}']"] = t
  return out


def _rss_mib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def add_arguments(parser: Any) -> None:
  group = parser.add_argument_group("--weight-sync-mapped (a pull into an engine's layout; memory by name)")
  group.add_argument("--weight-sync-mapped", action="store_true",
                     help="run only the mapped-pull comparison and the memory rows (see rdt_jax.bench._mapped)")
  group.add_argument("--mapped-cases", default="1x256MiB,1000x64MiB",
                     help="trees of the time rows (default 1x256MiB,1000x64MiB)")


def run(args: Any) -> dict[str, Any]:
  """Runs the rows, writes `bench-weight-sync-mapped.{json,md}` under `args.out`."""
  t_start = time.perf_counter()
  steps = (args.reps or (4 if args.quick else 8)) + 1
  cases = [c for c in str(args.mapped_cases).split(",") if c]
  rdt_jax.register()
  started = not ray.is_initialized()
  if started:
    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
  env = {"env_vars": _env.nixl_actor_env()}
  rows: list[dict[str, Any]] = []
  memory: list[dict[str, Any]] = []
  try:
    for case in cases:
      rows.append(_time_row(case, steps, env))
      print(_format(rows[-1]), flush=True)
    many = [(MEMORY_LEAF // 4 // 1024, 1024)] * MEMORY_LEAVES
    one = [(MEMORY_LEAVES * MEMORY_LEAF // 4 // 8192, 8192)]  # one leaf of the same size: read in parts of rows
    for how, extra, shapes in (("pull_named", {}, many), ("pull_named", THROUGH_RAY, many), ("mapped", {}, many),
                               ("mapped", {}, one), ("mapped", THROUGH_RAY, one)):
      bucket_env = {"RDT_JAX_WEIGHT_BUCKET_BYTES": str(MEMORY_BUCKET)}
      trainer = _Trainer.options(  # type: ignore[attr-defined]
          runtime_env={"env_vars": {**env["env_vars"], **bucket_env}}).remote()
      small = _Trainer.options(runtime_env=env).remote()  # type: ignore[attr-defined]
      ray.get([trainer.setup.remote(shapes), small.setup.remote([(16, 16)])])
      handle = ray.get(trainer.step.remote())
      gen = _Memory.options(  # type: ignore[attr-defined]
          runtime_env={"env_vars": {**env["env_vars"], **bucket_env, **extra}}).remote()
      ray.get(gen.warm.remote(ray.get(small.step.remote())))
      r = ray.get(gen.pull.remote(handle, how, shapes))
      memory.append({"how": how, "leaves": len(shapes), "version_mib": MEMORY_LEAVES * MEMORY_LEAF >> 20,
                     "bucket_mib": MEMORY_BUCKET >> 20,
                     **r, "buckets": round(r["extra_mib"] / (MEMORY_BUCKET >> 20), 2)})
      print(f"memory {how}, {len(shapes)} leaves ({r['route']}): {r['extra_mib']} MiB over the RSS before, "
            f"{memory[-1]['buckets']} buckets", flush=True)
      for a in (trainer, small, gen):
        ray.kill(a)
  finally:
    if started:
      ray.shutdown()
  result = {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "host": {"platform": platform.platform(), "python": platform.python_version()},
      "steps": steps, "wall_s": round(time.perf_counter() - t_start, 1), "rows": rows, "memory": memory,
  }
  out = pathlib.Path(args.out)
  result = _env.write_json(out / "bench-weight-sync-mapped.json", result)
  (out / "bench-weight-sync-mapped.md").write_text(markdown(result))
  print(markdown(result))
  return result


def _time_row(case: str, steps: int, env: dict[str, Any]) -> dict[str, Any]:
  shapes = _shapes(case)
  trainer = _Trainer.options(runtime_env=env).remote()  # type: ignore[attr-defined]
  gens = {how: _Generator.options(runtime_env=env).remote()  # type: ignore[attr-defined]
          for how in ("unmapped", "mapped")}
  ray.get([trainer.setup.remote(shapes), *(g.setup.remote(shapes, how == "mapped") for how, g in gens.items())])
  samples: list[dict[str, float]] = []
  for k in range(steps):
    handle = ray.get(trainer.step.remote())
    plain_s, transpose_s, plain_sum = ray.get(gens["unmapped"].pull.remote(handle))
    mapped_s, _, mapped_sum = ray.get(gens["mapped"].pull.remote(handle))
    if plain_sum != mapped_sum:
      raise RuntimeError(f"{case}: the mapped pull's engine tensors differ from the transposed plain pull's")
    if k:  # the first pull (plans, template checks) is not the steady state
      samples.append({"unmapped": plain_s, "transpose": transpose_s, "mapped": mapped_s})
  for a in (trainer, *gens.values()):
    ray.kill(a)

  def med(key: str) -> float:
    return round(statistics.median(s[key] for s in samples) * 1e3, 2)

  row: dict[str, Any] = {"case": case, "leaves": len(shapes), "unmapped_ms": med("unmapped"),
                         "transpose_ms": med("transpose"), "mapped_ms": med("mapped")}
  row["ratio"] = round(row["mapped_ms"] / (row["unmapped_ms"] + row["transpose_ms"]), 2)
  return row


def _format(r: dict[str, Any]) -> str:
  return (f"{r['case']:>12}: mapped {r['mapped_ms']} ms, unmapped {r['unmapped_ms']} ms + transpose "
          f"{r['transpose_ms']} ms: {r['ratio']}x")


def markdown(result: dict[str, Any]) -> str:
  """The result as the performance page shows it."""
  lines = [
      f"Mapped pulls, {result['when']} ({result['steps']} steps, medians of all but the first):", "",
      "| tree | mapped pull | plain pull | local transpose | mapped / (plain + transpose) |",
      "| --- | --- | --- | --- | --- |",
  ]
  lines += [f"| {r['case']} | {r['mapped_ms']} ms | {r['unmapped_ms']} ms | {r['transpose_ms']} ms | {r['ratio']}x |"
            for r in result["rows"]]
  lines += ["", "Extra memory of one pull (peak RSS minus RSS before, engine tensors resident):", "",
            "| pull | route | version | bucket | extra | in buckets |", "| --- | --- | --- | --- | --- | --- |"]
  lines += [f"| {m['how']} | {m['route']} | {m['version_mib']} MiB in {_leaves(m.get('leaves', MEMORY_LEAVES))} | "
            f"{m['bucket_mib']} MiB | {m['extra_mib']} MiB | {m['buckets']} |" for m in result["memory"]]
  return "\n".join(lines) + "\n"


def _leaves(n: int) -> str:
  return "one leaf" if n == 1 else f"{n} leaves"
