"""scripts/install_torch.py: the one torch rule every environment the set-up
and test scripts build follows. On a host without an NVIDIA GPU it never
downloads torch's CUDA build: it takes a CPU build that pip's configuration
or PyTorch's CPU index offers, or stops before any download with the exact
command to run.

PyTorch's own indexes cannot be reached from this project's machines, and
PyPI's CUDA build is several GB, so pip here resolves against local
directories holding wheels that stand in for the two builds: same name and
version, and the CUDA one requires an ``nvidia-*`` package as PyPI's does.
The rule reads only that metadata."""

from __future__ import annotations

import base64
import hashlib
import os
import pathlib
import subprocess
import venv
import zipfile

import pytest

#: Makes virtual environments and installs into them: not run by `--fast`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install_torch.py"


def _wheel(directory: pathlib.Path, name: str, version: str, requires: list[str]) -> None:
  """Writes a minimal installable wheel of `name` (a package of one module)."""
  dist = f"{name.replace('-', '_')}-{version}"
  info = f"{dist}.dist-info"
  files = {
      f"{name.replace('-', '_')}/__init__.py": f"__version__ = {version!r}\n",
      f"{info}/METADATA": "".join(
          [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
          + [f"Requires-Dist: {r}\n" for r in requires]
      ),
      f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
  }
  record = []
  for path, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
    record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
  record.append(f"{info}/RECORD,,")
  files[f"{info}/RECORD"] = "\n".join(record) + "\n"
  with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as zf:
    for path, text in files.items():
      zf.writestr(path, text)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
  """A fresh venv, and three local package sources: one offering a CUDA-like
  torch 2.13.0 (with its nvidia requirement), one a CPU build, one empty."""
  root = tmp_path_factory.mktemp("torch-rule")
  venv.create(root / "venv", with_pip=True)
  cuda, cpu, empty = root / "cuda", root / "cpu", root / "empty"
  for d in (cuda, cpu, empty):
    d.mkdir()
  _wheel(cuda, "torch", "2.13.0", ["filelock", 'nvidia-cuda-runtime-cu12==12.9.79; platform_system == "Linux"'])
  _wheel(cuda, "nvidia-cuda-runtime-cu12", "12.9.79", [])
  _wheel(cuda, "filelock", "3.0.0", [])
  _wheel(cpu, "torch", "2.13.0+cpu", ["filelock"])
  _wheel(cpu, "filelock", "3.0.0", [])
  return {"python": root / "venv" / "bin" / "python", "cuda": cuda, "cpu": cpu, "empty": empty}


def _run(env: dict[str, pathlib.Path], offer: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
  """Runs the rule in the venv with pip seeing only the `offer` directory (no
  configuration file, no index but an empty local one), and no GPU."""
  environ = {
      k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "RDT_JAX_TORCH"))
  }
  environ.update(
      PIP_CONFIG_FILE=os.devnull,
      PIP_INDEX_URL=env["empty"].as_uri(),
      PIP_FIND_LINKS=str(env[offer]),
      PIP_DISABLE_PIP_VERSION_CHECK="1",
      RDT_JAX_TORCH="cpu",
      RDT_JAX_TORCH_CPU_INDEX=env["empty"].as_uri(),
  )
  environ.update(extra)
  return subprocess.run(
      [str(env["python"]), str(SCRIPT), *args],
      capture_output=True, text=True, env=environ, timeout=300, check=False,
  )


def _torch_version(env: dict[str, pathlib.Path]) -> str | None:
  out = subprocess.run(
      [str(env["python"]), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
      capture_output=True, text=True, check=False,
  )
  return out.stdout.strip() if out.returncode == 0 else None


def test_the_rule_on_a_host_without_a_gpu(env: dict[str, pathlib.Path]) -> None:
  # Only the CUDA build on offer and the CPU index silent: stop before any
  # download, exit status 3, with the exact command to run.
  stopped = _run(env, "cuda")
  assert stopped.returncode == 3, stopped.stderr
  assert "stopped before downloading torch's CUDA build" in stopped.stderr
  command = (
      f"{env['python']} -m pip install torch==2.13.0 "
      "--index-url https://download.pytorch.org/whl/cpu"
  )
  assert command in stopped.stderr
  assert _torch_version(env) is None
  # --optional: go on without torch, still downloading nothing.
  optional = _run(env, "cuda", "--optional")
  assert optional.returncode == 0, optional.stderr
  assert "going on without torch" in optional.stderr
  assert _torch_version(env) is None
  # A CPU build on offer (as a wheel file a machine's pip configuration names):
  # taken without the user doing anything.
  taken = _run(env, "cpu")
  assert taken.returncode == 0, taken.stderr
  assert _torch_version(env) == "2.13.0+cpu"
  # Installed: nothing more to do, whatever is on offer.
  again = _run(env, "cuda")
  assert again.returncode == 0, again.stderr


def test_a_cpu_build_from_pytorchs_cpu_index(env: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
  # pip's configuration offers the CUDA build; the CPU index (here a local
  # one in the index layout) offers a CPU build, and it is taken from there.
  index = tmp_path / "index"
  for name, source in (("torch", "torch-2.13.0+cpu"), ("filelock", "filelock-3.0.0")):
    project = index / name
    project.mkdir(parents=True)
    wheel = f"{source}-py3-none-any.whl"
    (project / wheel).write_bytes((env["cpu"] / wheel).read_bytes())
    (project / "index.html").write_text(f'<a href="{wheel}">{wheel}</a>\n')
  subprocess.run([str(env["python"]), "-m", "pip", "uninstall", "-y", "-q", "torch"], check=False)
  taken = _run(env, "cuda", RDT_JAX_TORCH_CPU_INDEX=index.as_uri())
  assert taken.returncode == 0, taken.stderr
  assert "CPU build, from" in taken.stdout
  assert _torch_version(env) == "2.13.0+cpu"


def test_an_unknown_mode_is_refused(env: dict[str, pathlib.Path]) -> None:
  out = _run(env, "cpu", RDT_JAX_TORCH="gpu")  # whether or not torch is installed
  assert out.returncode == 2
  assert "expected auto, cpu or cuda" in out.stderr


@pytest.mark.parametrize("script", ["setup.sh", "test_wheel.sh", "matrix.sh"])
def test_every_environment_takes_torch_through_the_rule(script: str) -> None:
  text = (REPO / "scripts" / script).read_text()
  assert "scripts/install_torch.py" in text
  assert 'install -q --no-compile "torch==' not in text, f"{script} installs torch around the rule"

