"""`rdt-jax soak` runs the weight-sync loop and reports a clean run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _helpers import clean_env

#: Starts Ray in subprocesses: not run by `--fast` (tests/_selection.py).
pytestmark = pytest.mark.ray


def test_short_soak_run_is_clean(tmp_path):
  out = tmp_path / "soak.json"
  proc = subprocess.run(
      [sys.executable, "-m", "rdt_jax", "soak", "--minutes", "0.25", "--generators", "2",
       "--mb", "8", "--out", str(out)],
      capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  report = json.loads(out.read_text())
  assert report["steps"] > 0 and report["transfers"] == 2 * report["steps"]
  assert report["errors"] == 0 and report["mismatches"] == 0
  assert report["trainer"]["registrations"] == 0
  assert all(g["rss_peak"] > 0 for g in report["generators"])
  assert "soak:" in proc.stdout and "RSS high-water" in proc.stdout


#: The chaos soak's run here: 24 s of chaos with a kill every 4 s on average
#: (the default, 15 s, is for long runs), and producers forgotten after 5 s
#: idle instead of 60 s, so the end's wait for every counter to return to its
#: baseline is short. The long runs are in docs/benchmarks/chaos-*.txt.
#: What the test asserts happens in any such run, however slow the machine: the
#: seed fixes every draw, the first kill comes within the run's first half, the
#: fetch kinds take turns, and half the consumers have every node-local read
#: refused by an injected fault.
CHAOS_ARGS = ("--minutes", "0.4", "--kill-every", "4", "--seed", "0")
CHAOS_ENV = {"RDT_JAX_NIXL_PRODUCER_IDLE_S": "5"}


def test_chaos_soak_is_exact_and_leak_free(tmp_path):
  # Producers and consumers killed at random, refs freed at random, timeouts
  # firing mid-transfer, fetches into targets and slices: no wrong value, no
  # hang, only Ray errors, no late write into a target, every counter back to
  # its baseline.
  out = tmp_path / "chaos.json"
  proc = subprocess.run(
      [sys.executable, "-m", "rdt_jax", "soak", "--chaos", *CHAOS_ARGS, "--out", str(out)],
      capture_output=True, text=True, timeout=480, env={**clean_env(), **CHAOS_ENV}, cwd=tmp_path,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  report = json.loads(out.read_text())
  assert report["transfers"] > 0 and report["faults_injected"] > 0
  assert report["wrong_values"] == 0 and report["hangs"] == 0 and report["other_errors"] == 0
  assert report["leaks"] == 0 and report["late_writes"] == 0
  assert min(report["fetches_new"], report["fetches_targets"], report["fetches_slice"]) > 0
  assert all(c["views"] == 0 and c["producers"] == 0 for c in report["actors_at_end"])
  assert report["max_error_s"] < 60
  assert "chaos soak:" in proc.stdout and "wrong values 0" in proc.stdout


#: The weight-sync soak's run here: 24 s of rounds with a chaos event every 4 s
#: on average (the default) and a pull unanswered for 30 s counted as a hang
#: (60 s by default). The end waits until every counter is back to its baseline:
#: producers are forgotten after 5 s idle instead of 60 s, and a bucket's fetch
#: that a refused pull left running (its version freed) ends at Ray's fetch
#: timeout, 15 s here instead of 60 s, and is then parked and ended 2 s later
#: instead of 10 s. The long run is in docs/benchmarks/weight-sync-soak-10min.txt.
#: What the test asserts happens in any such run: the seed fixes every draw, a
#: run whose schedule brought no event ends with one, every round's newest
#: handle is pulled by a task (`pull_async`), and until a pull is refused as
#: stale every round pulls the oldest handle held as well.
WEIGHT_SYNC_ARGS = ("--minutes", "0.4", "--hang-bound", "30", "--seed", "0")
WEIGHT_SYNC_ENV = {"RDT_JAX_NIXL_PRODUCER_IDLE_S": "5", "RAY_rdt_fetch_fail_timeout_milliseconds": "15000",
                   "RDT_JAX_NIXL_PARK_END_S": "2"}


def test_weight_sync_soak_is_exact_and_leak_free(tmp_path):
  # A trainer publishing, generators (one colocated in the trainer) pulling
  # from threads and tasks at once, generators and trainers killed and
  # publishers recreated: every template holds exactly the version its
  # subscriber names, versions never go back, nothing hangs or writes late,
  # only stale and Ray errors, every counter back to its baseline.
  out = tmp_path / "weight-sync.json"
  proc = subprocess.run(
      [sys.executable, "-m", "rdt_jax", "soak", "--weight-sync", *WEIGHT_SYNC_ARGS, "--out", str(out)],
      capture_output=True, text=True, timeout=480, env={**clean_env(), **WEIGHT_SYNC_ENV}, cwd=tmp_path,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  report = json.loads(out.read_text())
  counts = report["counts"]
  assert counts["versions"] > 0 and counts["ok"] > 0 and counts["events"] > 0
  assert counts["async_pulls"] > 0 and counts["stale"] > 0
  for key in ("wrong_versions", "backwards", "hangs", "other_errors", "late_writes"):
    assert counts[key] == 0, (key, report["first_errors"])
  assert report["leaks"] == 0, report["actors_at_end"]
  assert "weight-sync soak:" in proc.stdout and "wrong versions 0" in proc.stdout and "leaks 0" in proc.stdout
