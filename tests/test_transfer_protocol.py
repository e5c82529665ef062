"""`jax_transfer`'s offer protocol, waits and state, without a Ray cluster:
one process plays producer and consumer (two transports, each with its own
JAX transfer server and offer service).

* nothing received is unpickled; a peer that breaks the protocol loses its
  connection and the service keeps serving;
* a producer that does not answer fails the fetch within the answer timeout
  (or at once on Ray's abort), holding no lock meanwhile;
* an offer whose consumer left without pulling is withdrawn, so the
  producer's arrays are not kept;
* connections to producers that are gone or idle are forgotten;
* a producer's host that cannot be reached is told from a producer that
  exited.
"""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

from _helpers import wait_for
from rdt_jax import _compat, _dlpack, _handoff, _limits
from rdt_jax.transports.transfer import TransferTransport, protocol

pytestmark = pytest.mark.skipif(not _compat.has_jax_transfer(), reason="jax has no transfer server")


@pytest.fixture(scope="module")
def pair():
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("RDT_JAX_INLINE_MAX_BYTES", "0")
    yield TransferTransport(), TransferTransport()


_serial = [0]


def _export(prod, tree):
  _serial[0] += 1
  obj_id = f"obj{_serial[0]}"
  for i, x in enumerate(tree):
    _handoff.record_described(x, _dlpack.describe(x, f"[{i}]"))
  return obj_id, prod.extract_tensor_transport_metadata(obj_id, tree)


def _fetch(cons, obj_id, meta, timeout=30):
  request = cons.fetch_multiple_tensors(obj_id, pickle.loads(pickle.dumps(meta)), CommunicatorMetadata())
  return cons.wait_fetch_complete(request, timeout)


def _tree():
  return [np.arange(1000, dtype=np.float32), np.arange(12, dtype=np.int32).reshape(3, 4)]


def test_pull_ends_with_no_pending_offer_and_pools_its_connection(pair):
  prod, cons = pair
  tree = _tree()
  obj_id, meta = _export(prod, tree)
  for _ in range(3):
    got = _fetch(cons, obj_id, meta)
    for g, x in zip(got, tree):
      np.testing.assert_array_equal(g, x)
  assert wait_for(lambda: prod.counters()["pending_offers"] == 0)
  assert cons.counters()["peers"] == 2  # one pooled offer connection, one transfer connection
  prod.garbage_collect(obj_id, meta, tree)


def test_offer_of_a_consumer_that_left_is_withdrawn(pair):
  """The consumer gives up after the offer and before pulling (as a dead
  one would): the producer withdraws the offer and keeps no array."""
  prod, cons = pair
  x = np.arange(4096, dtype=np.float32)
  obj_id, meta = _export(prod, [x])
  offered = prod._offers._objects[obj_id][1][0]
  base = sys.getrefcount(offered)
  address = (meta.offer_address[0], meta.offer_address[1])
  sock, _ = cons._request_offer(meta, obj_id, 12345, [None], threading.Event())
  assert prod.counters()["pending_offers"] == 1
  assert sys.getrefcount(offered) > base  # held by the offer
  sock.close()
  assert wait_for(lambda: prod.counters()["pending_offers"] == 0)
  assert wait_for(lambda: sys.getrefcount(offered) == base)
  prod.garbage_collect(obj_id, meta, [x])
  cons._peers.pool.forget(address)


def test_nothing_received_is_unpickled(pair, tmp_path):
  prod, cons = pair
  obj_id, meta = _export(prod, _tree())
  marker = tmp_path / "unpickled"

  class Boom:
    def __reduce__(self):
      return (open, (str(marker), "w"))

  address = (meta.offer_address[0], meta.offer_address[1])
  for payload in (pickle.dumps((obj_id, 1, None)), pickle.dumps(Boom()), b"\xff" * 64, b"[1, 2]"):
    sock = cons._peers.pool.take(address, meta.authkey, obj_id)
    sock.sendall(struct.pack(">I", len(payload)) + payload)
    sock.settimeout(10)
    assert sock.recv(16) == b""  # the service closed the connection
    sock.close()
  assert not marker.exists()
  # A message over the size limit is refused before it is read.
  sock = cons._peers.pool.take(address, meta.authkey, obj_id)
  sock.sendall(struct.pack(">I", _limits.TRANSFER_MAX_MESSAGE + 1))
  sock.settimeout(10)
  assert sock.recv(16) == b""
  sock.close()
  # A wrong key is refused at the challenge.
  with pytest.raises(RuntimeError, match="refused or did not answer"):
    cons._peers.pool.take(address, b"wrong key", obj_id)
  # The service still serves genuine requests.
  assert len(_fetch(cons, obj_id, meta)) == 2
  prod.garbage_collect(obj_id, meta, _tree())


class _SilentProducer:
  """An offer service that completes the challenge and never answers."""

  def __init__(self, key: bytes):
    self.listener = socket.create_server(("127.0.0.1", 0))
    self.address = self.listener.getsockname()[:2]
    self.key = key
    self.conns: list[socket.socket] = []
    threading.Thread(target=self._run, daemon=True).start()

  def _run(self):
    while True:
      try:
        conn, _ = self.listener.accept()
      except OSError:
        return
      self.conns.append(conn)
      nonce = "ab" * 32
      protocol.send(conn, {"nonce": nonce})
      protocol.receive(conn)
      protocol.send(conn, {"ok": True})

  def close(self):
    self.listener.close()
    for c in self.conns:
      c.close()


def test_a_stopped_producer_fails_the_fetch_in_bounded_time(pair, monkeypatch):
  prod, cons = pair
  obj_id, meta = _export(prod, _tree())
  silent = _SilentProducer(meta.authkey)
  monkeypatch.setattr(_limits, "TRANSFER_ANSWER_TIMEOUT_S", 1.0)
  meta.offer_address = silent.address
  start = time.monotonic()
  with pytest.raises(Exception, match="did not answer within 1s"):
    _fetch(cons, obj_id, meta)
  assert time.monotonic() - start < 10
  # Ray's abort ends the wait at once.
  monkeypatch.setattr(_limits, "TRANSFER_ANSWER_TIMEOUT_S", 60.0)
  threading.Timer(0.5, lambda: cons.abort_transport(obj_id, None)).start()
  start = time.monotonic()
  with pytest.raises(Exception, match="aborted"):
    _fetch(cons, obj_id, pickle.loads(pickle.dumps(meta)))
  assert time.monotonic() - start < 10
  silent.close()
  prod.garbage_collect(obj_id, meta, _tree())


def test_connections_to_gone_or_idle_producers_are_forgotten(pair, monkeypatch):
  prod, cons = pair
  obj_id, meta = _export(prod, _tree())
  _fetch(cons, obj_id, meta)
  assert cons.counters()["peers"] >= 1
  # A producer that is gone: nothing listens at its address any more.
  gone = socket.create_server(("127.0.0.1", 0))
  dead_address = gone.getsockname()[:2]
  gone.close()
  dead = pickle.loads(pickle.dumps(meta))
  dead.offer_address = dead_address
  for _ in range(3):
    with pytest.raises(Exception, match="has exited"):
      _fetch(cons, obj_id, dead)
  # Idle connections go after IDLE_S.
  monkeypatch.setattr(_limits, "TRANSFER_IDLE_S", 0.0)
  cons.prune()
  assert cons.counters()["peers"] == 0
  prod.garbage_collect(obj_id, meta, _tree())


@pytest.mark.parametrize("field, value", [
    ("offer_address", ("127.0.0.1", 0)), ("offer_address", "127.0.0.1:5"), ("server_address", None),
    ("authkey", b"short"),
])
def test_metadata_without_a_producer_to_pull_from_is_refused(pair, field, value):
  from rdt_jax import MetadataError

  prod, cons = pair
  obj_id, meta = _export(prod, _tree())
  bad = pickle.loads(pickle.dumps(meta))
  setattr(bad, field, value)
  with pytest.raises(MetadataError, match=f"field {field}"):
    _fetch(cons, obj_id, bad)
  assert wait_for(lambda: prod.counters()["pending_offers"] == 0)
  prod.garbage_collect(obj_id, meta, _tree())


#: Runs `peers.probe` against the address given as argv[1], with a 1 s connect
#: timeout, and prints the error's message.
_PROBE = """
import sys
from rdt_jax import _limits
from rdt_jax.transports.transfer import peers
_limits.TRANSFER_CONNECT_TIMEOUT_S = 1.0
try:
  peers.probe((sys.argv[1], 9), "obj-1")
except RuntimeError as e:
  print(e)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
    reason="needs root, unshare and ip to make a network namespace of its own",
)
@pytest.mark.parametrize("network", ["no-route", "silent-link"])
def test_an_unreachable_producer_host_is_told_from_a_dead_producer(network):
  """Run in a network namespace of the test's own, where the producer's
  address has no route (the kernel refuses at once) or lies behind a link
  where nothing answers (a veth pair whose far end has no address: the
  connect times out):
  either way the error says the network is the problem, not the producer.
  No packet leaves the namespace."""
  setup = "set -e; ip link set lo up"
  if network == "silent-link":
    setup += (" && ip link add v0 type veth peer name v1 && ip addr add 10.201.7.1/24 dev v0"
              " && ip link set v0 up && ip link set v1 up")
  script = f"{setup}; exec {shlex.quote(sys.executable)} -c {shlex.quote(_PROBE)} 10.201.7.2"
  start = time.monotonic()
  proc = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True, timeout=120)
  elapsed = time.monotonic() - start
  assert proc.returncode == 0, proc.stderr[-2000:]
  message = proc.stdout
  assert "Cannot reach 10.201.7.2:9" in message and "object obj-1" in message, message
  assert "has exited" not in message
  assert ("timed out" in message) == (network == "silent-link"), message
  assert elapsed < 60
