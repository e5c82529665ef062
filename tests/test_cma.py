"""Node-local reads: a jax_nixl consumer on its producer's host copies the
producer's host memory itself (`rdt_jax._node_local`), and falls back to
NIXL where the kernel refuses it or `RDT_JAX_NIXL_CMA=0` turns it off.

Objects here are larger than the in-band threshold, so they are exported.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

import rdt_jax
from _helpers import digest, sample, transport_manager, wait_for
from conftest import start_ray, worker_env
from rdt_jax import _limits, _process
from rdt_jax import _node_local as node_local

rdt_jax.register()

BIG = 1 << 20  # above the in-band threshold
IOV = 1 << 16


# ---- the reader, in one process


def test_split_cuts_runs_of_equal_bytes():
  pairs = [(1000, 5000, 10), (2000, 6000, 3), (3000, 7000, 7)]
  runs = node_local._split(pairs, 2)
  assert [sum(n for _, _, n in r) for r in runs] == [10, 10]
  assert runs[0] == [(1000, 5000, 10)] and runs[1] == [(2000, 6000, 3), (3000, 7000, 7)]
  runs = node_local._split([(0, 100, 9)], 4)
  assert runs == [[(0, 100, 3)], [(3, 103, 3)], [(6, 106, 3)]]
  assert node_local._split([(0, 0, 5)], 1) == [[(0, 0, 5)]]


def test_read_copies_from_a_process_exactly(monkeypatch):
  src = np.frombuffer(os.urandom(3 * IOV + 64), np.uint8).copy()
  dst = np.zeros_like(src)
  me = _process.identity()
  # More descriptors than one system call takes, and large enough for threads.
  pairs = [(dst.ctypes.data + i, src.ctypes.data + i, 1) for i in range(0, 2 * _limits.IOV_MAX + 5)]
  pairs.append((dst.ctypes.data + 2 * _limits.IOV_MAX + 5, src.ctypes.data + 2 * _limits.IOV_MAX + 5,
                src.nbytes - 2 * _limits.IOV_MAX - 5))
  monkeypatch.setattr(_limits, "PARALLEL_MIN_BYTES", 1024)
  node_local.read(me, pairs)
  assert np.array_equal(src, dst)


def test_read_refuses_a_producer_that_exited_or_a_reused_pid():
  me = _process.identity()
  buf = np.zeros(8, np.uint8)
  with pytest.raises(ProcessLookupError, match="has exited"):
    node_local.read((*me[:3], me[3] + 1), [(buf.ctypes.data, buf.ctypes.data, 8)])
  with open("/proc/sys/kernel/pid_max") as f:
    never = int(f.read())
  with pytest.raises(ProcessLookupError):
    node_local.read((*me[:2], never, 1), [(buf.ctypes.data, buf.ctypes.data, 8)])


def test_read_refuses_a_pid_reused_during_the_read(monkeypatch):
  # Where there are no pidfds, /proc is asked before and after the copy. The
  # producer exits while its memory is copied and its pid goes to a new
  # process: the start time read after the copy differs, and the read fails.
  monkeypatch.setattr(_process, "_pidfd_works", [False])
  monkeypatch.setattr(_process, "_watched", OrderedDict())
  me = _process.identity()
  src = np.arange(64, dtype=np.uint8)
  dst = np.zeros_like(src)
  real = _process.start_time
  calls = []

  def start_time(pid: int):
    calls.append(pid)
    started = real(pid)
    return started if len(calls) == 1 or started is None else started + 1  # reused after the first check

  monkeypatch.setattr(_process, "start_time", start_time)
  with pytest.raises(ProcessLookupError, match="during the read"):
    node_local.read(me, [(dst.ctypes.data, src.ctypes.data, src.nbytes)])
  assert len(calls) == 2, "the producer's start time was not checked after the copy"
  assert np.array_equal(dst, src)  # the copy ran; the check after it refused it


class _Child:
  """A Python process holding 64 known bytes at a printed address."""

  def __init__(self):
    code = ("import numpy as np, time; a = np.arange(64, dtype=np.uint8); "
            "print(a.ctypes.data, flush=True); time.sleep(120)")
    self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    self.address = int(self.proc.stdout.readline())
    me = _process.identity()
    self.identity = (me[0], me[1], self.proc.pid, _process.start_time(self.proc.pid))

  def kill_unreaped(self) -> None:
    """Kills it and waits until it has exited, leaving it a zombie (its pid
    cannot be reused yet): until /proc says so and, where there are pidfds,
    a pidfd of its own turns readable (which may come a little later)."""
    fd = os.pidfd_open(self.proc.pid) if _process._pidfd_works[0] else None
    self.proc.kill()
    assert wait_for(lambda: _process.start_time(self.proc.pid) is None)
    if fd is not None:
      try:
        assert select.select([fd], [], [], 30)[0], "the killed child's pidfd never turned readable"
      finally:
        os.close(fd)

  def close(self) -> None:
    self.proc.kill()
    self.proc.wait()
    self.proc.stdout.close()


@pytest.fixture
def child():
  c = _Child()
  yield c
  c.close()


def test_a_producer_that_exits_during_the_read_fails_it(monkeypatch, child):
  # With a pidfd: the process watched is the producer itself, and its exit
  # during the copy fails the read (the bytes copied are not to be used).
  if not _process._pidfd_works[0]:
    pytest.skip("no pidfd_open here")
  dst = np.zeros(64, np.uint8)
  node_local.read(child.identity, [(dst.ctypes.data, child.address, 64)])
  assert np.array_equal(dst, np.arange(64, dtype=np.uint8))
  assert child.identity in _process.watched()  # watched from now on
  real = node_local._read_all

  def read_then_exit(pid, prepared):
    real(pid, prepared)
    child.kill_unreaped()

  dst[:] = 0
  monkeypatch.setattr(node_local, "_read_all", read_then_exit)
  with pytest.raises(ProcessLookupError, match="during the read"):
    node_local.read(child.identity, [(dst.ctypes.data, child.address, 64)])
  assert np.array_equal(dst, np.arange(64, dtype=np.uint8))  # the copy ran; the check after it refused it
  assert child.identity not in _process.watched()  # forgotten once it exited
  with pytest.raises(ProcessLookupError, match="before the read"):
    node_local.read(child.identity, [(dst.ctypes.data, child.address, 64)])


def test_an_invalid_pid_is_not_alive_and_keeps_pidfds_on():
  me = _process.identity()
  works = _process._pidfd_works[0]
  assert not _process.alive((*me[:2], 0, me[3]))  # pidfd_open refuses pid 0 (EINVAL)
  assert _process._pidfd_works[0] == works


def test_watched_processes_are_bounded(monkeypatch):
  # Each watched process holds a file descriptor: at most WATCHED_MAX are kept.
  monkeypatch.setattr(_limits, "WATCHED_MAX", 2)
  _process.forget_watched()
  children = [_Child() for _ in range(3)]
  try:
    pidfds = _open_pidfds()
    assert all(_process.alive(c.identity) for c in children)
    if _process._pidfd_works[0]:
      assert _process.watched() == tuple(c.identity for c in children[1:])
      assert _open_pidfds() == pidfds + 2  # the first one's was closed when it was dropped
    assert _process.alive(children[0].identity)  # asked /proc again, then watched again
    assert len(_process.watched()) <= 2
  finally:
    for c in children:
      c.close()
  assert not any(_process.alive(c.identity) for c in children)
  assert _process.watched() == ()
  assert _open_pidfds() == pidfds


def _open_pidfds() -> int:
  """How many pidfds this process has open (other threads may open other files)."""
  count = 0
  for name in os.listdir("/proc/self/fd"):
    try:
      count += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[pidfd]"
    except OSError:
      pass  # closed meanwhile
  return count


def test_a_forked_child_checks_processes_even_if_the_lock_was_held_at_the_fork():
  # A child forked while another thread of its parent held the watch lock
  # gets a lock of its own: its first check must not hang.
  code = (
      "import os, sys\n"
      "from rdt_jax import _process\n"
      "me = _process.identity()\n"
      "assert _process.alive(me)\n"
      "_process._watch_lock.acquire()\n"
      "pid = os.fork()\n"
      "if pid == 0:\n"
      "  parent = (*me[:2], os.getppid(), _process.start_time(os.getppid()))\n"
      "  os._exit(0 if _process.alive(parent) and _process.alive(me) else 3)\n"
      "_process._watch_lock.release()\n"
      "sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
  )
  done = subprocess.run([sys.executable, "-c", code], timeout=60)
  assert done.returncode == 0


def test_unreadable_memory_is_an_error():
  me = _process.identity()
  buf = np.zeros(8, np.uint8)
  with pytest.raises(OSError, match=r"read -1 of 8 bytes|Bad address"):
    node_local.read(me, [(buf.ctypes.data, 8, 8)])  # address 8 is never mapped


def test_switched_off_by_environment(monkeypatch):
  me = _process.identity()
  assert node_local.can_read(me) and not node_local.can_read(None)
  assert not node_local.can_read(("another-host", me[1], me[2], me[3]))
  monkeypatch.setenv("RDT_JAX_NIXL_CMA", "0")
  assert not node_local.enabled() and not node_local.can_read(me)


def test_node_local_read_refuses_stale_metadata_like_a_nixl_read(monkeypatch):
  # One process, two agents: the producer is on this host, so reads are node-local.
  from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

  from rdt_jax import _dlpack, _handoff
  from rdt_jax.transports.nixl import NixlTransport

  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "0")
  prod, cons = NixlTransport(), NixlTransport()

  def export(obj: str, x):
    _handoff.record_described(x, _dlpack.describe(x, "[0]"))
    return prod.extract_tensor_transport_metadata(obj, [x])

  def fetch(obj: str, meta):
    return cons.wait_fetch_complete(cons.fetch_multiple_tensors(obj, meta, CommunicatorMetadata()), 30)

  old_x, new_x = jnp.asarray(sample((64,), "float32", 1)), jnp.asarray(sample((64,), "float32", 2))
  old = export("old", old_x)
  prod.garbage_collect("old", old, [old_x])  # freed before the consumer reads it
  new = export("new", new_x)  # its metadata tells consumers "old" is gone
  cons.receive_stats(reset=True)
  assert digest(fetch("new", new)[0]) == digest(new_x)
  assert cons.receive_stats()["direct"] == 1  # read node-locally
  with pytest.raises(Exception, match="freed by its producer"):
    fetch("old", old)
  prod.garbage_collect("new", new, [new_x])


# ---- end to end through Ray


@pytest.fixture(scope="module", autouse=True)
def _ray():
  start_ray(num_cpus=8)
  yield
  ray.shutdown()


def _actor(cls, **env: str):
  return cls.options(runtime_env=worker_env(**env)).remote()


@ray.remote(enable_tensor_transport=True)
class Producer:
  def __init__(self):
    rdt_jax.register()

  @ray.method(tensor_transport="jax_nixl")
  def tree(self, seed: int):
    return {"w": jnp.asarray(sample((BIG // 4,), "float32", seed)),
            "small": [jnp.asarray(sample((5, 7), "bfloat16", seed + i)) for i in range(40)],
            "np": sample((BIG // 8,), "int64", seed)}

  @ray.method(tensor_transport="jax_nixl")
  def big(self, nbytes: int):
    return jnp.asarray(sample((nbytes // 4,), "int32", 3))

  def pid(self) -> int:
    return os.getpid()


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def __init__(self):
    rdt_jax.register()

  def take(self, value) -> tuple:
    stats = transport_manager("jax_nixl").receive_stats(reset=True)
    leaves = jax.tree_util.tree_leaves(value)
    return [digest(x) for x in leaves], stats, node_local.enabled()


def _want_tree(seed: int) -> list[str]:
  tree = {"w": jnp.asarray(sample((BIG // 4,), "float32", seed)),
          "small": [jnp.asarray(sample((5, 7), "bfloat16", seed + i)) for i in range(40)],
          "np": sample((BIG // 8,), "int64", seed)}
  return [digest(x) for x in jax.tree_util.tree_leaves(tree)]


def test_same_host_reads_directly_and_exactly():
  producer, consumer = _actor(Producer), _actor(Consumer)
  digests, stats, _ = ray.get(consumer.take.remote(producer.tree.remote(1)), timeout=60)
  assert digests == _want_tree(1)
  assert stats["direct"] == 1 and stats["descriptors"] >= 2
  digests, stats, _ = ray.get(consumer.take.remote(producer.big.remote(64 << 20)), timeout=60)
  assert digests == [digest(jnp.asarray(sample(((64 << 20) // 4,), "int32", 3)))]
  assert stats["direct"] == 1  # several threads: 64 MiB is above PARALLEL_MIN_BYTES
  ray.kill(producer)
  ray.kill(consumer)


def test_switched_off_reads_through_nixl():
  producer, consumer = _actor(Producer), _actor(Consumer, RDT_JAX_NIXL_CMA="0")
  digests, stats, enabled = ray.get(consumer.take.remote(producer.tree.remote(2)), timeout=60)
  assert digests == _want_tree(2) and stats["direct"] == 0 and not enabled
  ray.kill(producer)
  ray.kill(consumer)


def test_refused_read_falls_back_to_nixl_for_good():
  # The kernel's refusal (EPERM under Yama's ptrace_scope, or for a
  # non-dumpable producer) cannot be caused here: the tests run as root, whose
  # CAP_SYS_PTRACE overrides both. The cma.read fault point raises it instead.
  producer, consumer = _actor(Producer), _actor(Consumer, RDT_JAX_FAULTS="cma.read:fail*1")
  digests, stats, enabled = ray.get(consumer.take.remote(producer.tree.remote(3)), timeout=60)
  assert digests == _want_tree(3) and stats["direct"] == 0
  assert not enabled  # refused once: this consumer stops trying
  digests, stats, enabled = ray.get(consumer.take.remote(producer.tree.remote(5)), timeout=60)
  assert digests == _want_tree(5) and stats["direct"] == 0
  ray.kill(producer)
  ray.kill(consumer)


def test_producer_that_died_is_an_error_naming_it():
  producer, consumer = _actor(Producer), _actor(Consumer)
  ref = producer.tree.remote(4)
  ray.wait([ref])
  pid = ray.get(producer.pid.remote())
  ray.kill(producer)
  assert wait_for(lambda: _process.start_time(pid) is None)
  died = r"source actor may have died(.|\n)*has died: the object died with it"
  with pytest.raises(ray.exceptions.RayTaskError, match=died):
    ray.get(consumer.take.remote(ref), timeout=60)
  ray.kill(consumer)
