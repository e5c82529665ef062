"""Prints the table of rdt_jax's fixed limits (`rdt_jax/_limits.py`) for docs/configuration.md.

Each constant's row comes from its source: the `#:` lines above it (what it
is, then `Why:`) and its value as written. `tests/test_limits.py` keeps the
table in the docs equal to this output.

  python scripts/limits_table.py
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "rdt_jax" / "_limits.py"


@dataclass(frozen=True)
class Limit:
  name: str
  value: str  # as written in the source
  what: str
  why: str


def limits(source: pathlib.Path = SOURCE) -> list[Limit]:
  """Every constant of `source`, in order, with its `#:` comment split at `Why:`."""
  text = source.read_text()
  lines = text.splitlines()
  out = []
  for node in ast.parse(text).body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    comment: list[str] = []
    i = node.lineno - 2
    while i >= 0 and lines[i].startswith("#:"):
      comment.insert(0, lines[i][2:].strip())
      i -= 1
    joined = " ".join(comment)
    what, _, why = joined.partition("Why:")
    assert node.value is not None
    out.append(Limit(node.target.id, ast.get_source_segment(text, node.value) or "", what.strip(), why.strip()))
  return out


def table() -> str:
  rows = ["| constant | value | what | why |", "| --- | --- | --- | --- |"]
  rows += [f"| `{x.name}` | `{x.value}` | {x.what} | {x.why} |" for x in limits()]
  return "\n".join(rows)


if __name__ == "__main__":
  print(table())
