"""A two-host Ray cluster on one machine, for tests that must cross a real network.

Each "host" is a set of Linux namespaces this module creates: its own network
namespace (one end of a veth pair, an address in a /24 of the test's own, and
loopback), and its own pid, ipc, uts and mount namespaces with a private
`/dev/shm` and an `/etc/hosts` naming both hosts. Host A runs Ray's head node (`ray start --head`, with the token
authentication Ray 2.60 turns on), host B a worker node that joins it over the
veth. Drivers run inside host A's namespaces (`TwoHosts.run`). No traffic
leaves the two namespaces: the only addresses are the two assigned here.

Tear-down is complete even when a test fails: killing the first process of a
host's pid namespace kills every process in it, and the network namespaces
(with the veth pair) are deleted.

Needs root (network namespaces, `unshare`, `mount`); `namespaces_available`
says why not where they cannot be created.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

TESTS_DIR = Path(__file__).parent
REPO = TESTS_DIR.parent
#: The subnet of the veth pair: host A is .1, host B is .2.
SUBNET = "10.231.77"
HEAD_PORT = 6379
RAY_BIN = Path(sys.executable).parent / "ray"


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
  log: Path | None = None

  def init_pid(self) -> int:
    """The root-namespace pid of the first process of this host's pid namespace."""
    assert self.process is not None
    children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
    if not children:
      raise RuntimeError(f"host {self.name}'s namespace has no process (its node exited); log: {self.log}")
    return int(children[0])


@dataclass
class TwoHosts:
  """Host A (Ray head, drivers) and host B (a worker node), joined by a veth pair."""

  workdir: Path
  env: dict[str, str] = field(default_factory=dict)
  cpus: int = 4
  #: Names this cluster's namespaces and interfaces (at most 7 characters:
  #: interface names have 15).
  tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")

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
      self._node(self.b, head=False)
      self._wait_for_nodes(2, timeout)
    except BaseException:
      self.stop()
      raise

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
    _sh("ip", "-n", self.a.netns, "link", "set", f"rdtj-va-{self.tag}", state)
    _sh("ip", "-n", self.b.netns, "link", "set", f"rdtj-vb-{self.tag}", state)

  # ---- drivers

  def driver_env(self) -> dict[str, str]:
    """The environment of a process that joins the cluster (token included)."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "PYTEST_", "RDT_JAX_FAULTS"))
    }
    env.update({
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": self.token,
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(REPO / "examples")]),
        "RDTJ_IFACE": f"rdtj-va-{self.tag}",  # host A's end of the link (drivers run on A)
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
        env=env, capture_output=True, text=True, timeout=timeout, cwd=TESTS_DIR,
    )

  def hostname(self, host: Host) -> str:
    return f"rdtj-{host.name}-{self.tag}"

  # ---- set-up steps

  def _network(self) -> None:
    a, b = self.a, self.b
    va, vb = f"rdtj-va-{self.tag}", f"rdtj-vb-{self.tag}"
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
           f"--num-cpus={self.cpus}", f'--resources={{"host_{host.name}": 100}}']
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
        f"mount -t tmpfs -o size=4g tmpfs /dev/shm && mount --bind '{hosts}' /etc/hosts && "
        f"hostname {self.hostname(host)} && exec " + " ".join(f"'{x}'" for x in ray)
    )
    host.log = self.workdir / f"node-{host.name}.log"
    host.process = subprocess.Popen(
        ["ip", "netns", "exec", host.netns,
         "unshare", "--pid", "--fork", "--mount-proc", "--ipc", "--uts", "--mount", "--propagation", "private",
         "sh", "-c", inside],
        env=self.driver_env(), stdout=host.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )

  def _wait_for_nodes(self, count: int, timeout: float) -> None:
    check = (
        "import ray, sys; ray.init(logging_level='error'); "
        f"sys.exit(0 if sum(n['Alive'] for n in ray.nodes()) >= {count} else 3)"
    )
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
      time.sleep(1.0)
      for host in (self.a, self.b):
        if host.process is not None and host.process.poll() is not None:
          raise RuntimeError(f"host {host.name}'s Ray node exited: {host.log.read_text()[-2000:]}")  # type: ignore[union-attr]
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
