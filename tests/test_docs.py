"""The docs build with warnings as errors, and every code block in them is checked.

The rule for docs/*.md: a code block is either

* a `{literalinclude}` of a file the tests run: an example listed in
  `tests/test_examples.py` (or its expected output, `examples/<name>.out`,
  which that test compares), or a script of the CI chain (`.ci/run` ->
  `scripts/test.sh` -> `scripts/setup.sh`); or
* a `{doctest}` (or `{testcode}`/`{testoutput}`) block, run by Sphinx's doctest
  builder here, exception messages included.

Blocks that hold no code are allowed: `{toctree}`, `{eval-rst}` holding only
autodoc directives, `{include}` of the files `rdt-jax bench` writes to
docs/benchmarks/ or `scripts/matrix.sh` writes to docs/matrix/, and `text` blocks (diagrams) without Python in them.
Admonitions are checked recursively. Anything else fails, naming the page and
line.
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import re
import subprocess
import sys

import pytest

import rdt_jax
import test_examples

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))

DOCTEST_DIRECTIVES = {"doctest", "testcode", "testoutput", "testsetup", "testcleanup"}
ADMONITIONS = {
    "admonition", "attention", "caution", "danger", "error", "hint", "important",
    "note", "seealso", "tip", "warning",
}
AUTODOC_LINE = re.compile(
    r"^(\.\. auto(function|class|exception|data|method|attribute)::\s+\S+|\s+:[\w-]+:.*)$"
)
# The CI chain: each file runs the next one.
CI_CHAIN = [".ci/run", "scripts/test.sh", "scripts/setup.sh"]


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
    if any(kind in DOCTEST_DIRECTIVES for kind, _, _, _ in code_blocks(page)):
      assert f"Document: {page.stem}\n" in report, f"{page.name}: no doctest ran\n{report}"


# ---- every code block is included from a tested file or doctested


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
  """(kind, argument, body, line) of every code block on `page`, recursing into
  admonitions. `kind` is a directive name ("literalinclude") or the fence's
  language ("text", "python", "" for none); "indented" for indented code."""
  text = page.read_text() if text is None else text
  for token in md_parser().parse(text):
    if token.type not in ("fence", "colon_fence", "code_block"):
      continue
    line = offset + (token.map[0] + 1 if token.map else 0)
    if token.type == "code_block":
      yield "indented", "", token.content, line
      continue
    m = re.match(r"^\{([\w:-]+)\}\s*(.*)$", token.info.strip())
    if m is None:
      yield token.info.strip().split(" ")[0], "", token.content, line
      continue
    kind, argument = m.group(1), m.group(2)
    if kind in ADMONITIONS:
      options, body = split_directive(token.content)
      yield from code_blocks(page, body, line + len(options))
    else:
      yield kind, argument, token.content, line


def files_the_tests_run() -> set[pathlib.Path]:
  files = set()
  for example in test_examples.EXAMPLES:
    script = test_examples.EXAMPLES_DIR / example.script
    files |= {script.resolve(), script.with_suffix(".out").resolve()}
  for caller, callee in itertools.pairwise(CI_CHAIN):
    assert callee in (REPO / caller).read_text(), f"{caller} no longer runs {callee}"
  files |= {(REPO / name).resolve() for name in CI_CHAIN}
  return files


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_block_is_included_or_doctested(page):
  tested_files = files_the_tests_run()
  problems = []
  for kind, argument, body, line in code_blocks(page):
    where = f"docs/{page.name}:{line}"
    if kind == "literalinclude":
      base = DOCS if argument.startswith("/") else page.parent
      target = (base / argument.lstrip("/")).resolve()
      if target not in tested_files:
        problems.append(f"{where}: includes {argument}, which no test runs")
    elif kind in DOCTEST_DIRECTIVES or kind == "toctree":
      pass
    elif kind == "eval-rst":
      bad = [line for line in body.splitlines() if line.strip() and not AUTODOC_LINE.match(line)]
      if bad:
        problems.append(f"{where}: eval-rst may hold autodoc directives only, not {bad[0]!r}")
    elif kind == "include":
      if not argument.startswith(("benchmarks/", "matrix/")):
        problems.append(f"{where}: include of {argument}; only docs/benchmarks/ and docs/matrix/ files")
    elif kind == "text":
      if re.search(r"^\s*(>>>|import |from \w+ import |def |class )", body, re.M):
        problems.append(f"{where}: a text block holding Python; include or doctest it")
    else:
      problems.append(
          f"{where}: code block ({kind or 'no language'}) neither included from a "
          "file the tests run nor a {doctest} block"
      )
  assert not problems, "\n".join(problems)


def test_api_page_documents_exactly_the_public_names():
  text = (DOCS / "api.md").read_text()
  directive = r"^\.\. auto(?:function|class|exception)::\s+rdt_jax\.(\w+)\s*$"
  documented = re.findall(directive, text, re.M)
  assert sorted(documented) == sorted(rdt_jax.__all__), (
      f"api.md documents {sorted(documented)}, rdt_jax.__all__ is {sorted(rdt_jax.__all__)}"
  )
  assert len(documented) == len(set(documented)), "a name is documented twice"


def test_tests_named_in_the_docs_exist():
  """The errors table names the test behind each row: those tests must exist."""
  defined: dict[str, set[str]] = {}
  for path in (REPO / "tests").glob("test_*.py"):
    tree = ast.parse(path.read_text())
    defined[path.name] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
  missing = []
  for page in PAGES:
    for module, name in re.findall(r"(test_\w+\.py)::(test_\w+)", page.read_text()):
      if name not in defined.get(module, set()):
        missing.append(f"{page.name}: {module}::{name}")
  assert not missing, "docs name tests that do not exist:\n" + "\n".join(missing)
