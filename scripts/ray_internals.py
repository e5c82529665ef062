"""Writes the table of every Ray internal rdt_jax touches into
docs/ray_integration.md, from the docstrings of the seam's rooms (`rdt_jax._ray`).

  python scripts/ray_internals.py          # rewrite the table in docs/ray_integration.md
  python scripts/ray_internals.py --check  # exit 1 if the page holds another table

Every function of `rdt_jax._ray` that touches a Ray internal says so in one
paragraph of its docstring with three labelled parts:

  Touches: what of Ray it wraps, reads, writes or calls.
  Why: what goes wrong without it.
  Retire when: the upstream change that would let it go.

(continuation lines indented). The table has one row per such function, room
by room in import order, functions in source order. tests/test_docs.py checks
that the page holds what this script writes, and that every wrap has the three
parts.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import sys
from typing import NamedTuple

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "ray_integration.md"
BEGIN = "<!-- ray internals: generated from the docstrings of rdt_jax._ray: python scripts/ray_internals.py -->"
END = "<!-- end ray internals -->"
ROOMS = ("version", "state", "serialization", "failures", "fetch", "names", "aio", "registration")
LABELS = ("Touches:", "Why:", "Retire when:")
# Document the checkout this script lives in, even if another copy is installed.
sys.path.insert(0, str(REPO))


class Touch(NamedTuple):
  room: str
  function: str
  touches: str
  why: str
  retire: str


def fields(doc: str) -> dict[str, str]:
  """The labelled parts of a docstring's `Touches:` paragraph ({} if none)."""
  lines = inspect.cleandoc(doc).splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith(LABELS[0])), None)
  if start is None:
    return {}
  found: dict[str, list[str]] = {}
  current = None
  for line in lines[start:]:
    if not line.strip():
      break
    label = next((lab for lab in LABELS if line.startswith(lab)), None)
    if label is not None:
      current = label
      found[label] = [line[len(label):].strip()]
    elif current is not None:
      found[current].append(line.strip())
  return {k: " ".join(v) for k, v in found.items()}


def functions(room: str) -> list[tuple[str, object]]:
  """The functions defined in room `room`, in source order."""
  module = importlib.import_module(f"rdt_jax._ray.{room}")
  own = [(n, f) for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == module.__name__]
  return sorted(own, key=lambda nf: nf[1].__code__.co_firstlineno)  # type: ignore[attr-defined]


def touches() -> list[Touch]:
  """Every function of the seam that touches a Ray internal, with why."""
  rows = []
  for room in ROOMS:
    for name, fn in functions(room):
      f = fields(inspect.getdoc(fn) or "")
      if f:
        rows.append(Touch(room, name, f.get(LABELS[0], ""), f.get(LABELS[1], ""), f.get(LABELS[2], "")))
  return rows


def table() -> str:
  rows = ["| Ray internal | rdt_jax | why | retire when |", "| --- | --- | --- | --- |"]
  rows += [f"| {t.touches} | `_ray/{t.room}.py` `{t.function}` | {t.why} | {t.retire} |" for t in touches()]
  return "\n".join(rows)


def render(page: str) -> str:
  """`page` with the generated table between its markers."""
  head, rest = page.split(BEGIN + "\n", 1)
  _, tail = rest.split(END, 1)
  return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
  args = parser.parse_args()
  page = PAGE.read_text()
  expected = render(page)
  if args.check:
    if page != expected:
      print(f"{PAGE.relative_to(REPO)} is out of date: run python scripts/ray_internals.py", file=sys.stderr)
      return 1
    return 0
  PAGE.write_text(expected)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
