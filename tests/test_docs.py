"""The docs build with warnings as errors, read completely as files, and every
code block in them is checked.

Every page reads completely as a file (README.md and docs/*.md, read on a
repository host or in an editor, show what the built site shows):

* no directive pulls content from elsewhere (`include`, `literalinclude`,
  `eval-rst`, autodoc), and no page holds only directives. docs/api.md is
  Markdown that `python scripts/api_reference.py` writes from the docstrings;
  a copy of a file another command writes (benchmark tables, the version matrix)
  sits inline between `<!-- generated from FILE ...: python scripts/sync_docs.py -->`
  and `<!-- end generated -->`, and must equal what `scripts/sync_docs.py` writes
  from that file;
* every link resolves as a file: a relative link names a file that exists, and
  its `#fragment` is a heading of that file (as a repository host makes anchors
  of headings) or an HTML anchor `<a id="..."></a>` in it; no MyST role
  (`{ref}`, `{doc}`, `{py:func}`, ...). docs/conf.py makes each HTML anchor a
  target Sphinx resolves too, so `api.md#rdt_jax.register` works in both.

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

Blocks that hold no code are allowed: `{toctree}`, and `text` blocks (diagrams,
copies of text files) without Python in them. Admonitions are checked
recursively. Anything else fails, naming the page and line.

The README's Python blocks that are not illustrative run, as scripts (an
example's code is run once, by `test_examples.run_example`), and its public
table lists exactly `rdt_jax.__all__`, each call form matching the signature.

Also checked: the docs index lists every page, the pages hold no development
history (issue numbers, commit hashes, test-status notes), docs/api.md is what
its script writes and documents exactly `rdt_jax.__all__`, and each committed
benchmark page under docs/benchmarks/ is exactly what the generator writes from
the JSON beside it. Each benchmark figure quoted in a marked block of the README,
docs/, docs/development/ or CHANGELOG.md names the value of a results file it
is, and equals it at its written precision (scripts/figures.py).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from typing import NamedTuple

import pytest

import rdt_jax
import test_examples
from _helpers import clean_env, load_script

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
# Directives whose content a reader of the file does not see: it comes from
# another file, or from the code (autodoc), or is reST.
HIDING_DIRECTIVES = re.compile(r"^(include|literalinclude|eval-rst|eval-md|auto\w+|py:\w+)$")
MARKER = re.compile(r"^<!--\s*(example|output|illustrative)\b:?\s*(.*?)\s*-->\s*$", re.S)
SELECT_OPTIONS = {"pyobject", "start-at", "start-after", "end-at", "end-before"}
# User docs hold no development history (the project's check, as a test).
HISTORY = re.compile(r"\b[Ii]ssue [0-9]+|\b(commit|at) [0-9a-f]{7,12}\b|tested here|not in the suite")


def page_name(page: pathlib.Path) -> str:
  return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


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


@pytest.mark.slow
def test_html_build_has_no_warnings(build_dir):
  proc = sphinx_build("html", build_dir)
  assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stdout + proc.stderr
  assert (build_dir / "html" / "index.html").exists()


@pytest.mark.slow
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
  if HIDING_DIRECTIVES.match(block.kind):
    return f"{{{block.kind}}} hides its content from a reader of the file (see test_page_reads_completely_as_a_file)"
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


def output_blocks() -> list[tuple[str, int, str, str]]:
  """(page, line, script, expected output) of every example-output block."""
  return [
      (page_name(page), block.line, block.marker[1].removeprefix("examples/"), block.body)
      for page in READ_PAGES
      for block in code_blocks(page)
      if block.marker is not None and block.marker[0] == "output"
  ]


@pytest.mark.ray  # runs the examples, which start Ray
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


# ---- every page reads completely as a file


def all_tokens(tokens):
  """`tokens` and their inline children, depth first."""
  for token in tokens:
    yield token
    if token.children:
      yield from all_tokens(token.children)


def page_tokens(text: str):
  """Every token of a page, with the bodies of admonitions parsed too (they
  hold Markdown; other directives' bodies do not)."""
  for token in all_tokens(md_parser().parse(text)):
    yield token
    if token.type in ("fence", "colon_fence"):
      m = re.match(r"^\{([\w:-]+)\}", token.info.strip())
      if m and m.group(1) in ADMONITIONS:
        yield from page_tokens(split_directive(token.content)[1])


@functools.cache
def file_anchors(path: pathlib.Path) -> frozenset[str]:
  """The `#fragment`s that resolve in `path` read as a file on a repository
  host: each heading's GitHub-style slug (a repeated one numbered), and the ids
  of HTML anchors."""
  from myst_parser.slugs import github_slugify

  text = path.read_text()
  anchors = set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))
  seen: dict[str, int] = {}
  tokens = list(page_tokens(text))
  for i, token in enumerate(tokens):
    if token.type != "heading_open":
      continue
    inline = tokens[i + 1]
    title = "".join(c.content for c in all_tokens(inline.children or []) if c.type in ("text", "code_inline"))
    slug = github_slugify(title)
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return frozenset(anchors)


def link_problem(page: pathlib.Path, href: str) -> str | None:
  """Why `href`, a link on `page`, does not resolve when the page is read as a
  file (None if it does)."""
  if re.match(r"^(https?|mailto):", href):
    return None
  if re.match(r"^[\w+.-]+:", href):
    return "a link only Sphinx resolves (a MyST link scheme)"
  path, _, fragment = href.partition("#")
  target = (page.parent / path).resolve() if path else page
  if not target.exists():
    return f"{path} does not exist"
  if fragment:
    if target.suffix != ".md":
      return "a fragment of a file that is not Markdown"
    if fragment not in file_anchors(target):
      return (
          f"#{fragment} is neither a heading nor an HTML anchor of {page_name(target)} "
          "(it resolves only in Sphinx, if at all): link a heading's anchor, or add <a id=...></a>"
      )
  return None


def reading_problems(page: pathlib.Path) -> list[str]:
  """What a reader of `page` as a file would miss."""
  name = page_name(page)
  problems = [
      f"{name}:{b.line}: {{{b.kind}}} {b.argument} hides its content from a reader of the file"
      + (f"; inline it between generated comments ({SYNC_DOCS})" if b.kind == "include" else "")
      for b in code_blocks(page)
      if HIDING_DIRECTIVES.match(b.kind)
  ]
  text = page.read_text()
  tokens = list(page_tokens(text))
  prose = [
      t for t in tokens
      if t.type in ("paragraph_open", "bullet_list_open", "ordered_list_open", "table_open", "blockquote_open")
      or (t.type in ("fence", "code_block") and not t.info.strip().startswith("{"))
  ]
  if not prose:
    problems.append(f"{name}: holds only headings and directives; a reader of the file sees nothing")
  for token in tokens:
    if token.type == "myst_role":
      problems.append(f"{name}: the role {{{token.meta.get('name')}}}`{token.content}` resolves only in Sphinx")
    for attr in ("href", "src"):
      value = token.attrGet(attr) if token.type in ("link_open", "image") else None
      if isinstance(value, str) and (problem := link_problem(page, value)):
        problems.append(f"{name}: link ({value}): {problem}")
  return problems


SYNC_DOCS = "python scripts/sync_docs.py"
API_REFERENCE = "python scripts/api_reference.py"


@pytest.mark.parametrize("page", READ_PAGES, ids=page_name)
def test_page_reads_completely_as_a_file(page):
  """No directive hides content (include, literalinclude, eval-rst, autodoc),
  the page holds more than directives, and every link resolves as a file."""
  problems = reading_problems(page)
  assert not problems, "\n".join(problems)


def test_reading_problems_are_found(tmp_path):
  """The check of `test_page_reads_completely_as_a_file` finds what it is for."""
  (tmp_path / "other.md").write_text("# Other page\n\n<a id=\"rdt_jax.x\"></a>\n\n## Twice\n\n## Twice\n")
  page = tmp_path / "page.md"
  page.write_text(
      "# A page\n\nSee [a](other.md#rdt_jax.x), [b](other.md#twice-1), [c](#a-page), [d](https://x.org).\n"
  )
  assert reading_problems(page) == []
  page.write_text("# Reference\n\n```{eval-rst}\n.. autofunction:: rdt_jax.register\n```\n")
  found = "\n".join(reading_problems(page))
  assert "{eval-rst}" in found and "holds only headings and directives" in found
  page.write_text(
      "# A page\n\n[x](#rdt_jax.register), {ref}`target`, [y](other.md#nothing), [z](gone.md)\n\n"
      "```{include} other.md\n```\n"
  )
  found = "\n".join(reading_problems(page))
  assert "#rdt_jax.register is neither" in found and "{ref}`target`" in found
  assert "#nothing is neither" in found and "gone.md does not exist" in found and "{include}" in found


def test_api_reference_is_what_its_script_writes():
  """docs/api.md is generated from the docstrings, so that it reads as a file."""
  expected = load_script("api_reference").render()
  assert (DOCS / "api.md").read_text() == expected, f"docs/api.md is out of date: run {API_REFERENCE}"


def test_ray_internals_table_is_what_its_script_writes():
  """docs/ray_integration.md's table of Ray internals is generated from the
  seam's docstrings: a wrap added or changed shows up there."""
  page = (DOCS / "ray_integration.md").read_text()
  assert page == load_script("ray_internals").render(page), (
      "docs/ray_integration.md is out of date: run python scripts/ray_internals.py"
  )


def test_every_wrap_of_ray_says_what_why_and_when_it_goes():
  """Each function of the seam that wraps a Ray function names what it
  touches, why, and the upstream change that would retire it."""
  script = load_script("ray_internals")
  wraps = [
      (room, name, fn) for room in script.ROOMS for name, fn in script.functions(room)
      if name.lstrip("_").startswith("wrap_")
  ]
  assert len(wraps) >= 10  # one wrap function may wrap two Ray functions (failures.py)
  missing = [
      f"_ray/{room}.py {name}" for room, name, fn in wraps
      if set(script.fields(fn.__doc__ or "")) != set(script.LABELS)
      or not all(script.fields(fn.__doc__ or "").values())
  ]
  assert missing == []


def generated_pages() -> list[pathlib.Path]:
  sync = load_script("sync_docs")
  return [p for p in sync.pages() if list(sync.blocks(p.read_text(), page_name(p)))]


@pytest.mark.parametrize("page", generated_pages(), ids=page_name)
def test_generated_blocks_equal_their_sources(page):
  """Each block between `<!-- generated from FILE ... -->` and `<!-- end
  generated -->` is what scripts/sync_docs.py writes from FILE."""
  sync = load_script("sync_docs")
  text = page.read_text()
  stale, unavailable = [], []
  for block in sync.blocks(text, page_name(page)):
    shown = text.splitlines()[block.start + 1 : block.end]
    try:
      expected = sync.body(block)
    except sync.SourceUnavailable as e:  # a script source without its history here (a shallow clone)
      unavailable.append(str(e))
      continue
    if shown != expected:
      stale.append(f"{page_name(page)}:{block.start + 1} (from {block.source})")
  assert not stale, "generated blocks differ from their sources: " + ", ".join(stale) + f"; run {SYNC_DOCS}"
  if unavailable:
    pytest.skip("cannot compute in this checkout: " + "; ".join(unavailable))


def test_generated_blocks_are_found():
  """Each page the docs once included files into keeps them inline."""
  names = {page_name(p) for p in generated_pages()}
  expected = {"benchmarks", "faults", "performance", "ray_integration", "resharding", "weight_sync"}
  assert {f"docs/{n}.md" for n in expected} <= names, names


# ---- the README


README = REPO / "README.md"


def readme_public_table() -> list[str]:
  """The first cells of the rows of the README's "Public API" table."""
  lines = README.read_text().split("\n## Public API\n", 1)[1].splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("|"))
  rows = []
  for line in lines[start + 2 :]:  # after the header and its rule
    if not line.startswith("|"):
      break
    rows.append(line.split("|")[1].strip())
  return rows


def test_readme_public_table_lists_exactly_rdt_jax_all():
  named = [
      re.match(r"[A-Za-z_]\w*", span).group(0)
      for cell in readme_public_table()
      for span in re.findall(r"`([^`]+)`", cell)
  ]
  assert sorted(named) == sorted(rdt_jax.__all__), (
      f"README.md's public table lists {sorted(set(named) - set(rdt_jax.__all__))} beyond rdt_jax.__all__ "
      f"and lacks {sorted(set(rdt_jax.__all__) - set(named))}"
  )
  assert len(named) == len(set(named)), "README.md's public table lists a name twice"


def test_readme_public_table_calls_match_the_signatures():
  """A call in the table (`receive_stats(transport="jax_nixl", reset=False)`)
  binds to the function's signature, its positional words naming the parameters."""
  problems = []
  for cell in readme_public_table():
    for span in re.findall(r"`([^`]+)`", cell):
      if "(" not in span:
        continue
      call = ast.parse(span, mode="eval").body
      assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name), span
      params = list(inspect.signature(getattr(rdt_jax, call.func.id)).parameters)
      try:
        inspect.signature(getattr(rdt_jax, call.func.id)).bind(
            *call.args, **{k.arg: k.value for k in call.keywords if k.arg}
        )
      except TypeError as e:
        problems.append(f"{span}: {e}")
        continue
      for i, arg in enumerate(call.args):
        if not (isinstance(arg, ast.Name) and arg.id == params[i]):
          problems.append(f"{span}: argument {i + 1} is `{ast.unparse(arg)}`, the parameter is `{params[i]}`")
  assert not problems, "README.md's public table:\n" + "\n".join(problems)


def readme_python_blocks() -> list[Block]:
  """The README's Python blocks a reader would run: those not marked illustrative."""
  return [
      b for b in code_blocks(README)
      if b.kind in ("python", "py") and not (b.marker is not None and b.marker[0] == "illustrative")
  ]


def example_run_for(block: Block) -> test_examples.Example | None:
  """The example whose run is `block`'s run: the block shows an example file
  whole but for its module docstring, and the example runs without arguments."""
  if block.marker is None or block.marker[0] != "example":
    return None
  script, _ = parse_example_marker(block.marker[1])
  example = test_examples.example_for(script)
  source = (test_examples.EXAMPLES_DIR / script).read_text()
  first = ast.parse(source).body[0]
  if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
    source = "\n".join(source.splitlines()[first.end_lineno :])
  return example if not example.args and source.strip("\n") == block.body.strip("\n") else None


@functools.cache
def run_snippet(code: str) -> subprocess.CompletedProcess:
  """Runs `code` as a script, from an empty directory, as test_examples runs an example."""
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="rdt-jax-readme-"))
  (workdir / "snippet.py").write_text(code)
  try:
    return subprocess.run(
        [sys.executable, "snippet.py"], cwd=workdir, env=clean_env(), capture_output=True, text=True, timeout=300
    )
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.ray  # runs the README's code, which starts Ray
@pytest.mark.parametrize("block", readme_python_blocks(), ids=lambda b: f"README.md:{b.line}")
def test_readme_python_blocks_run(block):
  """Every call in the README's code runs: each Python block not marked
  illustrative runs as a script (an example shown whole is the example's run,
  once per pytest process), and prints the output block that follows it."""
  example = example_run_for(block)
  proc = test_examples.run_example(example) if example is not None else run_snippet(block.body)
  assert proc.returncode == 0, f"README.md:{block.line}: the block failed:\n{proc.stderr[-4000:]}"
  blocks = list(code_blocks(README))
  following = blocks[blocks.index(block) + 1 :]
  if following and following[0].marker is not None and following[0].marker[0] == "output":
    assert output_pattern(following[0].body).fullmatch(proc.stdout), (
        f"README.md:{following[0].line}: the output shown differs from what the block printed:\n{proc.stdout}"
    )


def test_readme_has_no_doctest_blocks():
  """Sphinx builds docs/ only: a doctest block in the README would never run."""
  lines = [b.line for b in code_blocks(README) if b.kind in DOCTEST_DIRECTIVES]
  assert not lines, f"README.md: doctest blocks at lines {lines}; show an example's code instead"


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
  documented = re.findall(r'^<a id="rdt_jax\.(\w+)"></a>$', text, re.M)
  assert sorted(documented) == sorted(rdt_jax.__all__), (
      f"api.md documents {sorted(documented)}, rdt_jax.__all__ is {sorted(rdt_jax.__all__)}"
  )
  assert len(documented) == len(set(documented)), "a name is documented twice"
  testing = re.findall(r'^<a id="rdt_jax\.testing\.(\w+)"></a>$', text, re.M)
  assert sorted(testing) == sorted(importlib.import_module("rdt_jax.testing").__all__)


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
  from rdt_jax.bench import _mapped, _multihost, _report, _reshard, _twohost, _weights  # imports Ray: only here

  doc = json.loads(page.with_suffix(".json").read_text())
  generate = {
      "bench-reshard": _reshard.markdown, "bench-weight-sync": _weights.markdown,
      "bench-weight-sync-mapped": _mapped.markdown, "bench-weight-sync-trainers": _multihost.markdown,
      "bench-weight-sync-trainers-twohost": _multihost.markdown,
      "bench-weight-sync-gpu": _weights.markdown, "bench-twohost": _twohost.markdown,
  }.get(page.stem, _report.markdown)
  assert generate(doc) == page.read_text(), f"{page.name} differs from what the generator writes from its JSON"


# ---- figures in prose, against the results they name
#
# Each figure of a block marked `<!-- figures from ALIAS=FILE ... -->` is
# followed by `<!-- fig ALIAS: WORDS FIELD -->`, which names the one value of
# FILE it is; scripts/figures.py reads it and says the rules.

FIGURES = load_script("figures")


def figure_pages() -> list[pathlib.Path]:
  return [p for p in FIGURES.pages() if p.is_file() and "<!-- figures from" in p.read_text()]


def test_figure_blocks_are_found():
  """The pages that quote benchmark figures mark them, the development notes included."""
  names = {page_name(p) for p in figure_pages()}
  expected = {"README.md", "docs/performance.md", "docs/weight_sync.md", "docs/jax_to_torch.md",
              "docs/development/performance-log.md"}
  assert expected <= names, names


@pytest.mark.parametrize("page", FIGURES.pages(), ids=page_name)
def test_prose_figures_are_the_values_they_name(page):
  """Every figure of a marked block rounds, at its written precision, to the
  value its reference names; none is left without one (estimates and goals aside)."""
  if not page.is_file():
    pytest.skip(f"{page_name(page)} does not exist")
  problems = FIGURES.page_problems(page)
  assert not problems, "\n".join(problems)


def annotated(block):
  """The figures of `block` that name a value."""
  return [f for f in FIGURES.figures(block) if f.ref is not None and f.ref.startswith("fig ")]


def with_text(block, figure, text: str):
  """`block` with `figure`'s number and unit written as `text`."""
  i = figure.line - block.line - 1
  line = block.lines[i]
  end = figure.end - len(f"<!-- {figure.ref} -->")
  lines = list(block.lines)
  lines[i] = line[: figure.start] + text + line[end:]
  return block._replace(lines=lines)


def moved(value: str, up: bool) -> str:
  """`value` moved by 3% or one unit in its last place, whichever is larger,
  written at its precision (commas kept out)."""
  decimals = len(value.split(".")[1]) if "." in value else 0
  x = float(value.replace(",", ""))
  step = max(abs(x) * 0.03, 10**-decimals)
  return f"{x + step if up else max(x - step, 0):.{decimals}f}"


def all_blocks():
  return [b for p in figure_pages() for b in FIGURES.blocks(p.read_text(), page_name(p))]


def test_every_figure_moved_or_swapped_fails():
  """The check fails for each annotated figure of the repository moved by a
  small step at its written precision, and for any two different figures of a
  block swapped: it compares each figure with the one value it names, not with
  whatever value of that size the results hold."""
  passed = []
  count = 0
  for block in all_blocks():
    figures = annotated(block)
    for figure in figures:
      unit = "" if figure.unit == "x" else " "
      for up in (True, False):
        count += 1
        text = moved(figure.value, up) + unit + figure.unit
        if not FIGURES.block_problems(with_text(block, figure, text)):
          passed.append(f"{block.page}:{figure.line}: {figure.value} {figure.unit} moved to {text}")
    for i, a in enumerate(figures):
      for b in figures[i + 1 :]:
        if (float(a.value.replace(",", "")), a.unit) == (float(b.value.replace(",", "")), b.unit):
          continue
        count += 1
        text = lambda f: f.value + ("" if f.unit == "x" else " ") + f.unit  # noqa: E731
        # Right to left, so that the first swap leaves the second's offsets.
        first, second = sorted([a, b], key=lambda f: (f.line, f.start), reverse=True)
        other = {first: second, second: first}
        swapped = with_text(block, first, text(other[first]))
        swapped = with_text(swapped, second, text(other[second]))
        if not FIGURES.block_problems(swapped):
          passed.append(f"{block.page}: {text(a)} (line {a.line}) swapped with {text(b)} (line {b.line})")
  assert count > 1000, count
  assert not passed, "changed figures the check accepts:\n" + "\n".join(passed)


def test_figure_problems_are_found(tmp_path):
  """The check names the page and line of each kind of problem."""
  results = tmp_path / "results.json"
  results.write_text(json.dumps({
      "memcpy_ms": {"1x256MiB": 30.45},
      "summary": [
          {"case": "4KiB", "path": "jax_nixl", "variant": "", "median_s": 0.01084, "ratios": {"memcpy": 374.3}},
          {"case": "4KiB", "path": "object_store_numpy", "variant": "", "median_s": 0.0064},
          {"case": "fanout4", "path": "jax_nixl", "variant": "x4", "median_s": 0.07684},
          {"case": "fanout4", "path": "jax_nixl", "variant": "x1", "median_s": 0.02804},
      ],
      "targets": [
          {"name": "jax_nixl 4 KiB / object store NumPy", "value": 1.694},
          {"name": "jax_nixl 4 KiB / object store NumPy, jax's own cost subtracted", "value": 1.287},
      ],
      "samples": [{"case": "4KiB", "path": "raw", "seconds": 0.5}],
  }))
  page = tmp_path / "page.md"

  def problems(*lines: str) -> str:
    page.write_text(f"# A page\n\n<!-- figures from r={results} -->\n" + "\n".join(lines) + "\n")
    return "\n".join(FIGURES.page_problems(page))

  assert problems(
      "4 KiB: 10.8 ms<!-- fig r: 4KiB jax_nixl median -->, 10,840 us<!-- fig 4KiB jax_nixl median -->,",
      "0.0108 s<!-- fig 4KiB jax_nixl median_s -->, 1.69x<!-- fig 4KiB jax_nixl/object_store_numpy median -->,",
      "2.7x<!-- fig fanout4 x4/x1 median -->, 30.45 ms<!-- fig memcpy_ms.1x256MiB -->,",
      "374x<!-- fig 4KiB ratios.memcpy -->,",
      "76.8 ms<!-- fig max fanout4 median -->, about 2 ms, ~3 ms, at most 1.2x<!-- goal -->.",
  ) == ""
  at = f"{page}:4"
  assert problems("took 10.9 ms<!-- fig 4KiB jax_nixl median -->") == (
      f"{at}: 10.9 ms<!-- fig 4KiB jax_nixl median -->: the results hold 10.8 ms (10.84)"
  )
  assert problems("took 10.8 ms.").startswith(f"{at}: 10.8 ms names no result: follow it with <!-- fig")
  assert f"{at}: 9 ms<!-- fig 4MiB jax_nixl median -->: unknown `4MiB`" in problems(
      "9 ms<!-- fig 4MiB jax_nixl median -->"
  )
  found = problems("9 ms<!-- fig 4KiB jax_nixlx median -->")
  assert "unknown `jax_nixlx`" in found and "path: jax_nixl, object_store_numpy" in found
  assert "unknown statistic `mean`" in problems("9 ms<!-- fig 4KiB jax_nixl mean -->")
  assert "2 records" in problems("9 ms<!-- fig fanout4 jax_nixl median -->")
  assert "unknown statistic `seconds`" in problems("500 ms<!-- fig 4KiB raw seconds -->")  # raw samples are not read
  assert "no alias of this block" in problems("9 ms<!-- fig q: 4KiB jax_nixl median -->")
  assert "names a time, the figure is written as a ratio" in problems("9x<!-- fig 4KiB jax_nixl median -->")
  assert "is an estimate: it carries no reference" in problems("about 2 ms<!-- goal -->")
  # A record whose name holds spaces is picked by words it contains, and by no value coincidence.
  assert problems("1.29x<!-- fig name~subtracted value -->, 1.69x<!-- fig max name~NumPy value -->") == ""
  assert "the results hold 1.29x" in problems("1.28x<!-- fig name~subtracted value -->")
  assert "2 records" in problems("1.69x<!-- fig name~NumPy value -->")
  assert "unknown `name~jax.Array`" in problems("1.69x<!-- fig name~jax.Array value -->")
  assert "unknown `name=subtracted`" in problems("1.29x<!-- fig name=subtracted value -->")
  assert "unknown `value~1.287`" in problems("1.29x<!-- fig value~1.287 value -->")  # text of strings only
  page.write_text("# A page\n\n<!-- figures from r=docs/benchmarks/nope.json -->\n9 ms<!-- fig median -->\n")
  assert FIGURES.page_problems(page) == [f"{page}:3: r=docs/benchmarks/nope.json does not exist"]
  page.write_text("# A page\n\n<!-- figures from docs/benchmarks/bench-full.json -->\n9 ms\n")
  assert "a block names its results as ALIAS=PATH" in FIGURES.page_problems(page)[0]
  page.write_text("# A page\n\n9 ms<!-- fig full: 4KiB jax_nixl median -->\n")
  outside = f"{page}:3: a figure reference outside a block marked <!-- figures from ... -->"
  assert FIGURES.page_problems(page) == [outside]


@pytest.mark.parametrize("page", FIGURES.pages(), ids=page_name)
def test_every_figure_is_accounted_for(page):
  """Every figure of a page names its value, is an estimate or a goal, says why
  it is unchecked (its block or itself), or is generated text."""
  if not page.is_file():
    pytest.skip(f"{page_name(page)} does not exist")
  problems = FIGURES.coverage_problems(page.read_text(), page_name(page))
  assert not problems, "\n".join(problems)


def test_unaccounted_figures_are_found(tmp_path):
  """A figure with nothing said about it is refused; an unchecked block or note
  must say why and must hold a figure; generated text is not read."""
  page = tmp_path / "page.md"

  def problems(text: str) -> list[str]:
    page.write_text(text)
    return FIGURES.page_problems(page)

  assert [p.split(": ", 1)[1] for p in problems("# A page\n\ntook 9 ms and 2.5x.\n")] == [
      f"{f} is not accounted for: name its value (<!-- fig ... -->), "
      "or say above its paragraph why it is not checked (<!-- figures unchecked: REASON -->)"
      for f in ("9 ms", "2.5x")
  ]
  assert problems(
      "# A page\n\n<!-- figures unchecked: measured at abc1234, results not kept -->\ntook 9 ms,\n"
      "then 2.5x.\n\nabout 3 ms, 60 s<!-- unchecked: Ray's default -->, `4 ms`.\n\n"
      "```text\n5 ms\n```\n\n<!-- generated from x.md: python scripts/sync_docs.py -->\n\n6 ms\n\n"
      "<!-- end generated -->\n"
  ) == []
  # An unchecked block reaches the next blank line only.
  assert problems("# A page\n\n<!-- figures unchecked: old -->\n9 ms\n\n7 ms\n") == [
      f"{page}:6: 7 ms is not accounted for: name its value (<!-- fig ... -->), "
      "or say above its paragraph why it is not checked (<!-- figures unchecked: REASON -->)"
  ]
  assert problems("# A page\n\n<!-- figures unchecked: -->\n9 ms\n") == [
      f"{page}:3: an unchecked block says why: <!-- figures unchecked: REASON -->"
  ]
  assert problems("# A page\n\n<!-- figures unchecked: old -->\nno numbers\n") == [
      f"{page}:3: the unchecked block quotes no figure: remove its marker"
  ]
  assert problems("# A page\n\n9 ms<!-- unchecked: -->\n") == [
      f"{page}:3: 9 ms<!-- unchecked: -->: say why it is unchecked (<!-- unchecked: REASON -->)"
  ]


def test_settings_and_limits_are_read_from_the_code(tmp_path):
  """A figure naming a setting's default or a limit equals the code's value, in
  its unit; a name the code does not define, another value, a unit of another
  kind and a reference that follows no figure are refused."""
  from rdt_jax import _limits, _settings

  page = tmp_path / "page.md"

  def problems(text: str) -> list[str]:
    page.write_text(f"# A page\n\n{text}\n")
    return FIGURES.page_problems(page)

  answer_s = _limits.TRANSFER_ANSWER_TIMEOUT_S
  idle_s = _settings.SETTINGS["RDT_JAX_NIXL_PRODUCER_IDLE_S"].default
  assert problems(
      f"waits {answer_s:g} s<!-- limit TRANSFER_ANSWER_TIMEOUT_S --> "
      f"({answer_s * 1e3:g} ms<!-- limit TRANSFER_ANSWER_TIMEOUT_S -->), "
      f"forgets after {idle_s:g}s<!-- setting RDT_JAX_NIXL_PRODUCER_IDLE_S -->, "
      f"reads {_limits.DOCTOR_DEVICE_READ_MIN_GBPS:g} GB/s<!-- limit DOCTOR_DEVICE_READ_MIN_GBPS -->."
  ) == []
  wrong = problems(f"waits {answer_s + 1:g} s<!-- limit TRANSFER_ANSWER_TIMEOUT_S -->.")
  assert wrong == [
      f"{page}:3: {answer_s + 1:g} s<!-- limit TRANSFER_ANSWER_TIMEOUT_S -->: the code says {answer_s:g} s"
  ]
  assert "is no constant of rdt_jax/_limits.py" in problems("waits 30 s<!-- limit NO_SUCH_LIMIT_S -->.")[0]
  assert "is no setting of rdt_jax/_settings.py" in problems("waits 30 s<!-- setting RDT_JAX_NOPE -->.")[0]
  assert "the figure is written as a ratio" in problems("waits 30x<!-- limit TRANSFER_ANSWER_TIMEOUT_S -->.")[0]
  assert problems("waits <!-- limit TRANSFER_ANSWER_TIMEOUT_S --> long.") == [
      f"{page}:3: a setting or limit reference that follows no figure (write it right after the unit)"
  ]


def test_a_figure_added_to_an_accounted_page_is_refused():
  """A page whose figures are all accounted for fails once a figure is added
  with no reference, before the generated settings table or after prose."""
  name = "docs/configuration.md"
  text = (REPO / name).read_text()
  assert not FIGURES.coverage_problems(text, name)
  marker = text.index("<!-- settings-table")
  for changed in (text[:marker] + "It took 9 ms.\n\n" + text[marker:], "It took 9 ms.\n\n" + text):
    problems = FIGURES.coverage_problems(changed, name)
    assert len(problems) == 1 and "9 ms is not accounted for" in problems[0], problems


def test_a_changed_readme_figure_is_refused():
  """The README's figures, changed, fail with a message naming the page, line,
  reference and the value the results hold."""
  readme = README.read_text()
  for before, after in (("13.7x<!--", "9.9x<!--"), ("94.3 ms<!--", "144 ms<!--")):
    assert before in readme
    found = "\n".join(FIGURES.page_problems(README, readme.replace(before, after, 1)))
    assert f"{after[:-4]}<!-- fig full: 256MiB" in found and "the results hold" in found, found
