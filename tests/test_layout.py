"""The package's layering: no import cycles, one seam to Ray, one dispatch point.

Read from the source (module-level imports, outside `if TYPE_CHECKING:`), so
the rules hold however the modules happen to be imported at run time.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "rdt_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
  return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def module_imports(path: pathlib.Path) -> set[str]:
  """Names of the modules `path` imports at module level."""
  tree = ast.parse(path.read_text())
  found: set[str] = set()
  body = list(tree.body)
  while body:
    node = body.pop(0)
    if isinstance(node, ast.If) and not _is_type_checking(node):
      body.extend(node.body + node.orelse)
    elif isinstance(node, ast.Try):
      body.extend(node.body)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      submodules = {f"{node.module}.{a.name}" for a in node.names} & set(MODULES)
      # `from pkg import submodule` depends on the submodule, not on pkg.
      found.update(submodules or {node.module})
  return found


def internal_graph() -> dict[str, set[str]]:
  return {
      name: {m for m in module_imports(path) if m in MODULES and m != name}
      for name, path in MODULES.items()
  }


def test_no_import_cycles():
  graph = internal_graph()
  state: dict[str, int] = {}

  def visit(node: str, stack: list[str]) -> None:
    state[node] = 1
    for dep in sorted(graph[node]):
      if state.get(dep) == 1:
        cycle = [*stack[stack.index(dep):], dep] if dep in stack else [node, dep]
        pytest.fail(f"import cycle: {' -> '.join(cycle)}")
      if dep not in state:
        visit(dep, [*stack, dep])
    state[node] = 2

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])


def test_dlpack_layer_depends_on_nothing_above_it():
  for name, path in MODULES.items():
    if not name.startswith("rdt_jax._dlpack"):
      continue
    for dep in module_imports(path):
      top = dep.split(".")[0]
      assert top != "ray", f"{name} imports {dep}"
      if top == "rdt_jax":
        assert dep.startswith(("rdt_jax._dlpack", "rdt_jax._compat", "rdt_jax._settings")), f"{name} imports {dep}"


def test_transports_never_import_the_registry():
  for name, path in MODULES.items():
    if name.startswith(("rdt_jax.transports", "rdt_jax._seam", "rdt_jax._state", "rdt_jax._dlpack")):
      deps = module_imports(path)
      assert not any(d.startswith("rdt_jax._registry") for d in deps), name


RAW_ACCESS = re.compile(r"\.(unsafe_buffer_pointer|data_ptr)\(|\.ctypes\.data|\.sharding\.device_set")


def test_only_the_dlpack_layer_reads_array_internals():
  offenders = [
      f"{name}:{i}"
      for name, path in MODULES.items()
      if not name.startswith("rdt_jax._dlpack")
      for i, line in enumerate(path.read_text().splitlines(), 1)
      if RAW_ACCESS.search(line)
  ]
  assert offenders == []


RAY_PRIVATE = re.compile(r"ray\._private|\b_ray_system\b|CloudPickler|_thread_local|\._actor_id|"
                         r"transport_manager_info|rdt_manager\b|_trigger_fetch|"
                         r"_ensure_default_transports_registered")


def test_ray_internals_only_in_the_seam():
  offenders = [
      f"{name}:{i}: {line.strip()}"
      for name, path in MODULES.items()
      if name != "rdt_jax._seam" and not name.startswith("rdt_jax.bench")
      for i, line in enumerate(path.read_text().splitlines(), 1)
      if RAY_PRIVATE.search(line)
  ]
  assert offenders == []
