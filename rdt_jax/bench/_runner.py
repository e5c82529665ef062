"""The benchmark loop: set up every path, then measure them case by case.

Within a case every (path, variant) pair runs once per repetition, in an
order that rotates by one each repetition, so drift of this shared machine
hits every path alike. The first `warmup` repetitions are recorded but left
out of the statistics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from rdt_jax.bench import _cases, _floor, _paths
from rdt_jax.bench._paths import ActorGroup, ActorPath, Path

#: Seconds allowed for all actors to start.
_START_TIMEOUT_S = 300.0


@dataclass
class BenchConfig:
  """What one `rdt-jax bench` run measures and where it writes.

  Attributes:
    quick: the short case set and fewer repetitions.
    device: "cpu", or "gpu" to add device-to-device cases.
    out: directory for the JSON, PNG and Markdown outputs.
    paths: path ids to run (None: all); see `rdt-jax bench --help`.
    cases: case ids to run (None: the default set for `quick`/`device`).
    reps: measured repetitions per path and case (None: by payload size).
    warmup: unmeasured repetitions before them.
    pause: SIGSTOP the actors of paths not being measured.
    memory_min_bytes: measure peak memory in cases moving at least this.
    sample_timeout_s: a sample taking longer fails (its path is skipped for
      the rest of the case).
    idle_window_s: seconds over which each group's idle CPU use is measured.
    label: the output file stem's suffix (None: "quick", "full" or "custom").
    path_budget_s: about how many seconds one path may spend on one case: a
      path whose first sample is slow runs fewer repetitions (None: no limit;
      ignored when `reps` is given).
    min_reps: the fewest measured repetitions a slow path gets.
  """

  quick: bool = False
  device: str = "cpu"
  out: str = "bench-out"
  paths: tuple[str, ...] | None = None
  cases: tuple[str, ...] | None = None
  reps: int | None = None
  warmup: int = 1
  pause: bool = True
  memory_min_bytes: int = 16 * _cases.MiB
  sample_timeout_s: float = 180.0
  idle_window_s: float = 1.0
  label: str | None = None
  path_budget_s: float | None = 60.0
  min_reps: int = 3

  def file_label(self) -> str:
    if self.label:
      return self.label
    if self.cases is not None or self.paths is not None or self.reps is not None:
      return "custom"
    return "quick" if self.quick else "full"

  def case_list(self) -> list[_cases.Case]:
    """The cases to run, parsed (raises ValueError for an unknown id)."""
    if self.cases is not None:
      ids = list(self.cases)
    else:
      ids = list(_cases.QUICK_CASES if self.quick else _cases.FULL_CASES)
      if self.device == "gpu":
        ids += list(_cases.QUICK_GPU_CASES if self.quick else _cases.FULL_GPU_CASES)
    return [_cases.parse_case(i) for i in ids]


@dataclass
class Sample:
  """One measured (or failed) run of a path on a case."""

  case: str
  path: str
  variant: str
  rep: int
  warmup: bool
  position: int
  seconds: float | None
  read_seconds: float | None = None
  memory: dict[str, int] | None = None
  error: str | None = None


@dataclass
class RunState:
  """Everything one run produced, for the report."""

  config: BenchConfig
  cases: list[_cases.Case]
  paths: list[Path] = field(default_factory=list)
  samples: list[Sample] = field(default_factory=list)
  splits: list[dict[str, Any]] = field(default_factory=list)
  skips: list[dict[str, str]] = field(default_factory=list)
  idle_cpu: dict[str, float] = field(default_factory=dict)
  groups: dict[str, dict[str, Any]] = field(default_factory=dict)
  load: list[dict[str, Any]] = field(default_factory=list)
  reps: dict[str, int] = field(default_factory=dict)
  timings: dict[str, float] = field(default_factory=dict)
  registered: list[str] = field(default_factory=list)
  gpu_reason: str | None = None
  actor_groups: list[ActorGroup] = field(default_factory=list)
  resume_guard: Any = None


class Progress:
  """Progress on stderr: a live line on a terminal, plus permanent lines."""

  def __init__(self, stream: Any = None):
    self._stream = stream or sys.stderr
    self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
    self._start = time.perf_counter()
    self._live = False

  def elapsed(self) -> float:
    return time.perf_counter() - self._start

  def live(self, text: str) -> None:
    """Replaces the live line (terminals only)."""
    if self._tty:
      self._stream.write(f"\r\x1b[K[{self.elapsed():5.0f} s] {text}")
      self._stream.flush()
      self._live = True

  def line(self, text: str) -> None:
    """Prints a permanent line."""
    if self._live:
      self._stream.write("\r\x1b[K")
      self._live = False
    self._stream.write(f"[{self.elapsed():5.0f} s] {text}\n")
    self._stream.flush()


def loadavg() -> list[float]:
  """The 1, 5 and 15 minute load averages ([] where unavailable)."""
  try:
    with open("/proc/loadavg") as f:
      return [float(x) for x in f.read().split()[:3]]
  except OSError:
    return []


@contextlib.contextmanager
def resumed(group: ActorGroup | None, members: list[Any] | None = None) -> Iterator[None]:
  """Runs the body with `members` of `group` (default all) continued, pausing after."""
  if group is None:
    yield
    return
  group.resume(members)
  try:
    yield
  finally:
    group.pause()


# --------------------------------------------------------------------------
# Set-up.


def start_ray() -> bool:
  """Starts a private local Ray unless one is running here; True if started."""
  import ray

  if ray.is_initialized():
    return False
  package_parent = str(pathlib.Path(__file__).resolve().parents[2])
  pythonpath = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
  ray.init(
      address="local",
      num_cpus=os.cpu_count() or 2,
      include_dashboard=False,
      logging_level=logging.ERROR,
      log_to_driver=False,
      runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "NIXL_LOG_LEVEL": "WARN"}},
  )
  return True


def gpu_unavailable() -> str | None:
  """None if the Ray cluster has a GPU, else a reason to skip GPU cases."""
  import ray

  if ray.cluster_resources().get("GPU", 0) > 0:
    return None
  return "no GPU on this host (ray.cluster_resources() has no 'GPU')"


def _transport_paths(registered: list[str]) -> list[ActorPath]:
  from ray.experimental.rdt import util

  paths = []
  for name in registered:
    info = util.transport_manager_info[name.upper()]
    cls = info.transport_manager_class
    one_sided = bool(cls.is_one_sided())
    path = ActorPath(
        name,
        f"{name} (jax.Array)",
        "rdt_jax",
        "jax",
        name,
        tuple("cuda" if d in ("cuda", "gpu") else d for d in info.devices),
        refs_skip=None if one_sided else (
            "two-sided transport: the driver is not a member of the collective group"
        ),
    )
    path.one_sided = one_sided
    path.transport_class = cls
    paths.append(path)
    if name == "jax_nixl":  # the same transport in actors of another environment
      for pid, (label, refs_skip) in _paths.NIXL_VARIANTS.items():
        devices = ("cpu", "cuda") if pid == _paths.NIXL_CUDA_IPC else ("cpu",)  # the others are about host reads
        variant = ActorPath(pid, f"{label} (jax.Array)", "rdt_jax", "jax", name, devices, refs_skip=refs_skip)
        variant.transport_class = cls
        paths.append(variant)
  return paths


#: Ray's device-to-device transports with torch tensors: path id, Ray's
#: transport name, label, and for "refs" cases why a getter actor gets the
#: refs instead of the driver (None: the driver gets them).
_RAY_CUDA_TRANSPORTS: Final = (
    (_paths.RAY_NCCL, "NCCL", "Ray nccl (torch)", None),
    (_paths.RAY_CUDA_IPC, "CUDA_IPC", "Ray cuda_ipc (torch)", (
        "in refs cases a getter actor plays the driver (calls the producer, gets and reads the refs; "
        "one more actor call per sample): a CUDA_IPC reader needs the GPU Ray assigned to the producer, "
        "and the driver holds none"
    )),
)


def _ray_cuda_paths() -> list[ActorPath]:
  """Ray's own device-to-device transports with torch tensors: NCCL (two-sided,
  over an "nccl" group of the path's actors) and CUDA_IPC (one-sided: the
  consumer maps the producer's tensor, which Ray allows only between actors
  holding the same GPU; `bench_actor_class(gpu=True)` gives each a share).

  Both are always listed; one this Ray does not register (Ray registers them
  only where torch imports) gets a `skip_reason` saying so.
  """
  from ray.experimental.rdt import util

  util._ensure_default_transports_registered()
  paths = []
  for pid, name, label, refs_getter in _RAY_CUDA_TRANSPORTS:
    path = ActorPath(pid, label, "baseline", "torch", name.lower(), ("cuda",), refs_getter=refs_getter)
    info = util.transport_manager_info.get(name)
    if info is None:
      path.skip_reason = (
          f"Ray's {name} tensor transport is not registered in this process (Ray registers it only "
          "where torch imports): install torch"
      )
      paths.append(path)
      continue
    path.transport_class = info.transport_manager_class
    path.one_sided = bool(info.transport_manager_class.is_one_sided())
    if not path.one_sided:
      path.refs_skip = "two-sided transport: the driver is not a member of the collective group"
    paths.append(path)
  return paths


def make_paths(registered: list[str], cases: list[_cases.Case]) -> list[Path]:
  """Every path the benchmark knows, before any actor exists."""
  paths: list[Path] = list(_transport_paths(registered))
  paths.append(ActorPath(
      _paths.RAY_NIXL, "Ray nixl (torch)", "baseline", "torch", "nixl", ("cpu", "cuda"),
      refs_getter=(
          "in refs cases a getter actor plays the driver (calls the producer, gets "
          "and reads the refs; one more actor call per sample): Ray's NIXL agent "
          "spins a core in every process that has one, and the driver cannot be paused"
      ),
  ))
  paths += _ray_cuda_paths()
  paths.append(ActorPath(_paths.OS_NUMPY, "object store (NumPy)", "baseline", "numpy", None, ("cpu",)))
  paths.append(ActorPath(
      _paths.OS_NUMPY_JAX, "object store (NumPy, made jax.Array)", "baseline", "numpy", None, ("cpu",),
      reader="consume_as_jax",
  ))
  floor = ActorPath(
      _paths.RAY_FLOOR, "Ray RDT floor (no bytes moved)", "baseline", "torch", _floor.NAME, ("cpu",),
      reader="consume_nothing",
  )
  floor.skip_reason = _floor.register()
  paths.append(floor)
  paths.append(ActorPath(_paths.OS_JAX, "object store (jax.Array)", "baseline", "jax", None, ("cpu", "cuda")))
  paths.append(_paths.MemcpyPath())
  paths.append(_paths.DeviceMemcpyPath())
  if any(c.kind == "plain" for c in cases):
    paths += [_paths.PlainPath(False), _paths.PlainPath(True)]
  return paths


def select_paths(paths: list[Path], wanted: tuple[str, ...] | None) -> list[Path]:
  """The paths named in `wanted` (all but the opt-in ones if None).

  Raises:
    ValueError: for a name that is not a path here, listing those that are.
  """
  if wanted is None:
    return [p for p in paths if p.id not in _paths.OPT_IN_PATHS]
  known = {p.id for p in paths} | {_paths.PLAIN_WITH, _paths.PLAIN_WITHOUT}
  unknown = [w for w in wanted if w not in known]
  if unknown:
    raise ValueError(
        f"Unknown path(s) {', '.join(unknown)}; this host has: {', '.join(sorted(known))}."
    )
  return [p for p in paths if p.id in wanted]


def setup(state: RunState, progress: Progress) -> None:
  """Creates every path's actors, groups and collective groups; smoke-tests each path.

  Paths that cannot run get a `skip_reason`; nothing here raises for them.
  The groups go to `state.actor_groups` as they are made, so `teardown`
  finds them even if set-up fails part way.
  """
  config = state.config
  cases = state.cases
  paths = state.paths
  fan = max([c.count for c in cases if c.kind == "fanout"], default=1)
  devices = {c.device for c in cases if c.kind != "plain"}
  gpu_reason = gpu_unavailable() if "cuda" in devices else None
  actor_devices = sorted(d for d in devices if d == "cpu" or gpu_reason is None)
  groups = state.actor_groups
  by_name: dict[str, ActorGroup] = {}

  def group(name: str, device: str, maker) -> ActorGroup:
    key = f"{name}@{device}"
    if key not in by_name:
      by_name[key] = maker()
      by_name[key].name = key
      groups.append(by_name[key])
    return by_name[key]

  for p in paths:
    if isinstance(p, _paths.PlainPath):
      p.groups["cpu"] = group(p.id, "cpu", lambda p=p: _paths.make_plain_group(p.id, p.use_rdt_jax, config.pause))
      continue
    if isinstance(p, _paths.MemcpyPath):
      continue
    if isinstance(p, _paths.DeviceMemcpyPath):
      if "cuda" in actor_devices:
        p.groups["cuda"] = group(
            _paths.TORCH_GROUP,
            "cuda",
            lambda: _paths.make_group(_paths.TORCH_GROUP, fan, config.pause, True, ("torch",)),
        )
      continue
    assert isinstance(p, _paths.ActorPath)
    if p.skip_reason:
      continue
    for device in actor_devices:
      if device not in p.devices:
        continue
      torch_path = p.id in _paths.RAY_TORCH_PATHS
      name, env = _paths.GROUP_ENV.get(p.id, (_paths.TORCH_GROUP if torch_path else "main", None))
      preload = ("torch",) if torch_path else ("jax",)
      p.groups[device] = group(
          name,
          device,
          lambda name=name, device=device, preload=preload, env=env: _paths.make_group(
              name, fan, config.pause, device == "cuda", preload, env
          ),
      )
  progress.line(f"starting {sum(len(g.actors) for g in groups)} actors in {len(groups)} groups")
  t0 = time.perf_counter()
  started: list[ActorGroup] = []
  for g in groups:
    try:
      g.start(_START_TIMEOUT_S)
    except Exception as e:  # the group's paths are skipped with the reason; the others run
      _drop_group(paths, g, f"actors did not start: {_paths.first_line(e)}", progress)
      continue
    started.append(g)
    state.groups[g.name] = {"pids": g.pids, "infos": g.infos}
  state.timings["actors_start_s"] = time.perf_counter() - t0
  if config.pause:
    state.resume_guard = _paths.start_resume_guard([pid for g in started for pid in g.pids])
  for p in paths:
    if isinstance(p, ActorPath) and not p.one_sided and not p.skip_reason:
      p.skip_reason = _make_collective_groups(p)
    if isinstance(p, _paths.PlainPath) and "cpu" in p.groups:
      info = p.groups["cpu"].infos
      if any(i["rdt_jax"] != p.use_rdt_jax for i in info):
        p.skip_reason = f"rdt_jax imported in the actors is {info[0]['rdt_jax']}, expected {p.use_rdt_jax}"
  if gpu_reason is None and "cuda" in actor_devices:
    _check_gpu_frameworks(paths)
  for p in paths:
    p.gpu_skip = p.gpu_skip or gpu_reason
  for g in started:
    g.pause()
  t0 = time.perf_counter()
  _smoke_test(state, progress)
  state.timings["smoke_test_s"] = time.perf_counter() - t0
  progress.line(
      f"actors up in {state.timings['actors_start_s']:.1f} s, "
      f"smoke tests {state.timings['smoke_test_s']:.1f} s"
  )
  _measure_idle(state, started, progress)
  state.gpu_reason = gpu_reason


def _drop_group(paths: list[Path], group: ActorGroup, reason: str, progress: Progress) -> None:
  """Takes `group`, whose actors did not start, from every path that uses
  it; `reason` becomes each such path's `skip_reason` (a cpu group) or
  `gpu_skip` (a cuda group)."""
  for p in paths:
    for device, g in list(p.groups.items()):
      if g is group:
        del p.groups[device]
        if device == "cpu":
          p.skip_reason = reason
        else:
          p.gpu_skip = reason
  progress.line(f"skipping the paths of actor group {group.name}: {reason}")


def teardown(state: RunState) -> None:
  """Continues every actor `setup` made, stops the resume guard, kills the actors."""
  for g in state.actor_groups:
    g.resume()
  if state.resume_guard is not None:
    _paths.stop_resume_guard(state.resume_guard)
    state.resume_guard = None
  for g in state.actor_groups:
    g.kill()


def _make_collective_groups(path: ActorPath) -> str | None:
  """Creates the collective group a two-sided path needs; returns a skip reason."""
  from ray.experimental.collective import create_collective_group

  assert path.transport_class is not None
  backend = _paths.group_backend(path.id, path.transport_class)
  if backend is None:
    name = path.transport_class.__name__
    return f"two-sided transport with no known collective backend (set `group_backend` on {name})"
  for device, g in path.groups.items():
    try:
      with resumed(g):
        create_collective_group(g.actors, backend=backend)
    except Exception as e:
      return f"create_collective_group(backend={backend!r}) failed on {device}: {_paths.first_line(e)}"
  return None


def _check_gpu_frameworks(paths: list[Path]) -> None:
  """Takes the cuda actors away from each path whose array type cannot make
  cuda arrays there, the reason becoming its `gpu_skip`."""
  import ray

  for p in paths:
    if not isinstance(p, (ActorPath, _paths.DeviceMemcpyPath)) or "cuda" not in p.groups:
      continue
    g = p.groups["cuda"]
    framework = "torch" if p.framework == "torch" else "jax"
    try:
      reason = ray.get(g.producer.device_support.remote(framework), timeout=_START_TIMEOUT_S)
    except Exception as e:
      reason = f"checking {framework} on the GPU failed: {_paths.first_line(e)}"
    if reason:
      del p.groups["cuda"]
      p.gpu_skip = reason


def _smoke_test(state: RunState, progress: Progress) -> None:
  """One small transfer per path and device; a failure becomes the skip reason."""
  for p in state.paths:
    if p.skip_reason or isinstance(p, (_paths.MemcpyPath, _paths.PlainPath)):
      continue
    for device, g in list(p.groups.items()):
      case = _cases.parse_case("gpu:4KiB" if device == "cuda" else "4KiB")
      try:
        with resumed(g):
          p.prepare(case, state.config.sample_timeout_s)
          p.run(case, "", min(120.0, state.config.sample_timeout_s), False)
          g.drop_all()
      except Exception as e:
        reason = f"smoke test failed: {_paths.first_line(e)}"
        if device == "cpu":
          p.skip_reason = reason
        else:
          del p.groups[device]
          p.gpu_skip = reason
        progress.line(f"skipping {p.id} on {device}: {reason}")


def _measure_idle(state: RunState, groups: list[ActorGroup], progress: Progress) -> None:
  """CPU cores each group uses while idle (after its paths ran once)."""
  window = state.config.idle_window_s
  for g in groups:
    with resumed(g):
      before = g.cpu_seconds()
      time.sleep(window)
      state.idle_cpu[g.name] = (g.cpu_seconds() - before) / window
  progress.line(
      "idle CPU (cores) per group: "
      + ", ".join(f"{k} {v:.2f}" for k, v in state.idle_cpu.items())
  )


# --------------------------------------------------------------------------
# Measuring.


def _allowed_reps(first_s: float, reps: int, config: BenchConfig) -> int:
  """Repetitions for a unit whose first sample took `first_s` seconds.

  A slow path gets fewer (at least `config.min_reps`) so that it spends about
  `config.path_budget_s` per case; `--reps` given explicitly is kept as is.
  """
  if config.reps is not None or config.path_budget_s is None:
    return reps
  fit = int(config.path_budget_s / max(first_s, 1e-6))
  return max(min(config.min_reps, reps), min(reps, fit))


def _run_splits(
    state: RunState, case: _cases.Case, active: list[Path], reps: int, progress: Progress
) -> None:
  """Per-side timings of `case` for every one-sided rdt_jax path, interleaved
  (see `ActorPath.run_split`); single and tree cases only."""
  if case.kind not in ("single", "tree"):
    return
  paths = [p for p in active if isinstance(p, ActorPath) and p.splits()]
  config = state.config
  failed: set[str] = set()
  for r in range(-config.warmup, reps):
    k = (r + config.warmup) % max(1, len(paths))
    for p in paths[k:] + paths[:k]:
      if p.id in failed:
        continue
      g = p.group_of(case)
      progress.live(f"{case.id} per-side split {p.id} ...")
      try:
        with resumed(g, [g.producer, g.consumers[0]]):
          split = p.run_split(case, config.sample_timeout_s)
      except Exception as e:
        failed.add(p.id)
        state.skips.append({"case": case.id, "path": p.id, "variant": "split",
                            "reason": f"per-side split failed: {_paths.first_line(e)}"})
        continue
      if r >= 0:
        state.splits.append({"case": case.id, "path": p.id, "rep": r, **split})


def run_case(state: RunState, case: _cases.Case, index: int, progress: Progress) -> None:
  """Measures every path on `case`, interleaved; appends to `state.samples`."""
  config = state.config
  active: list[Path] = []
  for p in state.paths:
    if not p.applies(case):
      continue
    reason = p.case_skip(case)
    if not reason:
      try:
        with resumed(p.group(case)):
          p.prepare(case, config.sample_timeout_s)
      except Exception as e:
        reason = f"preparing the data failed: {_paths.first_line(e)}"
    if reason:
      state.skips.append({"case": case.id, "path": p.id, "reason": reason})
      continue
    active.append(p)
  units = [(p, v) for p in active for v in case.variants]
  reps = config.reps or _cases.default_reps(case, config.quick)
  state.reps[case.id] = reps
  memory = case.device == "cpu" and case.object_nbytes * case.objects >= config.memory_min_bytes
  failed: dict[tuple[str, str], str] = {}
  allowed: dict[tuple[str, str], int] = {}  # reps per unit, once its first sample is in
  title = f"[{index + 1}/{len(state.cases)}] {case.id}"
  for r in range(-config.warmup, reps):
    if not units:
      break
    k = (r + config.warmup) % len(units)
    for pos, (p, v) in enumerate(units[k:] + units[:k]):
      if (p.id, v) in failed or r >= allowed.get((p.id, v), reps):
        continue
      name = f"{p.id}{'/' + v if v else ''}"
      what = "warm-up" if r < 0 else f"rep {r + 1}/{reps}"
      progress.live(f"{title} {what} {name} ...")
      sample = Sample(case.id, p.id, v, r, r < 0, pos, None)
      try:
        with resumed(p.group(case), p.actors_for(case, v)):
          m = p.run(case, v, config.sample_timeout_s, memory and not isinstance(p, _paths.MemcpyPath))
        sample.seconds, sample.read_seconds, sample.memory = m.seconds, m.read_seconds, m.memory
        progress.live(f"{title} {what} {name}: {m.seconds * 1e3:.2f} ms")
        allowed.setdefault((p.id, v), _allowed_reps(m.seconds, reps, config))
      except Exception as e:
        sample.error = _paths.first_line(e)
        failed[(p.id, v)] = sample.error
        progress.line(f"{title} {name} failed: {sample.error}")
      state.samples.append(sample)
  for (pid, v), err in failed.items():
    state.skips.append({"case": case.id, "path": pid, "variant": v, "reason": f"failed: {err}"})
  _run_splits(state, case, [p for p in active if p.id not in {f[0] for f in failed}], reps, progress)
  for p in active:
    p.release()
    g = p.group(case)
    if g is not None and g.prepared:
      with resumed(g):
        g.drop_all()
  state.load.append({"case": case.id, "loadavg": loadavg(), "elapsed_s": progress.elapsed()})
