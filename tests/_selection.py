"""Which tests `--fast` runs, and the guard that holds them to it.

`pytest tests --fast` (what `scripts/test.sh --fast` runs after the lint)
selects the tests that start no Ray, minus the slow ones, plus the Ray smoke
test. A test starts Ray, and is marked `ray` here automatically, when its
own code or a fixture it uses calls `start_ray(` or `ray.init(` (the conftest's
`ray_session`, a module's own session fixture); a module that starts Ray in a
subprocess (a command, an example, a cluster) says so with
`pytestmark = pytest.mark.ray`.
Nothing else is trusted: under `--fast`, `RayGuard` makes `ray.init` raise in
every test but the smoke test, points `RAY_TMPDIR` at a folder of its own so
that a Ray started by a subprocess leaves a session there, and fails a test
after which Ray is up or a session appeared. A module that starts Ray without
saying so fails the fast loop at once, naming the test, instead of slowing it
down.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import pathlib
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

import ray

#: The markers, as `pytest --markers` lists them.
MARKERS = {
    "ray": "starts Ray (set for every test that uses the ray_session fixture); not run by --fast",
    "slow": "starts no Ray but takes tens of seconds (Sphinx builds, NIXL loopbacks, subprocesses); not run by --fast",
    "smoke": "the one Ray test --fast runs: a real transfer through Ray with rdt_jax's transport",
}
#: `-m` of the fast selection.
FAST_MARKEXPR = "smoke or not (ray or slow)"
#: Calls that start Ray in this process: `start_ray(...)` (the conftest's,
#: however imported) and `ray.init(...)`.
STARTS_RAY = frozenset({"start_ray", "ray.init"})


class RayStartedError(RuntimeError):
  """A test selected as Ray-free started Ray."""


def fast_markexpr(user: str | None) -> str:
  """The `-m` expression of a `--fast` run, within the caller's own `-m` if any."""
  return f"({FAST_MARKEXPR}) and ({user})" if user else FAST_MARKEXPR


def _called(node: ast.Call) -> str:
  """"name" or "module.name" of what `node` calls (the last two parts)."""
  f = node.func
  if isinstance(f, ast.Name):
    return f.id
  if isinstance(f, ast.Attribute):
    return f"{f.value.id}.{f.attr}" if isinstance(f.value, ast.Name) else f.attr
  return ""


@functools.cache
def calls_ray_init(fn: Callable[..., Any]) -> bool:
  """Whether `fn`'s code calls one of `STARTS_RAY` (docstrings and comments
  do not count); False where its source is not available."""
  try:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
  except (OSError, TypeError, SyntaxError):
    return False
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      called = _called(node)
      if called in STARTS_RAY or called.rpartition(".")[2] == "start_ray":
        return True
  return False


def starts_ray(test: Callable[..., Any], fixtures: Iterable[Callable[..., Any]]) -> bool:
  """Whether a test starts Ray in this process: its function or one of the
  fixture functions it uses (directly or through other fixtures) does."""
  return calls_ray_init(test) or any(calls_ray_init(f) for f in fixtures)


class RayGuard:
  """Holds the tests of a `--fast` run to starting no Ray (see the module
  docstring). `install` once per run; `allow` per test (True for the smoke
  test); `problem` after each test."""

  def __init__(self, tmpdir: pathlib.Path) -> None:
    self.tmpdir = tmpdir
    self.test = ""
    self.allowed = False
    self._init: Any = None

  def install(self) -> None:
    """Points `RAY_TMPDIR` (inherited by subprocesses) at `tmpdir` and makes
    `ray.init` raise unless the current test is allowed to start Ray."""
    os.environ["RAY_TMPDIR"] = str(self.tmpdir)
    self._init = ray.init
    guard = self

    def init(*args: Any, **kwargs: Any) -> Any:
      if not guard.allowed:
        raise RayStartedError(
            f"{guard.test} called ray.init under --fast, which runs only tests that start no Ray. "
            "Use the ray_session fixture or mark the module with `pytestmark = pytest.mark.ray` "
            "(tests/_selection.py)."
        )
      return guard._init(*args, **kwargs)

    ray.init = init

  def uninstall(self) -> None:
    """Gives `ray.init` back (the environment is the caller's to restore)."""
    if self._init is not None:
      ray.init = self._init
      self._init = None

  def allow(self, test: str, allowed: bool) -> None:
    """The test about to run (its node id), and whether it may start Ray."""
    self.test, self.allowed = test, allowed

  def sessions(self) -> set[str]:
    """The Ray sessions started under `tmpdir` so far (by any process)."""
    return {p.name for p in (self.tmpdir / "ray").glob("session_2*")}

  def problem(self, before: set[str]) -> str | None:
    """None if the current test left Ray down and started no session since
    `before` (`sessions()` when it began), else what it did."""
    if self.allowed:
      return None
    new = sorted(self.sessions() - before)
    if ray.is_initialized():
      what = "left Ray running"
    elif new:
      what = f"started Ray in another process (session {new[0]} under RAY_TMPDIR)"
    else:
      return None
    return (
        f"{self.test} {what} under --fast, which runs only tests that start no Ray. Mark its module "
        "with `pytestmark = pytest.mark.ray` (tests/_selection.py)."
    )
