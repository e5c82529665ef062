"""`rdt-jax bench`: every way of moving arrays between Ray actors, side by side.

In one run it measures, per case and interleaved: every registered rdt_jax
transport, Ray's built-in `nixl` transport with torch tensors (and on a GPU
Ray's `cuda_ipc`), the object store with NumPy arrays and with jax.Arrays,
and the memcpy limit (on a GPU the device copy's); plus the plain-method
check of issue 3 and the peak memory of each side. Every actor that may
create a NIXL agent, Ray's included, runs with the same UCX settings
(recorded in the environment section). It writes
`bench-<label>.json` (every sample and the summary), `bench-<label>.md` (also
printed) and `bench-<label>.png` (bandwidth vs size) under `--out`.

Run it as `rdt-jax bench [--quick]` or `python -m rdt_jax bench`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import sys
import time
from typing import TYPE_CHECKING, Any

from rdt_jax.bench._env import git_state as _git_state
from rdt_jax.bench._env import versions as _versions

if TYPE_CHECKING:
  from rdt_jax.bench._runner import BenchConfig

__all__ = ["BenchConfig", "add_arguments", "config_from_args", "main", "run", "validate"]


def __getattr__(name: str) -> Any:
  """`BenchConfig`, loaded on first use: the runner imports Ray, and the
  results writers (`_results`, `_env`) are used where Ray is not."""
  if name == "BenchConfig":
    from rdt_jax.bench._runner import BenchConfig

    return BenchConfig
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds `rdt-jax bench`'s options to `parser`."""
  parser.add_argument("--quick", action="store_true",
                      help="a short case set and fewer repetitions (under 2 minutes on 2 cores)")
  parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                      help="gpu adds device-to-device cases (skipped with a reason without a GPU); with "
                           "--weight-sync, weights in device memory on both sides")
  parser.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
  parser.add_argument("--paths", type=_csv, default=None,
                      help="comma-separated path ids to run: rdt_jax transport names "
                           "(jax_nixl, ...), ray_nixl_torch, ray_rdt_floor, object_store_numpy, "
                           "object_store_numpy_to_jax, object_store_jax, memcpy, plain_without_rdt_jax, "
                           "plain_with_rdt_jax; "
                           "device cases only: ray_cuda_ipc_torch, ray_nccl_torch, device_memcpy; "
                           "opt-in (only when named): jax_nixl_oob (in-band off), "
                           "jax_nixl_inband (in-band on up to 100 KiB), jax_nixl_ucx (node-local reads off), "
                           "jax_nixl_cuda_ipc (CUDA IPC reads of device memory on one node on)")
  parser.add_argument("--cases", type=_csv, default=None,
                      help="comma-separated cases: sizes (4KiB, 256MiB, 1GiB), treeN[xSIZE], "
                           "refsN[xSIZE], fanoutN[xSIZE], plain[SIZE]; prefix gpu: for device cases")
  parser.add_argument("--reps", type=int, default=None,
                      help="measured repetitions per path and case (default: by size)")
  parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first (default 1)")
  parser.add_argument("--no-pause", action="store_true",
                      help="do not SIGSTOP the actors of paths not being measured")
  parser.add_argument("--label", default=None,
                      help="output file suffix (default: quick, full or custom)")
  from rdt_jax.bench import _mapped, _multihost, _reshard, _twohost, _weights

  _reshard.add_arguments(parser)
  _weights.add_arguments(parser)
  _mapped.add_arguments(parser)
  _multihost.add_arguments(parser)
  _twohost.add_arguments(parser)


def _csv(text: str) -> tuple[str, ...]:
  return tuple(x.strip() for x in text.split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> BenchConfig:
  """The BenchConfig that parsed `rdt-jax bench` arguments ask for."""
  from rdt_jax.bench._runner import BenchConfig

  return BenchConfig(
      quick=args.quick,
      device=args.device,
      out=args.out,
      paths=args.paths,
      cases=args.cases,
      reps=args.reps,
      warmup=args.warmup,
      pause=not args.no_pause,
      idle_window_s=0.5 if args.quick else 1.0,
      path_budget_s=6.0 if args.quick else 40.0,
      label=args.label,
  )


def _rdt_jax_idle(state: Any) -> dict[str, float]:
  """Idle CPU of the actor groups that run rdt_jax transports (not Ray's own
  transports' groups, whose NIXL progress thread is Ray's)."""
  names = {
      g.name
      for p in state.paths
      if getattr(p, "kind", None) == "rdt_jax"
      for g in getattr(p, "groups", {}).values()
  }
  return {k: v for k, v in state.idle_cpu.items() if k in names}


def validate(config: BenchConfig) -> None:
  """Checks the cases and path names `config` asks for, before anything starts.

  Raises:
    ValueError: naming an unknown case or path and what is accepted.
  """
  import rdt_jax
  from rdt_jax.bench import _runner

  cases = config.case_list()
  _runner.select_paths(_runner.make_paths(rdt_jax.register(), cases), config.paths)


def run(config: BenchConfig) -> dict[str, Any]:
  """Runs the benchmark and writes its outputs; returns the JSON document.

  Starts a private local Ray (unless Ray is already initialized in this
  process) and shuts it down at the end.

  Raises:
    ValueError: for unknown case or path names.
  """
  t0 = time.perf_counter()
  os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
  import ray

  import rdt_jax
  from rdt_jax.bench import _env, _paths, _report, _runner

  progress = _runner.Progress()
  cases = config.case_list()
  registered = rdt_jax.register()
  state = _runner.RunState(config, cases, registered=registered)
  state.paths = _runner.select_paths(_runner.make_paths(registered, cases), config.paths)
  ucx = _env.ucx_record(
      _env.nixl_actor_env(),
      {name: env for name, env in (_paths.GROUP_ENV.get(p.id, ('', None)) for p in state.paths) if env},
  )
  stem = pathlib.Path(config.out) / f"bench-{config.file_label()}"
  load_start = _runner.loadavg()
  date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  git = _git_state()
  progress.line(f"rdt-jax bench: {len(cases)} cases, load average {load_start}")
  t_ray = time.perf_counter()
  started = _runner.start_ray()
  state.timings["ray_start_s"] = time.perf_counter() - t_ray
  try:
    _runner.setup(state, progress)
    state.timings["setup_s"] = time.perf_counter() - t0
    for i, case in enumerate(cases):
      _runner.run_case(state, case, i, progress)
      doc = _document(state, config, date, git, load_start, time.perf_counter() - t0, ucx, partial=True)
      _report.write_json(doc, stem.with_suffix(".json"))
      _print_case(progress, doc, case.id)
  finally:
    _runner.teardown(state)
    if started:
      ray.shutdown()
  wall = time.perf_counter() - t0
  doc = _document(state, config, date, git, load_start, wall, ucx, partial=False)
  _report.write_json(doc, stem.with_suffix(".json"))
  text = _report.markdown(doc)
  stem.with_suffix(".md").write_text(text)
  drawn = _report.plot(doc, stem.with_suffix(".png"))
  sys.stdout.write(text)
  sys.stdout.flush()
  progress.line(
      f"done in {wall:.0f} s: {stem.with_suffix('.json')}, {stem.with_suffix('.md')}"
      + (f", {stem.with_suffix('.png')}" if drawn else " (no plot: matplotlib is not installed)")
  )
  return doc


def _print_case(progress: Any, doc: dict[str, Any], case_id: str) -> None:
  for s in doc["summary"]:
    if s["case"] != case_id:
      continue
    name = s["path"] + (f"/{s['variant']}" if s["variant"] else "")
    progress.line(
        f"  {case_id:<10} {name:<28} median {s['median_s'] * 1e3:9.3f} ms "
        f"[{s['min_s'] * 1e3:.3f}-{s['max_s'] * 1e3:.3f}]  {s['gbps']:7.2f} GB/s  n={s['n']}"
    )


def _document(
    state: Any,
    config: BenchConfig,
    date: str,
    git: dict[str, Any],
    load_start: list[float],
    wall: float,
    ucx: dict[str, Any],
    partial: bool,
) -> dict[str, Any]:
  """The JSON document of a run (see the module docstring); `ucx` is the
  run's UCX settings (`_env.ucx_record`)."""
  from rdt_jax.bench import _runner, _stats

  summaries = _stats.summarize(state.samples, state.cases)
  plain = next((c for c in state.cases if c.kind == "plain"), None)
  plain_check = _stats.plain_check(summaries, plain.id) if plain else None
  if plain_check and plain is not None:
    plain_check["nbytes"] = plain.object_nbytes
  return {
      "schema": "rdt-jax-bench/1",
      "partial": partial,
      "wall_s": wall,
      "config": {
          "label": config.file_label(), "quick": config.quick, "device": config.device,
          "paths": config.paths, "cases": config.cases, "reps": config.reps,
          "warmup": config.warmup, "pause": config.pause,
          # What the consumers' check is (`_cases.host_checksum`); runs before it summed the words.
          "checksum": "block-weighted",
          "memory_min_bytes": config.memory_min_bytes,
          "path_budget_s": config.path_budget_s, "min_reps": config.min_reps,
          "sample_timeout_s": config.sample_timeout_s, "argv": sys.argv,
      },
      "environment": {
          "date": date,
          "host": platform.node(),
          "platform": platform.platform(),
          "cpus": os.cpu_count(),
          "versions": _versions(),
          "git": git,
          "loadavg_start": load_start,
          "loadavg_end": _runner.loadavg(),
          "load_per_case": state.load,
          "ucx": ucx,
          "note": "shared host: other jobs may run during the benchmark; see the load averages",
      },
      "timings": state.timings,
      "registered_transports": state.registered,
      "rdt_jax_paths": [p.id for p in state.paths if p.kind == "rdt_jax"],
      "paths": [
          {"id": p.id, "label": p.label, "kind": p.kind, "skip_reason": p.skip_reason,
           "note": getattr(p, "refs_getter", None)}
          for p in state.paths
      ],
      "groups": state.groups,
      "idle_cpu": state.idle_cpu,
      "cases": [
          {"id": c.id, "kind": c.kind, "device": c.device, "leaves": c.leaves,
           "leaf_nbytes": c.leaf_nbytes, "count": c.count, "object_nbytes": c.object_nbytes,
           "variants": list(c.variants), "description": c.describe(),
           "reps": state.reps.get(c.id)}
          for c in state.cases
      ],
      "skips": state.skips,
      "summary": [s.to_json() for s in summaries],
      "targets": [t.to_json() for t in _stats.targets(summaries, idle_cpu=_rdt_jax_idle(state), splits=state.splits)],
      "overhead": _stats.overhead(summaries, state.splits, state.cases),
      "splits": state.splits,
      "plain_check": plain_check,
      "samples": [dict(s.__dict__) for s in state.samples],
  }


def main(argv: list[str] | None = None) -> int:
  """`rdt-jax bench` without the `bench`: parses `argv` and runs."""
  parser = argparse.ArgumentParser(prog="rdt-jax bench", description=__doc__.splitlines()[0])
  add_arguments(parser)
  return run_from_args(parser.parse_args(argv), parser)


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
  """Builds the run's config from parsed `args` and runs it; returns 0.

  An invalid combination of options exits through `parser.error`.
  """
  budget = getattr(args, "budget", None)
  if budget is not None and not getattr(args, "weight_sync", False):
    parser.error("--budget applies to --weight-sync only; limit other runs with --cases and --reps")
  if budget is not None and budget <= 0:
    parser.error(f"--budget {budget:g}: give a positive number of seconds")
  if getattr(args, "trainers", None) and not getattr(args, "weight_sync", False):
    parser.error("--trainers applies to --weight-sync: rdt-jax bench --weight-sync --trainers 1,2,4")
  if getattr(args, "weight_sync", False) and getattr(args, "trainers", None):
    from rdt_jax.bench import _multihost

    try:
      _multihost.run(args)
    except (ValueError, RuntimeError) as e:
      parser.error(str(e))
    return 0
  if getattr(args, "two_host", False):
    from rdt_jax.bench import _twohost

    try:
      _twohost.run(args)
    except (ValueError, RuntimeError) as e:
      parser.error(str(e))
    return 0
  if getattr(args, "weight_sync_mapped", False):
    from rdt_jax.bench import _mapped

    _mapped.run(args)
    return 0
  if getattr(args, "weight_sync", False):
    from rdt_jax.bench import _weights

    _weights.run(args)
    return 0
  if getattr(args, "reshard", False):
    from rdt_jax.bench import _reshard

    try:
      _reshard.run(args)
    except ValueError as e:
      parser.error(str(e))
    return 0
  try:
    config = config_from_args(args)
    validate(config)
  except ValueError as e:
    parser.error(str(e))
  run(config)
  return 0
