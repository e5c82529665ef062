"""The docs build with warnings as errors, and every code block in them is checked.

The rule for README.md and docs/*.md: a fenced code block is one of

* **an example's code**: an HTML comment `<!-- example: examples/NAME.py -->`
  right before the block says which file it shows; the block must equal that
  file, or the part the comment's options select (the names of Sphinx's
  `literalinclude` options):

      <!-- example: examples/pipeline.py pyobject=JaxStage.init_params -->
      <!-- example: examples/pipeline.py start-after="# docs: begin three-hop" end-before="# docs: end three-hop" -->

  `pyobject` is a dotted name of a top-level function or class, or of a method
  (its decorators included); `start-at`/`start-after` and `end-at`/`end-before`
  select from the first line containing the text. The selection is dedented.
  The file must be an example `tests/test_examples.py` runs.
* **an example's output**: `<!-- output: examples/NAME.py -->` before the
  block; the block must equal what that example printed when
  `tests/test_examples.py` ran it (the same run: `test_examples.run_example`
  runs each example once per pytest process). In the block, `...` stands for
  any text within a line, and a line holding only `...` for any number of
  lines: for timings and other figures that change from run to run.
* **illustrative**: `<!-- illustrative -->` before the block marks code the
  tests do not run (install commands, fragments of a class). A Python block
  must still parse.
* a `{doctest}` (or `{testcode}`/`{testoutput}`) block, run by Sphinx's doctest
  builder here, exception messages included.

Blocks that hold no code are allowed: `{toctree}`, `{eval-rst}` holding only
autodoc directives, `{include}` of the files `rdt-jax bench` writes to
docs/benchmarks/ or `scripts/matrix.sh` writes to docs/matrix/, and `text`
blocks (diagrams) without Python in them. Admonitions are checked recursively.
Anything else fails, naming the page and line.

Also checked: the docs index lists every page, the pages hold no development
history (issue numbers, commit hashes, test-status notes), the API page documents
exactly `rdt_jax.__all__`, and each committed benchmark page under
docs/benchmarks/ is exactly what the generator writes from the JSON beside it.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap
from typing import NamedTuple

import pytest

import rdt_jax
import test_examples

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# Pages the code-block rules apply to: the docs and the README.
READ_PAGES = [REPO / "README.md", *PAGES]

DOCTEST_DIRECTIVES = {"doctest", "testcode", "testoutput", "testsetup", "testcleanup"}
ADMONITIONS = {
    "admonition", "attention", "caution", "danger", "error", "hint", "important",
    "note", "seealso", "tip", "warning",
}
AUTODOC_LINE = re.compile(
    r"^(\.\. auto(function|class|exception|data|method|attribute)::\s+\S+|\s+:[\w-]+:.*)$"
)
MARKER = re.compile(r"^<!--\s*(example|output|illustrative)\b:?\s*(.*?)\s*-->\s*$", re.S)
SELECT_OPTIONS = {"pyobject", "start-at", "start-after", "end-at", "end-before"}
# User docs hold no development history (the project's check, as a test).
HISTORY = re.compile(r"\b[Ii]ssue [0-9]+|\b(commit|at) [0-9a-f]{7,12}\b|tested here|not in the suite")


def page_name(page: pathlib.Path) -> str:
  return str(page.relative_to(REPO))


# ---- the Sphinx builds


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> pathlib.Path:
  """One directory for both builds: the doctest build reuses the html build's
  parsed doctrees instead of reading every page again."""
  return tmp_path_factory.mktemp("docs")


def sphinx_build(builder: str, out: pathlib.Path) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", builder,
       "-d", str(out / "doctrees"), str(DOCS), str(out / builder)],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
  )


def test_html_build_has_no_warnings(build_dir):
  proc = sphinx_build("html", build_dir)
  assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stdout + proc.stderr
  assert (build_dir / "html" / "index.html").exists()


def test_doctests_pass(build_dir):
  proc = sphinx_build("doctest", build_dir)
  report = (build_dir / "doctest" / "output.txt").read_text()
  assert proc.returncode == 0, proc.stdout + proc.stderr + report
  assert "0 failures in tests" in report, report
  # Each page with doctest blocks really ran them.
  for page in PAGES:
    if any(b.kind in DOCTEST_DIRECTIVES for b in code_blocks(page)):
      assert f"Document: {page.stem}\n" in report, f"{page.name}: no doctest ran\n{report}"


def test_index_lists_every_page():
  index = (DOCS / "index.md").read_text()
  listed = set(re.findall(r"^([\w/-]+)$", index, re.M))
  missing = [p.stem for p in PAGES if p.stem != "index" and p.stem not in listed]
  assert not missing, f"docs/index.md's toctrees do not list: {missing}"


# ---- code blocks


class Block(NamedTuple):
  kind: str  # directive name ("doctest"), fence language ("python", "" for none), "indented"
  argument: str  # a directive's argument
  body: str
  line: int  # 1-based line of the fence on its page
  marker: tuple[str, str] | None  # ("example" | "output" | "illustrative", its text)


def md_parser():
  from markdown_it.renderer import RendererHTML
  from myst_parser.config.main import MdParserConfig
  from myst_parser.parsers.mdit import create_md_parser

  return create_md_parser(
      MdParserConfig(enable_extensions={"colon_fence", "deflist"}), RendererHTML
  )


def split_directive(content: str) -> tuple[list[str], str]:
  """A directive body's leading `:option:` lines and the rest."""
  lines = content.splitlines()
  options = []
  while lines and lines[0].startswith(":"):
    options.append(lines.pop(0))
  return options, "\n".join(lines)


def code_blocks(page: pathlib.Path, text: str | None = None, offset: int = 0):
  """Every code block on `page` (a `Block`), recursing into admonitions; each
  with the `<!-- ... -->` marker right before it, if any."""
  text = page.read_text() if text is None else text
  marker = None
  for token in md_parser().parse(text):
    if token.type == "html_block":
      m = MARKER.match(token.content.strip())
      marker = (m.group(1), m.group(2)) if m else None
      continue
    if token.type not in ("fence", "colon_fence", "code_block"):
      if token.type not in ("list_item_open", "bullet_list_open", "ordered_list_open"):
        marker = None
      continue
    line = offset + (token.map[0] + 1 if token.map else 0)
    this_marker, marker = marker, None
    if token.type == "code_block":
      yield Block("indented", "", token.content, line, this_marker)
      continue
    m = re.match(r"^\{([\w:-]+)\}\s*(.*)$", token.info.strip())
    if m is None:
      yield Block(token.info.strip().split(" ")[0], "", token.content, line, this_marker)
      continue
    kind, argument = m.group(1), m.group(2)
    if kind in ADMONITIONS:
      options, body = split_directive(token.content)
      yield from code_blocks(page, body, line + len(options))
    else:
      yield Block(kind, argument, token.content, line, this_marker)


def parse_example_marker(text: str) -> tuple[str, dict[str, str]]:
  """`examples/x.py opt=value ...` -> (script under examples/, options)."""
  path, *words = shlex.split(text)
  if not path.startswith("examples/"):
    raise ValueError(f"{path}: an example marker names a file under examples/")
  options = {}
  for word in words:
    key, sep, value = word.partition("=")
    if not sep or key not in SELECT_OPTIONS:
      raise ValueError(f"{word!r}: options are {sorted(SELECT_OPTIONS)}, as key=value")
    options[key] = value
  return path.removeprefix("examples/"), options


def python_object_lines(source: str, dotted: str) -> tuple[int, int]:
  """0-based [start, stop) lines of the function or class `dotted` in `source`,
  decorators included."""
  body: list[ast.stmt] = ast.parse(source).body
  node: ast.stmt | None = None
  for name in dotted.split("."):
    node = next(
        (n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
         and n.name == name),
        None,
    )
    if node is None:
      raise LookupError(f"no function or class {dotted!r}")
    body = getattr(node, "body", [])
  assert node is not None and node.end_lineno is not None
  decorators = getattr(node, "decorator_list", [])
  first = min([node.lineno, *(d.lineno for d in decorators)])
  return first - 1, node.end_lineno


def select(source: str, options: dict[str, str]) -> str:
  """The part of `source` the `literalinclude`-style `options` select, dedented."""
  lines = source.splitlines()
  start, stop = 0, len(lines)
  if "pyobject" in options:
    start, stop = python_object_lines(source, options["pyobject"])

  def find(text: str, begin: int) -> int:
    for i in range(begin, stop):
      if text in lines[i]:
        return i
    raise LookupError(f"no line containing {text!r}")

  if "start-at" in options:
    start = find(options["start-at"], start)
  elif "start-after" in options:
    start = find(options["start-after"], start) + 1
  if "end-at" in options:
    stop = find(options["end-at"], start) + 1
  elif "end-before" in options:
    stop = find(options["end-before"], start)
  return textwrap.dedent("\n".join(lines[start:stop]))


def output_pattern(expected: str) -> re.Pattern:
  """`expected` as a regular expression: `...` is any text within a line; a
  line holding only `...` is any number of lines."""
  parts = []
  for line in expected.splitlines():
    if line.strip() == "...":
      parts.append(r"(?:[^\n]*\n)*?")
    else:
      parts.append(r"[^\n]*?".join(re.escape(p) for p in line.split("...")) + r"\n")
  return re.compile("".join(parts))


def check_block(page: pathlib.Path, block: Block) -> str | None:
  """What is wrong with `block` (None if nothing), except example outputs,
  which `test_output_blocks_match_what_the_examples_print` checks."""
  if block.marker is not None:
    kind, text = block.marker
    if kind == "example":
      try:
        script, options = parse_example_marker(text)
        test_examples.example_for(script)
        shown = select((test_examples.EXAMPLES_DIR / script).read_text(), options)
      except (ValueError, LookupError, OSError) as e:
        return f"example marker {text!r}: {e}"
      if block.body.rstrip("\n") != shown.rstrip("\n"):
        return f"differs from examples/{script} {options or ''}; it should read:\n{shown}"
      return None
    if kind == "output":
      try:
        test_examples.example_for(text.removeprefix("examples/"))
      except KeyError as e:
        return str(e)
      return None
    if block.kind in ("python", "py"):
      try:
        ast.parse(block.body)
      except SyntaxError as e:
        return f"illustrative Python block does not parse: {e}"
    return None
  if block.kind in DOCTEST_DIRECTIVES or block.kind == "toctree":
    return None
  if block.kind == "eval-rst":
    bad = [line for line in block.body.splitlines() if line.strip() and not AUTODOC_LINE.match(line)]
    return f"eval-rst may hold autodoc directives only, not {bad[0]!r}" if bad else None
  if block.kind == "include":
    if not block.argument.startswith(("benchmarks/", "matrix/")):
      return f"include of {block.argument}; only docs/benchmarks/ and docs/matrix/ files"
    return None
  if block.kind == "text":
    if re.search(r"^\s*(>>>|import |from \w+ import |def |class )", block.body, re.M):
      return "a text block holding Python; show an example file or doctest it"
    return None
  return (
      f"code block ({block.kind or 'no language'}) without a marker: mark it "
      "<!-- example: examples/... -->, <!-- output: examples/... --> or "
      "<!-- illustrative -->, or make it a {doctest} block"
  )


@pytest.mark.parametrize("page", READ_PAGES, ids=page_name)
def test_every_code_block_is_an_example_doctested_or_marked(page):
  problems = []
  blocks = list(code_blocks(page))
  for block in blocks:
    problem = check_block(page, block)
    if problem:
      problems.append(f"{page_name(page)}:{block.line}: {problem}")
  markers = len(re.findall(r"^<!--\s*(?:example|output|illustrative)\b", page.read_text(), re.M))
  if markers != sum(b.marker is not None for b in blocks):
    problems.append(f"{page_name(page)}: an example/output/illustrative marker is not right before a code block")
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", READ_PAGES, ids=page_name)
def test_no_directive_hides_code_from_a_reader(page):
  """Code and its output are in the page itself: no `literalinclude`."""
  hidden = [b.line for b in code_blocks(page) if b.kind == "literalinclude"]
  assert not hidden, f"{page_name(page)}: literalinclude at lines {hidden}; show the code in the page"


def output_blocks() -> list[tuple[str, int, str, str]]:
  """(page, line, script, expected output) of every example-output block."""
  return [
      (page_name(page), block.line, block.marker[1].removeprefix("examples/"), block.body)
      for page in READ_PAGES
      for block in code_blocks(page)
      if block.marker is not None and block.marker[0] == "output"
  ]


@pytest.mark.parametrize(
    "page, line, script, expected", output_blocks(), ids=[f"{p}:{n}" for p, n, _, _ in output_blocks()]
)
def test_output_blocks_match_what_the_examples_print(page, line, script, expected):
  proc = test_examples.run_example(test_examples.example_for(script))
  assert proc.returncode == 0, f"examples/{script} failed:\n{proc.stderr[-4000:]}"
  assert output_pattern(expected).fullmatch(proc.stdout), (
      f"{page}:{line}: the output shown differs from what examples/{script} printed:\n{proc.stdout}"
  )


def test_output_pattern_wildcards():
  assert output_pattern("a ... b\n").fullmatch("a 1.5 ms b\n")
  assert not output_pattern("a ... b\n").fullmatch("a 1\n2 b\n")
  assert output_pattern("x\n...\ny\n").fullmatch("x\n1\n2\ny\n")
  assert output_pattern("x\n...\ny\n").fullmatch("x\ny\n")
  assert not output_pattern("x (1)\n").fullmatch("x 1\n")


def test_pyobject_selection_includes_decorators():
  source = "import a\n\n\n@dec\nclass C:\n  @staticmethod\n  def f():\n    return 1\n\n  def g(self):\n    pass\n"
  assert select(source, {"pyobject": "C.f"}) == "@staticmethod\ndef f():\n  return 1"
  assert select(source, {"pyobject": "C", "end-before": "def g"}).startswith("@dec\nclass C:")


# ---- what the pages say


HISTORY_PAGES = READ_PAGES


@pytest.mark.parametrize("page", HISTORY_PAGES, ids=page_name)
def test_user_docs_hold_no_development_history(page):
  hits = [
      f"{page_name(page)}:{n}: {line.strip()}"
      for n, line in enumerate(page.read_text().splitlines(), 1)
      if HISTORY.search(line)
  ]
  assert not hits, "issue numbers, commit hashes or test-status notes in user docs:\n" + "\n".join(hits)


def test_api_page_documents_exactly_the_public_names():
  text = (DOCS / "api.md").read_text()
  directive = r"^\.\. auto(?:function|class|exception)::\s+rdt_jax\.(\w+)\s*$"
  documented = re.findall(directive, text, re.M)
  assert sorted(documented) == sorted(rdt_jax.__all__), (
      f"api.md documents {sorted(documented)}, rdt_jax.__all__ is {sorted(rdt_jax.__all__)}"
  )
  assert len(documented) == len(set(documented)), "a name is documented twice"


def test_tests_named_in_the_docs_exist():
  """A page that names a test (`tests/test_x.py::test_y`) names one that exists."""
  defined: dict[str, set[str]] = {}
  for path in (REPO / "tests").glob("test_*.py"):
    tree = ast.parse(path.read_text())
    defined[path.name] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
  missing = []
  for page in READ_PAGES:
    for module, name in re.findall(r"(test_\w+\.py)::(test_\w+)", page.read_text()):
      if name not in defined.get(module, set()):
        missing.append(f"{page.name}: {module}::{name}")
  assert not missing, "docs name tests that do not exist:\n" + "\n".join(missing)


# ---- committed benchmark pages


@pytest.mark.parametrize(
    "page",
    sorted((DOCS / "benchmarks").glob("bench-*.md")) + sorted((DOCS / "benchmarks" / "gpu").glob("bench-*.md")),
    ids=lambda p: str(p.relative_to(DOCS / "benchmarks")),
)
def test_benchmark_pages_are_what_the_generator_writes(page):
  """A committed benchmark page is exactly what `rdt-jax bench` writes from the
  committed JSON beside it: no figure or heading is edited by hand."""
  from rdt_jax.bench import _report, _reshard, _twohost, _weights  # imports Ray: only here

  doc = json.loads(page.with_suffix(".json").read_text())
  generate = {
      "bench-reshard": _reshard.markdown, "bench-weight-sync": _weights.markdown,
      "bench-weight-sync-gpu": _weights.markdown, "bench-twohost": _twohost.markdown,
  }.get(page.stem, _report.markdown)
  assert generate(doc) == page.read_text(), f"{page.name} differs from what the generator writes from its JSON"
