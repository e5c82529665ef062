"""Contract checks across two hosts: a Ray node in namespaces of its own.

The cluster (tests/_twohost.py) puts a worker node in its own network, pid,
ipc, uts and mount namespaces, joined to the head over a veth pair with Ray's
token authentication, so every transfer below crosses a network interface, a
pid namespace and a `/dev/shm` boundary, as between two machines (or two
pods). A driver on the head's host (tests/_twohost_driver.py) runs each
backend's checks, both directions; each check is a test here.

`jax_nixl`'s `link_flap` takes the link down mid-read and brings it back:
the read ends in an error within a bound (or the right bytes), and the next
read works.
"""

from __future__ import annotations

import json

import pytest

from _twohost import TESTS_DIR, TwoHosts, namespaces_available
from _twohost_driver import CHECKS

REASON = namespaces_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two-host cluster unavailable: {REASON}")

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  hosts = TwoHosts(tmp_path_factory.mktemp("twohost"))
  hosts.start()
  yield hosts
  hosts.stop()


@pytest.fixture(scope="module")
def results(cluster):
  """Each transport's checks, run once by one driver per transport."""
  cache: dict[str, dict] = {}

  def get(transport: str) -> dict:
    if transport not in cache:
      out = cluster.run([str(TESTS_DIR / "_twohost_driver.py"), transport], timeout=500)
      lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
      cache[transport] = {line["check"]: line for line in lines}
      cache[transport]["_stderr"] = out.stderr[-4000:]
    return cache[transport]

  return get


@pytest.mark.parametrize(
    ("transport", "check"), [(t, c) for t, checks in CHECKS.items() for c in checks]
)
def test_across_two_hosts(results, transport, check):
  got = results(transport)
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
