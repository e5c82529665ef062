"""`rdt-jax bench --two-host`: transfers between two Ray nodes joined by a real network link.

`TwoHosts` builds a two-node Ray cluster on one Linux machine. Each "host" is
a set of namespaces created here: its own network namespace (one end of a
veth pair, an address in `SUBNET`.0/24, and loopback), and its own pid, ipc,
uts and mount namespaces with a private `/dev/shm` and an `/etc/hosts` naming
both hosts. Host A runs Ray's head node (with the token authentication Ray
2.60 turns on), host B a worker node that joins it over the veth; drivers run
inside host A's namespaces (`TwoHosts.run`). No traffic leaves the two
namespaces: the only addresses are the two assigned here. Tear-down is
complete even when a caller fails: killing the first process of a host's pid
namespace kills every process in it, and the network namespaces (with the
veth pair) are deleted. It needs root; `namespaces_available` says why not
where the namespaces cannot be created. The test suite's two-host checks
(tests/test_twohost.py) run on the same cluster.

The benchmark (`run`) starts the cluster, runs `measure` as a driver on host A
and writes `bench-twohost.json` and `bench-twohost.md` under `--out`. Every
sample is one transfer from a producer actor on host B to a consumer actor on
host A, timed by the driver from the producing call to the consumer's checksum
of every byte (as `rdt-jax bench` times its paths). Besides the paths it
compares the NIXL progress poll's policies (`agent.PollPolicy`) on `jax_nixl`
with in-band objects off, so that every size takes NIXL's READ path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import pathlib
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "HEAD_PORT", "SUBNET", "Host", "TwoHosts", "drive", "markdown", "measure", "namespaces_available", "run",
]

#: The subnet of the veth pair: host A is .1, host B is .2.
SUBNET: Final = "10.231.77"
HEAD_PORT: Final = 6379
#: Each host's private `/dev/shm`, and the object store inside it (Ray puts
#: an object store larger than 95% of `/dev/shm` on disk instead).
SHM_BYTES: Final = 4 << 30
OBJECT_STORE_BYTES: Final = 2 << 30
RAY_BIN: Final = pathlib.Path(sys.executable).parent / "ray"


def namespaces_available() -> str | None:
  """None if this process can build the two hosts, else why not."""
  if os.geteuid() != 0:
    return "needs root to create network, pid and mount namespaces"
  for tool in ("ip", "unshare", "nsenter", "mount"):
    if shutil.which(tool) is None:
      return f"needs the {tool!r} command (iproute2 / util-linux)"
  probe = f"rdtj-probe-{os.getpid()}"
  made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
  if made.returncode != 0:
    return f"cannot create a network namespace: {made.stderr.strip()}"
  subprocess.run(["ip", "netns", "del", probe], capture_output=True)
  return None


def _sh(*args: str) -> None:
  subprocess.run(args, check=True, capture_output=True, text=True)


@dataclass
class Host:
  """One simulated host: its network namespace, address and Ray node process."""

  name: str
  netns: str
  address: str
  process: subprocess.Popen | None = None
  log: pathlib.Path | None = None

  def init_pid(self) -> int:
    """The root-namespace pid of the first process of this host's pid namespace."""
    assert self.process is not None
    children = pathlib.Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
    if not children:
      raise RuntimeError(f"host {self.name}'s namespace has no process (its node exited); log: {self.log}")
    return int(children[0])


@dataclass
class TwoHosts:
  """Host A (Ray head, drivers) and host B (a worker node), joined by a veth pair.

  Attributes:
    workdir: logs, Ray's temp dir and the hosts file go here.
    env: added to every process's environment (nodes and drivers).
    cpus: each node's `--num-cpus`.
    tag: names this cluster's namespaces and interfaces (at most 7
      characters: interface names have 15).
    pythonpath: the drivers' (and so the workers') `PYTHONPATH` entries.
    cwd: the drivers' working directory (default: `workdir`).
  """

  workdir: pathlib.Path
  env: dict[str, str] = field(default_factory=dict)
  cpus: int = 4
  tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
  pythonpath: list[str] = field(default_factory=list)
  cwd: pathlib.Path | None = None

  def __post_init__(self) -> None:
    assert len(self.tag) <= 7, f"tag {self.tag!r}: interface names would pass 15 characters"
    self.a = Host("a", f"rdtj-a-{self.tag}", f"{SUBNET}.1")
    self.b = Host("b", f"rdtj-b-{self.tag}", f"{SUBNET}.2")
    self.token = secrets.token_hex(32)
    self.workdir.mkdir(parents=True, exist_ok=True)

  # ---- life cycle

  def start(self, timeout: float = 120.0) -> None:
    """Creates both hosts, starts the head on A and joins B; waits for both nodes."""
    try:
      self._network()
      self._node(self.a, head=True)
      self._wait_for_nodes(1, timeout)
      self.start_b(timeout)
    except BaseException:
      self.stop()
      raise

  def start_b(self, timeout: float = 120.0) -> None:
    """(Re)starts host B's node (its namespaces anew) and waits until the
    cluster counts two live nodes. A node B started before is killed first
    and waited for until Ray counts it dead (its health checks fail)."""
    if self.b.process is not None:
      self.kill(self.b)
      self._wait_for_nodes(1, timeout)
    self._node(self.b, head=False)
    self._wait_for_nodes(2, timeout)

  def stop(self) -> None:
    """Kills every process of both hosts and deletes their namespaces."""
    for host in (self.b, self.a):
      self.kill(host)
    for host in (self.a, self.b):
      self._kill_netns_processes(host.netns)
      subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)

  def kill(self, host: Host) -> None:
    """Kills host `host` whole (its node and every process in its pid namespace)."""
    if host.process is None:
      return
    try:
      os.kill(host.init_pid(), signal.SIGKILL)
    except (RuntimeError, ProcessLookupError, FileNotFoundError):
      pass
    try:
      host.process.kill()
      host.process.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
      pass
    host.process = None

  def link(self, up: bool) -> None:
    """Takes the veth link between the hosts down or brings it back up."""
    state = "up" if up else "down"
    _sh("ip", "-n", self.a.netns, "link", "set", self.iface(self.a), state)
    _sh("ip", "-n", self.b.netns, "link", "set", self.iface(self.b), state)

  def iface(self, host: Host) -> str:
    """Host `host`'s end of the veth pair."""
    return f"rdtj-v{host.name}-{self.tag}"

  def hostname(self, host: Host) -> str:
    return f"rdtj-{host.name}-{self.tag}"

  # ---- drivers

  def driver_env(self) -> dict[str, str]:
    """The environment of a process that joins the cluster (token included).

    Everything else is inherited (`PYTHONPATH` included), so the nodes'
    workers import the rdt_jax the caller imports.
    """
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "PYTEST_", "RDT_JAX_FAULTS"))
    }
    env.update({
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": self.token,
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(self.pythonpath),
        "RDTJ_IFACE": self.iface(self.a),  # host A's end of the link (drivers run on A)
        **self.env,
    })
    return env

  def run(self, args: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Runs `python args...` as a driver on host A (its network, pid and mount
    namespaces), with `RAY_ADDRESS` set to the head; returns its output."""
    env = self.driver_env() | {"RAY_ADDRESS": f"{self.a.address}:{HEAD_PORT}"}
    return subprocess.run(
        ["nsenter", "-t", str(self.a.init_pid()), "-n", "-p", "-m", "-u", "-i", "--",
         sys.executable, *args],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=self.cwd or self.workdir,
    )

  # ---- set-up steps

  def _network(self) -> None:
    a, b = self.a, self.b
    va, vb = self.iface(a), self.iface(b)
    for host in (a, b):
      _sh("ip", "netns", "add", host.netns)
      _sh("ip", "-n", host.netns, "link", "set", "lo", "up")
    _sh("ip", "link", "add", va, "netns", a.netns, "type", "veth", "peer", "name", vb, "netns", b.netns)
    _sh("ip", "-n", a.netns, "addr", "add", f"{a.address}/24", "dev", va)
    _sh("ip", "-n", b.netns, "addr", "add", f"{b.address}/24", "dev", vb)
    _sh("ip", "-n", a.netns, "link", "set", va, "up")
    _sh("ip", "-n", b.netns, "link", "set", vb, "up")

  def _node(self, host: Host, head: bool) -> None:
    ray = [str(RAY_BIN), "start", "--block", "--disable-usage-stats", f"--node-ip-address={host.address}",
           f"--num-cpus={self.cpus}", f'--resources={{"host_{host.name}": 100}}',
           f"--object-store-memory={OBJECT_STORE_BYTES}"]
    if head:
      ray += ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false",
              f"--temp-dir={self.workdir / 'ray'}"]
    else:
      ray += [f"--address={self.a.address}:{HEAD_PORT}"]
    # Each host resolves both hostnames (Gloo binds to what its own resolves to).
    hosts = self.workdir / "hosts"
    hosts.write_text(
        "127.0.0.1 localhost\n" + "".join(f"{h.address} {self.hostname(h)}\n" for h in (self.a, self.b))
    )
    inside = (
        f"mount -t tmpfs -o size={SHM_BYTES} tmpfs /dev/shm && mount --bind '{hosts}' /etc/hosts && "
        f"hostname {self.hostname(host)} && exec " + " ".join(f"'{x}'" for x in ray)
    )
    host.log = self.workdir / f"node-{host.name}.log"
    host.process = subprocess.Popen(
        ["ip", "netns", "exec", host.netns,
         "unshare", "--pid", "--fork", "--mount-proc", "--ipc", "--uts", "--mount", "--propagation", "private",
         "sh", "-c", inside],
        env=self.driver_env(), stdout=host.log.open("a"), stderr=subprocess.STDOUT, start_new_session=True,
    )

  def _wait_for_nodes(self, count: int, timeout: float) -> None:
    """Waits until Ray counts exactly `count` live nodes."""
    check = (
        "import ray, sys; ray.init(logging_level='error'); "
        f"sys.exit(0 if sum(n['Alive'] for n in ray.nodes()) == {count} else 3)"
    )
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
      time.sleep(1.0)
      for host in (self.a, self.b)[:count]:
        if host.process is not None and host.process.poll() is not None:
          log = host.log.read_text()[-2000:] if host.log else ""
          raise RuntimeError(f"host {host.name}'s Ray node exited: {log}")
      try:
        out = self.run(["-c", check], timeout=60)
      except (RuntimeError, subprocess.TimeoutExpired) as e:
        last = str(e)
        continue
      if out.returncode == 0:
        return
      last = out.stderr[-2000:]
    raise TimeoutError(f"the two-host cluster did not reach {count} nodes in {timeout}s: {last}")

  @staticmethod
  def _kill_netns_processes(netns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    for pid in pids:
      try:
        os.kill(int(pid), signal.SIGKILL)
      except ProcessLookupError:
        pass


# --------------------------------------------------------------------------
# The benchmark.

#: The cases of a two-host run, and the measured repetitions of each.
SIZES: Final = {"4KiB": 15, "1MiB": 10, "64MiB": 5}

#: path id -> (label, framework the producer returns, tensor_transport or None
#: for the object store, extra environment of its actors).
PATHS: Final[dict[str, tuple[str, str, str | None, dict[str, str]]]] = {
    "jax_nixl": ("jax_nixl (jax.Array)", "jax", "jax_nixl", {}),
    "jax_transfer": ("jax_transfer (jax.Array)", "jax", "jax_transfer", {}),
    "ray_nixl_torch": ("Ray's nixl (torch)", "torch", "nixl", {}),
    "object_store_numpy": ("object store (NumPy)", "numpy", None, {}),
}

#: The progress-poll policies compared on `jax_nixl` with in-band objects off:
#: name -> `PollPolicy` fields (empty: the default, adaptive).
POLL_VARIANTS: Final[dict[str, dict[str, float]]] = {
    "fixed 10 ms": {"idle_s": 0.01, "busy_s": 0.01},
    "fixed 1 ms": {"idle_s": 0.001, "busy_s": 0.001},
    "busy (no sleep)": {"idle_s": 0.0, "busy_s": 0.0},
    "adaptive (default)": {},
}
POLL_PATH: Final = "jax_nixl_oob"
POLL_ENV: Final = {"RDT_JAX_INLINE_MAX_BYTES": "0"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds `--two-host` to `rdt-jax bench`'s options."""
  parser.add_argument(
      "--two-host", action="store_true",
      help="run between two Ray nodes that this command starts in network namespaces of their own, "
           "joined by a veth pair (needs root); writes bench-twohost.json/.md under --out",
  )


class _TwoHostActor:
  """The benchmark's actor (`_actors.BenchActor`) plus the poll policy's knobs."""

  def set_poll_policy(self, fields: dict[str, float]) -> None:
    from rdt_jax.transports.nixl import agent

    agent.set_poll_policy(agent.PollPolicy(**fields))

  def poll_counts(self) -> dict[str, int]:
    """Polls (and busy polls) this process's NIXL poller made so far."""
    from rdt_jax.transports.nixl import agent

    return agent.poll_counts()

  def cpu_seconds(self) -> float:
    """CPU time this process used so far (all its threads)."""
    return time.process_time()


def _actor_class() -> Any:
  import ray

  from rdt_jax.bench._actors import BenchActor

  cls = type("TwoHostBenchActor", (_TwoHostActor, BenchActor), {})
  return ray.remote(enable_tensor_transport=True)(cls)  # type: ignore[call-overload]


def _pair(env: dict[str, str], preload: tuple[str, ...]) -> tuple[Any, Any]:
  """A producer on host B and a consumer on host A."""
  cls = _actor_class()
  runtime_env = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env}}
  made = [
      cls.options(num_cpus=0, resources={f"host_{h}": 1}, runtime_env=runtime_env).remote(preload)
      for h in ("b", "a")
  ]
  return made[0], made[1]


def _sample(producer: Any, consumer: Any, key: str, transport: str | None, want: int, timeout: float) -> float:
  """One transfer, timed from the producing call to the consumer's checksum."""
  import ray

  send = producer.send.options(tensor_transport=transport) if transport else producer.send
  t0 = time.perf_counter()
  ref = send.remote(key)
  checksum, _ = ray.get(consumer.consume.remote(ref), timeout=timeout)
  seconds = time.perf_counter() - t0
  del ref
  if checksum != want:
    raise RuntimeError(f"wrong bytes arrived on host A (checksum {checksum}, want {want})")
  return seconds


def _series(producer: Any, consumer: Any, transport: str | None, framework: str, size: str, reps: int,
            timeout: float) -> list[float]:
  import ray

  from rdt_jax.bench import _cases

  case = _cases.parse_case(size)
  key = f"{size}/{framework}"
  want = ray.get(producer.prepare.remote(key, case, framework), timeout=timeout)[0]
  try:
    _sample(producer, consumer, key, transport, want, timeout)  # warm-up: connections, pools
    return [_sample(producer, consumer, key, transport, want, timeout) for _ in range(reps)]
  finally:
    ray.get(producer.drop.remote(key), timeout=timeout)


def measure(sizes: dict[str, int], paths: list[str], poll_variants: list[str], timeout: float = 300.0) -> dict:
  """Runs the two-host benchmark as a driver of the cluster `RAY_ADDRESS` names
  (host A); returns `{"results": [...], "skips": {...}}`, one result per path,
  variant and size with every sample in seconds."""
  import ray

  import rdt_jax

  ray.init(logging_level=logging.ERROR, runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
  rdt_jax.register()
  results: list[dict[str, Any]] = []
  skips: dict[str, str] = {}

  def record(path: str, variant: str, size: str, samples: list[float], extra: dict | None = None) -> None:
    results.append({"path": path, "variant": variant, "case": size, "samples": samples, **(extra or {})})
    print(f"  {path:<20} {variant:<20} {size:>6} median {statistics.median(samples) * 1e3:9.3f} ms", flush=True)

  for path in paths:
    _label, framework, transport, env = PATHS[path]
    producer, consumer = _pair(env, ("jax", "torch") if framework != "numpy" else ())
    try:
      for size, reps in sizes.items():
        try:
          record(path, "", size, _series(producer, consumer, transport, framework, size, reps, timeout))
        except Exception as e:  # one failing path must not lose the others' figures
          skips[f"{path}/{size}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
      for actor in (producer, consumer):
        ray.kill(actor)
  if poll_variants:
    producer, consumer = _pair(POLL_ENV, ("jax",))
    try:
      for size, reps in sizes.items():
        for variant in poll_variants:
          ray.get([a.set_poll_policy.remote(POLL_VARIANTS[variant]) for a in (producer, consumer)])
          before = ray.get(producer.poll_counts.remote())
          samples = _series(producer, consumer, "jax_nixl", "jax", size, reps, timeout)
          after = ray.get(producer.poll_counts.remote())
          polls = {k: after[k] - before[k] for k in after}
          record(POLL_PATH, variant, size, samples, {"producer_polls": polls})
      idle = {v: _idle_cores(producer, consumer, POLL_VARIANTS[v], timeout) for v in poll_variants}
    finally:
      for actor in (producer, consumer):
        ray.kill(actor)
  ray.shutdown()
  return {"results": results, "skips": skips, "idle_cores": idle if poll_variants else {}}


#: Seconds over which `_idle_cores` counts the producer's CPU time.
IDLE_WINDOW_S: Final = 3.0


def _idle_cores(producer: Any, consumer: Any, policy: dict[str, float], timeout: float) -> float:
  """Cores the producer's process uses under `policy` while it exports an
  object its consumer on the other host has read (so both poll), with no
  transfer running: the poll's idle cost."""
  import ray

  from rdt_jax.bench import _cases

  ray.get([a.set_poll_policy.remote(policy) for a in (producer, consumer)])
  want = ray.get(producer.prepare.remote("idle", _cases.parse_case("1MiB"), "jax"), timeout=timeout)[0]
  ref = producer.send.options(tensor_transport="jax_nixl").remote("idle")
  try:
    if ray.get(consumer.consume.remote(ref), timeout=timeout)[0] != want:
      raise RuntimeError("wrong bytes arrived on host A")
    time.sleep(0.5)  # past the busy hold of the transfer
    c0 = ray.get(producer.cpu_seconds.remote())
    time.sleep(IDLE_WINDOW_S)
    c1 = ray.get(producer.cpu_seconds.remote())
  finally:
    del ref
    ray.get(producer.drop.remote("idle"), timeout=timeout)
  return (c1 - c0) / IDLE_WINDOW_S


# --------------------------------------------------------------------------
# The command and its report.


def run(args: argparse.Namespace) -> dict:
  """`rdt-jax bench --two-host`: starts the cluster, measures from host A,
  writes `bench-twohost.json` and `.md` under `args.out`, stops the cluster.

  Raises:
    RuntimeError: where the namespaces cannot be created (not root, no
      iproute2), or the measuring driver failed.
  """
  reason = namespaces_available()
  if reason is not None:
    raise RuntimeError(f"rdt-jax bench --two-host {reason}; run it as root on Linux.")
  t0 = time.perf_counter()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  paths = list(args.paths) if args.paths else list(PATHS)
  unknown = [p for p in paths if p not in PATHS]
  if unknown:
    raise ValueError(f"--two-host measures {', '.join(PATHS)}; not {', '.join(unknown)}")
  sizes = {c: SIZES.get(c, 5) for c in args.cases} if args.cases else dict(SIZES)
  if args.reps:
    sizes = {c: args.reps for c in sizes}
  plan = {"sizes": sizes, "paths": paths, "poll_variants": list(POLL_VARIANTS)}
  package_parent = str(pathlib.Path(__file__).resolve().parents[2])
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="rdt-jax-twohost-"))  # logs, Ray's temp dir
  hosts = TwoHosts(workdir, pythonpath=[package_parent], tag="bench")
  load_start = _loadavg()
  date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  print(f"rdt-jax bench --two-host: starting the two nodes (load average {load_start})", flush=True)
  hosts.start()
  measured = drive(hosts, "rdt_jax.bench._twohost", plan, "the two-host benchmark")
  from rdt_jax.bench._env import git_state as _git_state
  from rdt_jax.bench._env import versions as _versions

  doc = {
      "schema": "rdt-jax-bench-twohost/1",
      "wall_s": time.perf_counter() - t0,
      "plan": plan,
      "environment": {
          "date": date, "host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
          "loadavg_start": load_start, "loadavg_end": _loadavg(), "versions": _versions(), **_git_state(),
          "link": f"veth pair {SUBNET}.1 (host A: head, driver, consumers) - {SUBNET}.2 (host B: producers)",
          "note": "shared host: other jobs may run during the benchmark; see the load averages",
      },
      "paths": {k: v[0] for k, v in PATHS.items()},
      **measured,
  }
  from rdt_jax.bench import _report

  _report.write_json(doc, out / "bench-twohost.json")
  text = markdown(doc)
  (out / "bench-twohost.md").write_text(text)
  sys.stdout.write(text)
  return doc


def drive(hosts: TwoHosts, module: str, plan: dict, what: str) -> dict:
  """Runs `python -m module '<plan as JSON>'` as a driver on host A of the
  started cluster `hosts`, then stops the cluster; echoes the driver's
  other lines to stderr and returns the last JSON line it printed.

  Raises:
    RuntimeError: naming `what`, if the driver failed or printed no JSON.
  """
  try:
    done = hosts.run(["-m", module, json.dumps(plan)], timeout=3600)
  finally:
    hosts.stop()
  sys.stderr.write("\n".join(x for x in done.stdout.splitlines() if not x.startswith("{")) + "\n")
  lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
  if done.returncode != 0 or not lines:
    raise RuntimeError(f"{what}'s driver failed (exit {done.returncode}): {done.stderr[-3000:]}")
  return lines[-1]


def _loadavg() -> list[float]:
  try:
    with open("/proc/loadavg") as f:
      return [float(x) for x in f.read().split()[:3]]
  except OSError:
    return []


def _ms(seconds: float) -> str:
  ms = seconds * 1e3
  return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def _mb_s(nbytes: int, seconds: float) -> str:
  return f"{nbytes / seconds / 1e6:,.0f}" if seconds > 0 else ""


def markdown(doc: dict) -> str:
  """The Markdown report of a two-host run, computed from its JSON document only."""
  from rdt_jax.bench import _cases

  env = doc["environment"]
  sizes = list(doc["plan"]["sizes"])
  nbytes = {s: _cases.parse_case(s).object_nbytes for s in sizes}
  by = {(r["path"], r["variant"], r["case"]): r for r in doc["results"]}
  out = [
      "# rdt-jax bench --two-host",
      "",
      f"Two Ray nodes on one machine, each in its own network, pid, ipc, uts and mount namespaces, "
      f"joined by a {env['link']}. Each sample moves one object from a producer actor on host B to a "
      "consumer actor on host A, timed by the driver (on host A) from the producing call until the consumer "
      "has read every byte; median [min-max] in ms of the measured repetitions, after one warm-up.",
      "",
      f"{env['date']}, {env['platform']}, {env['cpus']} CPUs, load average {env['loadavg_start']} at the start "
      f"and {env['loadavg_end']} at the end ({env['note']}). rdt_jax {str(env.get('commit'))[:12]}"
      + (f" with uncommitted changes to {', '.join(f.split()[-1] for f in env['uncommitted_rdt_jax_files'])}."
         if env.get("uncommitted_rdt_jax_files") else "."),
      "",
      "## Paths",
      "",
      "| path | " + " | ".join(f"{s} median [min-max] ms" for s in sizes) + " | " + f"{sizes[-1]} MB/s |",
      "| --- | " + " | ".join("---:" for _ in sizes) + " | ---: |",
  ]
  for path, label in doc["paths"].items():
    cells = []
    for s in sizes:
      r = by.get((path, "", s))
      cells.append(_cell(r) if r else doc["skips"].get(f"{path}/{s}", "not run"))
    last = by.get((path, "", sizes[-1]))
    speed = _mb_s(nbytes[sizes[-1]], statistics.median(last["samples"])) if last else ""
    out.append(f"| {label} | " + " | ".join(cells) + f" | {speed} |")
  variants = doc["plan"].get("poll_variants") or []
  if variants:
    out += [
        "",
        "## The producer's NIXL progress poll",
        "",
        "`jax_nixl` with in-band objects off (`RDT_JAX_INLINE_MAX_BYTES=0`), so every size is a NIXL READ; "
        "over TCP, UCX emulates the READ with messages the producer answers inside its progress polls. "
        "Each row sets one poll policy in both actors; the producer's polls (and how many of them were busy) "
        "are counted over the row's samples.",
        "",
        "| poll policy | " + " | ".join(f"{s} median [min-max] ms" for s in sizes) + " | "
        + f"{sizes[-1]} MB/s | producer polls (busy) |",
        "| --- | " + " | ".join("---:" for _ in sizes) + " | ---: | ---: |",
    ]
    for v in variants:
      rows = [by.get((POLL_PATH, v, s)) for s in sizes]
      cells = [_cell(r) if r else "not run" for r in rows]
      last = rows[-1]
      speed = _mb_s(nbytes[sizes[-1]], statistics.median(last["samples"])) if last else ""
      polls = [r["producer_polls"] for r in rows if r]
      count = f"{sum(p['polls'] for p in polls):,} ({sum(p['busy_polls'] for p in polls):,})"
      out.append(f"| {v} | " + " | ".join(cells) + f" | {speed} | {count} |")
  idle = doc.get("idle_cores") or {}
  if idle:
    out += [
        "",
        f"Idle CPU of the producer's process (cores, over {IDLE_WINDOW_S:g} s while it exports an object its "
        "consumer has read, no transfer running): "
        + ", ".join(f"{v} {c:.3f}" for v, c in idle.items()) + ".",
    ]
  if doc["skips"]:
    out += ["", "## Not measured", ""] + [f"* {k}: {v}" for k, v in sorted(doc["skips"].items())]
  return "\n".join(out) + "\n"


def _cell(r: dict) -> str:
  s = r["samples"]
  return f"{_ms(statistics.median(s))} [{_ms(min(s))}-{_ms(max(s))}]"


def _inside(plan_json: str) -> None:
  """The driver's entry point on host A: measures `plan` and prints one JSON line."""
  plan = json.loads(plan_json)
  doc = measure(plan["sizes"], plan["paths"], plan["poll_variants"])
  print(json.dumps(doc), flush=True)


if __name__ == "__main__":
  _inside(sys.argv[1])

