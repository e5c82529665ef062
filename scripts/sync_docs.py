"""Refreshes the generated blocks of the docs: copies of files that other
commands write (benchmark tables under docs/benchmarks/, the version matrix
under docs/matrix/), kept inline so that each page reads completely as a file.

  python scripts/sync_docs.py          # refresh every block in README.md and docs/*.md
  python scripts/sync_docs.py --check  # exit 1, naming the pages, if a block differs

A block sits between two comments, with the marker's indentation (a block inside
a list item is indented with it):

  <!-- generated from docs/benchmarks/bench-cma.md start-line=1: python scripts/sync_docs.py -->
  ...the selected part of the file...
  <!-- end generated -->

The options select from the source file as the options of the same names of
Sphinx's `include` directive do: `start-line=N` drops the first N lines,
`start-after=TEXT` keeps what follows the first occurrence of TEXT and
`end-before=TEXT` what precedes the next one; `literal` shows the selection as
a `text` code block instead of as Markdown. A source that is a Python script
(`scripts/gpu_age.py`) is run, not read: the block is what its `text()`
returns, and where the script raises its `Unavailable` (what it computes from
is not in this checkout) the block is left as it is, with a note. `table=NAME` writes a table of
results from FILE, a JSON results file (several, comma-separated, where the
table compares runs), with scripts/figures.py's `TABLES[NAME]`:

  <!-- generated from docs/benchmarks/bench-full.json table=results: python scripts/sync_docs.py -->

tests/test_docs.py fails when a block differs from what this script writes.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import shlex
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

REPO = pathlib.Path(__file__).resolve().parent.parent
REFRESH = "python scripts/sync_docs.py"
OPEN = re.compile(
    r"^(?P<indent>[ \t]*)<!-- generated from (?P<source>\S+)(?P<options>.*?): python scripts/sync_docs\.py -->$"
)
END = re.compile(r"^[ \t]*<!-- end generated -->$")
OPTIONS = {"start-line", "start-after", "end-before", "literal", "table"}


class SourceUnavailable(LookupError):
  """A script source cannot compute its block in this checkout (its `Unavailable`)."""


class Block(NamedTuple):
  source: str  # path of the source file, from the repository root
  options: dict[str, str]
  indent: str
  start: int  # 0-based line of the opening comment
  end: int  # 0-based line of the closing comment


def figures() -> Any:
  """scripts/figures.py, which writes the tables of results."""
  spec = importlib.util.spec_from_file_location("scripts_figures", REPO / "scripts" / "figures.py")
  assert spec is not None and spec.loader is not None
  module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
  if not hasattr(module, "TABLES"):
    spec.loader.exec_module(module)
  return module


def pages() -> list[pathlib.Path]:
  """The pages that may hold generated blocks."""
  return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def parse_options(text: str) -> dict[str, str]:
  options = {}
  for word in shlex.split(text):
    key, sep, value = word.partition("=")
    if key not in OPTIONS or (key == "literal") == bool(sep):
      raise ValueError(f"{word!r}: options are start-line=N, start-after=TEXT, end-before=TEXT, literal, table=NAME")
    options[key] = value
  return options


def blocks(text: str, page: str) -> Iterator[Block]:
  """Every generated block of a page's `text`."""
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    m = OPEN.match(lines[i])
    if m is None:
      if END.match(lines[i]):
        raise ValueError(f"{page}:{i + 1}: an end-generated comment without its opening comment")
      i += 1
      continue
    end = next((j for j in range(i + 1, len(lines)) if END.match(lines[j]) or OPEN.match(lines[j])), None)
    if end is None or not END.match(lines[end]):
      raise ValueError(f"{page}:{i + 1}: a generated block without its closing <!-- end generated -->")
    yield Block(m.group("source"), parse_options(m.group("options")), m.group("indent"), i, end)
    i = end + 1


def select(text: str, options: dict[str, str]) -> str:
  """The part of a source file's `text` the options select."""
  if "start-line" in options:
    text = "".join(text.splitlines(keepends=True)[int(options["start-line"]) :])
  if "start-after" in options:
    at = text.find(options["start-after"])
    if at < 0:
      raise LookupError(f"no {options['start-after']!r}")
    text = text[at + len(options["start-after"]) :]
  if "end-before" in options:
    at = text.find(options["end-before"])
    if at < 0:
      raise LookupError(f"no {options['end-before']!r}")
    text = text[:at]
  return text.strip("\n")


def source_text(source: str) -> str:
  """The text of a block's source: the file, or what a script source's
  `text()` returns.

  Raises:
    LookupError: if the source does not exist.
    SourceUnavailable: if a script source raised its `Unavailable`.
  """
  path = REPO / source
  if not path.is_file():
    raise LookupError(f"{source} does not exist")
  if path.suffix != ".py":
    return path.read_text()
  spec = importlib.util.spec_from_file_location(f"_sync_source_{path.stem}", path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # a dataclass in the script looks its module up there
  spec.loader.exec_module(module)
  try:
    return module.text()
  except module.Unavailable as e:
    raise SourceUnavailable(f"{source}: {e}") from None


def body(block: Block) -> list[str]:
  """The lines between a block's two comments, as this script writes them.

  Raises:
    LookupError: if the source does not exist or the selection is not in it.
    SourceUnavailable: if a script source cannot compute its text here.
  """
  if "table" in block.options:
    return ["", *(block.indent + line for line in figures().table(block.options["table"], block.source.split(","))), ""]
  lines = select(source_text(block.source), block.options).splitlines()
  if "literal" in block.options:
    fence = "`" * max([3, *(len(m) + 1 for line in lines for m in re.findall(r"`{3,}", line))])
    lines = [f"{fence}text", *lines, fence]
  return ["", *(block.indent + line if line.strip() else "" for line in lines), ""]


def refresh(text: str, page: str, notes: list[str] | None = None) -> str:
  """`text` (a page) with every generated block rewritten from its source; a
  block whose script source is unavailable here is kept as it is, and said so
  in `notes`."""
  lines = text.splitlines()
  out: list[str] = []
  done = 0
  for block in blocks(text, page):
    out += lines[done : block.start + 1]
    try:
      out += body(block)
    except SourceUnavailable as e:
      out += lines[block.start + 1 : block.end]
      if notes is not None:
        notes.append(f"{page}:{block.start + 1}: left as it is: {e}")
    except LookupError as e:
      raise LookupError(f"{page}:{block.start + 1}: {e}") from None
    done = block.end
  out += lines[done:]
  return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if a block differs from its source")
  args = parser.parse_args()
  stale: list[str] = []
  notes: list[str] = []
  for path in pages():
    name = str(path.relative_to(REPO))
    text = path.read_text()
    new = refresh(text, name, notes)
    if new != text:
      stale.append(name)
      if not args.check:
        path.write_text(new)
  for note in notes:
    print(note, file=sys.stderr)
  if args.check and stale:
    print(f"generated blocks differ from their sources in {', '.join(stale)}: run {REFRESH}", file=sys.stderr)
    return 1
  for name in stale:
    print(f"refreshed {name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
