"""The array layer without Ray: its rooms (`rdt_jax._dlpack`, `_memory`,
`_layout`) import and their tests pass where `import ray` fails, and
`import rdt_jax` imports neither Ray nor any framework."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).parent

# Put first on sys.path of the child process: makes `import ray` fail.
_BLOCK_RAY = '''
import sys

class _NoRay:
  def find_spec(self, name, path=None, target=None):
    if name == "ray" or name.startswith("ray."):
      raise ImportError(f"{name} is blocked in this test process")
    return None

sys.meta_path.insert(0, _NoRay())
'''


def _run_without_ray(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  (tmp_path / "sitecustomize.py").write_text(_BLOCK_RAY)
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
  return subprocess.run(
      [sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
  )


def test_ray_is_blocked_in_the_child(tmp_path):
  out = _run_without_ray(tmp_path, "-c", "import ray")
  assert out.returncode != 0 and "blocked in this test process" in out.stderr


def test_array_layer_imports_without_ray(tmp_path):
  code = (
      "import sys, rdt_jax, rdt_jax._dlpack, rdt_jax._memory, rdt_jax._layout; "
      "print(sorted(m for m in ('ray', 'jax', 'torch', 'nixl_cu12') if m in sys.modules))"
  )
  out = _run_without_ray(tmp_path, "-c", code)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


def test_import_rdt_jax_only_sets_the_seams_hooks(tmp_path):
  # The package root imports one module of rdt_jax (the hooks through which
  # the seam reaches the registry and targets) and fills every hook.
  code = (
      "import sys, rdt_jax\n"
      "from rdt_jax import _hooks\n"
      "hooks = ('register_transports', 'set_target_buffers', 'set_target_device')\n"
      "print(sorted(m for m in sys.modules if m.startswith('rdt_jax')),"
      " [h for h in hooks if getattr(_hooks, h) is _hooks._not_set])\n"
  )
  out = _run_without_ray(tmp_path, "-c", code)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "['rdt_jax', 'rdt_jax._hooks'] []"


#: The array layer's tests that need no Ray: arrays described, converted and
#: rebuilt with host memory and its layout (test_dlpack); device regions, their
#: layout and the CUDA helpers' host branches (test_device_memory).
NO_RAY_TESTS = ("test_dlpack.py", "test_device_memory.py")


@pytest.mark.slow  # runs the array layer's test modules again in a subprocess
def test_array_layer_tests_pass_without_ray(tmp_path):
  out = _run_without_ray(
      tmp_path,
      "-m", "pytest", *(str(TESTS / name) for name in NO_RAY_TESTS),
      "--noconftest", "-p", "no:cacheprovider", "-q", "-x",
      "--rootdir", str(tmp_path),
  )
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  assert " passed" in out.stdout and " failed" not in out.stdout
