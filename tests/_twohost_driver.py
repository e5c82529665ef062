"""Driver run on host A of the two-host cluster (tests/_twohost.py) by
tests/test_twohost.py: runs one backend's cross-host checks and prints one JSON
line per check, `{"check": ..., "ok": bool, "detail": ...}`.

Usage: python _twohost_driver.py TRANSPORT
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import ray

import rdt_jax
from _helpers import tree_fingerprint, wait_meta

rdt_jax.register()

DEVICES = 4
#: Workers import this module and tests/_helpers (the driver's PYTHONPATH).
WORKER_PATH = os.environ.get("PYTHONPATH", "")
ACTOR_ENV = {"env_vars": {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "PYTHONPATH": WORKER_PATH}}
#: A producer killed before a read: the consumer's error comes within this.
DEATH_BOUND_S = 30.0
SHAPE = (512, 64)  # 128 KiB: out of band by default
FULL = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)


def mixed(nbytes: int, seed: int) -> dict:
  import torch

  rng = np.random.default_rng(seed)
  return {
      "w": jnp.asarray(rng.integers(0, 255, nbytes, dtype=np.uint8)),
      "b": jnp.asarray(rng.standard_normal(7).astype(np.float32)),
      "n": rng.integers(0, 9, 5).astype(np.int32),
      "t": torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)),
      "step": seed,
  }


def mesh_sharding(mesh_shape: tuple, spec: tuple, names: tuple = ("x", "y")):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  devices = np.array(jax.local_devices()[: math.prod(mesh_shape)]).reshape(mesh_shape)
  return NamedSharding(Mesh(devices, names[: len(mesh_shape)]), PartitionSpec(*spec))


def sharded() -> dict:
  return {"w": jax.device_put(jnp.asarray(FULL), mesh_sharding((2, 2), ("x", "y")))}


def layout(x: Any) -> dict:
  s = x.sharding
  return {
      "mesh": dict(s.mesh.shape) if hasattr(s, "mesh") else None,
      "spec": [str(p) for p in s.spec] if hasattr(s, "spec") else None,
      "shards": sorted([sh.device.id, list(sh.data.shape)] for sh in x.addressable_shards),
  }


def _drop_traceback(error: BaseException) -> None:
  """Forgets the traceback of an error `ray.get` raised. Ray raises it from a
  frame whose list of values holds the error itself: the error, its
  traceback and that frame form a cycle, which keeps the caller's frame, and
  every ObjectRef among its locals, alive until Python's cyclic garbage
  collector runs (seconds or minutes later): the object is not freed when the
  caller drops its own reference."""
  error.__traceback__ = None


@ray.remote(enable_tensor_transport=True)
class Node:
  def identity(self) -> dict:
    import socket

    return {
        "hostname": socket.gethostname(),
        "pidns": os.readlink("/proc/self/ns/pid"),
        "netns": os.readlink("/proc/self/ns/net"),
        "node": ray.get_runtime_context().get_node_id(),
    }

  def shm_write(self, name: str) -> None:
    with open(f"/dev/shm/{name}", "w") as f:
      f.write("x")

  def shm_has(self, name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")

  def make(self, build: Callable[..., Any], *args: Any):
    return build(*args)

  def fingerprint(self, value: Any) -> Any:
    return tree_fingerprint(value)

  def reset(self, transport: str) -> None:
    _manager(transport).receive_stats(reset=True)

  def inspect(self, value: Any, transport: str) -> dict:
    """What arrived as this task's argument (Ray fetched it before the call):
    its fingerprint, its layout, and the fetch's counters (after `reset`)."""
    out = {"fingerprint": tree_fingerprint(value), "stats": _manager(transport).receive_stats(reset=True)}
    if isinstance(value, dict) and isinstance(value.get("w"), jax.Array):
      out["layout"] = layout(value["w"])
      out["values"] = np.asarray(value["w"]).tolist()
    return out

  def fetch(self, refs: list, transport: str, target: Callable[[], Any] | None = None) -> dict:
    """Gets refs[0] with `ray.get` (with `target()` as its target, if given);
    see `inspect`."""
    self.reset(transport)
    if target is not None:
      rdt_jax.set_target_for_ref(refs[0], target())
    return self.inspect(ray.get(refs[0], timeout=120), transport)

  def fetch_outcome(self, refs: list, timeout: float, started: str | None = None) -> dict:
    """Gets refs[0] with `ray.get(..., timeout)`: its fingerprint, or the
    error's type and message; and the seconds it took. Creates the file
    `/dev/shm/<started>` first, if named (the driver on this host sees it)."""
    if started:
      open(f"/dev/shm/{started}", "w").close()
    t0 = time.monotonic()
    try:
      value = ray.get(refs[0], timeout=timeout)
    except Exception as e:
      _drop_traceback(e)
      return {"error": type(e).__name__, "message": str(e).strip().splitlines()[-1][-300:],
              "seconds": time.monotonic() - t0}
    return {"fingerprint": tree_fingerprint(value), "seconds": time.monotonic() - t0}

  def counts(self) -> tuple[int, int]:
    """(registered regions outside the pools, objects exported) of this process's jax_nixl."""
    from _helpers import nixl_counts

    return nixl_counts()

  def kill_raylet(self, delay: float) -> None:
    """After `delay` seconds, SIGKILLs this host's raylet (this actor dies with it)."""
    import signal

    time.sleep(delay)
    for pid in os.listdir("/proc"):
      try:
        with open(f"/proc/{pid}/comm") as f:
          if f.read().strip() == "raylet":
            os.kill(int(pid), signal.SIGKILL)
      except (OSError, ValueError):
        continue

  def fetch_error(self, refs: list) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
      ray.get(refs[0], timeout=DEATH_BOUND_S * 3)
    except Exception as e:
      return type(e).__name__, time.monotonic() - t0
    return "none", time.monotonic() - t0


def _manager(transport: str) -> Any:
  from ray.experimental.rdt.util import get_tensor_transport_manager

  return get_tensor_transport_manager(transport.upper())


def on(host: str, transport: str):
  return Node.options(resources={f"host_{host}": 1}, num_cpus=0, runtime_env=ACTOR_ENV)


class Checks:
  def __init__(self, transport: str):
    self.transport = transport
    self.one_sided = transport != "jax_gloo"
    self.a = on("a", transport).remote()
    self.b = on("b", transport).remote()
    self.group = None
    if not self.one_sided:
      from ray.experimental.collective import create_collective_group

      self.group = create_collective_group([self.a, self.b], backend="torch_gloo")

  def make(self, actor: Any, build: Callable[..., Any], *args: Any):
    """The ref of `build(*args)` made on `actor`, ready to be lent inside a
    list (Ray lends an RDT ref only once its owner holds the metadata)."""
    ref = actor.make.options(tensor_transport=self.transport).remote(build, *args)
    ray.wait([ref], timeout=120)
    wait_meta(ref)
    return ref

  # Each check returns a JSON-able detail, or raises AssertionError.

  def hosts(self) -> dict:
    ia, ib = ray.get([self.a.identity.remote(), self.b.identity.remote()])
    assert ia["node"] != ib["node"], (ia, ib)
    for key in ("hostname", "pidns", "netns"):
      assert ia[key] != ib[key], f"same {key}: {ia[key]}"
    name = f"rdtj-probe-{os.getpid()}"
    ray.get(self.b.shm_write.remote(name))
    assert ray.get(self.b.shm_has.remote(name)) and not ray.get(self.a.shm_has.remote(name)), "shared /dev/shm"
    return {"a": ia["hostname"], "b": ib["hostname"]}

  def receive(self, dst: Any, ref: Any) -> dict:
    """`dst`'s view of `ref` passed as a task argument (both kinds of backend)."""
    ray.get(dst.reset.remote(self.transport))
    return ray.get(dst.inspect.remote(ref, self.transport), timeout=180)

  def _across(self, src: Any, dst: Any, nbytes: int, seed: int) -> dict:
    got = self.receive(dst, self.make(src, mixed, nbytes, seed))
    want = tree_fingerprint(mixed(nbytes, seed))
    assert got["fingerprint"] == want, (got["fingerprint"], want)
    return got["stats"]

  def b_to_a(self) -> dict:
    return self._across(self.b, self.a, 1 << 20, 1)

  def a_to_b(self) -> dict:
    return self._across(self.a, self.b, 1 << 20, 2)

  def small_b_to_a(self) -> dict:
    return self._across(self.b, self.a, 1 << 10, 3)

  def large_b_to_a(self) -> dict:
    return self._across(self.b, self.a, 64 << 20, 4)

  def no_node_local_reads(self) -> dict:
    stats = self._across(self.b, self.a, 4 << 20, 5)
    assert stats.get("direct", 0) == 0, stats
    return stats

  def driver_get(self) -> dict:
    ref = self.make(self.b, mixed, 256 << 10, 6)
    assert tree_fingerprint(ray.get(ref, timeout=120)) == tree_fingerprint(mixed(256 << 10, 6))
    return {}

  def sharded_leaf(self) -> dict:
    got = self.receive(self.a, self.make(self.b, sharded))
    assert got["values"] == FULL.tolist()
    assert got["layout"]["mesh"] == {"x": 2, "y": 2} and got["layout"]["spec"] == ["x", "y"], got["layout"]
    return got["layout"]

  def resharded_leaf(self) -> dict:
    ref = self.make(self.b, sharded)
    target = lambda: {"w": mesh_sharding((4,), (None, "x"))}  # noqa: E731
    got = ray.get(self.a.fetch.remote([ref], self.transport, target), timeout=180)
    assert got["values"] == FULL.tolist()
    assert got["layout"]["mesh"] == {"x": 4} and got["layout"]["spec"] == ["None", "x"], got["layout"]
    return got["layout"]

  def sliced_leaf(self) -> dict:
    ref = self.make(self.b, sharded)
    target = lambda: {"w": rdt_jax.Slice[100:300, 8:40]}  # noqa: E731
    got = ray.get(self.a.fetch.remote([ref], self.transport, target), timeout=180)
    assert got["values"] == FULL[100:300, 8:40].tolist()
    assert got["stats"]["inline"] == 0 and got["stats"]["bytes"] == FULL[100:300, 8:40].nbytes, got["stats"]
    return got["stats"]

  def multihost_weights(self) -> dict:
    """A multi-controller JAX trainer with one process on each host publishes
    two versions; a torch generator on host A pulls each combined version
    (process 0's part read on its host, process 1's through Ray from host
    B), bit for bit against the global arrays gathered from the trainer."""
    from _multihost import TWO, Generator, Trainer, free_port, sha

    coordinator = f"{ray.util.get_node_ip_address()}:{free_port()}"
    env = {"env_vars": {**ACTOR_ENV["env_vars"], "XLA_FLAGS": TWO}}
    trainer = [Trainer.options(resources={f"host_{h}": 1}, num_cpus=0, runtime_env=env).remote(i, 2, coordinator)
               for i, h in enumerate("ab")]
    gen = Generator.options(resources={"host_a": 1}, num_cpus=0, runtime_env=ACTOR_ENV).remote("torch")
    try:
      assert ray.get([t.devices.remote() for t in trainer], timeout=120) == [(2, 4), (2, 4)]
      routes = []
      for version in (1, 2):
        handle = rdt_jax.WeightsHandle.combine(ray.get([t.step.remote(version) for t in trainer], timeout=120))
        whole = ray.get([t.expected.remote() for t in trainer], timeout=120)[0]
        r = ray.get(gen.pull.remote(handle, 120), timeout=180)
        assert r["error"] is None, r["error"]
        assert r["shas"] == {k: sha(v) for k, v in whole.items()} and r["version"] == version, r
        routes.append(r["last"].route)
      assert routes == ["mixed", "mixed"], routes  # node-local from host A's process, buckets from host B's
      return {"routes": routes, "nbytes": r["last"].nbytes}
    finally:
      for actor in (*trainer, gen):
        ray.kill(actor)

  # jax_gloo is two-sided: its bytes move only as a task argument between
  # actors of one collective group. These check that what it refuses is
  # refused across hosts as on one (docs/backends.md, "Limits").

  def driver_get_refused(self) -> dict:
    """The driver's `ray.get` is refused naming the fixes, and the object
    store fallback (`_use_object_store=True`) returns the value."""
    ref = self.make(self.b, mixed, 256 << 10, 31)
    try:
      ray.get(ref, timeout=60)
    except Exception as e:
      assert "two-sided transport jax_gloo" in str(e) and "_use_object_store=True" in str(e), str(e)[-500:]
    else:
      raise AssertionError("ray.get of a jax_gloo ref returned a value in the driver")
    got = ray.get(ref, timeout=120, _use_object_store=True)
    assert tree_fingerprint(got) == tree_fingerprint(mixed(256 << 10, 31))
    return {}

  def target_refused(self) -> dict:
    """A target (resharding, slices) for a jax_gloo ref is refused naming jax_nixl."""
    ref = self.make(self.b, sharded)
    try:
      rdt_jax.set_target_for_ref(ref, {"w": rdt_jax.Slice[0:8]})
    except ValueError as e:
      assert "two-sided transport" in str(e) and "jax_nixl" in str(e), str(e)
      return {"error": str(e)[:200]}
    raise AssertionError("a target was accepted for a jax_gloo ref")

  def producer_killed(self) -> dict:
    producer = on("b", self.transport).remote()
    consumer = self.a
    ref = self.make(producer, mixed, 8 << 20, 7)
    ray.wait([ref], timeout=120)
    ray.kill(producer)
    time.sleep(1.0)
    error, elapsed = ray.get(consumer.fetch_error.remote([ref]), timeout=DEATH_BOUND_S * 4)
    assert error != "none", "a value arrived from a killed producer"
    assert elapsed < DEATH_BOUND_S, f"the error took {elapsed:.1f}s"
    return {"error": error, "seconds": round(elapsed, 3)}

  def _read_then(self, nbytes: int, seed: int, act: Callable[[Any, Any], None], consumer: Any | None = None,
                 timeout: float = 60.0, producer: Any | None = None) -> tuple[dict, Any, Any]:
    """Starts a read of a `nbytes` mixed value made on a fresh producer on
    host B (`producer`, if the caller started it already) by `consumer`
    (default: host A's actor), runs `act(producer, consumer)` `READ_START_S`
    after the consumer's fetch began, and returns the fetch's outcome (see
    `Node.fetch_outcome`), the producer and the ref."""
    producer = producer or on("b", self.transport).remote()
    consumer = consumer or self.a
    ref = self.make(producer, mixed, nbytes, seed)
    marker = f"/dev/shm/rdtj-read-{os.getpid()}-{seed}"
    pending = consumer.fetch_outcome.remote([ref], timeout, os.path.basename(marker))
    deadline = time.monotonic() + 120
    while not os.path.exists(marker):
      assert time.monotonic() < deadline, "the consumer's fetch did not begin within 120 s"
      time.sleep(0.01)
    os.unlink(marker)
    time.sleep(READ_START_S)
    t0 = time.monotonic()
    act(producer, consumer)
    try:
      outcome = ray.get(pending, timeout=timeout * 2)
    except ray.exceptions.RayActorError as e:
      _drop_traceback(e)
      outcome = {"error": type(e).__name__, "message": str(e)[-300:], "seconds": time.monotonic() - t0}
    outcome["after_act_s"] = round(time.monotonic() - t0, 3)
    return outcome, producer, ref

  def _check_outcome(self, outcome: dict, nbytes: int, seed: int, bound: float) -> dict:
    """An error within `bound` seconds, or exactly the right value."""
    if "error" in outcome:
      assert outcome["seconds"] < bound, f"the error took {outcome['seconds']:.1f}s (bound {bound}s): {outcome}"
    else:
      assert outcome["fingerprint"] == tree_fingerprint(mixed(nbytes, seed)), "wrong bytes"
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in outcome.items() if k != "fingerprint"}

  def producer_killed_mid_read(self) -> dict:
    """The producer is killed while a `FAULT_BYTES` read from it runs: the read ends
    in an error within `DEATH_BOUND_S` (or delivered the right bytes first),
    and host A's next read from another producer works."""
    outcome, _, _ = self._read_then(FAULT_BYTES, 21, lambda p, c: ray.kill(p))
    detail = self._check_outcome(outcome, FAULT_BYTES, 21, DEATH_BOUND_S)
    detail["next"] = self._across(self.b, self.a, 1 << 20, 22)
    return detail

  def consumer_killed_mid_read(self) -> dict:
    """A consumer is killed while its `FAULT_BYTES` read runs: its caller gets
    the actor's death within `DEATH_BOUND_S`; the producer is unaffected
    (another consumer reads the same object exactly, the next transfer works).
    Once the ref is dropped the producer frees the object within
    `FREE_BOUND_S` (`freed_s`; docs/faults.md, "A dead consumer")."""
    consumer, producer = on("a", self.transport).remote(), on("b", self.transport).remote()  # started together
    ray.get(consumer.identity.remote())
    outcome, producer, ref = self._read_then(
        FAULT_BYTES, 23, lambda p, c: ray.kill(c), consumer=consumer, producer=producer
    )
    assert "error" in outcome and outcome["seconds"] < DEATH_BOUND_S, outcome
    got = ray.get(self.a.fetch_outcome.remote([ref], 120), timeout=180)
    assert got.get("fingerprint") == tree_fingerprint(mixed(FAULT_BYTES, 23)), f"the producer's object: {got}"
    del ref
    t0 = time.monotonic()
    while (counts := ray.get(producer.counts.remote())) != (0, 0) and time.monotonic() < t0 + FREE_BOUND_S:
      time.sleep(0.5)
    ray.kill(producer)
    assert counts == (0, 0), (
        f"the producer still held {counts} (registrations, objects) {FREE_BOUND_S} s after the last ref was dropped")
    return {"error": outcome["error"], "seconds": round(outcome["seconds"], 3),
            "after_act_s": outcome["after_act_s"],
            "freed_s": round(time.monotonic() - t0, 3),
            "next": self._across(self.b, self.a, 1 << 20, 24)}

  def link_down_held(self) -> dict:
    """The link goes down mid-read and stays down past the read's timeout
    (`LINK_HELD_S` > `LINK_TIMEOUT_S`): the read ends within the timeout plus
    `LINK_SLACK_S`, by UCX's error or by the timeout (the detail says which),
    never a hang or wrong bytes; reads work once the link is back."""
    iface = os.environ["RDTJ_IFACE"]

    def down(producer: Any, consumer: Any) -> None:
      subprocess.run(["ip", "link", "set", iface, "down"], check=True)

    try:
      outcome, producer, _ = self._read_then(FAULT_BYTES, 25, down, timeout=LINK_TIMEOUT_S)
      time.sleep(max(0.0, LINK_HELD_S - outcome["after_act_s"]))
    finally:
      subprocess.run(["ip", "link", "set", iface, "up"], check=True)
    detail = self._check_outcome(outcome, FAULT_BYTES, 25, LINK_TIMEOUT_S + LINK_SLACK_S)
    detail["ended_by"] = "value" if "error" not in outcome else (
        "timeout" if "Timeout" in outcome["error"] else "transport error")
    time.sleep(1.0)
    detail["after"] = self._across(producer, self.a, 1 << 20, 26)
    ray.kill(producer)
    return detail

  def raylet_killed(self) -> dict:
    """Host B's raylet is killed while host A reads `FAULT_BYTES` from a producer
    there: the read ends in an error within `DEATH_BOUND_S` (or the right
    bytes). The producer itself kills it (a task; the READ needs none of the
    producer's tasks), and dies with the node. Host B's node is gone
    afterwards: the test restarts it and checks the next transfer. Runs last."""
    outcome, _, _ = self._read_then(FAULT_BYTES, 27, lambda p, c: p.kill_raylet.remote(0.0))
    return self._check_outcome(outcome, FAULT_BYTES, 27, DEATH_BOUND_S)

  def link_flap(self) -> dict:
    """The link between the hosts goes down mid-read for `LINK_DOWN_S` and
    comes back: the read ends in an error within `LINK_BOUND_S` or delivers
    the right bytes, and the next read after the link returns works."""
    iface = os.environ["RDTJ_IFACE"]
    ref = self.make(self.b, mixed, 64 << 20, 11)
    pending = self.a.fetch_outcome.remote([ref], LINK_BOUND_S * 2)
    time.sleep(0.2)
    subprocess.run(["ip", "link", "set", iface, "down"], check=True)
    try:
      time.sleep(LINK_DOWN_S)
    finally:
      subprocess.run(["ip", "link", "set", iface, "up"], check=True)
    outcome = ray.get(pending, timeout=LINK_BOUND_S * 4)
    if "error" in outcome:
      assert outcome["seconds"] < LINK_BOUND_S, outcome
    else:
      assert outcome["fingerprint"] == tree_fingerprint(mixed(64 << 20, 11)), "wrong bytes after a link flap"
    time.sleep(1.0)
    after = self._across(self.b, self.a, 1 << 20, 12)
    return {"during": {k: v for k, v in outcome.items() if k != "fingerprint"}, "after": after}


#: The link stays down this long in `link_flap`; a read it interrupts ends within `LINK_BOUND_S`.
LINK_DOWN_S = 3.0
LINK_BOUND_S = 30.0
#: `link_down_held`: the read's `ray.get` timeout, how long the link stays
#: down (longer; short enough that Ray's health checks keep host B's node),
#: and the slack allowed past the timeout.
LINK_TIMEOUT_S = 4.0
LINK_HELD_S = 7.0
LINK_SLACK_S = 6.0
#: A producer frees an object within this after its last ref is dropped.
FREE_BOUND_S = 20.0
#: Bytes of the mid-read fault checks' objects (over TCP, a read of about a second).
FAULT_BYTES = 128 << 20
#: Fault checks act this long after the consumer's fetch began.
READ_START_S = 0.3

CHECKS = {
    "jax_nixl": ["hosts", "b_to_a", "a_to_b", "small_b_to_a", "large_b_to_a", "no_node_local_reads", "driver_get",
                 "sharded_leaf", "resharded_leaf", "sliced_leaf", "multihost_weights", "producer_killed",
                 "producer_killed_mid_read",
                 "consumer_killed_mid_read", "link_flap", "link_down_held",
                 "raylet_killed"],
    "jax_gloo": ["hosts", "b_to_a", "a_to_b", "small_b_to_a", "large_b_to_a", "sharded_leaf", "driver_get_refused",
                 "target_refused"],
    "jax_transfer": ["hosts", "b_to_a", "a_to_b", "small_b_to_a", "large_b_to_a", "driver_get", "sharded_leaf",
                     "resharded_leaf", "sliced_leaf", "producer_killed"],
}


def main(transport: str, names: list[str]) -> None:
  ray.init(logging_level="error", runtime_env={"env_vars": {"PYTHONPATH": WORKER_PATH}})
  checks = Checks(transport)
  for name in names or CHECKS[transport]:
    t0 = time.monotonic()
    try:
      detail, ok = getattr(checks, name)(), True
    except Exception:
      detail, ok = traceback.format_exc()[-3000:], False
    line = {"check": name, "ok": ok, "detail": detail, "seconds": round(time.monotonic() - t0, 3)}
    print(json.dumps(line, default=str), flush=True)


#: The fault checks, in the order of docs/faults.md's table.
FAULT_CHECKS = ["producer_killed", "producer_killed_mid_read", "consumer_killed_mid_read", "link_flap",
                "link_down_held", "raylet_killed"]


def _freed(detail: dict) -> str:
  if "freed_s" not in detail:
    return ""
  return f"; the producer freed it {detail['freed_s']:.3f} s after the ref was dropped"


def fault_summary(paths: list[str]) -> str:
  """The fault checks' outcomes in the check lines (JSON per line) that
  tests/test_twohost.py writes beside its cluster (`checks-TRANSPORT.jsonl`),
  one line per check: how it ended and in how many seconds."""
  out = []
  for path in paths:
    transport = os.path.basename(path).removeprefix("checks-").removesuffix(".jsonl")
    for line in map(json.loads, open(path)):
      if line["check"] not in FAULT_CHECKS:
        continue
      if not line["ok"]:
        out.append(f"{transport:<13} {line['check']:<26} FAILED")
        continue
      d = line["detail"].get("during", line["detail"])
      ended = d.get("error") or "the right value"
      if "after_act_s" in d:
        when = f"{d['after_act_s']:.3f} s after the fault"
      else:  # no fault mid-read: the whole fetch
        when = f"the fetch took {d['seconds']:.3f} s"
      out.append(f"{transport:<13} {line['check']:<26} ended by {ended}, {when}"
                 + _freed(d))
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  if sys.argv[1] == "--summary":
    sys.stdout.write(fault_summary(sys.argv[2:]))
  else:
    main(sys.argv[1], sys.argv[2:])
