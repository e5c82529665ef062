"""A source checkout named `rdt_jax` beside a script shadows the installed
package (Python puts the script's folder first on `sys.path`, Ray puts it on
every worker's): the checkout's root `__init__.py` turns that into an
ImportError naming the folder and the fix, the one docs/troubleshooting.md
quotes. A checkout named `rdt-jax`, as docs/install.md clones it, shadows nothing.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import rdt_jax
from _helpers import clean_env

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = "import rdt_jax\n\nprint(rdt_jax.__file__, rdt_jax.register.__module__)\n"


def make_checkout(folder: pathlib.Path) -> None:
  """A checkout's root in `folder`: this repository's root files and an `rdt_jax/` package folder."""
  folder.mkdir()
  for name in ("__init__.py", "pyproject.toml", "README.md"):
    shutil.copyfile(REPO / name, folder / name)
  (folder / "rdt_jax").mkdir()
  (folder / "rdt_jax" / "__init__.py").write_text('"""Not the installed rdt_jax."""\n')


def run_beside(tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
  """Runs SCRIPT, saved in `tmp_path`, from `tmp_path`, as a user would."""
  (tmp_path / "train.py").write_text(SCRIPT)
  return subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=clean_env(), capture_output=True,
                        text=True, timeout=120)


def test_a_checkout_named_rdt_jax_beside_the_script_names_itself_and_the_fix(tmp_path):
  make_checkout(tmp_path / "rdt_jax")
  proc = run_beside(tmp_path)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last == (
      f"ImportError: 'import rdt_jax' found {tmp_path / 'rdt_jax'}, the root of an rdt_jax source checkout, "
      f"instead of the installed package: a folder named rdt_jax in {tmp_path}, the folder of the script being run "
      "(or another folder on sys.path), shadows it. Rename the checkout (for example to rdt-jax) and reinstall it "
      "from there (pip install -e .), or keep the script in another folder."
  ), proc.stderr
  # docs/troubleshooting.md quotes it, for a checkout in /home/me/work.
  quoted = last.replace(str(tmp_path), "/home/me/work")
  troubleshooting = " ".join((REPO / "docs" / "troubleshooting.md").read_text().split())
  assert quoted in troubleshooting


def test_a_checkout_named_rdt_jax_dash_shadows_nothing(tmp_path):
  make_checkout(tmp_path / "rdt-jax")
  proc = run_beside(tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  imported, module = proc.stdout.split()
  assert pathlib.Path(imported).resolve() == pathlib.Path(rdt_jax.__file__ or "").resolve()
  assert module == "rdt_jax._registry"


def test_the_root_file_does_nothing_under_another_name(tmp_path):
  checkout = tmp_path / "hour"
  make_checkout(checkout)
  proc = subprocess.run([sys.executable, "-c", "import hour; print(hour.__file__)"], cwd=tmp_path, env=clean_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert pathlib.Path(proc.stdout.strip()) == checkout / "__init__.py"
