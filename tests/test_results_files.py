"""How results files are written (rdt_jax/bench/_results.py) and pruned
(scripts/prune_results.py), and that the committed ones are in that form.
No Ray."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from _helpers import load_script
from rdt_jax.bench import _results

REPO = pathlib.Path(__file__).resolve().parent.parent
prune = load_script("prune_results")

BENCH_DOC = {
    "schema": "rdt-jax-bench/1",
    "config": {"label": "quick", "argv": ["rdt-jax", "bench", "--quick"], "reps": None},
    "environment": {"git": {"commit": "c" * 40, "uncommitted_rdt_jax_files": []}, "loadavg_start": [1.0, 2.0, 3.0]},
    "summary": [{"case": "4KiB", "path": "jax_nixl", "n": 3, "median_s": 0.001, "bytes_per_consumer": [4096, 4096]}],
    "targets": [{"name": "t", "value": 0.5, "met": True}],
    "overhead": [{"path": "jax_nixl", "fixed_s": 0.001, "sides": {"producer": {"fixed_s": 0.0005}}}],
    "splits": [{"case": "4KiB", "path": "jax_nixl", "rep": 0, "seconds": 0.001}],
    "samples": [
        {"case": "4KiB", "path": "jax_nixl", "rep": r, "seconds": 0.001 * r,
         "memory": {"producer": 0, "consumer": 4096}}
        for r in range(50)
    ],
    "results": [{"path": "jax_nixl", "case": "4KiB", "samples": [0.1] * 40}],
    "rows": [{"case": "1x4KiB", "pull_ms": 0.6, "samples": 6}],
}


def test_what_is_written_reads_back_as_the_document():
  text = _results.dumps(BENCH_DOC)
  assert json.loads(text) == BENCH_DOC
  assert text.endswith("}\n")


def test_each_sample_set_and_record_is_one_line():
  lines = _results.dumps(BENCH_DOC).splitlines()
  assert sum('"rep": ' in line and '"memory": {' in line for line in lines) == 50  # one line per sample
  assert any(line.strip().startswith('{"path": "jax_nixl", "case": "4KiB", "samples": [0.1, ') for line in lines)
  assert any(line.strip() == '"loadavg_start": [1.0, 2.0, 3.0]' for line in lines)
  assert len(lines) < 80


def test_values_json_cannot_write_go_through_default():
  doc = {"median": np.float64(0.5), "samples": np.arange(3.0), "pair": (1, 2)}
  text = _results.dumps(doc, default=lambda x: x.tolist())
  assert json.loads(text) == {"median": 0.5, "samples": [0.0, 1.0, 2.0], "pair": [1, 2]}


def test_non_finite_values_are_kept_as_json_writes_them():
  back = json.loads(_results.dumps({"ratio": math.inf, "median_s": math.nan}))
  assert back["ratio"] == math.inf and math.isnan(back["median_s"])


def test_write_replaces_the_file_whole(tmp_path):
  path = tmp_path / "out" / "bench-quick.json"
  _results.write(path, {"a": [1, 2]})
  _results.write(path, BENCH_DOC)
  assert json.loads(path.read_text()) == BENCH_DOC
  assert [p.name for p in path.parent.iterdir()] == ["bench-quick.json"]


def test_strip_drops_raw_samples_and_keeps_every_summary_field():
  stripped = prune.strip(BENCH_DOC)
  assert "samples" not in stripped
  assert "samples" not in stripped["results"][0]
  assert stripped["rows"][0]["samples"] == 6  # a count, not samples
  kept = {k: v for k, v in BENCH_DOC.items() if k not in {"samples", "results"}}
  assert {k: stripped[k] for k in kept} == kept
  assert stripped["results"] == [{"path": "jax_nixl", "case": "4KiB"}]


def test_superseded_runs_are_the_listed_ones():
  assert prune.superseded(REPO / "docs/development/benchmarks/house-35/bench-after.json")
  assert prune.superseded(REPO / "docs/benchmarks/gpu/2026-11-27/bench-gpu.json")
  assert prune.superseded(REPO / "docs/benchmarks/gpu/bench-gpu.json")
  assert not prune.superseded(REPO / "docs/benchmarks/gpu/2026-11-28/bench-gpu.json")
  assert not prune.superseded(REPO / "docs/benchmarks/bench-full.json")


def test_every_listed_superseded_run_exists():
  missing = [s for s in prune.SUPERSEDED if not (REPO / s).exists()]
  assert missing == [], f"SUPERSEDED names paths that do not exist: {missing}"


@pytest.mark.parametrize("path", prune.results(), ids=lambda p: str(p.relative_to(REPO)))
def test_committed_results_are_in_their_form(path):
  """Every results file is as the writers write it; a superseded run holds no
  raw samples. Fix: python scripts/prune_results.py."""
  assert path.read_text() == prune.form(path), f"{path.relative_to(REPO)}: run python scripts/prune_results.py"


def test_the_prune_script_imports_no_ray():
  """Its --check passes on the committed results without importing Ray."""
  check = (
      "import runpy, sys\n"
      "sys.argv = ['scripts/prune_results.py', '--check']\n"
      "try:\n"
      "  runpy.run_path('scripts/prune_results.py', run_name='__main__')\n"
      "except SystemExit as e:\n"
      "  assert not e.code, e.code\n"
      "assert 'ray' not in sys.modules, 'scripts/prune_results.py imported Ray'\n"
  )
  out = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
