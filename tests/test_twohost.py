"""Contract checks across two hosts: a Ray node in namespaces of its own.

The cluster (tests/_twohost.py) puts a worker node in its own network, pid,
ipc, uts and mount namespaces, joined to the head over a veth pair with Ray's
token authentication, so every transfer below crosses a network interface, a
pid namespace and a `/dev/shm` boundary, as between two machines (or two
pods). A driver on the head's host (tests/_twohost_driver.py) runs each
backend's checks, both directions; each check is a test here.

Network faults (`jax_nixl`): a producer killed before and during a read, a
consumer killed during a read, the link taken down mid-read (for 3 s, and
past the read's timeout), and host B's raylet killed mid-read. Each ends in
an error within the bound its check states (the measured time is in the
check's detail) or in the right bytes, and the next transfer works: after
the raylet's death the test restarts host B's node and checks transfers
both ways again.
"""

from __future__ import annotations

import json

import pytest

from _twohost import TESTS_DIR, TwoHosts, namespaces_available
from _twohost_driver import CHECKS

REASON = namespaces_available()
#: Starts a Ray cluster in other processes: not run by `--fast` (tests/_selection.py).
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"two-host cluster unavailable: {REASON}"), pytest.mark.ray]

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  hosts = TwoHosts(tmp_path_factory.mktemp("twohost"))
  hosts.start()
  yield hosts
  hosts.stop()


def run_checks(cluster: TwoHosts, transport: str, names: tuple[str, ...] = ()) -> dict:
  """Runs a driver of `transport`'s checks (default: all) on host A: its
  lines by check name, and its stderr's tail under "_stderr"."""
  out = cluster.run([str(TESTS_DIR / "_twohost_driver.py"), transport, *names], timeout=600)
  lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
  with (cluster.workdir / f"checks-{transport}.jsonl").open("a") as f:  # each check's detail and seconds
    f.writelines(json.dumps(line) + "\n" for line in lines)
  return {line["check"]: line for line in lines} | {"_stderr": out.stderr[-4000:]}


@pytest.fixture(scope="module")
def results(cluster):
  """Each transport's checks, run once by one driver per transport."""
  cache: dict[str, dict] = {}

  def get(transport: str) -> dict:
    if transport not in cache:
      cache[transport] = run_checks(cluster, transport)
      if "raylet_killed" in CHECKS[transport]:
        cluster.start_b()  # the check took host B's node down
    return cache[transport]

  return get


@pytest.mark.parametrize(("transport", "check"), [(t, c) for t, checks in CHECKS.items() for c in checks])
def test_across_two_hosts(results, transport, check):
  got = results(transport)
  assert check in got, f"the driver did not report {check}; its stderr:\n{got['_stderr']}"
  assert got[check]["ok"], got[check]["detail"]


def test_transfers_work_after_the_raylet_was_killed(cluster, results):
  """After `raylet_killed` (its node restarted), transfers work both ways."""
  results("jax_nixl")
  got = run_checks(cluster, "jax_nixl", ("b_to_a", "a_to_b"))
  for check in ("b_to_a", "a_to_b"):
    assert check in got, f"the driver did not report {check}; its stderr:\n{got['_stderr']}"
    assert got[check]["ok"], got[check]["detail"]


def test_teardown_leaves_no_namespace_or_process(tmp_path):
  import subprocess

  hosts = TwoHosts(tmp_path, tag="td")
  try:
    hosts._network()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert hosts.a.netns in namespaces and hosts.b.netns in namespaces
  finally:
    hosts.stop()
  namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  assert hosts.a.netns not in namespaces and hosts.b.netns not in namespaces
