"""The package's layering: no import cycles, one seam to Ray, one dispatch point.

Read from the source, so the rules hold however the modules happen to be
imported at run time. Every import counts wherever it is written (module
level, inside a function or method, under `try:`), and so does
`importlib.import_module("name")` with a literal name: an import deferred to
a function still ties the two modules together. Only imports under
`if TYPE_CHECKING:` (type annotations) are left out.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "rdt_jax"


def _module_name(path: pathlib.Path) -> str:
  if not path.is_relative_to(PACKAGE):
    return path.stem
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
  return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _absolute(module: str | None, level: int, importer: str, is_package: bool) -> str:
  """The absolute module name of a (possibly relative) `from ... import`."""
  if not level:
    return module or ""
  base = importer.split(".")
  base = base[: len(base) - level + (1 if is_package else 0)]
  return ".".join([*base, module] if module else base)


def _imported(node: ast.AST, importer: str, is_package: bool) -> set[str]:
  """The modules one AST node imports (none for most nodes)."""
  if isinstance(node, ast.Import):
    return {a.name for a in node.names}
  if isinstance(node, ast.ImportFrom):
    module = _absolute(node.module, node.level, importer, is_package)
    submodules = {f"{module}.{a.name}" for a in node.names} & set(MODULES)
    # `from pkg import submodule` depends on the submodule, not on pkg.
    return submodules or {module}
  if (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
      and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
  ):
    return {node.args[0].value}
  return set()


def module_imports(path: pathlib.Path) -> set[str]:
  """Names of the modules `path` imports anywhere outside `if TYPE_CHECKING:`."""
  name = _module_name(path)
  is_package = path.name == "__init__.py"
  found: set[str] = set()
  stack: list[ast.AST] = [ast.parse(path.read_text())]
  while stack:
    node = stack.pop()
    if _is_type_checking(node):
      stack.extend(node.orelse)  # type: ignore[attr-defined]
      continue
    found |= _imported(node, name, is_package)
    stack.extend(ast.iter_child_nodes(node))
  return found


def internal_graph() -> dict[str, set[str]]:
  return {
      name: {m for m in module_imports(path) if m in MODULES and m != name}
      for name, path in MODULES.items()
  }


def test_no_import_cycles():
  graph = internal_graph()
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  cycles: list[str] = []

  def visit(node: str, stack: list[str]) -> None:
    state[node] = 1
    for dep in sorted(graph[node]):
      if state.get(dep) == 1:
        cycles.append(" -> ".join([*stack[stack.index(dep):], dep]))
      elif dep not in state:
        visit(dep, [*stack, dep])
    state[node] = 2

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])
  assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_imports_are_read_wherever_they_are_written(tmp_path):
  source = tmp_path / "example.py"
  source.write_text(
      "from typing import TYPE_CHECKING\n"
      "import importlib\n"
      "if TYPE_CHECKING:\n"
      "  import annotations_only\n"
      "else:\n"
      "  import at_run_time\n"
      "def f():\n"
      "  from in_function import x\n"
      "class C:\n"
      "  def m(self):\n"
      "    import in_method\n"
      "    return importlib.import_module('by_name')\n"
  )
  assert module_imports(source) == {
      "typing", "importlib", "at_run_time", "in_function", "in_method", "by_name",
  }


#: The array layer's rooms, bottom-up: describing and converting arrays,
#: their memory, where their bytes lie. None imports Ray; each imports of
#: rdt_jax only itself, the rooms below it, and Ray-free modules with no
#: dependency on the layers above. The framework modules are the bottom room's:
#: memory is allocated and ordered through them (a region is a torch or jax
#: buffer), and layouts are made of their arrays (a target layout is a jax
#: sharding, packing describes each leaf).
ROOMS = ("rdt_jax._dlpack", "rdt_jax._memory", "rdt_jax._layout")
BELOW_THE_LAYER = ("rdt_jax._compat", "rdt_jax._settings", "rdt_jax._limits", "rdt_jax._error_base")
MAY_IMPORT = {room: (*ROOMS[: i + 1], *BELOW_THE_LAYER) for i, room in enumerate(ROOMS)}


def _within(name: str, package: str) -> bool:
  return name == package or name.startswith(package + ".")


def _room_of(name: str) -> str | None:
  return next((room for room in ROOMS if _within(name, room)), None)


@pytest.mark.parametrize("room", ROOMS)
def test_array_layer_depends_on_nothing_above_it(room):
  """No room imports Ray, nor any module of rdt_jax above it: the DLPack
  layer's rule, for each of the layer's rooms."""
  modules = [name for name in MODULES if _within(name, room)]
  assert modules, f"no modules in {room}"
  for name in modules:
    for dep in module_imports(MODULES[name]):
      top = dep.split(".")[0]
      assert top != "ray", f"{name} imports {dep}"
      if top == "rdt_jax":
        assert any(_within(dep, allowed) for allowed in MAY_IMPORT[room]), f"{name} imports {dep}"


#: One module per framework; each knows only its own framework (and numpy,
#: the layer's host buffer type).
FRAMEWORK_MODULES = tuple(f"rdt_jax._dlpack._{fw}" for fw in ("numpy", "jax", "torch", "cupy"))


def test_framework_modules_know_only_their_own_framework():
  # Conversions between frameworks are `_interop`'s; picking a framework for
  # an array is `_dispatch`'s. A framework module needs neither, nor another
  # framework module, nor the layers built on them (the rooms above
  # `_dlpack` are kept out by `test_array_layer_depends_on_nothing_above_it`).
  above = (*FRAMEWORK_MODULES, "rdt_jax._dlpack._interop", "rdt_jax._dlpack._dispatch",
           "rdt_jax._dlpack._sharding")
  for name in FRAMEWORK_MODULES:
    deps = {d for d in module_imports(MODULES[name]) if d in above and d != name}
    assert deps == set(), f"{name} imports {sorted(deps)}"


@pytest.mark.parametrize("room", ROOMS)
def test_room_readme_lists_every_module_bottom_up(room):
  """Each room's README.md module table names every module of the room, each
  importing only modules listed before it (and the rooms below)."""
  readme = (PACKAGE / room.removeprefix("rdt_jax.") / "README.md").read_text()
  listed = [f"{room}.{m}" for m in re.findall(r"^\| `(_\w+)` \|", readme, re.MULTILINE)]
  modules = sorted(n for n in MODULES if n.startswith(room + "."))
  assert sorted(listed) == modules
  for i, name in enumerate(listed):
    later = {d for d in module_imports(MODULES[name]) if d in listed[i:]}
    assert later == set(), f"{name} imports {sorted(later)}, listed after it in its README"


def _surface_names_used(path: pathlib.Path, room: str) -> set[str]:
  """Public names of `room` (`rdt_jax._dlpack`, ...) that `path` uses:
  `_dlpack.name` attributes and `from rdt_jax._dlpack import name`."""
  short = room.rsplit(".", 1)[1]
  used: set[str] = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Attribute):
      owner = node.value
      if (isinstance(owner, ast.Name) and owner.id == short) or (
          isinstance(owner, ast.Attribute) and owner.attr == short
      ):
        used.add(node.attr)
    elif isinstance(node, ast.ImportFrom) and node.module == room and not node.level:
      used.update(a.name for a in node.names)
  return {n for n in used if not n.startswith("_")}


@pytest.mark.parametrize("room", ROOMS)
def test_room_surface_is_what_the_rest_uses(room):
  """Each room's `__all__` is exactly the names used outside the array layer,
  by the package, its tests, scripts and examples. The rooms use each other's
  modules directly; tests of a room's own internals import its private
  modules (`from rdt_jax._memory import _host`)."""
  package = importlib.import_module(room)
  users = [
      p for p in sorted(PACKAGE.parent.glob("*/**/*.py"))
      if p.parts[len(PACKAGE.parent.parts)] in ("rdt_jax", "tests", "scripts", "examples")
      and _room_of(_module_name(p)) is None
  ]
  used = set().union(*(_surface_names_used(p, room) for p in users))
  exported = set(package.__all__)
  assert len(exported) == len(package.__all__), "a name is listed twice in __all__"
  assert sorted(used - exported) == [], "used outside the layer but not exported"
  assert sorted(exported - used) == [], "exported but used nowhere outside the layer"
  assert all(hasattr(package, n) for n in exported)


def test_transports_never_import_the_registry():
  for name, path in MODULES.items():
    if name.startswith(("rdt_jax.transports", "rdt_jax._ray", "rdt_jax._handoff", "rdt_jax._receive_mode", *ROOMS)):
      deps = module_imports(path)
      assert not any(d.startswith("rdt_jax._registry") for d in deps), name


RAW_ACCESS = re.compile(r"\.(unsafe_buffer_pointer|data_ptr)\(|\.ctypes\.data|\.sharding\.device_set")


def test_only_the_array_layer_reads_array_internals():
  # rdt_jax.testing checks what arrived (a sharding's mesh and spec) as a
  # user's own test would: it moves nothing.
  offenders = [
      f"{name}:{i}"
      for name, path in MODULES.items()
      if _room_of(name) is None and not name.startswith("rdt_jax.testing")
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
      if not name.startswith(("rdt_jax._ray", "rdt_jax.bench"))
      for i, line in enumerate(path.read_text().splitlines(), 1)
      if RAY_PRIVATE.search(line)
  ]
  assert offenders == []


MAX_MODULE_LINES = 500


def test_no_module_outgrows_a_room():
  # A module over MAX_MODULE_LINES lines (the benchmark aside) must be named in
  # ARCHITECTURE.md on a line that says "over 500 lines" and why.
  allowed = {
      line.split("`")[1]
      for line in (PACKAGE.parent / "ARCHITECTURE.md").read_text().splitlines()
      if "over 500 lines" in line and line.count("`") >= 2
  }
  over = [
      f"{name} ({len(path.read_text().splitlines())} lines)"
      for name, path in MODULES.items()
      if not name.startswith("rdt_jax.bench")
      and len(path.read_text().splitlines()) > MAX_MODULE_LINES
      and str(path.relative_to(PACKAGE.parent)) not in allowed
  ]
  assert over == [], "split these into rooms, or say in ARCHITECTURE.md why one is over 500 lines"
