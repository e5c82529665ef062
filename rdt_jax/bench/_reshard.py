"""`rdt-jax bench --reshard`: resharded weight sync, against a full pull.

An FSDP trainer shards its weights over 8 forced cpu devices (rows split 8
ways); `--generators` tensor-parallel generator processes each need one slice
of every weight: column-parallel `wq` (a slice along the non-leading axis:
strided in the trainer's shards) and row-parallel `wo` (a leading-axis
slice: contiguous runs). Per transport it measures, interleaved, each
generator's `ray.get` time and the bytes its backend was asked to move
(`DlpackTransport.receive_stats`):

* `full`: every generator pulls the whole tree (arriving as NumPy, gathered;
  over jax_transfer through a whole-leaf `Slice`, which the trainer cuts
  into one array, as a one-device consumer cannot pull an 8-device leaf
  otherwise) and cuts its slice locally: what a consumer does without
  resharding;
* `slice`: every generator asks for its slice (`rdt_jax.Slice`) and only that
  crosses; jax_nixl reads one descriptor per contiguous run (one per row of
  each source shard for the strided `wq`);
* `slice_rows`: as `slice`, but every generator takes leading rows of both
  weights (contiguous runs: one descriptor per source shard overlapped), to
  separate the cost of strided reads;
* `producer_gather`: the trainer cuts each generator's slices into contiguous
  arrays (a device copy on the trainer, timed) and puts one object per
  generator, which the generator pulls whole: the alternative to strided reads.

Every variant is checked against the trainer's gathered weights (checksum of
each generator's slice). Writes `bench-reshard.json` and `bench-reshard.md`
under `--out` and prints the table.
"""

from __future__ import annotations

import datetime
import logging
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import ray

import rdt_jax
from rdt_jax.bench import _env

VARIANTS = ("full", "slice", "slice_rows", "producer_gather")


def _weights(width: int, layers: int) -> dict[str, Any]:
  """The trainer's weights, on 8 devices, rows split 8 ways."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  rows = NamedSharding(Mesh(np.array(jax.devices()[:8]), ("fsdp",)), PartitionSpec("fsdp", None))
  out = {}
  for i in range(layers):
    wq = jnp.arange(width * 4 * width, dtype=jnp.float32).reshape(width, 4 * width) + i
    out[f"l{i}"] = {
        "wq": jax.device_put(wq, rows),
        "wo": jax.device_put(wq.T * 2.0, rows),
    }
  return out


def _slices(width: int, layers: int, rank: int, world: int, rows_only: bool = False) -> dict[str, Any]:
  """Generator `rank`'s index ranges of every weight (`rows_only`: leading
  rows of both weights, the contiguous case)."""
  k = 4 * width // world
  cols = (slice(None), slice(rank * k, (rank + 1) * k))
  rows = (slice(rank * k, (rank + 1) * k), slice(None))
  q_rows = (slice(rank * width // world, (rank + 1) * width // world), slice(None))
  return {f"l{i}": {"wq": q_rows if rows_only else cols, "wo": rows} for i in range(layers)}


def _checksum(tree: Any) -> str:
  """sha256 of every leaf's bytes (C order), in leaf order."""
  import hashlib

  import jax

  h = hashlib.sha256()
  for x in jax.tree_util.tree_leaves(tree):
    h.update(np.ascontiguousarray(rdt_jax.to_numpy(x)).tobytes())
  return h.hexdigest()


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Trainer:
  def __init__(self, width: int, layers: int):
    self.width, self.layers = width, layers
    self.params = _weights(width, layers)

  def put(self, transport: str) -> list:
    return [ray.put(self.params, _tensor_transport=transport)]

  def gather(self, transport: str, world: int) -> tuple[list, float]:
    """Each generator's slices as contiguous arrays, one object per rank."""
    import jax

    t0 = time.perf_counter()
    refs = []
    for rank in range(world):
      index = _slices(self.width, self.layers, rank, world)
      part = jax.tree_util.tree_map(
          lambda x, i: jax.device_put(x[i], jax.devices()[0]), self.params, index,
      )
      jax.block_until_ready(part)
      refs.append(ray.put(part, _tensor_transport=transport))
    return refs, time.perf_counter() - t0

  def expected(self, world: int, rows_only: bool) -> list[str]:
    import jax

    out = []
    for rank in range(world):
      index = _slices(self.width, self.layers, rank, world, rows_only)
      out.append(_checksum(jax.tree_util.tree_map(lambda x, i: np.asarray(x)[i], self.params, index)))
    return out


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Generator:
  def __init__(self, rank: int, world: int, width: int, layers: int):
    self.rank, self.world, self.width, self.layers = rank, world, width, layers
    rdt_jax.receive_as("numpy")

  def pull(self, refs: list, transport: str, variant: str) -> dict[str, Any]:
    import jax
    from ray.experimental.rdt.util import get_tensor_transport_manager

    manager: Any = get_tensor_transport_manager(transport.upper())
    manager.receive_stats(reset=True)
    index = _slices(self.width, self.layers, self.rank, self.world, variant == "slice_rows")
    ref = refs[self.rank] if variant == "producer_gather" else refs[0]
    t0 = time.perf_counter()
    if variant in ("slice", "slice_rows"):
      rdt_jax.set_target_for_ref(ref, jax.tree_util.tree_map(
          lambda i: rdt_jax.Slice(i), index, is_leaf=lambda v: isinstance(v, tuple)
      ))
    elif variant == "full" and transport == "jax_transfer":
      # A whole-array pull of an 8-device leaf needs 8 devices here; a
      # whole-leaf Slice has the trainer cut it into one array instead.
      rdt_jax.set_target_for_ref(ref, jax.tree_util.tree_map(
          lambda i: rdt_jax.Slice(()), index, is_leaf=lambda v: isinstance(v, tuple)
      ))
    value = ray.get(ref)
    if variant == "full":  # cut the slice locally (a copy), as a user would
      value = jax.tree_util.tree_map(lambda x, i: np.ascontiguousarray(x[i]), value, index)
    seconds = time.perf_counter() - t0
    stats = manager.receive_stats(reset=True)
    return {"seconds": seconds, "checksum": _checksum(value), **stats}


def add_arguments(parser: Any) -> None:
  group = parser.add_argument_group("--reshard (the resharded weight-sync case)")
  group.add_argument("--reshard", action="store_true",
                     help="run only the resharded weight-sync case (see rdt_jax.bench._reshard)")
  group.add_argument("--reshard-mb", type=int, default=64, help="trainer weights in MiB (default 64)")
  group.add_argument("--reshard-generators", type=int, default=2, help="generator processes (default 2)")
  group.add_argument("--reshard-transports", default="jax_nixl,jax_transfer",
                     help="comma-separated one-sided transports (default jax_nixl,jax_transfer)")


def run(args: Any) -> dict[str, Any]:
  """Runs the case, writes `bench-reshard.{json,md}` under `args.out`."""
  world = args.reshard_generators
  layers = 4
  # Each layer holds wq (w x 4w) and wo (4w x w) float32: 32 w^2 bytes.
  width = int((args.reshard_mb * (1 << 20) / layers / 32) ** 0.5) // (8 * world) * (8 * world)
  reps = args.reps or (5 if args.quick else 9)
  registered = rdt_jax.register()
  transports = [t for t in args.reshard_transports.split(",") if t]
  unknown = [t for t in transports if t not in registered]
  if unknown:
    raise ValueError(f"Unknown or unregistered transport(s) {unknown}; registered: {registered}.")
  started = not ray.is_initialized()
  if started:
    ray.init(num_cpus=world + 2, include_dashboard=False, logging_level=logging.WARNING)
  eight = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}}
  t0 = time.perf_counter()
  try:
    trainer = _Trainer.options(runtime_env=eight).remote(width, layers)  # type: ignore[attr-defined]
    gens = [_Generator.remote(r, world, width, layers) for r in range(world)]  # type: ignore[attr-defined]
    expected = {rows: ray.get(trainer.expected.remote(world, rows)) for rows in (False, True)}
    samples: list[dict[str, Any]] = []
    for rep in range(reps + 1):  # the first round warms up, unrecorded
      for transport in transports:
        for variant in VARIANTS:
          gather_s = 0.0
          start = time.perf_counter()
          if variant == "producer_gather":
            refs, gather_s = ray.get(trainer.gather.remote(transport, world))
          else:
            refs = ray.get(trainer.put.remote(transport))
          results = ray.get([g.pull.remote(refs, transport, variant) for g in gens])
          wall = time.perf_counter() - start
          for rank, r in enumerate(results):
            if r["checksum"] != expected[variant == "slice_rows"][rank]:
              raise RuntimeError(f"{transport}/{variant}: generator {rank} got wrong values")
          if rep:
            samples.append({"transport": transport, "variant": variant, "wall_s": wall,
                            "gather_s": gather_s, "consumers": results})
          del refs
  finally:
    if started:
      ray.shutdown()
  full_nbytes = layers * 32 * width * width
  doc = {
      "schema": "rdt-jax-bench-reshard/1",
      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "host": platform.node(),
      "argv": sys.argv,
      "config": {"width": width, "layers": layers, "generators": world, "reps": reps,
                 "trainer_devices": 8, "full_nbytes": full_nbytes, "transports": transports},
      "wall_s": time.perf_counter() - t0,
      "summary": _summary(samples, transports, full_nbytes),
      "samples": samples,
  }
  out = pathlib.Path(args.out)
  doc = _env.write_json(out / "bench-reshard.json", doc)
  text = markdown(doc)
  (out / "bench-reshard.md").write_text(text)
  sys.stdout.write(text)
  return doc


def _summary(samples: list[dict[str, Any]], transports: list[str], full: int) -> list[dict[str, Any]]:
  out = []
  for transport in transports:
    for variant in VARIANTS:
      rows = [s for s in samples if s["transport"] == transport and s["variant"] == variant]
      if not rows:
        continue
      fetch = [c["seconds"] for s in rows for c in s["consumers"]]
      first = rows[0]["consumers"]
      out.append({
          "transport": transport,
          "variant": variant,
          "n": len(rows),
          "wall_median_s": statistics.median(s["wall_s"] for s in rows),
          "fetch_median_s": statistics.median(fetch),
          "gather_median_s": statistics.median(s["gather_s"] for s in rows),
          "bytes_per_consumer": [c["bytes"] for c in first],
          "descriptors_per_consumer": [c["descriptors"] for c in first],
          "full_nbytes": full,
      })
  return out


def markdown(doc: dict[str, Any]) -> str:
  """The run as a Markdown table."""
  c = doc["config"]
  lines = [
      "# Resharded weight sync",
      "",
      f"Trainer: {c['layers']} layers of wq ({c['width']} x {4 * c['width']}) and wo "
      f"({4 * c['width']} x {c['width']}) float32 over {c['trainer_devices']} devices "
      f"(rows split), {c['full_nbytes'] / (1 << 20):.0f} MiB; {c['generators']} generator "
      f"processes, each needing 1/{c['generators']} of every weight (wq by columns, wo by "
      f"rows; `slice_rows`: both by rows). Medians of {c['reps']} rounds; `fetch` is one "
      "generator's `ray.get` (plus the local cut for `full`), `round` the driver's time for the trainer call and every "
      "generator's fetch; `gather` the trainer's slicing for `producer_gather`.",
      "",
      "| transport | variant | bytes moved per generator | of the full payload | "
      "descriptors | fetch (ms) | gather (ms) | round (ms) |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for s in doc["summary"]:
    b = s["bytes_per_consumer"][0]
    d = s["descriptors_per_consumer"][0]
    lines.append(
        f"| {s['transport']} | {s['variant']} | {b:,} | {b / s['full_nbytes']:.1%} | "
        f"{d if d else '-'} | {s['fetch_median_s'] * 1e3:.1f} | "
        f"{s['gather_median_s'] * 1e3:.1f} | {s['wall_median_s'] * 1e3:.1f} |"
    )
  lines += ["", f"Run: `{' '.join(['rdt-jax', *doc['argv'][1:]])}` on {doc['date']}.", ""]
  return "\n".join(lines)
