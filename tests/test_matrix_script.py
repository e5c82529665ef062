"""scripts/matrix.sh on a host that lacks a leg's Python: a loud skip, or a
failure under CI=true (never a failure at the end of a long run)."""

from __future__ import annotations

import os
import subprocess

import conftest

SCRIPT = conftest.REPO / "scripts" / "matrix.sh"


def _run(**env: str) -> subprocess.CompletedProcess:
  full = {k: v for k, v in os.environ.items() if k != "CI"}
  full.update({"PY312_VERSION": "0.0.0-missing", "MATRIX_SETUP_ONLY": "1", **env})
  return subprocess.run(["bash", str(SCRIPT), "py312"], env=full, capture_output=True, text=True, timeout=60)


def test_a_leg_whose_python_is_missing_is_skipped_with_a_loud_line():
  out = _run()
  assert out.returncode == 0, out.stderr
  assert "=== matrix leg py312: SKIPPED: its Python is not installed on this host" in out.stderr


def test_under_ci_a_leg_whose_python_is_missing_fails():
  out = _run(CI="true")
  assert out.returncode == 1
  assert "=== matrix leg py312: FAILED: its Python is not installed on this host (CI=true)" in out.stderr


def test_the_test_command_checks_the_legs_before_the_suite():
  """scripts/test.sh runs this check before lint and pytest, so a host
  without a leg's Python learns it at once."""
  out = _run(CI="true", MATRIX_CHECK_ONLY="1", MATRIX_SETUP_ONLY="")
  assert out.returncode == 1 and "FAILED: its Python is not installed" in out.stderr
  text = (conftest.REPO / "scripts" / "test.sh").read_text()
  assert text.index("MATRIX_CHECK_ONLY=1 bash scripts/matrix.sh") < text.index("python -m pytest tests")
