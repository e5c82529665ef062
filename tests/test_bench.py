"""`rdt-jax bench` in a tiny configuration: its outputs exist and are well formed.

Correctness only: no assertion here depends on how fast anything is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rdt_jax.bench import _cases

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small enough to finish in about a minute on 2 cores: one array, a pytree,
# refs (batch and loop) and the plain check. Fan-out would start 2 more actors
# per group; its code path is the single-array one with more readers.
TINY_CASES = ("4KiB", "tree8x4KiB", "tree2x16KiB", "refs2x4KiB", "plain64KiB")
BASELINES = ("ray_nixl_torch", "object_store_numpy", "object_store_jax", "memcpy")


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
  assert len(doc["targets"]) == 13
  for t in doc["targets"]:
    assert set(t) == {"name", "goal", "value", "met", "detail"}
  by_name = {t["name"]: t for t in doc["targets"]}
  four_kib = by_name["jax_nixl 4 KiB / object store NumPy"]
  assert four_kib["value"] == pytest.approx(
      jax_nixl["median_s"] / jax_nixl["median_s"] * jax_nixl["ratios"]["object_store_numpy"]
  )
  assert four_kib["met"] == (four_kib["value"] <= 1.2)
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
