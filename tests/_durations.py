"""The full run's slowest tests, kept in a committed file.

`scripts/test.sh` with no arguments (the full run CI makes) sets
`RDT_JAX_TEST_DURATIONS` to `docs/development/test-durations.txt`; at the end
of that pytest run `tests/conftest.py` writes there the commit, the date, the
pytest stage's wall time and its `SLOWEST` slowest test phases, ranked and
formatted as pytest's `--durations` prints them, then every module's total
(all its phases summed), longest first: where the run's time goes. Runs with arguments and
`--fast` runs write nothing.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import subprocess
from collections.abc import Iterable
from typing import Any

#: The environment variable that names the file (set by scripts/test.sh).
ENV = "RDT_JAX_TEST_DURATIONS"
#: How many test phases the file lists (CI prints as many: `--durations=30`).
SLOWEST = 30


def timed(reports: Iterable[Any]) -> list[Any]:
  """The test phases among `reports`: those with a duration and a phase
  (collection and warning reports have none)."""
  return [r for r in reports if hasattr(r, "duration") and hasattr(r, "when")]


def slowest(reports: Iterable[Any], n: int = SLOWEST) -> list[str]:
  """The `n` longest phases (setup, call, teardown) of `reports`, longest
  first, one line each as pytest's `--durations` writes it
  ("12.34s call     tests/test_x.py::test_y"). Reports without a duration
  (collection, warnings) are left out."""
  phases = sorted(timed(reports), key=lambda r: r.duration, reverse=True)
  return [f"{r.duration:02.2f}s {r.when:<8} {r.nodeid}" for r in phases[:n]]


def by_module(reports: Iterable[Any]) -> list[str]:
  """Every module's total time (the sum of its tests' setup, call and
  teardown phases), longest first, one line each: "123.4s  37 tests
  tests/test_x.py". Reports without a duration are left out."""
  totals: dict[str, float] = {}
  tests: dict[str, set[str]] = {}
  for r in timed(reports):
    module = r.nodeid.split("::", 1)[0]
    totals[module] = totals.get(module, 0.0) + r.duration
    tests.setdefault(module, set()).add(r.nodeid)
  ranked = sorted(totals, key=lambda m: totals[m], reverse=True)
  return [f"{totals[m]:.1f}s {len(tests[m]):4d} tests  {m}" for m in ranked]


def render(commit: str, date: str, wall_s: float, lines: list[str], outcome: str,
           modules: list[str] | None = None) -> str:
  """The file's text: a header naming the run, then `lines`, then `modules`."""
  return (
      "# The full test run's slowest test phases (written by tests/conftest.py at the end of\n"
      "# `bash scripts/test.sh` with no arguments; tests/_durations.py).\n"
      f"commit: {commit}\n"
      f"date: {date}\n"
      f"pytest wall time: {wall_s:.0f} s ({wall_s / 60:.1f} min)\n"
      f"outcome: {outcome}\n"
      f"slowest {len(lines)}:\n" + "".join(line + "\n" for line in lines)
      + (f"modules, by total time ({len(modules)}):\n" + "".join(m + "\n" for m in modules) if modules else "")
  )


def commit_of(repo: pathlib.Path) -> str:
  """`repo`'s HEAD commit, with "+ uncommitted changes" when its tree differs
  from it; "unknown" outside a git checkout."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + (" + uncommitted changes" if dirty else "")


def target_from_environment() -> str | None:
  """The file `RDT_JAX_TEST_DURATIONS` names, taken out of the environment
  (so that no pytest run this one starts, in a subprocess, writes it too)."""
  return os.environ.pop(ENV, None) or None


def write(stats: dict[str, list[Any]], wall_s: float, exitstatus: int, repo: pathlib.Path,
          target: str | None) -> pathlib.Path | None:
  """Writes `target` (relative to `repo`) from a terminal reporter's `stats`;
  None (nothing written) when `target` is None."""
  if not target:
    return None
  path = repo / target
  reports = [r for category in stats.values() for r in category]
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  outcome = "passed" if exitstatus == 0 else f"exit status {exitstatus}"
  path.write_text(render(commit_of(repo), date, wall_s, slowest(reports), outcome,
                              by_module(reports)))
  return path
