"""Benchmark figures quoted in the docs, each recomputed from the results it names.

A paragraph, list or table that quotes figures is preceded by a comment that
declares the results files it reads, each under a short alias:

  <!-- figures from full=docs/benchmarks/bench-full.json inline=docs/benchmarks/bench-inline.json -->

The block runs to the next blank line. Each figure in it (a time in s, ms or
us, a rate in GB/s, a ratio written `1.5x`) is followed, with nothing between,
by a comment that names the value it is:

  13.7x<!-- fig full: 256MiB object_store_jax/jax_nixl median -->
  94.3 ms<!-- fig full: 256MiB jax_nixl median -->

A reference is `[ALIAS:] WORD... FIELD`. Without `ALIAS:` it reads the block's
first file. A record is any JSON object of the file (the top-level raw
`samples` list excepted); the words select exactly one record that has FIELD: a
word `key=value` matches a record whose `key` is `value`, a bare word a record
holding it as any of its values, and `a|b` either. FIELD is a key of the record,
dotted into nested objects (`ratios.memcpy`), its unit suffix (`_s`, `_ms`,
`_us`) may be left off (`median` reads `median_s`). One word written `A/B` makes
the figure a ratio: the reference read with A over the reference read with B
(`object_store_jax/jax_nixl`, `mapped_ms/unmapped_ms`). Two whole references
joined by ` / ` are a ratio across files. A first word `min` or `max` lets the
words select several records and takes the least or greatest value.

The value, converted to the unit written (a field's unit is its suffix: `_s`,
`_ms`, `_us`, `gbps`; a ratio or a field without a unit is written `x`), must
round to the figure at its written precision: `13.7x` is round(value, 1),
`1.29 s` round(seconds, 2). A figure after "about", "under", "over" or "~" is
an estimate and carries no reference; `<!-- goal -->` after a figure marks a
goal the results are measured against (`at most 1.2x`). Any other figure
without a reference fails.

Tables of results are not typed: they are generated blocks
(`<!-- generated from FILE table=NAME: python scripts/sync_docs.py -->`) that
scripts/sync_docs.py writes with `TABLES[NAME]` below.

  python scripts/figures.py            # check every page, print the problems
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

REPO = pathlib.Path(__file__).resolve().parent.parent

BLOCK_MARKER = re.compile(r"^\s*<!-- figures from (?P<files>[^>]+?) -->\s*$")
FIGURE = re.compile(
    r"(?P<before>\b(?:about|under|over)\s+|~)?(?<![\w.])"
    r"(?P<value>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)\s?(?P<unit>ms|us|µs|s|GB/s|x)(?![\w/])"
    r"(?P<note><!-- (?P<ref>fig [^>]*?|goal) -->)?"
)
# Seconds per unit of a time field's suffix, and per written time unit.
TIME = {"_s": 1.0, "_ms": 1e-3, "_us": 1e-6}
WRITTEN_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
# Raw samples, which older results files do not keep: never a figure's source.
RAW = ("samples",)


class FigureError(LookupError):
  """A reference that names no value, or a value of another kind than written."""


class Block(NamedTuple):
  page: str  # the page, from the repository root
  line: int  # 1-based line of the block's marker
  files: dict[str, str]  # alias -> results file, from the repository root; the first is the default
  lines: list[str]  # the block's lines, after the marker


class Figure(NamedTuple):
  line: int  # 1-based line on the page
  start: int  # offset of the figure in its line
  end: int  # offset after its reference comment
  value: str  # as written: "1,776.85"
  unit: str
  estimate: bool
  ref: str | None  # the comment's body: "fig full: ...", "goal", or None


def pages() -> list[pathlib.Path]:
  """The pages whose figures are checked: the README, the user docs, the
  development notes and the changelog."""
  return [
      REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
      *sorted((REPO / "docs" / "development").glob("*.md")), REPO / "CHANGELOG.md",
  ]


def page_name(page: pathlib.Path) -> str:
  return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


def parse_files(text: str, where: str) -> dict[str, str]:
  """`alias=path ...` of a block marker, in order."""
  files: dict[str, str] = {}
  for word in text.split():
    alias, sep, path = word.partition("=")
    if not sep or not alias or not path:
      raise FigureError(
          f"{where}: {word!r}: a block names its results as ALIAS=PATH (full=docs/benchmarks/bench-full.json)"
      )
    files[alias] = path
  return files


def blocks(text: str, page: str) -> Iterator[Block]:
  """The figure blocks of a page's `text`."""
  lines = text.splitlines()
  for n, line in enumerate(lines):
    m = BLOCK_MARKER.match(line)
    if not m:
      continue
    body = []
    for following in lines[n + 1 :]:
      if not following.strip():
        break
      body.append(following)
    yield Block(page, n + 1, parse_files(m.group("files"), f"{page}:{n + 1}"), body)


def figures(block: Block) -> Iterator[Figure]:
  """The figures of a block, in order."""
  for i, line in enumerate(block.lines):
    for m in FIGURE.finditer(line):
      ref = m.group("ref")
      yield Figure(
          block.line + 1 + i, m.start("value"), m.end(), m.group("value"), m.group("unit"),
          bool(m.group("before")), ref,
      )


# ---- reading a value


@functools.cache
def load(path: str) -> Any:
  """A results file, parsed (paths from the repository root)."""
  full = REPO / path
  if not full.is_file():
    raise FigureError(f"{path} does not exist")
  return json.loads(full.read_text())


def records(doc: Any) -> list[dict[str, Any]]:
  """Every JSON object of a results file, the raw samples excepted."""
  out: list[dict[str, Any]] = []

  def walk(node: Any, top: bool) -> None:
    if isinstance(node, dict):
      out.append(node)
      for k, v in node.items():
        if not (top and k in RAW):
          walk(v, False)
    elif isinstance(node, list):
      for v in node:
        walk(v, False)

  walk(doc, True)
  return out


def scalar(value: Any) -> bool:
  return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def field_of(record: dict[str, Any], field: str) -> tuple[str, Any] | None:
  """(the key read, its value) for `field` of `record`: dotted into nested
  objects, the unit suffix optional; None if the record has no such number."""
  node: Any = record
  parts = field.split(".")
  for part in parts[:-1]:
    node = node.get(part) if isinstance(node, dict) else None
  last = parts[-1]
  if isinstance(node, list) and last.isdigit() and int(last) < len(node):
    value = node[int(last)]
    return (field, value) if scalar(value) and not isinstance(value, str) else None
  if not isinstance(node, dict):
    return None
  for key in (last, *(last + suffix for suffix in TIME)):
    value = node.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return ".".join([*parts[:-1], key]), value
  return None


def word_matches(record: dict[str, Any], word: str) -> bool:
  key, sep, wanted = word.partition("=")
  options = (wanted if sep else word).split("|")
  if sep:
    return scalar(record.get(key)) and str(record[key]) in options
  return any(scalar(v) and str(v) in options for v in record.values())


def unit_key(key: str) -> str:
  """The part of a dotted field that names its unit: the last with a unit
  suffix (`memcpy_ms.1x256MiB` is in ms, `link_gbps.0` in GB/s)."""
  for part in reversed(key.split(".")):
    if part.endswith((*TIME, "gbps")):
      return part
  return key


def unit_of(key: str) -> str:
  """The dimension of a field by its name: "time", "rate" or "ratio"."""
  key = unit_key(key)
  if key.endswith(tuple(TIME)):
    return "time"
  return "rate" if key.endswith("gbps") else "ratio"


def in_base_unit(key: str, value: float) -> float:
  """A time in seconds, anything else as recorded."""
  key = unit_key(key)
  for suffix, seconds in TIME.items():
    if key.endswith(suffix):
      return value * seconds
  return value


def describe(candidates: list[dict[str, Any]]) -> str:
  """The identifying values of `candidates`, by key: what a word may name."""
  keys: dict[str, list[str]] = {}
  for record in candidates:
    for k, v in record.items():
      if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool) and k not in ("n", "reps", "samples")):
        values = keys.setdefault(k, [])
        if str(v) not in values:
          values.append(str(v))
  shown = [f"{k}: {', '.join(v[:20])}{' ...' if len(v) > 20 else ''}" for k, v in keys.items() if len(v) <= 40]
  return "; ".join(shown) or "none"


def read_term(doc: Any, path: str, words: list[str]) -> tuple[str, float]:
  """(dimension, value in its base unit) of one reference without a ratio."""
  aggregate = words[0] if words and words[0] in ("min", "max") else None
  words = words[1:] if aggregate else words
  if not words:
    raise FigureError("a reference names a field, after the words that select its record")
  *selectors, field = words
  holding = [(r, found) for r in records(doc) if (found := field_of(r, field)) is not None]
  if not holding:
    raise FigureError(f"unknown statistic `{field}`: no record of {path} has a number by that name")
  for word in selectors:
    if not any(word_matches(r, word) for r, _ in holding):
      raise FigureError(
          f"unknown `{word}`: no record of {path} with `{field}` holds it "
          f"(their values: {describe([r for r, _ in holding])})"
      )
  chosen = [(r, found) for r, found in holding if all(word_matches(r, w) for w in selectors)]
  if not chosen:
    raise FigureError(f"no record of {path} with `{field}` holds all of {' '.join(selectors)}")
  if len(chosen) > 1 and aggregate is None:
    raise FigureError(
        f"{len(chosen)} records of {path} match {' '.join(words)}: add words to pick one "
        f"(their values: {describe([r for r, _ in chosen])}), or start with min or max"
    )
  dims = {unit_of(key) for _, (key, _) in chosen}
  if len(dims) > 1:
    raise FigureError(f"{' '.join(words)} reads fields of different units in {path}")
  values = [in_base_unit(key, value) for _, (key, value) in chosen]
  value = min(values) if aggregate == "min" else max(values)
  return dims.pop(), value


def read(block: Block, ref: str) -> tuple[str, float]:
  """(dimension, value) that a figure's reference `ref` (the text after
  `fig `) names: "time" in seconds, "rate" in GB/s, "ratio"."""
  return read_in(tuple(block.files.items()), ref)


@functools.cache
def read_in(files: tuple[tuple[str, str], ...], ref: str) -> tuple[str, float]:
  """`read` for a block declaring `files` (alias, path), cached: a page quotes
  one value many times."""
  block = Block("", 0, dict(files), [])
  parts = ref.split(" / ")
  if len(parts) > 2:
    raise FigureError(f"`{ref}`: a ratio of whole references has two sides")
  if len(parts) == 2:
    dims = [read(block, part) for part in parts]
    if dims[0][0] != dims[1][0]:
      raise FigureError(f"`{ref}`: a ratio of a {dims[0][0]} to a {dims[1][0]}")
    return "ratio", dims[0][1] / dims[1][1]
  alias, sep, rest = ref.partition(":")
  if not sep or " " in alias.strip():
    alias, rest = next(iter(block.files)), ref
  alias = alias.strip()
  if alias not in block.files:
    raise FigureError(f"`{alias}:` is no alias of this block (it declares {', '.join(block.files)})")
  path = block.files[alias]
  doc = load(path)
  words = rest.split()
  slashed = [i for i, w in enumerate(words) if "/" in w]
  if len(slashed) > 1:
    raise FigureError(f"`{ref}`: one word of a reference may be a ratio A/B")
  if not slashed:
    return read_term(doc, path, words)
  i = slashed[0]
  top, bottom = words[i].split("/", 1)
  (dim_top, a), (dim_bottom, b) = (read_term(doc, path, [*words[:i], w, *words[i + 1 :]]) for w in (top, bottom))
  if dim_top != dim_bottom:
    raise FigureError(f"`{ref}`: a ratio of a {dim_top} to a {dim_bottom}")
  if b == 0:
    raise FigureError(f"`{ref}`: the ratio's divisor is 0")
  return "ratio", a / b


def shown(value: float, written: str) -> bool:
  """Whether `value` rounds to `written` at its precision (commas allowed)."""
  decimals = len(written.split(".")[1]) if "." in written else 0
  target = float(written.replace(",", ""))
  return abs(value - target) <= 0.5 * 10**-decimals * (1 + 1e-9)


def value_in(dim: str, value: float, unit: str) -> float:
  """`value` of dimension `dim` in the written unit; FigureError if it is of another kind."""
  wanted = "time" if unit in WRITTEN_TIME else "rate" if unit == "GB/s" else "ratio"
  if dim != wanted:
    raise FigureError(f"the reference names a {dim}, the figure is written as a {wanted} ({unit})")
  return value / WRITTEN_TIME[unit] if dim == "time" else value


def figure_problem(block: Block, figure: Figure) -> str | None:
  """Why `figure` of `block` is not the value it names (None if it is)."""
  gap = "" if figure.unit == "x" else " "
  where = f"{block.page}:{figure.line}: {figure.value}{gap}{figure.unit}"
  if figure.ref is None:
    if figure.estimate:
      return None
    return f"{where} names no result: follow it with <!-- fig ALIAS: WORDS FIELD --> (or mark a goal <!-- goal -->)"
  if figure.ref == "goal":
    return f"{where} is an estimate: it carries no reference" if figure.estimate else None
  try:
    dim, value = read(block, figure.ref[len("fig ") :])
    shown_value = value_in(dim, value, figure.unit)
  except FigureError as e:
    return f"{where}<!-- {figure.ref} -->: {e}"
  if not shown(shown_value, figure.value):
    decimals = len(figure.value.split(".")[1]) if "." in figure.value else 0
    return (
        f"{where}<!-- {figure.ref} -->: the results hold {shown_value:,.{decimals}f}{gap}{figure.unit} "
        f"({shown_value:.6g})"
    )
  return None


def block_problems(block: Block) -> list[str]:
  """What is wrong with a block: files that do not exist, figures that are not
  what they name or name nothing."""
  problems = [
      f"{block.page}:{block.line}: {alias}={path} does not exist"
      for alias, path in block.files.items() if not (REPO / path).is_file()
  ]
  if problems:
    return problems
  found = list(figures(block))
  if not found:
    return [f"{block.page}:{block.line}: the marked block quotes no figure"]
  return [p for f in found if (p := figure_problem(block, f)) is not None]


def stray_references(text: str, page: str) -> list[str]:
  """References outside any figure block, or not right after a figure (code
  spans and fenced blocks aside)."""
  inside: set[int] = set()
  for block in blocks(text, page):
    inside.update(range(block.line + 1, block.line + 1 + len(block.lines)))
  problems = []
  fenced = False
  for n, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith(("```", "~~~")):
      fenced = not fenced
    if fenced:
      continue
    # Code spans show the notation; they reference nothing.
    line = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)
    attached = {m.start("note") for m in FIGURE.finditer(line) if m.group("note")}
    for m in re.finditer(r"<!-- (?:fig |goal -->)", line):
      if n not in inside:
        problems.append(f"{page}:{n}: a figure reference outside a block marked <!-- figures from ... -->")
      elif m.start() not in attached:
        problems.append(f"{page}:{n}: a figure reference that follows no figure (write it right after the unit)")
  return problems


def page_problems(path: pathlib.Path, text: str | None = None) -> list[str]:
  """Every problem with the figures of a page."""
  text = path.read_text() if text is None else text
  name = page_name(path)
  try:
    found = list(blocks(text, name))
  except FigureError as e:
    return [str(e)]
  return [p for b in found for p in block_problems(b)] + stray_references(text, name)


# ---- tables written from results


def ms(seconds: float) -> str:
  """A time as the benchmark pages write it: three significant digits, in s
  from one second up, in ms below."""
  if seconds >= 1:
    return f"{num(seconds)} s"
  return f"{num(seconds * 1e3)} ms"


def num(x: float) -> str:
  """Three significant digits, without exponents."""
  return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def summary(doc: dict[str, Any], case: str, path: str) -> dict[str, Any]:
  """The summary row of `path` at `case` of an `rdt-jax bench` run; `case` may
  name a variant (`fanout4:x4`)."""
  case, _, variant = case.partition(":")
  for row in doc["summary"]:
    if row["case"] == case and row["path"] == path and (row.get("variant") or "") == variant:
      return row
  raise LookupError(f"no summary row for {path} at {case}{':' + variant if variant else ''}")


FULL_CASES = [
    ("4KiB", "one 4 KiB array"), ("64MiB", "one 64 MiB array"), ("256MiB", "one 256 MiB array"),
    ("tree1000", "1,000 leaves, 64 MiB"), ("tree10000", "10,000 leaves, 64 MiB"),
    ("fanout4:x4", "one 64 MiB ref, 4 consumers"), ("refs64:batch", "64 refs x 1 MiB, one `ray.get`"),
]
FULL_PATHS = [
    ("jax_nixl", "`jax_nixl`"), ("object_store_jax", "object store, `jax.Array`"),
    ("ray_nixl_torch", "Ray's NIXL, torch"), ("object_store_numpy", "object store, NumPy"),
    ("object_store_numpy_to_jax", "object store, NumPy made `jax.Array`"),
]


def table_results(docs: list[Any]) -> list[str]:
  """The README's table: the median of each path at each case of a full run."""
  (doc,) = docs
  rows = [
      "| case | " + " | ".join(label for _, label in FULL_PATHS) + " |",
      "| --- |" + " --- |" * len(FULL_PATHS),
  ]
  for case, label in FULL_CASES:
    cells = [ms(summary(doc, case, path)["median_s"]) for path, _ in FULL_PATHS]
    rows.append(f"| {label} | " + " | ".join(cells) + " |")
  return rows


COST_PATHS = [
    ("jax_nixl", "`jax_nixl`"), ("ray_rdt_floor", "Ray's RDT floor (a transport that moves nothing)"),
    ("object_store_jax", "object store, `jax.Array`"), ("object_store_numpy", "object store, NumPy"),
    ("object_store_numpy_to_jax", "object store, NumPy made `jax.Array`"), ("ray_nixl_torch", "Ray's NIXL, torch"),
]


def table_costs(docs: list[Any]) -> list[str]:
  """docs/performance.md's table: each path's cost per object (the median of
  one 4 KiB array) and per added leaf (the overhead fit's slope)."""
  (doc,) = docs
  slopes = {row["path"]: row["slope_us"] for row in doc["overhead"]}
  rows = ["| path | per object (one 4 KiB array) | per added leaf |", "| --- | --- | --- |"]
  for path, label in COST_PATHS:
    rows.append(f"| {label} | {ms(summary(doc, '4KiB', path)['median_s'])} | {slopes[path]:.1f} us |")
  return rows


TARGETS = [
    ("1,000 leaves / object store NumPy", "<= 1.5", "tree1000", "object_store_numpy", ""),
    ("1,000 leaves / NumPy made `jax.Array`", "<= 1.0", "tree1000", "object_store_numpy_to_jax", ""),
    ("10,000 leaves / object store NumPy", "<= 1.5", "tree10000", "object_store_numpy",
     "jax's own cost of 10,000 arrays, made and read back, which the object store with NumPy does not pay (below)"),
    ("10,000 leaves / NumPy made `jax.Array`", "<= 1.0", "tree10000", "object_store_numpy_to_jax", ""),
    ("4 KiB / object store NumPy", "<= 1.5", "4KiB", "object_store_numpy",
     "Ray's floor alone is {floor}; the rest is rdt_jax's export, read, one `jax.Array` and the lifetime lookup, "
     "one GCS round trip"),
    ("256 MiB / object store NumPy", "<= 1.0", "256MiB", "object_store_numpy",
     "the kernel's cross-process copy against Ray's threaded `memcpy` (above)"),
    ("64 MiB to 4 consumers / object store NumPy", "<= 1.2", "fanout4:x4", "object_store_numpy",
     "four copies against one (above)"),
]


def ratio(doc: dict[str, Any], case: str, top: str, bottom: str) -> float:
  """`top`'s median over `bottom`'s at `case`; a `bottom` holding a colon is
  another case of the same path (`ratio(doc, "refs64:loop", "jax_nixl", "refs64:batch")`)."""
  if ":" in bottom:
    return summary(doc, case, top)["median_s"] / summary(doc, bottom, top)["median_s"]
  return summary(doc, case, top)["median_s"] / summary(doc, case, bottom)["median_s"]


def table_targets(docs: list[Any]) -> list[str]:
  """docs/performance.md's table of the plain-return targets in two runs (the
  committed one first): `jax_nixl`'s median over the other path's, and the
  batched-get ratio. The bound is "met", or what keeps the committed run from
  the goal (`{floor}`: Ray's floor over the object store with NumPy at 4 KiB,
  the other run's in parentheses)."""
  rows = ["| target | goal (ratio) | committed run | the other run | bound |", "| --- | --- | --- | --- | --- |"]
  floors = [ratio(d, "4KiB", "ray_rdt_floor", "object_store_numpy") for d in docs]
  floor = f"{floors[0]:.2f}x" + "".join(f" ({f:.2f}x)" for f in floors[1:])

  def bound(goal: str, value: float, note: str) -> str:
    limit = float(goal.split()[1])
    met = value <= limit if goal.startswith("<=") else value >= limit
    if not met and not note:
      raise LookupError(f"a missed target ({goal}, {value:.2f}) without a note saying why")
    return "met" if met else note.format(floor=floor)

  for label, goal, case, path, note in TARGETS:
    values = [ratio(d, case, "jax_nixl", path) for d in docs]
    cells = " | ".join(f"{v:.2f}x" for v in values)
    rows.append(f"| {label} | {goal} | {cells} | {bound(goal, values[0], note)} |")
  values = [ratio(d, "refs64:loop", "jax_nixl", "refs64:batch") for d in docs]
  cells = " | ".join(f"{v:.2f}x" for v in values)
  rows.append(f"| 64 refs: one by one / one `ray.get` | >= 1.5 | {cells} | {bound('>= 1.5', values[0], '')} |")
  return rows


def table_trainers(docs: list[Any]) -> list[str]:
  """docs/weight_sync.md's table: a version's time by trainer processes and generators."""
  (doc,) = docs
  rows = [
      "| tree | trainer processes | 1 generator | 2 generators | 4 generators |",
      "| --- | --- | --- | --- | --- |",
  ]
  by = {(r["case"], r["trainers"], r["generators"]): r["rdt_ms"] for r in doc["rows"]}
  for case, label in (("1000x64MiB", "1,000 leaves, 64 MiB"), ("1x256MiB", "one 256 MiB leaf")):
    for trainers in (1, 2, 4):
      cells = [f"{by[case, trainers, g]:g} ms" for g in (1, 2, 4)]
      rows.append(f"| {label} | {trainers} | " + " | ".join(cells) + " |")
  return rows


GPU_CASES = [
    ("1x4KiB", "one 4 KiB leaf", "fixed cost under 2 ms"), ("1x256MiB", "one 256 MiB leaf", "at most 0.2x"),
    ("1000x64MiB", "1,000 leaves, 64 MiB", "at most 0.5x"), ("10000x64MiB", "10,000 leaves, 64 MiB", ""),
]


def gpu_target(target: str, rdt: list[float], store: list[float]) -> str:
  """`target: met` or `target: missed`: a fixed cost bounds rdt_jax's time in
  ms, "at most R" its ratio to the store's."""
  if not target:
    return "-"
  bound = float(re.findall(r"[\d.]+", target)[0])
  met = max(rdt) < bound if target.endswith("ms") else max(a / b for a, b in zip(rdt, store)) <= bound
  return f"{target}: {'met' if met else 'missed'}"


def table_gpu_weights(docs: list[Any]) -> list[str]:
  """docs/weight_sync.md's table of a GPU weight-sync run: per case and number
  of generators, rdt_jax's publish and pull against the object store."""
  (doc,) = docs
  rows = ["| tree | generators | rdt publish + pull | store | ratio | target |", "|" + " --- |" * 6]
  sync = {(r["case"], r["generators"], r["path"]): r["sync_ms"] for r in doc["rows"] if r["kinds"].startswith("torch")}
  for case, label, target in GPU_CASES:
    gens = [g for g in (1, 2, 4) if (case, g, "rdt") in sync]
    rdt = [sync[case, g, "rdt"] for g in gens]
    store = [sync[case, g, "store"] for g in gens]
    ratios = [f"{a / b:.2f}x" for a, b in zip(rdt, store)]
    ratio = f"{ratios[0]} each" if len(ratios) > 1 and len(set(ratios)) == 1 else " / ".join(ratios)
    rows.append(
        f"| {label} | {' / '.join(map(str, gens))} | {' / '.join(f'{v:g}' for v in rdt)} ms "
        f"| {' / '.join(f'{v:g}' for v in store)} ms | {ratio} | {gpu_target(target, rdt, store)} |"
    )
  return rows


TABLES: dict[str, Callable[[list[Any]], list[str]]] = {
    "results": table_results, "costs": table_costs, "targets": table_targets,
    "trainers": table_trainers, "gpu-weights": table_gpu_weights,
}


def table(name: str, sources: list[str]) -> list[str]:
  """The lines of table `name` written from the results files `sources`."""
  if name not in TABLES:
    raise LookupError(f"no table {name!r}: the tables are {', '.join(TABLES)}")
  return TABLES[name]([load(s) for s in sources])


def main() -> int:
  problems = [p for page in pages() for p in page_problems(page)]
  print("\n".join(problems) or "every figure is the value it names")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
