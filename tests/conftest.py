"""Shared fixtures: one local Ray session per test module.

Helpers the modules share (arrays, digests, waiting) live in `_helpers`. The
hooks here also select `--fast` runs (`_selection`: Ray-free tests, plus one
Ray smoke test) and write the full run's slowest tests (`_durations`).
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time

import pytest
import ray

import _durations
import _selection

# Re-exported: test modules use them as conftest.wait_for / conftest.wait_meta.
from _helpers import wait_for, wait_meta  # noqa: F401

TESTS_DIR = pathlib.Path(__file__).parent
REPO = TESTS_DIR.parent
# Workers import the test modules' actor and transport classes by reference.
# examples/ too: a transport registered by one test module (the shm example)
# stays in this process's Ray registry for the modules after it, whose new
# actors then receive it, so their workers must be able to import it.
# Not the repository root: workers import rdt_jax as installed (editable in
# .venv, from the wheel in scripts/test_wheel.sh), like the driver.
WORKER_PYTHONPATH = os.pathsep.join([str(TESTS_DIR), str(REPO / "examples")])
# The driver imports the example transport as a user's module, by name.
sys.path.insert(0, str(REPO / "examples"))


#: The environment of modules that test the out-of-band mechanisms themselves
#: (NIXL READs, registrations, parking, faults, bytes each backend moves):
#: small objects not sent in band (the default, kept explicit), and no
#: node-local reads, so that every object takes the path under test whatever
#: its size. Every other module runs with the defaults, which read a producer
#: on the same host directly (test_cma); in-band sending is opt-in (test_inline).
OUT_OF_BAND_ENV = {"RDT_JAX_INLINE_MAX_BYTES": "0", "RDT_JAX_NIXL_CMA": "0"}
#: Only small objects out of band (node-local reads as by default).
NOT_IN_BAND_ENV = {"RDT_JAX_INLINE_MAX_BYTES": "0"}


def worker_env(**env: str) -> dict:
  """An actor's `runtime_env`: its worker can import the tests, with `env` set
  (fault rules in `RDT_JAX_FAULTS` enabled with `RDT_JAX_FAULTS_ENABLE`)."""
  if env.get("RDT_JAX_FAULTS"):
    env = {"RDT_JAX_FAULTS_ENABLE": "1", **env}
  return {"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH, **env}}


def start_ray(env: dict[str, str] | None = None, **kwargs) -> None:
  """Starts a local Ray for one test module, workers able to import tests.

  `env` is set in this process (restored after the module) and in every
  worker's environment.
  """
  import rdt_jax

  os.environ.update(env or {})
  rdt_jax.register()
  runtime_env = kwargs.pop("runtime_env", {})
  env_vars = {"PYTHONPATH": WORKER_PYTHONPATH, **(env or {}), **runtime_env.pop("env_vars", {})}
  ray.init(
      # A new local cluster even when another process on this machine has
      # `ray start`ed one (ray.init() would join it, and refuse num_cpus).
      address=kwargs.pop("address", "local"),
      num_cpus=kwargs.pop("num_cpus", 8),
      include_dashboard=False,
      logging_level="warning",
      runtime_env={"env_vars": env_vars, **runtime_env},
      **kwargs,
  )


@pytest.fixture(scope="module", autouse=True)
def _restore_environment():
  """Gives every module the environment the one before it found: whatever a
  module sets (`start_ray(env=...)`, its fixtures), changes or removes in
  this process is undone, exactly, after its last test."""
  saved = dict(os.environ)
  yield
  restore_environ(saved)


#: Variables the process itself owns, left as they are: `ray.init` sets the first
#: three in the driver for the process's life (Ray 2.60's token authentication:
#: removing RAY_AUTH_MODE after a Ray has run makes the next cluster's actors die
#: at start), pytest the last.
PROCESS_ENV = frozenset({"RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "PYTHONBREAKPOINT", "PYTEST_CURRENT_TEST"})


def restore_environ(saved: dict[str, str]) -> None:
  """Makes `os.environ` exactly `saved` (a `dict(os.environ)`), but for
  `PROCESS_ENV`: adds, changes back and removes variables (through
  `os.environ`, so subprocesses see it)."""
  for k in set(os.environ) - set(saved) - PROCESS_ENV:
    del os.environ[k]
  for k, v in saved.items():
    if k not in PROCESS_ENV and os.environ.get(k) != v:
      os.environ[k] = v


# ---- --fast (tests/_selection.py) and the durations file (tests/_durations.py)

_GUARD = pytest.StashKey[_selection.RayGuard]()
_STARTED = pytest.StashKey[float]()
_DURATIONS = pytest.StashKey["str | None"]()


def pytest_addoption(parser):
  parser.addoption(
      "--fast", action="store_true",
      help="run only the tests that start no Ray (minus the slow ones) and the Ray smoke test; "
      "a selected test that starts Ray fails (tests/_selection.py)",
  )


def pytest_configure(config):
  config.stash[_STARTED] = time.monotonic()
  config.stash[_DURATIONS] = _durations.target_from_environment()
  for name, text in _selection.MARKERS.items():
    config.addinivalue_line("markers", f"{name}: {text}")
  if config.getoption("fast", False):
    config.option.markexpr = _selection.fast_markexpr(config.option.markexpr)
    guard = _selection.RayGuard(pathlib.Path(tempfile.mkdtemp(prefix="rdtjax-fast-")))
    guard.install()
    config.stash[_GUARD] = guard


def pytest_unconfigure(config):
  guard = config.stash.get(_GUARD, None)
  if guard is not None:
    guard.uninstall()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks `ray` every test that starts Ray itself or through its fixtures
  (before `-m` deselects; tests/_selection.py)."""
  for item in items:
    if item.get_closest_marker("ray") is not None or not isinstance(item, pytest.Function):
      continue
    defs = item._fixtureinfo.name2fixturedefs
    fixtures = [d.func for name in item.fixturenames for d in defs.get(name, ())]
    if _selection.starts_ray(item.function, fixtures):
      item.add_marker(pytest.mark.ray)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  """Under --fast: only the smoke test may start Ray, in its fixtures too."""
  guard = item.config.stash.get(_GUARD, None)
  if guard is not None:
    guard.allow(item.nodeid, item.get_closest_marker("smoke") is not None)


@pytest.fixture(autouse=True)
def _ray_free_under_fast(request):
  """Under --fast: fails a test after which Ray runs, or which started a
  Ray session in another process (tests/_selection.py)."""
  guard = request.config.stash.get(_GUARD, None)
  before = guard.sessions() if guard is not None else set()
  yield
  problem = guard.problem(before) if guard is not None else None
  if problem:
    pytest.fail(problem, pytrace=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  """The full run (scripts/test.sh with no arguments) keeps its slowest tests."""
  if config.getoption("fast", False):
    return
  wall_s = time.monotonic() - config.stash[_STARTED]
  path = _durations.write(terminalreporter.stats, wall_s, int(exitstatus), REPO, config.stash[_DURATIONS])
  if path is not None:
    terminalreporter.write_line(f"slowest tests written to {path}")


@pytest.fixture(scope="module")
def ray_session(request):
  """A local Ray for the module, in the module's `RAY_ENV` and with its
  `RAY_NUM_CPUS` (default 8) if it sets them."""
  start_ray(env=getattr(request.module, "RAY_ENV", None), num_cpus=getattr(request.module, "RAY_NUM_CPUS", 8))
  yield
  ray.shutdown()
