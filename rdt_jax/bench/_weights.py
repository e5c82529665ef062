"""`rdt-jax bench --weight-sync`: a trainer's versions into a fleet of generators.

A trainer actor makes new arrays every step (a jitted update of every leaf,
with or without `donate_argnums`) and publishes them to 1, 2 or 4 generator
actors of three kinds, in turn: `torch` (torch tensors written in place),
`jax` (jax arrays on a 2-device mesh of its own, each leaf sharded over it)
and `slice` (half of each leaf's rows, into torch tensors: generator i takes
half i % 2). Per tree shape (one 4 KiB leaf, whose publish + pull is the
per-step fixed cost; one 256 MiB leaf; 1,000 and 10,000 leaves of 64 MiB in
all) and generator count, four paths run in turn:

* `rdt`: `WeightPublisher.publish` (jax_nixl; host leaves, so packed) and
  `WeightSubscriber.pull`;
* `rdt_donate`: the same, the trainer's step donating its input arrays;
* `pytree`: `WeightPublisher(pack=False)`: each version one RDT object of
  the tree, as `examples/weight_sync.py` ran before versions were packed;
* `store`: the object store with NumPy: the trainer `ray.put`s its arrays
  as NumPy, each generator `ray.get`s them and copies them into its
  tensors (torch), `jax.device_put`s them with its shardings (jax), or
  copies its half (slice).

Per step it records the trainer's step time, the publish (or `ray.put`)
time in the trainer, and the pull: the longest of the generators' times
from the start of `pull` (or `ray.get`) until its leaves hold the version.
The first step of each run is reported apart (first pull: registration,
plans, template check); the steady state is the median of the others. Each
pull is checked against the trainer's bytes (a CRC-32 of every byte of every
leaf in order, or of the generator's half, taken outside the timed part). The
same run measures one host copy of the payload (`memcpy_ms`, a numpy copy
into a warm buffer), the rate the targets are stated at. Writes
`bench-weight-sync.json` and `bench-weight-sync.md` under `--out`.

With `--device gpu` the weights live in device memory on both sides, every
actor holding a share of one GPU (`GPU_SHARE`, XLA's preallocation off): the
trainer's arrays are on its GPU, so versions are sent as a pytree
(`rdt` and `pytree` are the same path there), and every generator is of
kind `torch`, CUDA tensors written in place (the vLLM-style engine):
resharding, so a jax target sharding, lands in host memory, and
`Slice(into=)` takes host memory only. A pull is timed until its device
work is done (`torch.cuda.synchronize`); `store` is the trainer's
device-to-host copy and `ray.put`, then each generator's host-to-device
copy. No host memcpy rate is measured. Writes
`bench-weight-sync-gpu.{json,md}`.

Rows (tree x generators x path) are written to the outputs as each
finishes. A row that fails is recorded under `skipped` with its error, and
the run goes on. With `--budget S` the run ends within about S seconds of
its start (Ray's start included): a row whose estimated time (`budget_skip`)
no longer fits is not started, and a row still running when the budget runs
out is cut off, the rows after it not started; each is recorded under
`skipped` with the reason. Every actor gets the UCX settings of the
benchmark's NIXL-capable actors (`_env.nixl_actor_env`, recorded as `ucx`).
"""

from __future__ import annotations

import datetime
import functools
import logging
import pathlib
import platform
import statistics
import time
from typing import Any

import numpy as np
import ray

import rdt_jax
from rdt_jax.bench import _cases, _env, _paths

PATHS = ("rdt", "rdt_donate", "pytree", "store")
KINDS = ("torch", "jax", "slice")
#: Generator kinds with device memory (target shardings and `Slice(into=)`
#: land in host memory).
GPU_KINDS = ("torch",)
TWO_DEVICES = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}
#: The share of the one GPU each actor holds with `--device gpu`.
GPU_SHARE = 0.1
#: The announced stream whose asking cost a run measures (`_latest_cost`).
LATEST_STREAM = "bench-latest"
#: Questions for the newest handle per run, after versions announced.
LATEST_ASKS = 30
GPU_ENV = {"env_vars": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NIXL_LOG_LEVEL": "WARN"}}


def _leaf_shapes(case: str) -> list[tuple[int, ...]]:
  """Leaf shapes (float32) of a case: "1x<M>MiB" (one 2-D leaf of M MiB),
  "1x<K>KiB" (one leaf of K KiB), or "<n>x<M>MiB" (n 1-D leaves, M MiB in all)."""
  count, size = case.split("x")
  if size.endswith("KiB"):  # rows of 16 floats: halves and 2-way shards divide it
    return [((int(size.removesuffix("KiB")) << 10) // 64, 16)]
  nbytes = int(size.removesuffix("MiB")) << 20
  if int(count) == 1:
    return [(nbytes // 4 // 1024, 1024)]
  n = int(count)
  rows = nbytes // 4 // n
  return [(rows - rows % 2,)] * n


def _half(shape: tuple[int, ...], which: int) -> slice:
  h = shape[0] // 2
  return slice(which * h, (which + 1) * h)


def _checksum(arrays: list[Any]) -> str:
  """CRC-32 of every byte of `arrays`, in order (`_cases.ordered_checksum`)."""
  return f"{_cases.ordered_checksum(arrays):08x}"


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Trainer:
  def ready(self, device: str) -> None:
    """Imports jax and finds its `device` ("cpu" or "gpu"), before any row is timed."""
    import jax

    jax.devices(device)

  def setup(self, case: str, path: str, device: str = "cpu") -> None:
    import jax

    rng = np.random.default_rng(0)
    where = jax.devices(device)[0]
    self.params = [jax.device_put(rng.random(s, dtype=np.float32), where) for s in _leaf_shapes(case)]
    donate = (0,) if path == "rdt_donate" else ()
    self.update = jax.jit(lambda p: [x + 1.0 for x in p], donate_argnums=donate)
    self.path = path
    self.version = 0
    self.publisher = None
    if path != "store":
      self.publisher = rdt_jax.WeightPublisher(transport="jax_nixl", keep=2, pack=path != "pytree")

  def step(self) -> tuple[Any, float, float, dict[str, str]]:
    """One jitted step, then publish; (handle or [ref], step s, publish s, checksums)."""
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
    host = [np.asarray(x) for x in self.params]
    sums = {"full": _checksum(host)}
    for which in (0, 1):
      sums[f"half{which}"] = _checksum([a[_half(a.shape, which)] for a in host])
    return out, t1 - t0, t2 - t1, sums


  def announce(self, version: int) -> float:
    """Publishes a small version on the announced stream `LATEST_STREAM`
    (`announce=True`); the seconds that publish took."""
    import jax.numpy as jnp

    if getattr(self, "announcer", None) is None:
      self.announcer: Any = rdt_jax.WeightPublisher(keep=2, name=LATEST_STREAM, announce=True)
    t0 = time.perf_counter()
    self.announcer.publish({"w": jnp.zeros(16, jnp.float32)}, version=version)
    return time.perf_counter() - t0

  def close_announcer(self) -> None:
    if getattr(self, "announcer", None) is not None:
      self.announcer.close()
      self.announcer = None


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Generator:
  def ready(self, device: str) -> None:
    """Imports torch (and with `device` "gpu" starts CUDA in it), before any row is timed."""
    import torch

    if device == "gpu":
      torch.empty(1, device="cuda")

  def setup(self, case: str, kind: str, index: int, device: str = "cpu") -> None:
    import torch

    shapes = _leaf_shapes(case)
    self.kind = kind
    self.which = index % 2
    self.gpu = device == "gpu"
    if kind == "torch":
      self.tensors = [torch.empty(s, device="cuda" if self.gpu else "cpu") for s in shapes]
      template: Any = self.tensors
    elif kind == "slice":
      self.tensors = [torch.empty((s[0] // 2, *s[1:])) for s in shapes]
      template = [rdt_jax.Slice((_half(s, self.which),), into=t) for s, t in zip(shapes, self.tensors)]
    else:
      import jax
      from jax.sharding import Mesh, NamedSharding, PartitionSpec

      mesh = Mesh(np.array(jax.devices()[:2]), ("y",))
      self.shardings = [NamedSharding(mesh, PartitionSpec("y")) for _ in shapes]
      template = self.shardings
    self.subscriber = rdt_jax.WeightSubscriber(template)

  def _sum(self, leaves: list[Any]) -> tuple[str, str]:
    key = "full" if self.kind != "slice" else f"half{self.which}"
    return key, _checksum([rdt_jax.to_numpy(x) for x in leaves])

  def _settle(self, leaves: list[Any]) -> None:
    """Waits for the device work behind `leaves` (with device memory)."""
    if self.gpu:
      import jax
      import torch

      jax.block_until_ready([x for x in leaves if isinstance(x, jax.Array)])
      torch.cuda.synchronize()

  def pull(self, handle: Any) -> tuple[float, tuple[str, str]]:
    t0 = time.perf_counter()
    leaves = self.subscriber.pull(handle)
    self._settle(leaves)
    dt = time.perf_counter() - t0
    return dt, self._sum(leaves if self.kind == "jax" else self.tensors)

  def ask_latest(self, version: int, asks: int) -> list[float]:
    """Seconds of each of `asks` questions for `LATEST_STREAM`'s newest
    handle (`rdt_jax.latest_handle`), once the board answers `version`."""
    deadline = time.monotonic() + 30
    while True:
      handle = rdt_jax.latest_handle(LATEST_STREAM)
      if handle is not None and handle.version == version:
        break
      if time.monotonic() > deadline:
        raise RuntimeError(f"the board never announced version {version} of {LATEST_STREAM}")
      time.sleep(0.01)
    out = []
    for _ in range(asks):
      t0 = time.perf_counter()
      rdt_jax.latest_handle(LATEST_STREAM)
      out.append(time.perf_counter() - t0)
    return out

  def get_copy(self, refs: list) -> tuple[float, tuple[str, str]]:
    t0 = time.perf_counter()
    arrays = ray.get(refs[0])
    if self.kind == "jax":
      import jax

      leaves = [jax.device_put(a, s) for a, s in zip(arrays, self.shardings)]
      jax.block_until_ready(leaves)
    elif self.gpu:
      import warnings

      import torch

      with warnings.catch_warnings():  # torch warns of the store's read-only arrays; it only reads them
        warnings.simplefilter("ignore", UserWarning)
        for t, a in zip(self.tensors, arrays):
          t.copy_(torch.from_numpy(a), non_blocking=False)
      leaves = self.tensors
      self._settle(leaves)
    else:
      for t, a in zip(self.tensors, arrays):
        # The object store's arrays are read-only: copy through numpy.
        t.numpy()[...] = a if self.kind == "torch" else a[_half(a.shape, self.which)]
      leaves = self.tensors
    dt = time.perf_counter() - t0
    return dt, self._sum(leaves)


def add_arguments(parser: Any) -> None:
  group = parser.add_argument_group("--weight-sync (a trainer's versions into generators)")
  group.add_argument("--weight-sync", action="store_true",
                     help="run only the weight-sync case (see rdt_jax.bench._weights)")
  group.add_argument("--weight-sync-leaves", default="1000,10000",
                     help="leaf counts of the many-leaf trees, --weight-sync-mb in all (default 1000,10000)")
  group.add_argument("--weight-sync-mb", type=int, default=64, help="size of the many-leaf trees (default 64)")
  group.add_argument("--weight-sync-big-mb", type=int, default=256,
                     help="size of the one-leaf tree (default 256; 0 leaves it out)")
  group.add_argument("--weight-sync-small-kb", type=int, default=4,
                     help="size of the one-leaf tree that measures the fixed cost (default 4; 0 leaves it out)")
  group.add_argument("--weight-sync-generators", default="1,2,4", help="generator counts (default 1,2,4)")
  group.add_argument("--weight-sync-paths", default=",".join(PATHS), help=f"paths (default {','.join(PATHS)})")
  group.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                     help="with --weight-sync: end within about SECONDS of the start; rows that no longer fit "
                          "are not started, a row still running is cut off, each recorded as skipped with the "
                          "reason (default: no limit)")


def _memcpy_ms(nbytes: int, reps: int = 5) -> float:
  src = np.ones(nbytes, np.uint8)
  dst = np.empty_like(src)
  np.copyto(dst, src)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t0)
  return _ms(statistics.median(times))


def _actor_options(device: str, generator: bool) -> dict[str, Any]:
  """Ray options of the trainer (`generator` False) or a generator: the UCX
  settings (`_env.nixl_actor_env`), then with `device` "gpu" a `GPU_SHARE`
  and `GPU_ENV`, else for a generator `TWO_DEVICES`."""
  env = _env.nixl_actor_env()
  options: dict[str, Any] = {}
  if device == "gpu":
    env.update(GPU_ENV["env_vars"])
    options["num_gpus"] = GPU_SHARE
  elif generator:
    env.update(TWO_DEVICES["env_vars"])
  if env:
    options["runtime_env"] = {"env_vars": env}
  return options


def _estimate_s(done: list[dict[str, Any]], case: str, generators: int, path: str) -> float | None:
  """Seconds a row of `case` x `generators` x `path` is expected to take,
  from the rows `done` before it (each with its `wall_s`), or None if none
  is done.

  The longest row of the same tree and path, else of the same tree, else of
  any tree, each scaled by `generators` over its own count where that is
  larger (a pull goes to every generator).
  """
  for same in (
      lambda r: r["case"] == case and r["path"] == path,
      lambda r: r["case"] == case,
      lambda r: True,
  ):
    like = [r for r in done if same(r)]
    if like:
      return max(r["wall_s"] * max(1.0, generators / r["generators"]) for r in like)
  return None


def budget_skip(
    done: list[dict[str, Any]], case: str, generators: int, path: str, elapsed_s: float, budget_s: float | None
) -> str | None:
  """Why a row of `case` x `generators` x `path` is not started, `elapsed_s`
  into a run of `budget_s` seconds (None: no budget), or None to start it.

  A row is started while time is left and, once rows are `done` (each with
  its `wall_s`), its estimate (`_estimate_s`) fits in the time left.
  """
  if budget_s is None:
    return None
  left = budget_s - elapsed_s
  estimate = _estimate_s(done, case, generators, path)
  if left <= 0:
    return f"not started: --budget {budget_s:g} s was spent ({elapsed_s:.0f} s in)"
  if estimate is not None and estimate > left:
    return (f"not started: about {estimate:.0f} s needed (from the rows before it), {left:.0f} s left of "
            f"--budget {budget_s:g} s")
  return None


class _CutOff(Exception):
  """A row still running when the budget ran out."""


def _get(refs: Any, deadline: float | None, what: str) -> Any:
  """`ray.get(refs)`, waiting at most until `deadline` (a `perf_counter`
  time; None: no limit).

  Raises:
    _CutOff: naming `what` was being waited for, when the deadline passes.
  """
  if deadline is None:
    return ray.get(refs)
  try:
    return ray.get(refs, timeout=max(0.0, deadline - time.perf_counter()))
  except ray.exceptions.GetTimeoutError:
    raise _CutOff(f"cut off by the budget during {what}") from None


def _latest_cost(trainer: Any, generator: Any, deadline: float | None) -> dict[str, Any]:
  """What asking for the newest version costs: a generator's
  `rdt_jax.latest_handle` (one actor call to the board), `LATEST_ASKS`
  times after each of three announced versions, and the trainer's publish
  of a 64-byte version with `announce=True` (the announcement's call is not
  waited for)."""
  asks: list[float] = []
  publishes: list[float] = []
  for version in (1, 2, 3):
    publishes.append(_get(trainer.announce.remote(version), deadline, "the newest-version question"))
    asks += _get(generator.ask_latest.remote(version, LATEST_ASKS), deadline, "the newest-version question")
  _get(trainer.close_announcer.remote(), deadline, "the newest-version question")
  ordered = sorted(asks)
  return {
      "asks": len(asks), "ask_ms": _ms(statistics.median(asks)), "ask_min_ms": _ms(ordered[0]),
      "ask_max_ms": _ms(ordered[-1]), "announced_publish_ms": _ms(statistics.median(publishes)),
  }


def _run_row(
    trainer: Any, gens: list[Any], kinds: list[str], case: str, path: str, device: str, steps: int,
    deadline: float | None,
) -> list[dict[str, float]]:
  """Sets the trainer and `gens` up for `case` and `path` (a new subscriber
  each) and runs `steps` steps; returns each step's times.

  Raises:
    RuntimeError: if a generator's bytes differ from the trainer's.
    _CutOff: when `deadline` passes first.
  """
  _get(trainer.setup.remote(case, path, device), deadline, "set-up")
  _get([g.setup.remote(case, kinds[i], i, device) for i, g in enumerate(gens)], deadline, "set-up")
  samples = []
  for k in range(steps):
    out, step_s, publish_s, want = _get(trainer.step.remote(), deadline, f"step {k + 1} of {steps}")
    if path == "store":
      calls = [g.get_copy.remote(out) for g in gens]
    else:
      calls = [g.pull.remote(out) for g in gens]
    got = _get(calls, deadline, f"step {k + 1} of {steps}")
    pull_s = max(s for s, _ in got)
    if any(want[key] != value for _, (key, value) in got):
      raise RuntimeError(f"{case} {path}: a generator's bytes differ from the trainer's")
    samples.append({"step_s": step_s, "publish_s": publish_s, "pull_s": pull_s})
    del out
  return samples


def run(args: Any) -> dict[str, Any]:
  """Runs the case, writes `bench-weight-sync.{json,md}` under `args.out`.

  Raises:
    SystemExit: for unknown paths, a budget that is not positive, or
      `--device gpu` on a host without a GPU.
  """
  t_start = time.perf_counter()
  budget = getattr(args, "budget", None)
  if budget is not None and budget <= 0:
    raise SystemExit(f"--budget {budget:g}: give a positive number of seconds")
  deadline = None if budget is None else t_start + budget
  steps = (args.reps or (4 if args.quick else 6)) + 1
  counts = [int(n) for n in str(args.weight_sync_generators).split(",") if n]
  paths = [p for p in str(args.weight_sync_paths).split(",") if p]
  unknown = sorted(set(paths) - set(PATHS))
  if unknown:
    raise SystemExit(f"unknown --weight-sync-paths {unknown}; choose from {', '.join(PATHS)}")
  cases = [f"1x{args.weight_sync_small_kb}KiB"] if getattr(args, "weight_sync_small_kb", 0) else []
  cases += [f"1x{args.weight_sync_big_mb}MiB"] if args.weight_sync_big_mb else []
  cases += [f"{n}x{args.weight_sync_mb}MiB" for n in str(args.weight_sync_leaves).split(",") if n]
  device = getattr(args, "device", "cpu")
  rdt_jax.register()
  ucx = _env.ucx_record(_env.nixl_actor_env(), {})
  started = not ray.is_initialized()
  if started:
    ray.init(num_cpus=max(counts) + 2, include_dashboard=False, logging_level=logging.WARNING)
  if device == "gpu":
    from rdt_jax.bench import _runner

    reason = _runner.gpu_unavailable()
    if reason is not None:
      if started:
        ray.shutdown()
      raise SystemExit(f"--weight-sync --device gpu: {reason}")
  rows: list[dict[str, Any]] = []
  skipped: list[dict[str, Any]] = []
  memcpy = {} if device == "gpu" else {
      case: _memcpy_ms(sum(int(np.prod(s)) * 4 for s in _leaf_shapes(case))) for case in cases
  }

  latest: dict[str, Any] | None = None

  def write() -> dict[str, Any]:  # after every row: a run cut short keeps its rows
    return _write(args, device, rows, steps, t_start, memcpy, skipped=skipped, budget_s=budget, ucx=ucx,
                  latest=latest)

  try:
    trainer = _Trainer.options(**_actor_options(device, False)).remote()  # type: ignore[attr-defined]
    gens = [
        _Generator.options(**_actor_options(device, True)).remote()  # type: ignore[attr-defined]
        for _ in range(max(counts))
    ]
    kind_list = GPU_KINDS if device == "gpu" else KINDS
    kinds = [kind_list[i % len(kind_list)] for i in range(len(gens))]
    stopped: str | None = None  # why no further row starts (a row was cut off, or the actors did not start)
    try:  # the actors' start and imports, once, so that no row's time includes them
      _get([trainer.ready.remote(device), *(g.ready.remote(device) for g in gens)], deadline, "the actors' start")
    except _CutOff as e:
      stopped = f"not started: {e} (--budget {budget:g} s)"
    except Exception as e:
      stopped = f"not started: the actors did not start: {_paths.first_line(e)}"
    for case, n, path in [(c, n, p) for c in cases for n in counts for p in paths]:
      kinds_n = ",".join(kinds[:n])
      names = {"case": case, "generators": n, "kinds": kinds_n, "path": path}
      reason = stopped or budget_skip(rows, case, n, path, time.perf_counter() - t_start, budget)
      if reason is None:
        t_row = time.perf_counter()
        try:
          samples = _run_row(trainer, gens[:n], kinds, case, path, device, steps, deadline)
        except _CutOff as e:
          reason = f"{e} ({time.perf_counter() - t_row:.0f} s into the row; --budget {budget:g} s)"
          stopped = "not started: an earlier row was cut off by the budget"
        except Exception as e:  # this row's failure, recorded; the next rows set up anew
          reason = f"failed: {_paths.first_line(e)}"
        else:
          rows.append(_row(case, n, path, samples, kinds_n, time.perf_counter() - t_row))
          print(_format_row(rows[-1]), flush=True)
      if reason is not None:
        skipped.append({**names, "reason": reason})
        print(f"{case:>12} x{n} {path:<10} skipped: {reason}", flush=True)
      write()
    if stopped is None:
      try:
        latest = _latest_cost(trainer, gens[0], deadline)
      except _CutOff as e:
        latest = {"skipped": f"{e} (--budget {budget:g} s)"}
      except Exception as e:
        latest = {"skipped": f"failed: {_paths.first_line(e)}"}
      print(f"newest version: {latest}", flush=True)
  finally:
    if started:
      ray.shutdown()
  result = write()
  print(markdown(result))
  return result


def _write(
    args: Any,
    device: str,
    rows: list[dict[str, Any]],
    steps: int,
    t_start: float,
    memcpy: dict[str, float],
    skipped: list[dict[str, Any]] | None = None,
    budget_s: float | None = None,
    ucx: dict[str, Any] | None = None,
    latest: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Writes the rows so far as `bench-weight-sync[-gpu].{json,md}` under
  `args.out`; returns the result written (with `skipped` rows and their
  reasons, the `budget_s`, the `ucx` settings and the `latest` question's
  cost where given)."""
  result: dict[str, Any] = {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "host": {"platform": platform.platform(), "python": platform.python_version()},
      "steps": steps, "wall_s": round(time.perf_counter() - t_start, 1), "memcpy_ms": memcpy, "rows": rows,
  }
  if budget_s is not None:
    result["budget_s"] = budget_s
  if skipped is not None:
    result["skipped"] = skipped
  if ucx is not None:
    result["ucx"] = ucx
  if latest is not None:
    result["latest"] = latest
  if device == "gpu":
    result["device"] = _gpu_name()
  out_dir = pathlib.Path(args.out)
  stem = "bench-weight-sync-gpu" if device == "gpu" else "bench-weight-sync"
  result = _env.write_json(out_dir / f"{stem}.json", result)
  (out_dir / f"{stem}.md").write_text(markdown(result))
  return result


@functools.cache
def _gpu_name() -> str:
  """The driver's name of the GPU the actors share (torch's, in this process)."""
  import torch

  return str(torch.cuda.get_device_name(0))


def _ms(x: float) -> float:
  return round(x * 1e3, 2)


def _row(
    case: str, n: int, path: str, samples: list[dict[str, float]], kinds: str, wall_s: float
) -> dict[str, Any]:
  """One row of the results: the first step apart, medians of the others,
  and the `wall_s` the row took (set-up included)."""
  first, steady = samples[0], samples[1:]

  def med(key: str) -> float:
    return _ms(statistics.median(s[key] for s in steady))

  return {
      "case": case, "generators": n, "kinds": kinds, "path": path,
      "first_publish_ms": _ms(first["publish_s"]), "first_pull_ms": _ms(first["pull_s"]),
      "step_ms": med("step_s"), "publish_ms": med("publish_s"), "pull_ms": med("pull_s"),
      "sync_ms": _ms(statistics.median(s["publish_s"] + s["pull_s"] for s in steady)),
      "samples": len(steady), "wall_s": round(wall_s, 2),
  }


def _format_row(r: dict[str, Any]) -> str:
  return (f"{r['case']:>12} x{r['generators']} {r['path']:<10} first {r['first_publish_ms']:8.1f} + "
          f"{r['first_pull_ms']:8.1f} ms  steady step {r['step_ms']:7.1f} publish {r['publish_ms']:7.1f} "
          f"pull {r['pull_ms']:7.1f} ms")


#: The steady-state targets (issue text): publish + pull against the object
#: store, per tree; `None` where no ratio is set.
TARGETS = {"1x": 1.0, "10000x": 0.5}
#: The per-step fixed cost target, ms: publish + pull of the one-leaf KiB tree.
FIXED_TARGET_MS = 2.0


def _target(case: str) -> float | None:
  if _fixed_case(case):
    return None
  for prefix, ratio in TARGETS.items():
    if case.startswith(prefix):
      return ratio
  return None


def _fixed_case(case: str) -> bool:
  """True for the tree that measures the fixed cost (one leaf of a few KiB)."""
  return case.endswith("KiB")


def fixed_text(result: dict[str, Any]) -> str:
  """What the fixed-cost column of `result`'s targets table means."""
  if "device" in result:
    return ("No host copy rate is measured with device memory, so the fixed-cost column is empty; the one-leaf "
            f"KiB tree's publish + pull is the per-step fixed cost, whose target is under {FIXED_TARGET_MS:g} ms.")
  return ("The fixed cost is publish + pull less two host copies of the payload (the publisher's packing copy and "
          "the generator's copy), each at the copy rate measured in this run (`memcpy`). For the one-leaf KiB tree "
          f"the copies take microseconds: its publish + pull is the per-step fixed cost, whose target is under "
          f"{FIXED_TARGET_MS:g} ms.")


def markdown(result: dict[str, Any]) -> str:
  store = {(r["case"], r["generators"]): r["sync_ms"] for r in result["rows"] if r["path"] == "store"}
  if "device" in result:
    title = "# rdt-jax bench --weight-sync --device gpu"
    kinds = (f"Device memory on both sides, every actor on a share of one {result['device']}: trainer arrays on "
             "the GPU, every generator torch CUDA tensors written in place.")
  else:
    title = "# rdt-jax bench --weight-sync"
    kinds = "Generators by kind: torch in place, jax on a 2-device mesh, slice = half of each leaf into torch."
  lines = [
      title,
      "",
      f"{result['when']}, {result['host']['platform']}, Python {result['host']['python']}; "
      f"{result['steps']} steps per run, the first reported apart, medians of the others; {result['wall_s']} s. "
      + kinds
      + (f" Budget: {result['budget_s']:g} s." if result.get("budget_s") is not None else ""),
      "",
      "| tree | generators | path | trainer step ms | first publish + pull ms | publish ms | pull ms "
      "| publish + pull ms | vs store |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in result["rows"]:
    base = store.get((r["case"], r["generators"]))
    ratio = f"{r['sync_ms'] / base:.2f}x" if base else "-"
    lines.append(
        f"| {r['case']} | {r['generators']} ({r['kinds']}) | {r['path']} | {r['step_ms']} | "
        f"{r['first_publish_ms']} + {r['first_pull_ms']} | {r['publish_ms']} | {r['pull_ms']} | "
        f"{r['sync_ms']} | {ratio} |"
    )
  lines += [
      "",
      "## Targets (steady state, `rdt` and `rdt_donate` against `store`)",
      "",
      fixed_text(result),
      "",
      "| tree | generators | path | publish + pull ms | store ms | ratio | target | met | memcpy ms "
      "| fixed cost ms |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in result["rows"]:
    if r["path"] not in ("rdt", "rdt_donate"):
      continue
    base = store.get((r["case"], r["generators"]))
    target = _target(r["case"])
    copy = result.get("memcpy_ms", {}).get(r["case"])
    fixed = round(r["sync_ms"] - 2 * copy, 2) if copy is not None else "-"
    against: float | None = r["sync_ms"] / base if base else None
    met = "-" if target is None or against is None else ("yes" if against <= target else "no")
    goal = f"{target}x" if target else "-"
    if _fixed_case(r["case"]):
      goal, met = f"fixed < {FIXED_TARGET_MS:g} ms", "yes" if r["sync_ms"] < FIXED_TARGET_MS else "no"
    lines.append(
        f"| {r['case']} | {r['generators']} | {r['path']} | {r['sync_ms']} | {base if base else '-'} | "
        f"{f'{against:.2f}x' if against is not None else '-'} | {goal} | {met} | "
        f"{copy if copy is not None else '-'} | {fixed} |"
    )
  latest = result.get("latest")
  if latest is not None:
    lines += ["", "## The newest version (`rdt_jax.latest_handle`)", ""]
    if "skipped" in latest:
      lines.append(f"Not measured: {latest['skipped']}.")
    else:
      lines.append(
          f"A generator's question for the newest handle: median {latest['ask_ms']} ms "
          f"({latest['ask_min_ms']}-{latest['ask_max_ms']} ms, {latest['asks']} questions); the trainer's "
          f"publish of a 64-byte version with `announce=True`: median {latest['announced_publish_ms']} ms."
      )
  if result.get("skipped"):
    lines += ["", "## Skipped", ""]
    lines += [f"* {r['case']} x{r['generators']} {r['path']}: {r['reason']}" for r in result["skipped"]]
  if result.get("ucx") is not None:
    lines += ["", _env.ucx_text(result["ucx"])]
  return "\n".join(lines) + "\n"
