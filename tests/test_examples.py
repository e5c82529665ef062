"""Every example under examples/ runs, as a user would run it.

Each entry of EXAMPLES is one script with its command-line arguments (or, with
`pytest=True`, a test module a user runs with pytest). A script
runs in a subprocess from an empty temporary directory, with this interpreter
and a clean environment (no PYTHONPATH pointing into tests/), and must exit 0
within its time limit; the examples check their own results and exit non-zero
when a check fails. `copy=True` runs a copy of the script under another name
instead of the file itself: the docs promise that the quickstart, copied into
a new file, runs as written.

Each example runs once per pytest process (`run_example` caches the result):
tests/test_docs.py compares the output the docs show against the same run.
"""

from __future__ import annotations

import functools
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple

import pytest

from _helpers import clean_env

#: Starts Ray in subprocesses: not run by `--fast` (tests/_selection.py).
pytestmark = pytest.mark.ray

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO / "examples"


class Example(NamedTuple):
  script: str  # path under examples/
  args: tuple[str, ...] = ()
  copy: bool = False  # run a copy in the temporary directory, not the file
  timeout_s: int = 180
  pytest: bool = False  # a test module: run `python -m pytest` on it


# One line per example, one example per script. The docs may show code and
# output only of scripts listed here (tests/test_docs.py checks it).
EXAMPLES = [
    Example("quickstart.py", copy=True),
    Example("demo.py", ("--mb", "8", "--leaves", "4", "--rounds", "1")),
    Example("pipeline.py"),
    Example("weight_sync.py", ("--steps", "4", "--mb", "4"), timeout_s=300),
    Example("rl_loop.py", timeout_s=300),
    Example("shm_transport.py"),
    Example("test_shm_transport.py", pytest=True, timeout_s=300),
    Example("reshard.py"),
    Example("jax_to_torch.py", timeout_s=300),
    Example("weight_sync_multihost.py", timeout_s=300),
]


@functools.cache
def run_example(example: Example) -> subprocess.CompletedProcess:
  """Runs `example` once in this pytest process and returns the finished process."""
  source = EXAMPLES_DIR / example.script
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="rdt-jax-example-"))
  script = source
  if example.copy:
    script = workdir / f"copied_{source.name}"
    shutil.copyfile(source, script)
  command = [sys.executable, str(script), *example.args]
  if example.pytest:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script), *example.args]
  try:
    return subprocess.run(
        command,
        cwd=workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=example.timeout_s,
    )
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def example_for(script: str) -> Example:
  """The EXAMPLES entry of `script` (a path under examples/)."""
  for example in EXAMPLES:
    if example.script == script:
      return example
  raise KeyError(f"examples/{script} is not listed in tests/test_examples.py's EXAMPLES")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: " ".join((e.script, *e.args)))
def test_example_runs(example: Example):
  proc = run_example(example)
  assert proc.returncode == 0, (
      f"{example.script} exited with {proc.returncode}\n"
      f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
  )
