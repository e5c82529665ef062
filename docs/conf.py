"""Sphinx configuration for the rdt_jax docs (MyST Markdown + autodoc).

Build (warnings are errors, as tests/test_docs.py runs it):

  sphinx-build -W --keep-going -b html docs docs/_build/html
  sphinx-build -W --keep-going -b doctest docs docs/_build/doctest
"""

from __future__ import annotations

import doctest
import pathlib
import re
import sys

from docutils import nodes
from docutils.transforms import Transform

DOCS = pathlib.Path(__file__).resolve().parent
REPO = DOCS.parent
# Document the checkout these docs live in, even if another copy is installed.
sys.path.insert(0, str(REPO))

import rdt_jax  # noqa: E402

project = "rdt_jax"
author = "rdt_jax contributors"
copyright = "rdt_jax contributors"
release = rdt_jax.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# docs/benchmarks/ holds files `rdt-jax bench` writes; benchmarks.md includes
# them, so they are not documents of their own.
# docs/development/ keeps history for developers; it is not part of the site.
exclude_patterns = ["_build", "benchmarks/**", "matrix/**", "development/**", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings follow Google style with `single backticks` for code (as jax's
# do); render them as inline code rather than as cross-reference attempts.
default_role = "code"

autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
# "Attributes:" sections become field lists, not attribute directives that
# would clash with the dataclass fields autodoc already documents.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# Cross-references to rdt_jax's public names (`{func}`rdt_jax.register``) must
# resolve. Types in signatures that are not public rdt_jax classes (other
# projects' types: the build uses no intersphinx so that it works offline;
# rdt_jax's private ones) are not checked, so that a new type in a signature
# does not break the build.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:class", r"(?!rdt_jax\.[A-Za-z]\w*$).*"),
    (r"py:.*", r"(ray|jax|jaxlib|numpy|np|torch|ml_dtypes|typing|collections)(\..*)?"),
    (r"py:.*", r"(Any|Callable|ClassVar|Final|Literal)"),
    (r"py:.*", r"rdt_jax\._\w*(\..*)?|rdt_jax\.transports(\..*)?"),
]

# sphinx.ext.doctest: every `{doctest}` block in the docs runs in the doctest
# build. Exception messages are compared too (no IGNORE_EXCEPTION_DETAIL).
doctest_default_flags = (
    doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.DONT_ACCEPT_TRUE_FOR_1
)
doctest_global_setup = """
import rdt_jax
"""

# A docstring may write `jax.Array`s; reST ends inline markup only before
# whitespace or punctuation, so end it explicitly ("`jax.Array`\\ s").
_BACKTICK_THEN_WORD = re.compile(r"(?<![`\\])(`[^`\s][^`]*`)(?=[A-Za-z0-9])")


def _close_inline_code(app, what, name, obj, options, lines):
  lines[:] = [_BACKTICK_THEN_WORD.sub(r"\1\\ ", line) for line in lines]


# Pages link to an anchor in another page as `page.md#name`, so that the link
# works where the Markdown is read as a file too. A page sets such an anchor as
# an HTML anchor on a line of its own, `<a id="rdt_jax.register"></a>`, which a
# repository host resolves; this transform makes each a target Sphinx resolves
# (the link then lands on the section or paragraph that follows).
_HTML_ANCHOR = re.compile(r'^<a id="([^"]+)">$')


class HtmlAnchorTargets(Transform):
  default_priority = 200  # before docutils moves targets onto the next element (260)

  def apply(self, **kwargs):
    for paragraph in list(self.document.findall(nodes.paragraph)):
      children = [c for c in paragraph.children if not (isinstance(c, nodes.Text) and not c.strip())]
      if (
          len(children) == 2
          and all(isinstance(c, nodes.raw) and c.get("format") == "html" for c in children)
          and children[1].astext().strip() == "</a>"
          and (m := _HTML_ANCHOR.match(children[0].astext().strip()))
      ):
        target = nodes.target("", "", ids=[m.group(1)], names=[nodes.fully_normalize_name(m.group(1))])
        target.source, target.line = paragraph.source, paragraph.line
        paragraph.replace_self(target)
        self.document.note_explicit_target(target, target)


def setup(app):
  app.connect("autodoc-process-docstring", _close_inline_code)
  app.add_transform(HtmlAnchorTargets)


html_theme = "alabaster"
html_title = f"rdt_jax {release}"
html_static_path: list[str] = []
