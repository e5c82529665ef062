"""Benchmark paths: the ways of moving a case's data that are compared.

* every registered rdt_jax transport (jax.Array values; one-sided ones are
  used as is, two-sided ones get a collective group over their actors);
* `ray_nixl_torch`: Ray's built-in `nixl` transport with torch tensors; on
  cuda also `ray_nccl_torch` (Ray's `nccl`, over an "nccl" collective group)
  and `ray_cuda_ipc_torch` (Ray's `cuda_ipc`: the consumer maps the
  producer's tensor, on the GPU Ray assigned to both);
* `object_store_numpy` / `object_store_jax`: a method without
  `tensor_transport` returning NumPy arrays / jax.Arrays;
* `object_store_numpy_to_jax`: the NumPy arrays, each made a `jax.Array` on
  the consumer (what a JAX user of the object store does);
* `ray_rdt_floor`: torch tensors over a Ray transport that moves no bytes
  (`_floor`): Ray's own cost of an RDT object, the floor of every transport;
* `memcpy`: NumPy copies of the same bytes in the driver, into buffers that
  are already faulted in (the limit for any path on one host);
* `device_memcpy`: on cuda, torch copies of the same bytes between two
  tensors on the GPU, in one actor (the limit for any device path);
* `plain_without_rdt_jax` / `plain_with_rdt_jax`: the plain-method check.

Every actor that may create a NIXL agent gets the same UCX settings
(`_env.nixl_actor_env`), so Ray's `nixl` reads device memory as rdt_jax's
transports do.

A path's actors live in an `ActorGroup`. Groups not being measured are paused
with SIGSTOP: on this 2-core host, the spinning NIXL progress thread of Ray's
`nixl` transport (~0.7 core per idle process) would otherwise slow every other
path measured after it. `--no-pause` turns this off.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from rdt_jax.bench import _actors, _cases, _env

#: Baseline path ids, in table order.
RAY_NIXL: Final = "ray_nixl_torch"
RAY_NCCL: Final = "ray_nccl_torch"
RAY_CUDA_IPC: Final = "ray_cuda_ipc_torch"
#: Paths over Ray's own transports, with torch tensors (one actor group).
RAY_TORCH_PATHS: Final = (RAY_NIXL, RAY_NCCL, RAY_CUDA_IPC)
OS_NUMPY: Final = "object_store_numpy"
OS_JAX: Final = "object_store_jax"
#: The object store with NumPy, each leaf made a `jax.Array` on the consumer
#: (`_cases.numpy_to_jax`): the alternative a JAX user of Ray has.
OS_NUMPY_JAX: Final = "object_store_numpy_to_jax"
#: Ray's floor: torch tensors over a Ray transport that moves nothing (`_floor`).
RAY_FLOOR: Final = "ray_rdt_floor"
MEMCPY: Final = "memcpy"
DEVICE_MEMCPY: Final = "device_memcpy"
PLAIN_WITHOUT: Final = "plain_without_rdt_jax"
PLAIN_WITH: Final = "plain_with_rdt_jax"
#: Paths every other path's ratios are computed against, where both ran.
BASELINES: Final = (OS_NUMPY, OS_NUMPY_JAX, OS_JAX, RAY_NIXL, RAY_FLOOR, MEMCPY, RAY_CUDA_IPC, DEVICE_MEMCPY)
#: The actor group of the paths that move torch tensors (Ray's transports,
#: and the device copy, which shares their prepared tensors).
TORCH_GROUP: Final = "ray_nixl"
#: jax_nixl with its actors' UCX restricted to sockets (the network path).
NIXL_TCP: Final = "jax_nixl_tcp"
#: The environment of that path's actors: UCX may use TCP only, so NIXL reads
#: over sockets even between processes of one host, and no node-local reads
#: (`rdt_jax._node_local`), which would bypass NIXL on one host.
TCP_ENV: Final = {"UCX_TLS": "tcp", "RDT_JAX_NIXL_CMA": "0"}
#: jax_nixl with in-band sending off (every object is registered and READ),
#: as by default, whatever the environment the benchmark runs in. Opt-in.
NIXL_OOB: Final = "jax_nixl_oob"
OOB_ENV: Final = {"RDT_JAX_INLINE_MAX_BYTES": "0"}
#: jax_nixl with in-band sending turned on up to 100 KiB: run beside jax_nixl,
#: it measures what the opt-in saves on small objects. Opt-in (`--paths`).
NIXL_INBAND: Final = "jax_nixl_inband"
INBAND_ENV: Final = {"RDT_JAX_INLINE_MAX_BYTES": str(100 << 10)}
#: jax_nixl with node-local reads off (every READ goes through NIXL's UCX):
#: run beside jax_nixl, it measures what `process_vm_readv` gains. Opt-in.
NIXL_UCX: Final = "jax_nixl_ucx"
UCX_ENV: Final = {"RDT_JAX_NIXL_CMA": "0"}
#: jax_nixl with CUDA IPC reads of device memory on one node turned on
#: (`RDT_JAX_NIXL_CUDA_IPC`, off by default until a GPU run passes): run
#: beside jax_nixl on a GPU, it measures what that path gains. Opt-in.
NIXL_CUDA_IPC: Final = "jax_nixl_cuda_ipc"
CUDA_IPC_ENV: Final = {"RDT_JAX_NIXL_CUDA_IPC": "1"}
#: The jax_nixl variants, each run in an actor group of its own environment
#: (`GROUP_ENV`): its label, and why it skips "refs" cases (None: it runs
#: them), whose reader, the driver, runs with the defaults.
NIXL_VARIANTS: Final = {
    NIXL_TCP: ("jax_nixl over TCP", "the driver's UCX is not restricted to TCP"),
    NIXL_OOB: ("jax_nixl, in-band off", None),
    NIXL_INBAND: ("jax_nixl, in-band on", None),
    NIXL_UCX: ("jax_nixl, node-local reads off", "the driver reads node-locally"),
    NIXL_CUDA_IPC: ("jax_nixl, CUDA IPC reads on", "the driver reads with the defaults"),
}
#: Paths a run includes only when `--paths` names them.
OPT_IN_PATHS: Final = (NIXL_OOB, NIXL_INBAND, NIXL_UCX, NIXL_CUDA_IPC)
#: Actor group name and environment of the paths whose actors need their own.
GROUP_ENV: Final = {
    # Its own actors: the Ray nixl group's actors hold NIXL agents whose
    # progress threads spin, which would be measured as Ray's floor.
    RAY_FLOOR: ("floor", None),
    NIXL_TCP: ("tcp", TCP_ENV),
    NIXL_OOB: ("oob", OOB_ENV),
    NIXL_INBAND: ("inband", INBAND_ENV),
    NIXL_UCX: ("ucx", UCX_ENV),
    NIXL_CUDA_IPC: ("cuda_ipc", CUDA_IPC_ENV),
}

_ANSI: Final = re.compile(r"\x1b\[[0-9;]*m")

#: Group backends of two-sided rdt_jax transports, by transport name, for
#: transports that do not say so themselves (DESIGN.md: jax_gloo uses a
#: "torch_gloo" group, jax_nccl an "nccl" one).
_KNOWN_GROUP_BACKENDS: Final = {"jax_gloo": "torch_gloo", "jax_nccl": "nccl", RAY_NCCL: "nccl"}

#: The share of the one GPU each actor that holds cuda memory gets (Ray
#: assigns it, so Ray's CUDA_IPC finds the same GPU index on both sides).
GPU_SHARE: Final = 0.1
#: The environment of those actors: no up-front reservation of most of the
#: GPU's memory by jax.
GPU_ENV: Final = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


@dataclass
class Measurement:
  """What one sample measured.

  Attributes:
    seconds: end-to-end wall time in the driver.
    read_seconds: time the reader(s) spent summing the data (the longest one).
    memory: peak RSS growth during the sample, in bytes, per side
      ("producer", "consumer", "consumer1", ..., "driver").
  """

  seconds: float
  read_seconds: float | None = None
  memory: dict[str, int] | None = None


class SampleError(RuntimeError):
  """A sample that failed or returned wrong data."""


# --------------------------------------------------------------------------
# Actor groups.


class ActorGroup:
  """A producer and its consumers, shared by the paths that run on them.

  Attributes:
    name: for messages.
    producer: the producing actor.
    consumers: consumer actors; the first reads single cases, all of them
      fan-out cases.
  """

  def __init__(self, name: str, actors: list[Any], pause: bool):
    self.name = name
    self.producer = actors[0]
    self.consumers = actors[1:]
    self._pause = pause
    self._stopped: set[int] = set()
    self.pids: list[int] = []
    self.infos: list[dict[str, Any]] = []
    self.prepared: dict[str, list[int]] = {}

  @property
  def actors(self) -> list[Any]:
    return [self.producer, *self.consumers]

  def start(self, timeout: float) -> None:
    """Waits until every actor is up and records its pid.

    Raises:
      ray.exceptions.GetTimeoutError: if that takes longer than `timeout`.
    """
    import ray

    infos = ray.get([a.info.remote() for a in self.actors], timeout=timeout)
    self.pids = [i["pid"] for i in infos]
    self.infos = infos

  def pause(self) -> None:
    """Stops the group's processes (SIGSTOP), if pausing is on."""
    if self._pause:
      self._signal(set(self.pids) - self._stopped, signal.SIGSTOP)

  def resume(self, members: list[Any] | None = None) -> None:
    """Continues (SIGCONT) the processes of `members` (default: all actors)."""
    if members is None:
      pids = set(self.pids)
    else:
      pids = {pid for a, pid in zip(self.actors, self.pids) if any(a is m for m in members)}
    self._signal(pids & self._stopped, signal.SIGCONT)

  def _signal(self, pids: set[int], sig: int) -> None:
    for pid in pids:
      try:
        os.kill(pid, sig)
      except ProcessLookupError:
        pass
      if sig == signal.SIGSTOP:
        self._stopped.add(pid)
      else:
        self._stopped.discard(pid)

  def prepare(self, key: str, call: Callable[[], Any], timeout: float) -> list[int]:
    """Runs `call` (which returns a ref to checksums) once per key; cached."""
    import ray

    if key not in self.prepared:
      self.prepared[key] = ray.get(call(), timeout=timeout)
    return self.prepared[key]

  def drop_all(self) -> None:
    """Frees every value `prepare` built on the producer."""
    import ray

    if self.prepared:
      ray.get([self.producer.drop.remote(k) for k in self.prepared])
      self.prepared.clear()

  def cpu_seconds(self) -> float:
    """CPU seconds the group's processes have used so far."""
    return sum(process_cpu_seconds(pid) for pid in self.pids)

  def kill(self) -> None:
    import ray

    self.resume()
    for a in self.actors:
      try:
        ray.kill(a)
      except Exception:
        pass


_RESUME_GUARD: Final = """
import os, signal, sys
sys.stdin.read()  # returns at EOF: when the benchmark's driver exits, however it exits
for pid in sys.argv[1:]:
  try:
    os.kill(int(pid), signal.SIGCONT)
  except OSError:
    pass
"""


def start_resume_guard(pids: list[int]) -> Any:
  """Starts a process that continues `pids` once this process exits.

  A driver killed while it has actors paused would leave them stopped for
  good (a stopped process cannot notice that Ray went away); the guard
  continues them, and they exit as Ray's workers do when their driver dies.
  """
  import subprocess
  import sys

  return subprocess.Popen(
      [sys.executable, "-c", _RESUME_GUARD, *map(str, pids)],
      stdin=subprocess.PIPE,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
  )


def stop_resume_guard(guard: Any) -> None:
  """Ends the guard from `start_resume_guard` without it signalling anything.

  Call it after continuing the actors and before killing them, so the guard
  never signals a pid that a finished actor has given back to the system.
  """
  guard.kill()
  guard.wait(timeout=10)
  guard.stdin.close()


def process_cpu_seconds(pid: int) -> float:
  """User plus system CPU seconds of process `pid` (0.0 if it is gone)."""
  try:
    import psutil
  except ImportError:
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
      return 0.0
  try:
    t = psutil.Process(pid).cpu_times()
  except psutil.Error:
    return 0.0
  return t.user + t.system


def actor_env(gpu: bool, env: dict[str, str] | None = None) -> dict[str, str]:
  """The env_vars of a BenchActor's runtime_env: the UCX settings every
  NIXL-capable actor gets (`_env.nixl_actor_env`), then `GPU_ENV` when
  `gpu`, then `env` (a path's own, which wins on a conflict).

  Ray merges them into the job's env_vars (PYTHONPATH stays the job's).
  """
  out = _env.nixl_actor_env()
  if gpu:
    out.update(GPU_ENV)
  out.update(env or {})
  return out


def bench_actor_class(gpu: bool, env: dict[str, str] | None = None) -> Any:
  """The BenchActor as a Ray actor class: a `GPU_SHARE` of the GPU when
  `gpu`, and the environment `actor_env(gpu, env)`."""
  import ray

  # Ray's type stubs do not know enable_tensor_transport yet.
  cls = ray.remote(enable_tensor_transport=True)(_actors.BenchActor)  # type: ignore[call-overload]
  options: dict[str, Any] = {"num_cpus": 0}
  if gpu:
    options["num_gpus"] = GPU_SHARE
  env_vars = actor_env(gpu, env)
  if env_vars:
    options["runtime_env"] = {"env_vars": env_vars}
  return cls.options(**options)


def make_group(
    name: str,
    consumers: int,
    pause: bool,
    gpu: bool = False,
    preload: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> ActorGroup:
  """Creates a group of BenchActors: a producer and `consumers` consumers.

  Each actor imports the `preload` modules as it starts, with `env` added to
  its environment.
  """
  cls = bench_actor_class(gpu, env)
  return ActorGroup(name, [cls.remote(preload) for _ in range(1 + consumers)], pause)


def make_plain_group(name: str, use_rdt_jax: bool, pause: bool) -> ActorGroup:
  """Creates one PlainActor producer (see `_plain`); the driver reads its values."""
  import ray

  from rdt_jax.bench import _plain

  cls = ray.remote(_plain.plain_actor_class()).options(num_cpus=0)
  return ActorGroup(name, [cls.remote(use_rdt_jax)], pause)


# --------------------------------------------------------------------------
# Paths.


@dataclass
class Path:
  """One way of moving a case's bytes, as compared by the benchmark.

  Attributes:
    id: the name used in `--paths`, the JSON and the tables.
    label: a human label for tables and the plot.
    kind: "rdt_jax" (a transport of ours), "baseline" or "check".
    skip_reason: why the path does not run at all (None if it runs).
    groups: the path's actors, by device kind ("cpu", "cuda").
    gpu_skip: why the path cannot run cuda cases (None if it can).
  """

  id: str
  label: str
  kind: str
  skip_reason: str | None = None
  groups: dict[str, ActorGroup] = field(default_factory=dict)
  gpu_skip: str | None = None

  def applies(self, case: _cases.Case) -> bool:
    """Whether `case` is one this path is compared on at all."""
    return case.kind != "plain"

  def case_skip(self, case: _cases.Case) -> str | None:
    """Why this applicable path cannot run `case` (None if it can)."""
    if self.skip_reason:
      return self.skip_reason
    if case.device not in self.groups:
      if case.device == "cuda" and self.gpu_skip:
        return self.gpu_skip
      if self.groups:
        return f"no {case.device} actors for this path"
    return None

  def group(self, case: _cases.Case) -> ActorGroup | None:
    return self.groups.get(case.device)

  def group_of(self, case: _cases.Case) -> ActorGroup:
    """The actor group for `case`, which the runner made before running it."""
    g = self.group(case)
    if g is None:
      raise RuntimeError(f"path {self.id} has no {case.device} actors")
    return g

  def actors_for(self, case: _cases.Case, variant: str) -> list[Any] | None:
    """The actors one sample uses, to be continued while it runs (None: all)."""
    return None

  def prepare(self, case: _cases.Case, timeout: float) -> None:
    """Builds the case's data where this path needs it (untimed)."""

  def run(self, case: _cases.Case, variant: str, timeout: float, memory: bool) -> Measurement:
    """Runs one sample of `case`.

    Raises:
      SampleError: if the data that arrived is wrong, or the sample failed.
    """
    raise NotImplementedError

  def release(self) -> None:
    """Frees what `prepare` kept in the driver."""


class ActorPath(Path):
  """A path between BenchActors: a transport, or the object store (None)."""

  def __init__(
      self,
      id: str,
      label: str,
      kind: str,
      framework: str,
      transport: str | None,
      devices: tuple[str, ...] = ("cpu",),
      refs_getter: str | None = None,
      refs_skip: str | None = None,
      reader: str = "consume",
  ):
    """See the attributes of `Path`; besides them:

    Args:
      framework: the array type the producer returns ("numpy", "jax", "torch").
      transport: the `tensor_transport` of the producing call (None: the
        object store).
      devices: the device kinds the path moves.
      refs_getter: for "refs" cases, why a getter actor gets the refs
        instead of the driver (None: the driver gets them).
      refs_skip: why the path cannot run "refs" cases at all (None: it can).
      reader: the consumer's BenchActor method ("consume": reads every byte;
        "consume_as_jax": makes NumPy leaves jax.Arrays first;
        "consume_nothing": reads nothing, and the data is not checked).
    """
    super().__init__(id, label, kind)
    self.framework = framework
    self.transport = transport
    self.devices = devices
    self.refs_getter = refs_getter
    self.refs_skip = refs_skip
    self.reader = reader
    self.one_sided = True
    self.transport_class: type | None = None

  def case_skip(self, case: _cases.Case) -> str | None:
    if case.device not in self.devices:
      return f"{self.label} does not move {case.device} memory"
    reason = super().case_skip(case)
    if reason:
      return reason
    if case.kind == "refs" and self.refs_skip:
      return self.refs_skip
    return None

  def _key(self, case: _cases.Case) -> str:
    return f"{case.id}/{self.framework}"

  def actors_for(self, case: _cases.Case, variant: str) -> list[Any] | None:
    g = self.group_of(case)
    if case.kind == "refs":
      return [g.producer] if self.refs_getter is None else [g.producer, g.consumers[-1]]
    return [g.producer, *self._readers(case, variant, g)]

  @staticmethod
  def _readers(case: _cases.Case, variant: str, g: ActorGroup) -> list[Any]:
    return g.consumers[: int(variant[1:])] if case.kind == "fanout" else g.consumers[:1]

  def prepare(self, case: _cases.Case, timeout: float) -> None:
    g = self.group_of(case)
    key = self._key(case)
    g.prepare(key, lambda: g.producer.prepare.remote(key, case, self.framework), timeout)

  def _send(self, g: ActorGroup) -> Any:
    method = g.producer.send
    return method.options(tensor_transport=self.transport) if self.transport else method

  def run(self, case: _cases.Case, variant: str, timeout: float, memory: bool) -> Measurement:
    import ray

    g = self.group_of(case)
    key = self._key(case)
    expected = g.prepared[key]
    send = self._send(g)
    if case.kind == "refs":
      return self._run_refs(case, variant, g, key, send, expected, timeout, memory)
    readers = self._readers(case, variant, g)
    sides = {"producer": g.producer, **_reader_sides(readers)}
    baseline = _reset_peaks(sides) if memory else None
    t0 = time.perf_counter()
    ref = send.remote(key)
    out = ray.get([getattr(c, self.reader).remote(ref) for c in readers], timeout=timeout)
    seconds = time.perf_counter() - t0
    del ref
    for checksum, _ in out:
      if checksum is not None:
        _check(checksum, expected[0])
    return Measurement(seconds, max(s for _, s in out), _peaks(sides, baseline) if memory else None)

  def splits(self) -> bool:
    """Whether `run_split` applies: rdt_jax's one-sided transports (Ray's
    `ray.put` takes only those)."""
    return self.kind == "rdt_jax" and self.one_sided and self.transport is not None

  def run_split(self, case: _cases.Case, timeout: float) -> dict[str, float]:
    """One transfer timed per side, inside the actors.

    The producer `ray.put`s the object (timed there), the consumer `ray.get`s
    the ref and reads it (timed there); what is left of the driver's
    end-to-end time is Ray's: two actor calls, the owner's metadata, results.

    Raises:
      SampleError: if the data that arrived is wrong.
    """
    import ray

    g = self.group_of(case)
    key = self._key(case)
    assert self.transport is not None
    t0 = time.perf_counter()
    refs, put_s = ray.get(g.producer.put_timed.remote(key, self.transport), timeout=timeout)
    checksum, get_s, read_s, jax_s = ray.get(g.consumers[0].get_timed.remote(refs), timeout=timeout)
    seconds = time.perf_counter() - t0
    del refs
    _check(checksum, g.prepared[key][0])
    return {
        "seconds": seconds, "producer_s": put_s, "consumer_s": get_s, "read_s": read_s,
        "ray_s": seconds - put_s - get_s - read_s, "jax_s": jax_s,
    }

  def _run_refs(self, case, variant, g, key, send, expected, timeout, memory) -> Measurement:
    import ray

    batch = variant == "batch"
    if self.refs_getter is None:
      sides: dict[str, Any] = {"producer": g.producer}
      baseline = _reset_peaks(sides) if memory else None
      driver_base = _actors.reset_peak_rss() if memory else None
      t0 = time.perf_counter()
      refs = [send.remote(key, i) for i in range(case.count)]
      values = ray.get(refs, timeout=timeout) if batch else [ray.get(r, timeout=timeout) for r in refs]
      t1 = time.perf_counter()
      sums = [self._driver_read(v) for v in values]
      seconds = time.perf_counter() - t0
      read = time.perf_counter() - t1
      mem = None
      if memory:
        mem = _peaks(sides, baseline)
        mem["driver"] = _actors.peak_rss() - (driver_base or 0)
      del refs, values
    else:
      # A getter actor stands in for the driver (see refs_getter).
      getter = g.consumers[-1]
      sides = {"producer": g.producer, "getter": getter}
      baseline = _reset_peaks(sides) if memory else None
      t0 = time.perf_counter()
      call = getter.call_and_get.remote(g.producer, key, case.count, self.transport, batch)
      sums, read = ray.get(call, timeout=timeout)
      seconds = time.perf_counter() - t0
      mem = _peaks(sides, baseline) if memory else None
    for got, want in zip(sums, expected):
      if got is not None:
        _check(got, want)
    return Measurement(seconds, read, mem)

  def _driver_read(self, value: Any) -> int | None:
    """What `reader` does, done in the driver (refs cases)."""
    if self.reader == "consume_nothing":
      return None
    if self.reader == "consume_as_jax":
      value = _cases.numpy_to_jax(value)
    return _cases.value_checksum(value)


class MemcpyPath(Path):
  """NumPy copies of the same bytes in the driver: the limit for any path
  between host memories (device cases compare with `DeviceMemcpyPath`)."""

  def __init__(self) -> None:
    super().__init__(MEMCPY, "memcpy", "baseline")
    self._buffers: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}

  def case_skip(self, case: _cases.Case) -> str | None:
    if case.device != "cpu":
      return f"memcpy copies host memory; the limit for {case.device} cases is {DEVICE_MEMCPY}"
    return None

  def prepare(self, case: _cases.Case, timeout: float) -> None:
    self._buffers.clear()
    sources = [
        x
        for i in range(case.objects)
        for x in _cases.value_leaves(_actors.make_value(case, "numpy", i))
    ]
    targets = [np.empty_like(x) for x in sources]
    for t in targets:
      t.fill(0)  # fault the pages in
    self._buffers[case.id] = (sources, targets)

  def run(self, case: _cases.Case, variant: str, timeout: float, memory: bool) -> Measurement:
    copies = int(variant[1:]) if case.kind == "fanout" else 1
    sources, targets = self._buffers[case.id]
    t0 = time.perf_counter()
    for _ in range(copies):
      for s, d in zip(sources, targets):
        np.copyto(d, s)
    return Measurement(time.perf_counter() - t0)

  def release(self) -> None:
    self._buffers.clear()


class DeviceMemcpyPath(Path):
  """torch copies of a cuda case's bytes between two tensors on the GPU, in
  one actor: the limit for any device-to-device path.

  One sample is one call to the producer of the torch group
  (`BenchActor.device_memcpy`): it copies every leaf of the case's object
  (`N` times for an `xN` fan-out variant) into tensors allocated before the
  clock starts, synchronized before and after; the seconds are the actor's.
  The tensors are the ones Ray's torch paths send (same group, same key).
  """

  #: The array type of the copied tensors (for `device_support`).
  framework: Final = "torch"

  def __init__(self) -> None:
    super().__init__(DEVICE_MEMCPY, "device memcpy (torch)", "baseline")

  def case_skip(self, case: _cases.Case) -> str | None:
    if case.device != "cuda":
      return f"device_memcpy copies cuda memory; the limit for {case.device} cases is {MEMCPY}"
    return super().case_skip(case)

  def actors_for(self, case: _cases.Case, variant: str) -> list[Any] | None:
    return [self.group_of(case).producer]

  def _key(self, case: _cases.Case) -> str:
    return f"{case.id}/{self.framework}"

  def prepare(self, case: _cases.Case, timeout: float) -> None:
    g = self.group_of(case)
    key = self._key(case)
    g.prepare(key, lambda: g.producer.prepare.remote(key, case, self.framework), timeout)

  def run(self, case: _cases.Case, variant: str, timeout: float, memory: bool) -> Measurement:
    import ray

    g = self.group_of(case)
    copies = int(variant[1:]) if case.kind == "fanout" else 1
    key = self._key(case)
    seconds, checksum = ray.get(g.producer.device_memcpy.remote(key, copies), timeout=timeout)
    _check(checksum, sum(g.prepared[key]) % (1 << 64))
    return Measurement(seconds)


class PlainPath(Path):
  """A NumPy array from a method without `tensor_transport` (issue 3's check).

  rdt_jax's reducers act where a value is serialized, so the check varies the
  producer: one process that never imported rdt_jax, one that imported it
  and called `register()`. The driver gets and reads the array.
  """

  def __init__(self, use_rdt_jax: bool):
    if use_rdt_jax:
      super().__init__(PLAIN_WITH, "plain method, rdt_jax registered", "check")
    else:
      super().__init__(PLAIN_WITHOUT, "plain method, no rdt_jax", "check")
    self.use_rdt_jax = use_rdt_jax

  def applies(self, case: _cases.Case) -> bool:
    return case.kind == "plain"

  def prepare(self, case: _cases.Case, timeout: float) -> None:
    g = self.group_of(case)
    g.prepare("plain", lambda: g.producer.prepare.remote(case.object_nbytes), timeout)

  def run(self, case: _cases.Case, variant: str, timeout: float, memory: bool) -> Measurement:
    import ray

    g = self.group_of(case)
    sides = {"producer": g.producer}
    baseline = _reset_peaks(sides) if memory else None
    driver_base = _actors.reset_peak_rss() if memory else None
    t0 = time.perf_counter()
    ref = g.producer.send.remote()
    value = ray.get(ref, timeout=timeout)
    t1 = time.perf_counter()
    checksum = _cases.host_checksum(value)
    seconds = time.perf_counter() - t0
    del ref, value
    _check(checksum, g.prepared["plain"][0])
    mem = None
    if memory:
      mem = _peaks(sides, baseline)
      mem["driver"] = _actors.peak_rss() - (driver_base or 0)
    return Measurement(seconds, seconds - (t1 - t0), mem)


# --------------------------------------------------------------------------
# Helpers.


def _reader_sides(readers: list[Any]) -> dict[str, Any]:
  if len(readers) == 1:
    return {"consumer": readers[0]}
  return {f"consumer{i}": r for i, r in enumerate(readers)}


def _reset_peaks(sides: dict[str, Any]) -> dict[str, int]:
  import ray

  names = list(sides)
  values = ray.get([sides[n].reset_peak.remote() for n in names])
  return dict(zip(names, values))


def _peaks(sides: dict[str, Any], baseline: dict[str, int] | None) -> dict[str, int]:
  assert baseline is not None
  import ray

  names = list(sides)
  values = ray.get([sides[n].peak.remote() for n in names])
  return {n: v - baseline[n] for n, v in zip(names, values) if baseline[n] >= 0}


def _check(got: int, want: int) -> None:
  if got != want:
    raise SampleError(f"wrong data arrived: checksum {got:#x}, expected {want:#x}")


def group_backend(name: str, cls: type) -> str | None:
  """The collective-group backend a two-sided transport needs, if known."""
  for attr in ("group_backend", "collective_backend"):
    value = getattr(cls, attr, None)
    if isinstance(value, str):
      return value
  return _KNOWN_GROUP_BACKENDS.get(name)


def first_line(e: BaseException) -> str:
  """A one-line summary of an exception, for skip reasons and the JSON.

  For an error raised in an actor, summarizes the actor's exception.
  """
  cause = getattr(e, "cause", None)
  if isinstance(cause, BaseException) and cause is not e:
    return first_line(cause)
  lines = [line.strip() for line in _ANSI.sub("", str(e)).splitlines() if line.strip()]
  if lines and lines[0].startswith("ray::"):
    lines = lines[-1:]  # a remote traceback: its last line names the error
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
