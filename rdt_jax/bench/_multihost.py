"""`rdt-jax bench --weight-sync --trainers 1,2,4`: one version published by
1, 2 or 4 trainer processes of a multi-controller JAX trainer, pulled by 1,
2 or 4 generators, against the object store.

The trainer is T Ray actors forming one JAX program (`jax.distributed`, CPU
collectives through gloo) with four CPU devices in all (4/T each). Its
parameters are global arrays sharded by rows over the four devices, so
every T publishes the same total bytes: one 256 MiB leaf (`1x256MiB`) or
1,000 leaves of 64 KiB (`1000x64MiB`). T = 1 is one process with four
devices, a one-process publisher whose handle is pulled as it is.

Per version, the trainer takes one jitted step (not timed), then each path
moves that version in turn (order alternating by version), timed from the
driver's call to the last generator's return:

* `rdt`: every trainer process publishes (`WeightPublisher.publish`, its
  shards packed), the driver combines the handles, and every generator
  pulls into torch tensors in place, all at once;
* `store`: every trainer process `ray.put`s the shards it holds as one
  object (a list of NumPy arrays, each out of band: one copy into the
  object store, mapped by readers on this host) and returns its ref with
  the shards' boxes; every generator `ray.get`s every process's object and
  copies each shard into its place in its torch tensors, all at once. (One
  object per shard instead costs Ray's per-object work per shard: 2.6-3.5 s
  for 1,000 leaves of four shards here, against 0.15-0.24 s for `rdt`.)

Both paths' generator tensors are checked equal every version (CRC-32 of
the bytes, outside the timed part). Reported: per-version time (median of
all versions but the first), aggregate rate (bytes received by all
generators / time), the ratio of `rdt` to `store`, and each T's time over
T = 1's at the same generator count (target: at most 1.2).

Writes `bench-weight-sync-trainers.{json,md}` under `--out`.

With `--two-host` the same rows run on the two-host cluster
(`rdt_jax.bench._twohost.TwoHosts`: two Ray nodes in network namespaces of
their own, joined by a veth pair): every trainer process on host B, every
generator on host A, so every byte crosses the link. In the same run a
plain TCP copy of 256 MiB from host B to host A over the same link (one
socket, `sendall` of one buffer, `recv_into` another) measures the link's
own rate, reported beside each row's cross-host rate. Writes
`bench-weight-sync-trainers-twohost.{json,md}`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pathlib
import platform
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

import rdt_jax
from rdt_jax.bench import _cases, _env

#: CPU devices of the trainer in all, whatever its process count.
DEVICES = 4
#: Bytes of the plain TCP copy that measures the two-host link.
LINK_BYTES = 256 << 20


def _shapes(case: str) -> list[tuple[int, int]]:
  """The leaves of a case: "1x<M>MiB" one square leaf, "<n>x<M>MiB" n leaves of 64 rows."""
  count, size = case.split("x")
  n, nbytes = int(count), int(size.removesuffix("MiB")) << 20
  if n == 1:
    rows = int(np.sqrt(nbytes // 4))
    return [(rows, nbytes // 4 // rows)]
  return [(64, nbytes // 4 // n // 64)] * n


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Trainer:
  """One process of the trainer."""

  def __init__(self, process: int, processes: int, coordinator: str):
    import jax

    if processes > 1:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(coordinator, num_processes=processes, process_id=process)
    self.pub = rdt_jax.WeightPublisher(keep=2)
    self.version = 0

  def setup(self, shapes: list[tuple[int, int]]) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x", None))

    def leaf(i: int, shape: tuple[int, int]) -> Any:
      def block(index: Any) -> np.ndarray:
        return np.full([len(range(*s.indices(n))) for s, n in zip(index, shape)], i, np.float32)

      return jax.make_array_from_callback(shape, rows, block)

    self.params = {f"l{i:04d}": leaf(i, s) for i, s in enumerate(shapes)}
    self.update = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x + 1.0, p))
    jax.block_until_ready(self.params)

  def step(self) -> None:
    import jax

    self.params = self.update(self.params)
    jax.block_until_ready(self.params)
    self.version += 1

  def publish(self) -> Any:
    return self.pub.publish(self.params, version=self.version)

  def put(self) -> tuple[list[tuple[str, tuple[tuple[int, int], ...]]], Any]:
    """The shards this process holds with replica_id 0, put in the object
    store as one object (a list of NumPy arrays, each out of band): their
    (leaf, box), and the object's ref."""
    where, shards = [], []
    for name, x in self.params.items():
      for shard in x.addressable_shards:
        if shard.replica_id == 0:
          where.append((name, tuple(s.indices(n)[:2] for s, n in zip(shard.index, x.shape))))
          shards.append(np.asarray(shard.data))
    return where, ray.put(shards)


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Generator:
  def setup(self, shapes: list[tuple[int, int]]) -> None:
    import torch

    self.rdt = {f"l{i:04d}": torch.zeros(s) for i, s in enumerate(shapes)}
    self.store = {f"l{i:04d}": torch.zeros(s) for i, s in enumerate(shapes)}
    self.sub = rdt_jax.WeightSubscriber(self.rdt)

  def pull(self, handle: Any) -> str:
    self.sub.pull(handle)
    return self.sub.last_pull.route if self.sub.last_pull else ""

  def get(self, parts: list[tuple[list[tuple[str, Any]], Any]]) -> None:
    """Every process's object (fetched together), each shard copied into its place."""
    values = ray.get([ref for _, ref in parts])
    for (where, _), shards in zip(parts, values):
      for (name, box), a in zip(where, shards):
        np.copyto(self.store[name].numpy()[tuple(slice(lo, hi) for lo, hi in box)], a)

  def checksums(self) -> tuple[int, int]:
    return (_cases.ordered_checksum(list(self.rdt.values())), _cases.ordered_checksum(list(self.store.values())))


@ray.remote(num_cpus=0)
class _LinkEnd:
  """One end of the plain TCP copy over the two-host link."""

  def listen(self, address: str) -> int:
    """Starts receiving `LINK_BYTES` on a new port of `address`; returns the port."""
    self.sock = socket.create_server((address, 0))
    self.done = threading.Event()
    self.seconds = 0.0

    def receive() -> None:
      conn, _ = self.sock.accept()
      buf = memoryview(bytearray(1 << 20))
      got = conn.recv_into(buf)
      t0 = time.perf_counter()  # from the first bytes: the connection's setup is not the link's rate
      while got < LINK_BYTES:
        n = conn.recv_into(buf)
        if not n:
          break
        got += n
      self.seconds = time.perf_counter() - t0
      conn.close()
      self.done.set()

    threading.Thread(target=receive, daemon=True).start()
    return int(self.sock.getsockname()[1])

  def received(self) -> float:
    self.done.wait(120)
    self.sock.close()
    return self.seconds

  def send(self, address: str, port: int) -> None:
    data = bytes(LINK_BYTES)
    with socket.create_connection((address, port)) as conn:
      conn.sendall(data)


def _link_rate(a: str) -> float:
  """GB/s of a plain TCP copy from host B to host A at address `a` (median of three)."""
  rates = []
  for _ in range(3):
    rx = _LinkEnd.options(resources={"host_a": 1}).remote()  # type: ignore[attr-defined]
    tx = _LinkEnd.options(resources={"host_b": 1}).remote()  # type: ignore[attr-defined]
    port = ray.get(rx.listen.remote(a))
    ray.get(tx.send.remote(a, port))
    rates.append(LINK_BYTES / ray.get(rx.received.remote()) / 1e9)
    for end in (rx, tx):
      ray.kill(end)
  return round(statistics.median(rates), 2)


def add_arguments(parser: Any) -> None:
  group = parser.add_argument_group("--weight-sync --trainers (multi-process trainers)")
  group.add_argument("--trainers", default=None,
                     help="with --weight-sync: trainer process counts to compare, e.g. 1,2,4 "
                          "(see rdt_jax.bench._multihost)")
  group.add_argument("--generators", default="1,2,4", help="with --trainers: generator counts (default 1,2,4)")
  group.add_argument("--trainer-cases", default="1x256MiB,1000x64MiB",
                     help="with --trainers: trees (default 1x256MiB,1000x64MiB)")


def _ints(text: str) -> list[int]:
  return [int(x) for x in str(text).split(",") if x]


def run(args: Any) -> dict[str, Any]:
  """Runs the rows (on this host, or with `--two-host` across the two-host
  cluster), writes the result under `args.out`."""
  t_start = time.perf_counter()
  plan: dict[str, Any] = {
      "versions": (args.reps or (3 if args.quick else 6)) + 1,
      "trainers": _ints(args.trainers), "generators": _ints(args.generators),
      "cases": [c for c in str(args.trainer_cases).split(",") if c],
  }
  for t in plan["trainers"]:
    if t < 1 or DEVICES % t:
      raise ValueError(f"--trainers {t}: the trainer has {DEVICES} devices in all; give a divisor of {DEVICES}.")
  name = "bench-weight-sync-trainers"
  if getattr(args, "two_host", False):
    name += "-twohost"
    measured = _across_hosts(plan)
  else:
    rdt_jax.register()
    started = not ray.is_initialized()
    if started:
      ray.init(num_cpus=max(plan["trainers"]) + max(plan["generators"]) + 2, include_dashboard=False,
               logging_level=logging.WARNING)
    try:
      measured = {"rows": measure(plan, two_host=False)}
    finally:
      if started:
        ray.shutdown()
  rows = measured["rows"]
  _relate(rows)
  result = {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "host": {"platform": platform.platform(), "python": platform.python_version()},
      "versions": plan["versions"], "devices": DEVICES, "wall_s": round(time.perf_counter() - t_start, 1),
      **measured,
  }
  out = pathlib.Path(args.out)
  result = _env.write_json(out / f"{name}.json", result)
  (out / f"{name}.md").write_text(markdown(result))
  print(markdown(result))
  return result


def _across_hosts(plan: dict[str, Any]) -> dict[str, Any]:
  """`measure` as a driver on host A of a two-host cluster started here."""
  from rdt_jax.bench import _twohost

  reason = _twohost.namespaces_available()
  if reason is not None:
    raise RuntimeError(f"rdt-jax bench --two-host {reason}; run it as root on Linux.")
  package_parent = str(pathlib.Path(__file__).resolve().parents[2])
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="rdt-jax-trainers-"))
  hosts = _twohost.TwoHosts(workdir, pythonpath=[package_parent], tag="train", cpus=6)
  hosts.start()
  measured = _twohost.drive(hosts, "rdt_jax.bench._multihost", plan, "the two-host trainers benchmark")
  return {**measured, "link": f"veth pair {_twohost.SUBNET}.2 (host B: trainer processes) -> "
                               f"{_twohost.SUBNET}.1 (host A: generators, driver)"}


def measure(plan: dict[str, Any], two_host: bool) -> list[dict[str, Any]]:
  """The rows of `plan` (Ray initialized). With `two_host`, trainer
  processes run on host B and generators on host A of the two-host cluster."""
  env = _env.nixl_actor_env()
  place: Callable[[str], dict[str, Any]] = (
      (lambda host: {"resources": {f"host_{host}": 1}, "num_cpus": 0}) if two_host else (lambda host: {}))
  rows: list[dict[str, Any]] = []
  gens = [_Generator.options(runtime_env={"env_vars": env}, **place("a")).remote()  # type: ignore[attr-defined]
          for _ in range(max(plan["generators"]))]
  for t in plan["trainers"]:
    flags = {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES // t}"}
    if two_host:
      from rdt_jax.bench._twohost import SUBNET

      coordinator = f"{SUBNET}.2:{random.randrange(20000, 40000)}"  # process 0, on host B
    else:
      with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [_Trainer.options(runtime_env={"env_vars": flags}, **place("b")).remote(  # type: ignore[attr-defined]
        i, t, coordinator) for i in range(t)]
    for case in plan["cases"]:
      shapes = _shapes(case)
      ray.get([p.setup.remote(shapes) for p in procs] + [g.setup.remote(shapes) for g in gens])
      for g in plan["generators"]:
        rows.append(_row(case, shapes, t, procs, gens[:g], plan["versions"]))
        print(_format(rows[-1]), flush=True)
    for p in procs:
      ray.kill(p)
  for g in gens:
    ray.kill(g)
  return rows


def _inside(plan_json: str) -> None:
  """The two-host driver's entry point on host A: measures `plan`, the
  link's own rate, and prints one JSON line."""
  ray.init(logging_level=logging.ERROR, runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
  rdt_jax.register()
  from rdt_jax.bench._twohost import SUBNET

  link = _link_rate(f"{SUBNET}.1")
  rows = measure(json.loads(plan_json), two_host=True)
  after = _link_rate(f"{SUBNET}.1")
  ray.shutdown()
  print(json.dumps({"rows": rows, "link_gbps": [link, after]}), flush=True)


def _row(case: str, shapes: list[tuple[int, int]], t: int, procs: list[Any], gens: list[Any],
         versions: int) -> dict[str, Any]:
  samples: dict[str, list[float]] = {"rdt": [], "store": []}
  routes: set[str] = set()
  for v in range(versions):
    ray.get([p.step.remote() for p in procs])
    for path in (("rdt", "store") if v % 2 else ("store", "rdt")):
      t0 = time.perf_counter()
      if path == "rdt":
        handles = ray.get([p.publish.remote() for p in procs])
        handle = handles[0] if t == 1 else rdt_jax.WeightsHandle.combine(handles)
        routes.update(ray.get([g.pull.remote(handle) for g in gens]))
      else:
        parts = ray.get([p.put.remote() for p in procs])
        ray.get([g.get.remote(parts) for g in gens])
        del parts
      if v:  # the first version (plans, template checks, connections) is not the steady state
        samples[path].append(time.perf_counter() - t0)
    sums = ray.get([g.checksums.remote() for g in gens])
    if any(a != b for a, b in sums):
      raise RuntimeError(f"{case}, {t} trainers: a generator's pulled tensors differ from the object store's")
  nbytes = sum(int(np.prod(s)) * 4 for s in shapes) * len(gens)
  row: dict[str, Any] = {"case": case, "trainers": t, "generators": len(gens), "route": ",".join(sorted(routes))}
  for path, xs in samples.items():
    ms = statistics.median(xs) * 1e3
    row[f"{path}_ms"] = round(ms, 2)
    row[f"{path}_gbps"] = round(nbytes / ms / 1e6, 2)
  row["ratio"] = round(row["rdt_ms"] / row["store_ms"], 2)
  return row


def _relate(rows: list[dict[str, Any]]) -> None:
  """Each row's time over that of one trainer process at the same case and generator count."""
  one = {(r["case"], r["generators"]): r["rdt_ms"] for r in rows if r["trainers"] == 1}
  for r in rows:
    base = one.get((r["case"], r["generators"]))
    r["vs_one_trainer"] = None if base is None else round(r["rdt_ms"] / base, 2)


def _format(r: dict[str, Any]) -> str:
  return (f"{r['case']:>11}, {r['trainers']} trainer processes -> {r['generators']} generators: rdt {r['rdt_ms']} ms "
          f"({r['rdt_gbps']} GB/s, {r['route']}), object store {r['store_ms']} ms: {r['ratio']}x")


def markdown(result: dict[str, Any]) -> str:
  """The result as the weight-sync page shows it."""
  lines = [
      f"Multi-process trainers, {result['when']} ({result['versions']} versions, medians of all but the first; "
      f"{result['devices']} CPU devices in all):", "",
      "| tree | trainer processes | generators | rdt_jax | object store | rdt_jax / object store | aggregate (rdt_jax) "
      "| vs one trainer process |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in result["rows"]:
    vs = "" if r["vs_one_trainer"] is None else f"{r['vs_one_trainer']}x"
    lines.append(f"| {r['case']} | {r['trainers']} | {r['generators']} | {r['rdt_ms']} ms | {r['store_ms']} ms | "
                 f"{r['ratio']}x | {r['rdt_gbps']} GB/s | {vs} |")
  if "link_gbps" in result:
    before, after = result["link_gbps"]
    lines += ["", f"Across the two hosts ({result['link']}): a plain TCP copy of {LINK_BYTES >> 20} MiB over the same "
              f"link ran at {before} GB/s before the rows and {after} GB/s after (median of three each); the "
              "aggregate column is the cross-host rate of the rows."]
  targets = _targets(result["rows"])
  if targets:
    lines += ["", "| target | goal | measured | met |", "| --- | --- | --- | --- |", *targets]
  return "\n".join(lines) + "\n"


def _targets(rows: list[dict[str, Any]]) -> list[str]:
  out = [f"| {r['case']}, {r['trainers']} trainer processes -> {r['generators']} generators / one trainer process "
         f"| <= 1.2x | {r['vs_one_trainer']}x | {'met' if r['vs_one_trainer'] <= 1.2 else 'NOT met'} |"
         for r in rows if r["trainers"] > 1 and r["vs_one_trainer"] is not None]
  for r in rows:
    goal = 0.5 if r["case"].startswith("1000x") else 1.0
    if r["case"].startswith(("1000x", "1x256")):
      out.append(f"| {r['case']}, {r['trainers']} -> {r['generators']} / object store | <= {goal}x | {r['ratio']}x "
                 f"| {'met' if r['ratio'] <= goal else 'NOT met'} |")
  return out


if __name__ == "__main__":
  _inside(sys.argv[1])
