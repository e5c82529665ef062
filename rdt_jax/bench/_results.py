"""How every benchmark, soak and measuring script writes its results file.

Compact JSON that `json.load` reads as any JSON: the structure one entry per
line, but on one line each: a list or object that holds no list or object (a
set of samples), an item of a list that holds only such values besides scalars
(one record of a table: a sample with its memory figures, a summary row), and
any value whose one-line form is short. A run of thousands of samples is as
many lines as records, not one line per number, so diffs, reviews and searches
of committed results stay readable. Imports nothing but the standard library
(no Ray).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any, Final

#: A list or object whose one-line form is at most this long stays on one line.
SHORT: Final = 100

_INDENT: Final = " "


def dumps(doc: Any, default: Callable[[Any], Any] | None = None) -> str:
  """`doc` as compact JSON text, ending with a newline.

  Args:
    doc: a JSON-serializable value (objects keep their key order).
    default: called for a value `json` cannot write, as `json.dumps`'s
      `default` is (a numpy array's `tolist`, say).

  Returns:
    Text that `json.loads` reads back equal to `json.loads(json.dumps(doc,
    default=default))`.
  """
  plain = json.loads(json.dumps(doc, default=default))  # tuples, numpy values... as JSON has them
  return _dump(plain, 0, record=False) + "\n"


def write(path: pathlib.Path | str, doc: Any, default: Callable[[Any], Any] | None = None) -> None:
  """Writes `doc` at `path` as `dumps` does, atomically (a reader sees the old
  file or the new one), creating the folders above it."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(dumps(doc, default))
  tmp.replace(path)


def _one_line(value: Any) -> str:
  return json.dumps(value, separators=(", ", ": "))


def _items(value: Any) -> list[Any]:
  return list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []


def _flat(value: Any) -> bool:
  """Whether `value` is a scalar, or a list or object of scalars only."""
  return not any(isinstance(v, (dict, list)) for v in _items(value))


def _dump(value: Any, depth: int, record: bool) -> str:
  """`value` at nesting `depth`; `record`: it is an item of a list (one line
  if it holds scalars and flat values only)."""
  line = _one_line(value)
  if _flat(value) or len(line) <= SHORT or (record and all(_flat(v) for v in _items(value))):
    return line
  inner = _INDENT * (depth + 1)
  if isinstance(value, dict):
    entries = [f"{inner}{json.dumps(k)}: {_dump(v, depth + 1, record=False)}" for k, v in value.items()]
    opening, closing = "{", "}"
  else:
    entries = [f"{inner}{_dump(v, depth + 1, record=True)}" for v in value]
    opening, closing = "[", "]"
  return opening + "\n" + ",\n".join(entries) + "\n" + _INDENT * depth + closing
