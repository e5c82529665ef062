"""Fixed tuning constants live in one module, each with why it has its value.

`rdt_jax/_limits.py` holds them; `docs/configuration.md` lists them in a table
generated from that module; no other module of the package (the benchmark
aside) defines a numeric constant of its own, so a value is decided in one
place.
"""

from __future__ import annotations

import ast
import pathlib
import re

from _helpers import load_script
from rdt_jax import _limits

REPO = pathlib.Path(__file__).parent.parent
PACKAGE = REPO / "rdt_jax"
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")

#: Numeric module constants allowed outside `_limits`, each a fact, not a choice.
FACTS = {
    ("_memory/_cuda.py", "_IS_LEGACY_CUDA_IPC_CAPABLE"): "a CUDA driver attribute number",
    ("_memory/_ipc.py", "_LAZY_ENABLE_PEER_ACCESS"): "a CUDA driver flag",
    ("_memory/_ipc.py", "_STREAM_NON_BLOCKING"): "a CUDA driver flag",
    ("_memory/_ipc.py", "HANDLE_BYTES"): "the size of CUDA's IPC handle",
    ("_doctor/judge_setup.py", "XLA_DEFAULT_FRACTION"): "jaxlib's default, which the doctor reports",
    ("_settings.py", "_KIB"): "a unit",
    ("_settings.py", "_MIB"): "a unit",
    ("_settings.py", "_GIB"): "a unit",
    ("_settings.py", "_TIB"): "a unit",
}


def _is_number(node: ast.AST) -> bool:
  """True for a numeric literal, or arithmetic on numeric literals only."""
  if isinstance(node, ast.Constant):
    return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
  if isinstance(node, ast.UnaryOp):
    return _is_number(node.operand)
  if isinstance(node, ast.BinOp):
    return _is_number(node.left) and _is_number(node.right)
  return False


def _numeric_constants(path: pathlib.Path) -> list[str]:
  found = []
  for node in ast.parse(path.read_text()).body:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    value = getattr(node, "value", None)
    found.extend(
        t.id for t in targets
        if isinstance(t, ast.Name) and CONSTANT.match(t.id) and value is not None and _is_number(value)
    )
  return found


def test_every_limit_says_what_it_is_and_why():
  rows = load_script("limits_table").limits()
  names = [r.name for r in rows]
  assert len(rows) >= 30 and len(set(names)) == len(names)
  assert set(names) == {n for n in vars(_limits) if CONSTANT.match(n) and n != "Final"}
  missing = [r.name for r in rows if not r.what or not r.why]
  assert missing == [], "each constant in rdt_jax/_limits.py needs a `#:` line and a `#: Why:` line"


def test_every_limit_is_used():
  code = "\n".join(
      p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "_limits.py" and "bench" not in p.parts
  )
  unused = [r.name for r in load_script("limits_table").limits() if f"_limits.{r.name}" not in code]
  assert unused == []


def test_no_module_decides_a_number_of_its_own():
  offenders = [
      f"{path.relative_to(PACKAGE)}: {name}"
      for path in sorted(PACKAGE.rglob("*.py"))
      if path.name != "_limits.py" and "bench" not in path.relative_to(PACKAGE).parts
      for name in _numeric_constants(path)
      if (path.relative_to(PACKAGE).as_posix(), name) not in FACTS
  ]
  assert offenders == [], "move these to rdt_jax/_limits.py, each with a `#: Why:` line"


def test_the_check_sees_a_numeric_constant(tmp_path):
  path = tmp_path / "probe.py"
  path.write_text("A = 1\nB: int = 1 << 4\n_C = -2.5\nD = 'text'\nE = (1, 2)\nlower = 3\n")
  assert _numeric_constants(path) == ["A", "B", "_C"]


def test_configuration_page_lists_every_limit():
  page = (REPO / "docs" / "configuration.md").read_text()
  start = page.index("<!-- limits-table")
  table = page[start:page.index("<!-- /limits-table -->")].split("\n", 1)[1]
  assert table == load_script("limits_table").table() + "\n", "regenerate: python scripts/limits_table.py"
