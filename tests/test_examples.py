"""Every example under examples/ runs, as a user would run it.

Each entry of EXAMPLES is one script with its command-line arguments. A script
runs in a subprocess from an empty temporary directory, with this interpreter
and a clean environment (no PYTHONPATH pointing into tests/), and must exit 0
within its time limit. If `examples/<name>.out` exists, the script's standard
output must equal it exactly (the docs show those files as the expected
output). `copy=True` runs a copy of the script under another name instead of
the file itself: the docs promise that the quickstart, copied into a new file,
runs as written.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
from typing import NamedTuple

import pytest

from _helpers import clean_env

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO / "examples"


class Example(NamedTuple):
  script: str  # path under examples/
  args: tuple[str, ...] = ()
  copy: bool = False  # run a copy in the temporary directory, not the file
  timeout_s: int = 180


# One line per example. The docs may `literalinclude` only scripts listed here
# (tests/test_docs.py checks it).
EXAMPLES = [
    Example("quickstart.py", copy=True),
    Example("demo.py", ("--mb", "16", "--leaves", "8", "--rounds", "1")),
    Example("pipeline.py"),
    Example("weight_sync.py", ("--generators", "2", "--steps", "3", "--mb", "4")),
    Example("shm_transport.py"),
    Example("reshard.py"),
]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: " ".join((e.script, *e.args)))
def test_example_runs(example: Example, tmp_path: pathlib.Path):
  source = EXAMPLES_DIR / example.script
  script = source
  if example.copy:
    script = tmp_path / f"copied_{source.name}"
    shutil.copyfile(source, script)
  proc = subprocess.run(
      [sys.executable, str(script), *example.args],
      cwd=tmp_path,
      env=clean_env(),
      capture_output=True,
      text=True,
      timeout=example.timeout_s,
  )
  assert proc.returncode == 0, (
      f"{example.script} exited with {proc.returncode}\n"
      f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
  )
  expected = source.with_suffix(".out")
  if expected.exists():
    assert proc.stdout == expected.read_text(), (
        f"{example.script}: stdout differs from {expected.relative_to(REPO)}\n"
        f"--- stdout\n{proc.stdout}"
    )
