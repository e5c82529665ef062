"""The suite's own machinery, Ray-free: the durations file the full run
writes (tests/_durations.py), the guard that holds `--fast` to tests that
start no Ray (tests/_selection.py), the environment each module gets back,
and docs/faults.md's list of fault points against the code's."""

from __future__ import annotations

import os
import pathlib
import re
from types import SimpleNamespace

import pytest
import ray

import _durations
import _selection
from rdt_jax import _faults

REPO = pathlib.Path(__file__).resolve().parent.parent


def _report(nodeid: str, when: str, duration: float) -> SimpleNamespace:
  return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)


# ---- the durations file


def test_slowest_ranks_every_phase_and_keeps_n():
  reports = [
      _report("tests/test_a.py::test_one", "call", 3.5),
      _report("tests/test_a.py::test_one", "setup", 12.25),
      _report("tests/test_b.py::test_two", "call", 0.01),
      _report("tests/test_b.py::test_two", "teardown", 7.0),
      SimpleNamespace(nodeid="tests/test_c.py"),  # a collect report: no duration
  ]
  assert _durations.slowest(reports, 3) == [
      "12.25s setup    tests/test_a.py::test_one",
      "7.00s teardown tests/test_b.py::test_two",
      "3.50s call     tests/test_a.py::test_one",
  ]


def test_modules_are_ranked_by_the_sum_of_their_phases():
  reports = [
      _report("tests/test_a.py::test_one", "setup", 2.0),
      _report("tests/test_a.py::test_one", "call", 1.0),
      _report("tests/test_a.py::test_two[x]", "call", 1.5),
      _report("tests/test_b.py::test_three", "call", 5.0),
      SimpleNamespace(nodeid="tests/test_c.py"),
  ]
  assert _durations.by_module(reports) == [
      "5.0s    1 tests  tests/test_b.py",
      "4.5s    2 tests  tests/test_a.py",
  ]


def test_the_file_is_written_only_when_the_full_run_names_it(tmp_path, monkeypatch):
  stats = {
      "passed": [_report(f"tests/test_x.py::test_{i}", "call", float(i)) for i in range(40)],
      "": [_report("tests/test_x.py::test_99", "setup", 99.0)],
  }
  monkeypatch.delenv(_durations.ENV, raising=False)
  assert _durations.write(stats, 2700.0, 0, tmp_path, _durations.target_from_environment()) is None
  assert list(tmp_path.iterdir()) == []
  monkeypatch.setenv(_durations.ENV, "durations.txt")
  target = _durations.target_from_environment()
  assert target == "durations.txt" and _durations.ENV not in os.environ  # not passed on to subprocesses
  path = _durations.write(stats, 2700.0, 1, tmp_path, target)
  assert path == tmp_path / "durations.txt"
  text = path.read_text().splitlines()
  assert "commit: unknown" in text  # tmp_path is no git checkout
  assert "pytest wall time: 2700 s (45.0 min)" in text and "outcome: exit status 1" in text
  assert re.fullmatch(r"date: \d{4}-\d\d-\d\d \d\d:\d\d UTC", next(t for t in text if t.startswith("date:")))
  listed = text[text.index("slowest 30:") + 1 : text.index("modules, by total time (1):")]
  assert text[-1] == f"{99.0 + sum(range(40)):.1f}s   41 tests  tests/test_x.py"  # test_99 too
  assert listed[0] == "99.00s setup    tests/test_x.py::test_99"
  assert listed[1:] == [f"{i}.00s call     tests/test_x.py::test_{i}" for i in range(39, 10, -1)]


def test_commit_names_head_and_uncommitted_changes():
  commit = _durations.commit_of(REPO)
  assert re.fullmatch(r"[0-9a-f]{12}( \+ uncommitted changes)?", commit), commit


# ---- the --fast guard


def test_a_guarded_test_cannot_start_ray_and_the_smoke_test_can(tmp_path):
  guard = _selection.RayGuard(tmp_path)
  saved_init, saved_tmp = ray.init, os.environ.get("RAY_TMPDIR")
  guard.install()
  try:
    assert os.environ["RAY_TMPDIR"] == str(tmp_path)
    guard.allow("tests/test_x.py::test_y", False)
    with pytest.raises(_selection.RayStartedError, match=r"tests/test_x.py::test_y called ray.init under --fast"):
      ray.init(address="local", num_cpus=1)
    assert guard.problem(set()) is None and not ray.is_initialized()
    guard.allow("tests/test_nixl.py::test_smoke", True)
    assert ray.init is not saved_init and guard.problem(set()) is None
  finally:
    guard.uninstall()
    if saved_tmp is None:
      os.environ.pop("RAY_TMPDIR", None)
    else:
      os.environ["RAY_TMPDIR"] = saved_tmp
  assert ray.init is saved_init


def test_a_ray_session_started_by_a_subprocess_is_found(tmp_path):
  guard = _selection.RayGuard(tmp_path)
  guard.allow("tests/test_x.py::test_y", False)
  before = guard.sessions()
  # What `ray.init` leaves under RAY_TMPDIR, in whatever process it ran.
  (tmp_path / "ray" / "session_2026-01-01_00-00-00_000000_4242").mkdir(parents=True)
  (tmp_path / "ray" / "session_latest").mkdir()
  problem = guard.problem(before)
  assert problem is not None and "session_2026-01-01_00-00-00_000000_4242" in problem
  assert "pytestmark = pytest.mark.ray" in problem


def test_ray_starts_are_found_in_tests_and_fixtures():
  def fixture():
    import conftest

    conftest.start_ray(num_cpus=1)

  def test(fixture):
    assert ray.is_initialized()

  def plain():
    return ray.get_runtime_context

  assert _selection.starts_ray(test, [fixture]) and not _selection.starts_ray(test, [plain])


def test_fast_keeps_the_callers_selection():
  assert _selection.fast_markexpr(None) == "smoke or not (ray or slow)"
  assert _selection.fast_markexpr("not gpu") == "(smoke or not (ray or slow)) and (not gpu)"


# ---- each module's environment


def test_the_environment_is_restored_exactly():
  import conftest

  os.environ["RDT_JAX_SUITE_TOOLS_OLD"] = "old"
  try:
    before = dict(os.environ)
    os.environ["RDT_JAX_SUITE_TOOLS_NEW"] = "1"  # added, as start_ray(env=...) adds
    os.environ["RDT_JAX_SUITE_TOOLS_OLD"] = "changed"
    os.environ["PATH"] = before["PATH"] + os.pathsep + "/nowhere"
    del os.environ["HOME"]
    conftest.restore_environ(before)
    assert dict(os.environ) == before
  finally:
    os.environ.pop("RDT_JAX_SUITE_TOOLS_OLD", None)



def test_the_variables_the_process_owns_are_left_as_they_are():
  """`ray.init` sets RAY_AUTH_MODE for the process's life; a later module's
  cluster needs it, so the restore neither removes nor changes it."""
  import conftest

  had = os.environ.pop("RAY_AUTH_MODE", None)
  try:
    before = dict(os.environ)
    os.environ["RAY_AUTH_MODE"] = "token"  # as ray.init under Ray 2.60 sets it
    conftest.restore_environ(before)
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} == before
  finally:
    os.environ.pop("RAY_AUTH_MODE", None)
    if had is not None:
      os.environ["RAY_AUTH_MODE"] = had


# ---- fault points: the code's and docs/faults.md's


def points_in_code() -> set[str]:
  """Every point a `_faults.hit("...")` call in rdt_jax names."""
  found = set()
  for path in (REPO / "rdt_jax").rglob("*.py"):
    text = path.read_text()
    calls = re.findall(r"_faults\.hit\(\s*([^,)]*)", text)
    named = [c for c in calls if re.fullmatch(r'"[a-z]+\.[a-z]+"', c)]
    assert len(named) == len(calls), f"{path}: a fault point not named literally: {calls}"
    found.update(c.strip('"') for c in named)
  return found


def points_in_docs() -> set[str]:
  """The points docs/faults.md's "Forcing faults" section lists."""
  text = (REPO / "docs" / "faults.md").read_text()
  section = text.split("## Forcing faults", 1)[1].split("\n## ", 1)[0]
  bullet = re.search(r"^\* points: (.*?)(?=^\* )", section, re.M | re.S)
  assert bullet, "docs/faults.md: no `* points:` list under Forcing faults"
  return set(re.findall(r"`([a-z]+\.[a-z]+)`", bullet.group(1)))


def test_every_fault_point_is_defined_called_and_documented():
  code, defined, docs = points_in_code(), set(_faults.POINTS), points_in_docs()
  assert code == defined, f"called but not in POINTS: {code - defined}; in POINTS but never called: {defined - code}"
  assert docs == defined, f"missing from docs/faults.md: {defined - docs}; documented but not defined: {docs - defined}"
