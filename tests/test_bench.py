"""`rdt-jax bench` in a tiny configuration: its outputs exist and are well formed.

Correctness only: no assertion here depends on how fast anything is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rdt_jax.bench import _cases

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small enough to finish in about a minute on 2 cores: one array, a pytree,
# refs (batch and loop) and the plain check. Fan-out would start 2 more actors
# per group; its code path is the single-array one with more readers.
TINY_CASES = ("4KiB", "tree8x4KiB", "tree2x16KiB", "refs2x4KiB", "plain64KiB")
BASELINES = (
    "ray_nixl_torch", "ray_rdt_floor", "object_store_numpy", "object_store_numpy_to_jax", "object_store_jax", "memcpy",
)

#: Starts Ray in subprocesses: not run by `--fast` (tests/_selection.py).
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
  """Runs the command once in a subprocess; returns (doc, markdown, stdout, out dir)."""
  out = tmp_path_factory.mktemp("bench")
  cmd = [
      sys.executable, "-m", "rdt_jax", "bench",
      "--cases", ",".join(TINY_CASES), "--reps", "2", "--warmup", "1",
      "--out", str(out), "--label", "tiny",
  ]
  pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
  env = {**os.environ, "PYTHONPATH": pythonpath}
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  doc = json.loads((out / "bench-tiny.json").read_text())
  md = (out / "bench-tiny.md").read_text()
  return doc, md, proc.stdout, proc.stderr, out


def test_json_has_every_case_path_and_sample(bench_run):
  doc, _, _, _, _ = bench_run
  assert doc["schema"] == "rdt-jax-bench/1" and doc["partial"] is False
  assert [c["id"] for c in doc["cases"]] == list(TINY_CASES)
  assert "jax_nixl" in doc["registered_transports"]
  assert set(doc["environment"]["loadavg_start"]) and doc["environment"]["cpus"] >= 1
  skipped = {(k["case"], k["path"]) for k in doc["skips"]}
  paths = [p["id"] for p in doc["paths"] if p["skip_reason"] is None]
  assert {"jax_nixl", *BASELINES} <= set(paths)
  summary = {(s["case"], s["path"], s["variant"]): s for s in doc["summary"]}
  for case in doc["cases"]:
    for path in paths:
      is_plain = path.startswith("plain_")
      if is_plain != (case["kind"] == "plain") or (case["id"], path) in skipped:
        continue
      for variant in case["variants"]:
        s = summary[(case["id"], path, variant)]
        assert s["n"] == 2
        assert 0 < s["min_s"] <= s["q1_s"] <= s["median_s"] <= s["q3_s"] <= s["max_s"]
        assert s["gbps"] > 0 and s["moved_bytes"] > 0
  # Every (case, path, variant) ran once per repetition plus the warm-up.
  counts: dict[tuple, int] = {}
  for sample in doc["samples"]:
    assert sample["error"] is None, sample
    assert sample["seconds"] > 0
    key = (sample["case"], sample["path"], sample["variant"])
    counts[key] = counts.get(key, 0) + 1
  assert set(counts.values()) == {3}


def test_interleaving_rotates_the_order(bench_run):
  doc, _, _, _, _ = bench_run
  first = {}
  for s in doc["samples"]:
    if s["case"] == "4KiB" and s["position"] == 0:
      first[s["rep"]] = s["path"]
  assert len(set(first.values())) == len(first) == 3  # a new path leads each repetition


def test_ratios_targets_and_checks(bench_run):
  doc, _, _, _, _ = bench_run
  jax_nixl = next(s for s in doc["summary"] if s["case"] == "4KiB" and s["path"] == "jax_nixl")
  assert set(jax_nixl["ratios"]) == set(BASELINES)
  assert len(doc["targets"]) == 19
  for t in doc["targets"]:
    assert set(t) == {"name", "goal", "value", "met", "detail"}
  by_name = {t["name"]: t for t in doc["targets"]}
  four_kib = by_name["jax_nixl 4 KiB / object store NumPy"]
  assert four_kib["value"] == pytest.approx(
      jax_nixl["median_s"] / jax_nixl["median_s"] * jax_nixl["ratios"]["object_store_numpy"]
  )
  assert four_kib["met"] == (four_kib["value"] <= 1.5)
  floor = by_name["Ray's floor: an RDT object that moves nothing, 4 KiB / object store NumPy"]
  assert floor["met"] is None and floor["value"] > 0  # measured, no goal
  assert all(t["met"] is None for n, t in by_name.items() if "256 MiB" in n or "leaves" in n)  # not in this run
  idle = by_name["idle CPU per rdt_jax actor group (cores, worst group)"]
  rdt_jax_groups = ("main@cpu", "tcp@cpu")  # not ray_nixl@cpu: Ray's own NIXL spins a core
  assert idle["value"] == pytest.approx(max(doc["idle_cpu"][g] for g in rdt_jax_groups))
  assert idle["met"] == (idle["value"] <= 0.05)
  plain = doc["plain_check"]
  assert plain["nbytes"] == 64 * 1024
  ratio = plain["with_rdt_jax_median_s"] / plain["without_rdt_jax_median_s"]
  assert plain["ratio"] == pytest.approx(ratio)
  # The plain check's processes really differ in whether rdt_jax was imported.
  groups = doc["groups"]
  assert all(not i["rdt_jax"] for i in groups["plain_without_rdt_jax@cpu"]["infos"])
  assert all(i["rdt_jax"] for i in groups["plain_with_rdt_jax@cpu"]["infos"])
  assert set(doc["idle_cpu"]) == set(groups)


def test_markdown_table_and_plot(bench_run):
  _, md, stdout, stderr, out = bench_run
  assert md in stdout  # the table is printed too
  for heading in ("## End-to-end time", "## Bandwidth", "## jax_nixl: ratio", "## Targets",
                  "## Plain method"):
    assert heading in md
  table = md.split("## End-to-end time")[1].split("##")[0].strip().splitlines()
  header = [c.strip() for c in table[0].strip("|").split("|")]
  assert header[0] == "case" and "jax_nixl (jax.Array)" in header and "memcpy" in header
  rows = [r for r in table[2:] if r.startswith("|")]
  assert len(rows) == 1 + 2 + 2  # 4KiB, two trees, refs x2 variants
  assert all(len(r.strip("|").split("|")) == len(header) for r in rows)
  png = (out / "bench-tiny.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  assert "4KiB" in stderr  # progress went to stderr


def test_per_object_and_per_leaf_cost(bench_run):
  doc, md, _, _, _ = bench_run
  rows = {r["path"]: r for r in doc["overhead"]}
  one_sided = [p for p in doc["rdt_jax_paths"] if p in ("jax_nixl", "jax_nixl_tcp", "jax_transfer")]
  assert "jax_nixl" in one_sided and {"object_store_numpy", "ray_nixl_torch"} <= set(rows)
  for path, r in rows.items():
    assert r["fixed_case"] == "4KiB" and r["fixed_s"] > 0
    assert r["slope_cases"] == ["tree2x16KiB", "tree8x4KiB"]
    summary = {s["case"]: s["median_s"] for s in doc["summary"] if s["path"] == path and not s["variant"]}
    assert r["slope_us"] == pytest.approx((summary["tree8x4KiB"] - summary["tree2x16KiB"]) / 6 * 1e6)
    # Per side only where the producer can ray.put: one-sided rdt_jax transports.
    assert (r["sides"] is not None) == (path in one_sided), path
  for path in one_sided:
    splits = [s for s in doc["splits"] if s["path"] == path]
    assert {s["case"] for s in splits} == {"4KiB", "tree8x4KiB", "tree2x16KiB"}
    for s in splits:
      assert s["producer_s"] > 0 and s["consumer_s"] > 0 and s["read_s"] >= 0
      parts = s["producer_s"] + s["consumer_s"] + s["read_s"] + s["ray_s"]
      assert parts == pytest.approx(s["seconds"])
    sides = rows[path]["sides"]
    assert set(sides) == {"producer", "ray", "consumer", "read"}
    assert all(v["fixed_s"] is not None and v["slope_us"] is not None for v in sides.values())
  section = md.split("## Per-object and per-leaf cost")[1].split("\n## ")[0]
  assert "| jax_nixl (jax.Array) |" in section and "`tree2x16KiB` and `tree8x4KiB`" in section


def test_case_grammar():
  assert _cases.parse_case("256MiB") == _cases.Case("256MiB", "single", 1, 256 << 20)
  tree = _cases.parse_case("tree1000")
  assert tree.leaves == 1000 and abs(tree.object_nbytes - (64 << 20)) < 8 * 1000
  assert _cases.parse_case("refs8").variants == ("batch", "loop")
  fan = _cases.parse_case("fanout4x1MiB")
  assert _cases.parse_case("fanout4").object_nbytes == 64 << 20
  assert fan.variants == ("x1", "x4") and fan.moved_nbytes("x4") == 4 << 20
  assert _cases.parse_case("gpu:64MiB").device == "cuda"
  with pytest.raises(ValueError, match="Unknown case 'huge'"):
    _cases.parse_case("huge")
  with pytest.raises(ValueError, match="multiple of 8"):
    _cases.parse_case("12B")


def test_checksum_matches_plain_actor():
  from rdt_jax.bench import _plain

  x = _cases.host_leaf(4096 + 12, 0)
  checksum = _plain.plain_actor_class().prepare.__globals__["_checksum"]
  assert checksum(x) == _cases.host_checksum(x)


def test_reshard_case_reports_bytes_per_generator(tmp_path):
  """`rdt-jax bench --reshard`: every variant checked against the trainer's
  weights; a slice moves half of the payload to each of two generators."""
  cmd = [
      sys.executable, "-m", "rdt_jax", "bench", "--reshard", "--reps", "1",
      "--reshard-mb", "2", "--reshard-transports", "jax_nixl,jax_transfer", "--out", str(tmp_path),
  ]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  doc = json.loads((tmp_path / "bench-reshard.json").read_text())
  assert len(doc["commit"]) == 40  # every result records the commit it measured
  full = doc["config"]["full_nbytes"]
  rows = {(s["transport"], s["variant"]): s for s in doc["summary"]}
  for transport in ("jax_nixl", "jax_transfer"):
    assert rows[(transport, "full")]["bytes_per_consumer"] == [full, full]
    for variant in ("slice", "slice_rows", "producer_gather"):
      assert rows[(transport, variant)]["bytes_per_consumer"] == [full // 2, full // 2]
  # Strided column slices cost a descriptor per row of each source shard;
  # leading-row slices one per source shard overlapped.
  descriptors = {k: v["descriptors_per_consumer"][0] for k, v in rows.items()}
  assert descriptors[("jax_nixl", "slice")] > descriptors[("jax_nixl", "slice_rows")]
  assert "| jax_nixl | slice |" in (tmp_path / "bench-reshard.md").read_text()


def test_reshard_refuses_an_unknown_transport(tmp_path):
  cmd = [sys.executable, "-m", "rdt_jax", "bench", "--reshard", "--reshard-transports", "jax_nope",
         "--out", str(tmp_path)]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "Unknown or unregistered transport(s) ['jax_nope']" in proc.stderr


# ---- device baselines and UCX settings (their GPU runs: scripts/gpu.sh)

DEVICE_PATHS = ("ray_cuda_ipc_torch", "device_memcpy")


def _bench(tmp_path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "rdt_jax", "bench", *args, "--out", str(tmp_path)]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_device_paths_are_listed_and_skipped_on_host_cases(bench_run):
  """Ray's CUDA_IPC and the device copy are paths of every run; on host cases
  each is skipped with its reason, and the host memcpy runs."""
  doc, md, _, _, _ = bench_run
  paths = {p["id"]: p for p in doc["paths"]}
  assert paths["ray_cuda_ipc_torch"]["label"] == "Ray cuda_ipc (torch)"
  assert paths["device_memcpy"]["label"] == "device memcpy (torch)"
  assert all(paths[p]["kind"] == "baseline" and paths[p]["skip_reason"] is None for p in DEVICE_PATHS)
  reasons = {(k["case"], k["path"]): k["reason"] for k in doc["skips"]}
  for case in TINY_CASES[:-1]:  # the plain check is no path's case
    assert reasons[(case, "ray_cuda_ipc_torch")] == "Ray cuda_ipc (torch) does not move cpu memory"
    assert reasons[(case, "device_memcpy")] == "device_memcpy copies cuda memory; the limit for cpu cases is memcpy"
    assert (case, "memcpy") not in reasons
  assert not [s for s in doc["summary"] if s["path"] in DEVICE_PATHS]
  assert "* device_memcpy on 4KiB, tree8x4KiB" in md


def test_every_nixl_actor_gets_the_ucx_settings(bench_run):
  """Every bench actor that may create a NIXL agent, Ray's nixl ones
  included, runs with the UCX device-read settings; the run records them."""
  from rdt_jax.bench import _env, _paths
  from rdt_jax.transports.nixl import ucx

  doc, md, _, _, _ = bench_run
  recorded = doc["environment"]["ucx"]
  # The defaults where this host has a CUDA driver (none elsewhere), as the
  # driver passed them: this environment sets none of the variables itself.
  assert recorded["actors"] == _env.nixl_actor_env() == ucx.device_read_env() | {
      k: os.environ[k] for k in ucx.DEVICE_READ_DEFAULTS if k in os.environ
  }
  assert recorded["groups"] == {"tcp": {"UCX_TLS": "tcp"}}  # jax_nixl_tcp's own, on top
  assert _env.ucx_text(recorded) in md
  assert "UCX variables passed to every actor that may create a NIXL agent (Ray's nixl included): " in md
  assert "; besides, tcp actors: `UCX_TLS=tcp`." in md
  # A path's own variable wins; the GPU actors' XLA setting is kept beside them.
  env = _paths.actor_env(True, {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"})
  assert env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def test_nixl_actor_env_keeps_the_users_value_and_the_opt_out(monkeypatch):
  from rdt_jax.bench import _env

  monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
  assert _env.nixl_actor_env() == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}  # the user's, passed on as is
  monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
  monkeypatch.setenv("RDT_JAX_UCX_DEFAULTS", "0")
  assert _env.nixl_actor_env() == {}


def test_device_paths_parse_and_skip_without_a_gpu(tmp_path):
  """`--paths` accepts the device baselines; on a host without a GPU their
  device cases are skipped with the reason, and nothing fails."""
  proc = _bench(tmp_path, "--device", "gpu", "--cases", "gpu:4KiB", "--paths",
                "ray_cuda_ipc_torch,device_memcpy,ray_nixl_torch,memcpy", "--label", "nogpu")
  assert proc.returncode == 0, proc.stderr[-4000:]
  doc = json.loads((tmp_path / "bench-nogpu.json").read_text())
  assert [p["id"] for p in doc["paths"]] == ["ray_nixl_torch", "ray_cuda_ipc_torch", "memcpy", "device_memcpy"]
  reasons = {k["path"]: k["reason"] for k in doc["skips"]}
  no_gpu = "no GPU on this host (ray.cluster_resources() has no 'GPU')"
  assert reasons == {
      "ray_nixl_torch": no_gpu, "ray_cuda_ipc_torch": no_gpu, "device_memcpy": no_gpu,
      "memcpy": "memcpy copies host memory; the limit for cuda cases is device_memcpy",
  }
  assert not doc["samples"]


def test_a_group_that_did_not_start_skips_only_its_paths():
  """Actors that do not start cost their paths (with the reason), not the run."""
  from rdt_jax.bench import _paths, _runner

  cases = [_cases.parse_case("4KiB"), _cases.parse_case("gpu:4KiB")]
  paths = {p.id: p for p in _runner.make_paths([], cases)}
  torch_gpu = _paths.ActorGroup("ray_nixl@cuda", ["producer", "consumer"], pause=False)
  torch_cpu = _paths.ActorGroup("ray_nixl@cpu", ["producer", "consumer"], pause=False)
  for pid in ("ray_cuda_ipc_torch", "device_memcpy", "ray_nixl_torch"):
    paths[pid].groups["cuda"] = torch_gpu
  paths["ray_nixl_torch"].groups["cpu"] = torch_cpu
  _runner._drop_group(list(paths.values()), torch_gpu, "actors did not start: boom", _runner.Progress())
  for pid in ("ray_cuda_ipc_torch", "device_memcpy", "ray_nixl_torch"):
    assert paths[pid].case_skip(cases[1]) == "actors did not start: boom"
  assert paths["ray_nixl_torch"].case_skip(cases[0]) is None  # its cpu actors started
  assert paths["ray_nixl_torch"].groups == {"cpu": torch_cpu}


def test_unknown_path_is_refused_with_the_known_ones(tmp_path):
  proc = _bench(tmp_path, "--paths", "ray_cuda_ipc,device_memcpy", "--cases", "4KiB", timeout=120)
  assert proc.returncode == 2
  assert "Unknown path(s) ray_cuda_ipc; this host has:" in proc.stderr
  assert "ray_cuda_ipc_torch" in proc.stderr and "device_memcpy" in proc.stderr


# ---- the weight-sync benchmark's budget


def _row(case: str, generators: int, path: str, wall_s: float) -> dict:
  return {"case": case, "generators": generators, "path": path, "wall_s": wall_s}


def test_weight_sync_budget_estimates_from_the_rows_before():
  from rdt_jax.bench._weights import budget_skip

  assert budget_skip([], "1x4KiB", 1, "rdt", elapsed_s=1e6, budget_s=None) is None  # no budget
  assert budget_skip([], "1x4KiB", 1, "rdt", elapsed_s=5, budget_s=10) is None  # nothing to estimate from
  assert budget_skip([], "1x4KiB", 1, "rdt", elapsed_s=10, budget_s=10) == (
      "not started: --budget 10 s was spent (10 s in)"
  )
  done = [_row("1000x64MiB", 1, "rdt", 4.0), _row("1000x64MiB", 1, "store", 1.0), _row("1x4KiB", 4, "rdt", 0.5)]
  # The same tree and path, scaled by the generators: 4 s x 2 = 8 s.
  assert budget_skip(done, "1000x64MiB", 2, "rdt", elapsed_s=3, budget_s=10) == (
      "not started: about 8 s needed (from the rows before it), 7 s left of --budget 10 s"
  )
  assert budget_skip(done, "1000x64MiB", 2, "rdt", elapsed_s=1, budget_s=10) is None
  # The same tree, another path: the tree's longest row (4 s), scaled to 4 generators.
  assert "about 16 s needed" in budget_skip(done, "1000x64MiB", 4, "pytree", elapsed_s=0, budget_s=10)
  # A tree not run yet: the longest row of the run.
  assert "about 4 s needed" in budget_skip(done, "10000x64MiB", 1, "rdt", elapsed_s=7, budget_s=10)
  assert budget_skip(done, "10000x64MiB", 1, "rdt", elapsed_s=5, budget_s=10) is None


def test_weight_sync_budget_records_the_rows_it_skips(tmp_path):
  """A budget spent before the first row: every row is recorded as skipped,
  with the reason, in both outputs, and the run ends normally."""
  proc = _bench(
      tmp_path, "--weight-sync", "--budget", "0.5", "--weight-sync-leaves", "", "--weight-sync-big-mb", "0",
      "--weight-sync-generators", "1,2", "--weight-sync-paths", "rdt,store", "--reps", "1",
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  doc = json.loads((tmp_path / "bench-weight-sync.json").read_text())
  assert doc["rows"] == [] and doc["budget_s"] == 0.5
  assert len(doc["commit"]) == 40 and "uncommitted_rdt_jax_files" in doc
  assert [(r["case"], r["generators"], r["path"]) for r in doc["skipped"]] == [
      ("1x4KiB", 1, "rdt"), ("1x4KiB", 1, "store"), ("1x4KiB", 2, "rdt"), ("1x4KiB", 2, "store"),
  ]
  reason = "not started: cut off by the budget during the actors' start (--budget 0.5 s)"
  assert {r["reason"] for r in doc["skipped"]} == {reason}
  md = (tmp_path / "bench-weight-sync.md").read_text()
  assert "Budget: 0.5 s." in md and f"* 1x4KiB x2 store: {reason}" in md


def test_weight_sync_measures_asking_for_the_newest_version(tmp_path):
  """One small row, then the cost of `rdt_jax.latest_handle` from a
  generator and of an announced publish, in both outputs."""
  proc = _bench(
      tmp_path, "--weight-sync", "--weight-sync-leaves", "", "--weight-sync-big-mb", "0",
      "--weight-sync-generators", "1", "--weight-sync-paths", "rdt", "--reps", "1",
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  doc = json.loads((tmp_path / "bench-weight-sync.json").read_text())
  latest = doc["latest"]
  assert latest["asks"] == 3 * 30 and 0 < latest["ask_min_ms"] <= latest["ask_ms"] <= latest["ask_max_ms"]
  assert latest["announced_publish_ms"] > 0
  md = (tmp_path / "bench-weight-sync.md").read_text()
  assert f"median {latest['ask_ms']} ms" in md and "## The newest version" in md


def test_weight_sync_budget_cuts_off_a_wait():
  """A wait still going at the deadline ends with the row's cut-off, not a hang."""
  import time

  import ray

  import conftest
  from rdt_jax.bench import _weights

  def sleep(seconds: float) -> None:
    time.sleep(seconds)

  conftest.start_ray(num_cpus=1)
  try:
    t0 = time.perf_counter()
    with pytest.raises(_weights._CutOff, match=r"^cut off by the budget during step 2 of 5$"):
      _weights._get(ray.remote(sleep).remote(60), time.perf_counter() + 1.0, "step 2 of 5")
    assert time.perf_counter() - t0 < 30
    assert _weights._get(ray.put(7), time.perf_counter() + 30, "set-up") == 7
  finally:
    ray.shutdown()


def test_budget_is_for_weight_sync_only(tmp_path):
  proc = _bench(tmp_path, "--budget", "60", "--cases", "4KiB", timeout=120)
  assert proc.returncode == 2 and "--budget applies to --weight-sync only" in proc.stderr


def test_weight_sync_trainers_short_form(tmp_path):
  """`rdt-jax bench --weight-sync --trainers 1,2` (its short form): one and
  two trainer processes of one JAX program publish the same bytes; every
  generator's tensors equal the object store path's (checked every version)."""
  proc = _bench(tmp_path, "--weight-sync", "--trainers", "1,2", "--generators", "1,2", "--trainer-cases",
                "1x1MiB,64x1MiB", "--reps", "1", timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  doc = json.loads((tmp_path / "bench-weight-sync-trainers.json").read_text())
  assert len(doc["commit"]) == 40
  rows = {(r["case"], r["trainers"], r["generators"]): r for r in doc["rows"]}
  assert sorted(rows) == sorted((c, t, g) for c in ("1x1MiB", "64x1MiB") for t in (1, 2) for g in (1, 2))
  assert all(r["rdt_ms"] > 0 and r["store_ms"] > 0 and r["route"] == "node_local" for r in rows.values()), rows
  assert rows[("64x1MiB", 2, 2)]["vs_one_trainer"] is not None
  assert "| target | goal | measured | met |" in (tmp_path / "bench-weight-sync-trainers.md").read_text()


def test_trainers_is_for_weight_sync_only(tmp_path):
  proc = _bench(tmp_path, "--trainers", "1,2", "--cases", "4KiB", timeout=120)
  assert proc.returncode == 2 and "--trainers applies to --weight-sync" in proc.stderr
  proc = _bench(tmp_path, "--weight-sync", "--trainers", "3", timeout=120)
  assert proc.returncode == 2 and "give a divisor of 4" in proc.stderr


def test_benchmark_checksum_sees_a_changed_byte_and_moved_blocks():
  """The main benchmark's check: a changed byte, two 4 KiB blocks swapped,
  or two leaves swapped change it."""
  x = _cases.host_leaf(64 * 1024 + 12, 3)
  flat = x.view(np.uint8)
  base = _cases.host_checksum(x)
  for at in (0, 5000, flat.size - 1):  # a whole block, the partial block, the last bytes
    changed = flat.copy()
    changed[at] ^= 0x10
    assert _cases.host_checksum(changed) != base
  moved = flat.copy()
  moved[:4096], moved[4096:8192] = flat[4096:8192], flat[:4096]
  assert _cases.host_checksum(moved) != base
  a, b = _cases.host_leaf(4096, 1), _cases.host_leaf(4096, 2)
  assert _cases.value_checksum({"a": a, "b": b}) != _cases.value_checksum({"a": b, "b": a})


def test_ordered_checksum_covers_every_byte_in_order():
  """The soaks' and the weight-sync benchmark's check: a changed byte, or
  two chunks (or leaves) swapped, changes it."""
  a, b = np.arange(1024, dtype=np.float32), np.arange(1024, 2048, dtype=np.float32)
  whole = _cases.ordered_checksum([a, b])
  assert whole == _cases.ordered_checksum([np.concatenate([a, b])])
  assert whole != _cases.ordered_checksum([b, a])
  swapped = np.concatenate([a[512:], a[:512]])
  assert _cases.ordered_checksum([swapped]) != _cases.ordered_checksum([a])
  flipped = a.copy()
  flipped.view(np.uint8)[4000] ^= 1
  assert _cases.ordered_checksum([flipped]) != _cases.ordered_checksum([a])


def _summary(case: str, path: str, median_s: float):
  from rdt_jax.bench._stats import Summary

  return Summary(case, path, "", 5, median_s, median_s, median_s, median_s, median_s, 1, 1.0, None, None, None, {})


def test_the_many_leaf_targets_weigh_jax_s_own_cost():
  from rdt_jax.bench import _stats

  # jax_nixl 120 ms; the object store 40 ms with NumPy, 100 ms made jax.Array
  # with jnp.asarray; jax's own cost of the arrays jax_nixl hands over: 60 ms
  # in the per-side splits (median of 50, 60, 90).
  runs = [_summary("tree1000", p, s) for p, s in (
      ("jax_nixl", 0.120), ("object_store_numpy", 0.040), ("object_store_numpy_to_jax", 0.100),
  )]
  splits = [{"case": "tree1000", "path": "jax_nixl", "jax_s": s} for s in (0.05, 0.09, 0.06)]
  splits.append({"case": "tree1000", "path": "jax_transfer", "jax_s": 0.5})  # another path's: not counted
  by_name = {t.name: t for t in _stats.targets(runs, splits=splits)}
  converted = by_name["jax_nixl 1,000 leaves / 64 MiB / object store NumPy made jax.Array"]
  assert converted.value == pytest.approx(1.2) and converted.met is False
  plain = by_name["jax_nixl 1,000 leaves / 64 MiB / object store NumPy"]
  assert plain.value == pytest.approx(3.0) and plain.met is False
  subtracted = "/ object store NumPy, jax's own cost of the jax.Arrays subtracted"
  without = by_name[f"jax_nixl 1,000 leaves / 64 MiB {subtracted}"]
  assert without.value == pytest.approx(1.5) and without.met is True
  assert by_name[f"jax_nixl 10,000 leaves / 64 MiB {subtracted}"].met is None  # not in this run
  assert _stats.targets(runs)[2].met is None  # no splits: not measured


def test_jax_s_own_cost_is_made_and_read_as_rdt_jax_makes_them():
  import jax

  from rdt_jax.bench import _cases

  value = {f"l{i}": jax.device_put(np.arange(64, dtype=np.float32) + i) for i in range(50)}
  value["numpy"] = np.zeros(4)  # not a jax leaf: not counted
  assert 0 < _cases.jax_cost_s(value) < 5
  assert _cases.jax_cost_s({"numpy": np.zeros(4)}) < 1e-3


def test_numpy_leaves_become_jax_arrays_byte_for_byte():
  import jax

  from rdt_jax.bench import _cases

  value = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.int8)}
  made = _cases.numpy_to_jax(value)
  assert all(isinstance(x, jax.Array) for x in made.values())
  assert _cases.value_checksum(made) == _cases.value_checksum(value)
