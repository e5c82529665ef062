"""No lock of `jax_nixl` is held across connection work or registration.

Loading or removing a producer's agent (a connection: an unreachable peer can
hold it for long) and registering memory (pinning gigabytes) run outside every
lock of the transport's rooms, so the rest of the process goes on meanwhile:
its exports and releases, its READs from other producers. Work on one
producer, or one region, is still done once: a second READ from a producer
being connected waits for that connection and shares it; a second
registration of a region being registered waits and takes a reference.

The first tests drive the rooms with agents that block inside the NIXL call
until the test lets them go, so they wait on events, never on time. The last
one stalls a real agent's connection with an injected delay.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rdt_jax import _dlpack, _faults, _handoff
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata
from rdt_jax.transports.nixl.registrations import Registrations
from rdt_jax.transports.nixl.views import RemoteViews

CPU = _dlpack.Device("cpu")
#: How long a step that must not wait for the blocked call may take (a hang bound, not a timing).
HANG_S = 30.0


class _Gate:
  """A NIXL call that blocks until the test opens the gate; `entered` is set
  once a thread is inside it."""

  def __init__(self) -> None:
    self.entered = threading.Event()
    self.open = threading.Event()

  def pass_through(self) -> None:
    self.entered.set()
    assert self.open.wait(HANG_S), "the test never opened the gate"


class _BlockingAgent:
  """Records the calls the rooms make; the call named by `blocks` waits on `gate`."""

  def __init__(self, blocks: tuple[str, object]) -> None:
    self.blocks = blocks
    self.gate = _Gate()
    self.calls: list[tuple[str, object]] = []
    self._lock = threading.Lock()

  def _call(self, name: str, arg: object) -> None:
    if (name, arg) == self.blocks:
      self.gate.pass_through()
    with self._lock:
      self.calls.append((name, arg))

  def add_remote_agent(self, metadata: bytes) -> None:
    self._call("add", metadata)

  def remove_remote_agent(self, name: str) -> None:
    self._call("remove", name)

  def register_memory(self, descs: list, mem_type: str) -> object:
    self._call("register", descs[0][0])
    return ("handle", descs[0][0])

  def deregister_memory(self, handle: object) -> None:
    self._call("deregister", handle[1])  # type: ignore[index]


def _meta(producer: str, version: int = 1) -> NixlTransportMetadata:
  return NixlTransportMetadata(
      tensor_meta=[], agent_name=producer, agent_meta=f"{producer}-v{version}".encode(), agent_version=version,
  )


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
  """Runs `fn(*args)` in a thread; the list gets its result or exception."""
  out: list = []

  def run() -> None:
    try:
      out.append(fn(*args))
    except BaseException as e:
      out.append(e)

  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t, out


def _done(fn, *args):
  """`fn(*args)` run in a thread that must end within `HANG_S`: a step
  blocked behind the stalled call fails here instead of hanging."""
  t, out = _in_thread(fn, *args)
  t.join(HANG_S)
  assert not t.is_alive(), f"{fn.__name__} waited for the stalled NIXL call"
  if isinstance(out[0], BaseException):
    raise out[0]
  return out[0]


def test_a_connection_in_progress_holds_up_only_reads_from_its_own_producer():
  agent = _BlockingAgent(("add", b"slow-v1"))
  views = RemoteViews(lambda: agent, lambda: None)
  first, first_out = _in_thread(views.open_read, _meta("slow"))
  assert agent.gate.entered.wait(HANG_S)

  # Another producer is connected, read from and forgotten meanwhile.
  views.close_read(_done(views.open_read, _meta("fast")))
  assert _done(views.forget, "fast") is True
  # The producer being connected is not forgotten under the connection.
  assert _done(views.forget, "slow") is False
  # A second READ from it waits for the connection, then shares it.
  second, second_out = _in_thread(views.open_read, _meta("slow"))
  second.join(0.2)
  assert second.is_alive() and views.inflight("slow") == 0

  agent.gate.open.set()
  first.join(HANG_S)
  second.join(HANG_S)
  assert first_out == ["slow"] and second_out == ["slow"]
  assert views.inflight("slow") == 2
  assert [c for c in agent.calls if c[0] == "add" and c[1] == b"slow-v1"] == [("add", b"slow-v1")]
  views.close_read("slow")
  views.close_read("slow")
  assert views.forget("slow") is True and len(views) == 0


def test_a_failed_connection_leaves_no_view_and_lets_the_next_read_try_again():
  class _Refusing(_BlockingAgent):
    def add_remote_agent(self, metadata: bytes) -> None:
      self.refusals = getattr(self, "refusals", 0) + 1
      if self.refusals == 1:
        raise RuntimeError("NIXL_ERR_BACKEND")
      super().add_remote_agent(metadata)

  agent = _Refusing(("none", None))
  views = RemoteViews(lambda: agent, lambda: None)
  with pytest.raises(RuntimeError, match="NIXL_ERR_BACKEND"):
    views.open_read(_meta("p"))
  assert len(views) == 0 and views.inflight() == 0
  views.close_read(views.open_read(_meta("p")))
  assert agent.calls == [("add", b"p-v1")]


def test_a_disconnect_in_progress_holds_up_no_other_producer():
  agent = _BlockingAgent(("remove", "slow"))
  views = RemoteViews(lambda: agent, lambda: None)
  for producer in ("slow", "fast"):
    views.close_read(views.open_read(_meta(producer)))
  forgetting, out = _in_thread(views.forget, "slow")
  assert agent.gate.entered.wait(HANG_S)
  views.close_read(_done(views.open_read, _meta("fast", version=2)))  # extended meanwhile
  reconnect, reconnected = _in_thread(views.open_read, _meta("slow"))
  reconnect.join(0.2)
  assert reconnect.is_alive()  # waits for the disconnect, then connects again
  agent.gate.open.set()
  forgetting.join(HANG_S)
  reconnect.join(HANG_S)
  assert out == [True] and reconnected == ["slow"]
  assert agent.calls[-3:] == [("add", b"fast-v2"), ("remove", "slow"), ("add", b"slow-v1")]
  views.close_read("slow")


def test_a_registration_in_progress_holds_up_no_other_region():
  agent = _BlockingAgent(("register", 0x1000))
  regs = Registrations(lambda: agent, lambda: None)
  first, first_out = _in_thread(regs.register, 0x1000, 4096, CPU)
  assert agent.gate.entered.wait(HANG_S)

  # Another region is registered, used and deregistered meanwhile.
  other = _done(regs.register, 0x9000, 4096, CPU)
  _done(regs.unregister, [other])
  assert _done(regs.epochs) == (1, 1, 0)
  # A second registration of the region being registered waits, then shares it.
  second, second_out = _in_thread(regs.register, 0x1000, 4096, CPU)
  second.join(0.2)
  assert second.is_alive()

  agent.gate.open.set()
  first.join(HANG_S)
  second.join(HANG_S)
  key = (0x1000, 4096, "cpu", 0)
  assert first_out == [key] and second_out == [key]
  assert agent.calls.count(("register", 0x1000)) == 1 and regs.count() == 1
  regs.unregister([key])
  assert regs.count() == 1  # one reference left
  regs.unregister([key])
  assert regs.count() == 0 and agent.calls.count(("deregister", 0x1000)) == 1


def test_a_region_registered_again_during_its_deregistration_waits_for_it():
  agent = _BlockingAgent(("deregister", 0x1000))
  regs = Registrations(lambda: agent, lambda: None)
  key = regs.register(0x1000, 4096, CPU)
  leaving, _ = _in_thread(regs.unregister, [key])
  assert agent.gate.entered.wait(HANG_S)
  assert regs.count() == 1  # still registered until NIXL says otherwise
  _done(regs.unregister, [regs.register(0x9000, 64, CPU)])  # another region meanwhile
  again, again_out = _in_thread(regs.register, 0x1000, 4096, CPU)
  again.join(0.2)
  assert again.is_alive()  # never registered twice at once
  agent.gate.open.set()
  leaving.join(HANG_S)
  again.join(HANG_S)
  assert again_out == [key]
  calls = [c for c in agent.calls if c[1] == 0x1000]
  assert calls == [("register", 0x1000), ("deregister", 0x1000), ("register", 0x1000)]
  regs.unregister([key])


def test_a_failed_registration_lets_a_waiting_one_try_again():
  agent = _BlockingAgent(("register", 0x1000))
  fail = threading.Event()
  register = agent.register_memory

  def refuse_once(descs, mem_type):
    if not fail.is_set():
      fail.set()
      agent.gate.pass_through()
      raise RuntimeError("NIXL_ERR_BACKEND")
    return register(descs, mem_type)

  agent.register_memory = refuse_once  # type: ignore[method-assign]
  regs = Registrations(lambda: agent, lambda: None)
  first, first_out = _in_thread(regs.register, 0x1000, 4096, CPU, False, "for object o")
  assert agent.gate.entered.wait(HANG_S)
  second, second_out = _in_thread(regs.register, 0x1000, 4096, CPU)
  agent.gate.open.set()
  first.join(HANG_S)
  second.join(HANG_S)
  assert "could not register 4096 bytes of DRAM at 0x1000 (cpu:0) for object o" in str(first_out[0])
  assert second_out == [(0x1000, 4096, "cpu", 0)] and regs.count() == 1
  regs.unregister(second_out)


# ---- a real agent


def test_exports_releases_and_other_reads_go_on_while_a_connection_stalls(monkeypatch):
  pytest.importorskip("nixl_cu12", reason="NIXL is not installed")
  from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

  from rdt_jax.transports.nixl import NixlTransport

  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "0")
  monkeypatch.setenv("RDT_JAX_NIXL_CMA", "0")  # read through NIXL: a connection per producer
  near, far, consumer = NixlTransport(), NixlTransport(), NixlTransport()
  leaves = {name: np.arange(4096, dtype=np.int32) + i for i, name in enumerate(("near", "far", "own"))}
  exported = []

  def export(transport: NixlTransport, obj: str):
    x = leaves[obj.split("-")[0]]
    _handoff.record_described(x, _dlpack.describe(x, "[0]"))
    meta = transport.extract_tensor_transport_metadata(obj, [x])
    exported.append((transport, obj, meta, [x]))
    return meta

  def fetch(obj: str, meta):
    got = consumer.wait_fetch_complete(consumer.fetch_multiple_tensors(obj, meta, CommunicatorMetadata()), 60)
    return np.asarray(got[0])

  try:
    near_meta = export(near, "near-1")
    assert (fetch("near-1", near_meta) == leaves["near"]).all()  # connected to `near`
    far_meta = export(far, "far-1")
    # The stall is a sleep that starts when the point acts: work that waited
    # for the connection would end after it, however fast the machine.
    stall_s = 10.0
    _faults.configure(f"nixl.connect:delay={stall_s}*1")
    slow, slow_out = _in_thread(fetch, "far-1", far_meta)
    deadline = time.monotonic() + HANG_S
    while not _faults.injected().get("nixl.connect") and time.monotonic() < deadline:
      time.sleep(0.01)
    stalled_at = time.monotonic()  # at most 10 ms after the stall began
    own = export(consumer, "own-1")  # the stalled process exports
    consumer.garbage_collect("own-1", own, [leaves["own"]])  # and releases
    exported.pop()
    assert (fetch("near-1", near_meta) == leaves["near"]).all()  # and reads from another producer
    took = time.monotonic() - stalled_at
    slow.join(HANG_S)
    assert took < stall_s, f"the work ended {took:.1f} s into a {stall_s} s connection stall: it waited for it"
    assert (slow_out[0] == leaves["far"]).all()
  finally:
    _faults.configure(None)
    for transport, obj, meta, xs in exported:
      transport.garbage_collect(obj, meta, xs)
