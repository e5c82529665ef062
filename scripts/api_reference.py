"""Writes docs/api.md, the API reference, from the docstrings of the public names.

  python scripts/api_reference.py          # rewrite docs/api.md
  python scripts/api_reference.py --check  # exit 1 if docs/api.md is not what it writes

The page is plain Markdown, so that it reads completely as a file: one entry per
name of `rdt_jax.__all__` (and the members listed in SECTIONS), each with its
signature and its docstring, the docstring's Google-style sections (`Args:`,
`Returns:`, `Raises:`, `Attributes:`) turned into lists. Each entry starts with an
HTML anchor `<a id="rdt_jax.NAME"></a>`: other pages link to `api.md#rdt_jax.NAME`,
which a repository host resolves through the anchor and Sphinx through the target
docs/conf.py makes of it. tests/test_docs.py checks that the committed page is
what this script writes.
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import inspect
import pathlib
import re
import sys
from typing import Any, ForwardRef, NamedTuple

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "api.md"
REFRESH = "python scripts/api_reference.py"
# Document the checkout this script lives in, even if another copy is installed.
sys.path.insert(0, str(REPO))

import rdt_jax  # noqa: E402

ALL = "all"  # every public member the class itself defines that has a docstring


class Entry(NamedTuple):
  name: str  # a name of rdt_jax.__all__, or "module.Name" for a name of rdt_jax.module.__all__
  members: tuple[str, ...] | str = ()  # members to document, in this order, or ALL


class Section(NamedTuple):
  title: str
  intro: str
  entries: tuple[Entry, ...]


HEADER = """\
# API reference

<!-- written by {refresh} from the docstrings: edit the docstrings, not this page -->

The public names, exactly those in `rdt_jax.__all__` (and, for testing custom
transports, `rdt_jax.testing.__all__`), with their signatures and docstrings.
Everything else in the package is private and may change without notice.
`import rdt_jax` imports neither Ray nor any array framework; each name loads
its module on first use.
"""

SECTIONS = (
    Section("Registration and receiving", "", (Entry("register"), Entry("receive_as"), Entry("receive_stats"))),
    Section("Converting pytrees", "", (Entry("to_jax"), Entry("to_torch"), Entry("to_numpy"))),
    Section(
        "Receive targets",
        "",
        (Entry("set_target_for_ref"), Entry("set_target_device_for_ref"), Entry("Slice", ("box",))),
    ),
    Section(
        "Weight sync",
        "A trainer publishes versions, generators pull them into live parameters\n"
        "([Weight sync](weight_sync.md)).",
        (
            Entry("WeightPublisher", ("publish", "close", "versions", "version", "stats")),
            Entry("WeightSubscriber", ("pull", "pull_async", "pull_named", "pull_latest", "version", "last_pull")),
            Entry("WeightsHandle"),
            Entry("latest_handle"),
            Entry("From"),
            Entry("Fuse"),
            Entry("PullStats"),
            Entry("PublishStats"),
        ),
    ),
    Section("asyncio", "", (Entry("get_async"),)),
    Section(
        "Errors",
        "Every one derives from `RdtJaxError`; each is described, with its causes and fixes, in\n"
        "[Errors and limitations](errors.md), which draws the family as a tree.",
        (
            Entry("RdtJaxError"),
            Entry("UnsupportedLeafError"),
            Entry("MetadataError"),
            Entry("TransportNotRegisteredError"),
            Entry("UnknownObjectError"),
            Entry("UnsupportedRayError"),
            Entry("SettingError"),
            Entry("StaleWeightsError"),
            Entry("TemplateError"),
            Entry("MappingError"),
            Entry("ArgumentTypeError"),
            Entry("SetupError"),
            Entry("AwaitNotSupportedError"),
            Entry("RefNotReadyError"),
            Entry("ProducerDiedError"),
            Entry("ProducerActorDiedError"),
            Entry("NixlError"),
            Entry("DeviceViewBusy"),
        ),
    ),
    Section(
        "Writing a transport",
        "A backend subclasses `DlpackTransport` (it moves bytes) or\n"
        "`WholeArrayTransport` (it moves whole jax arrays), sets `name` and `devices`,\n"
        "implements the backend hooks ([Write your own DLPack transport](custom_transport.md)), and is\n"
        "registered with `register_transport`. Ray calls the methods of Ray's interface\n"
        "(`extract_tensor_transport_metadata`, `fetch_multiple_tensors`, ...); the base\n"
        "implements them and calls the hooks.",
        (Entry("register_transport"), Entry("DlpackTransport", ALL), Entry("WholeArrayTransport", ALL)),
    ),
    Section(
        "What the hooks are given",
        "",
        (
            Entry("DlpackTransportMetadata", ("nbytes",)),
            Entry("DescribedLeaf", ("device",)),
            Entry("LeafSpec", ("nbytes",)),
            Entry("Destination", ALL),
            Entry("Placement", ALL),
        ),
    ),
    Section(
        "Testing a transport",
        "`rdt_jax.testing` (needs pytest: the `testing` extra) runs the transport\n"
        "contract against your own transport ([Write your own DLPack transport](custom_transport.md)).",
        (Entry("testing.TransportContract", ("setup_actors",)),),
    ),
)

SECTION_NAMES = {
    "Args": "Arguments", "Arguments": "Arguments", "Attributes": "Attributes", "Raises": "Raises",
    "Returns": "Returns", "Yields": "Yields", "Note": "Note", "Notes": "Notes",
}
LIST_SECTIONS = {"Arguments", "Attributes", "Raises"}
SECTION_LINE = re.compile(r"^(\w+):$")
ITEM_LINE = re.compile(r"^  (\*{0,2}[\w.]+): ?(.*)$")
ROLE = re.compile(r":(?:py:)?(?:func|class|exc|meth|attr|mod|data|obj):`~?([^`]+)`")
CODE_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")


def anchor(dotted: str) -> str:
  return f"rdt_jax.{dotted}"


def documented_members(cls: type, entry: Entry) -> list[str]:
  if entry.members != ALL:
    return list(entry.members)
  names = []
  for name, value in vars(cls).items():
    if name.startswith("_"):
      continue
    if isinstance(value, (staticmethod, classmethod)):
      value = value.__func__
    if (inspect.isfunction(value) or isinstance(value, property)) and inspect.getdoc(value):
      names.append(name)
  return names


# ---- signatures


def annotation(value: Any) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, ForwardRef):
    return value.__forward_arg__
  return inspect.formatannotation(value)


def format_signature(sig: inspect.Signature, skip_first: bool = False) -> str:
  params = list(sig.parameters.values())
  if skip_first and params:
    params = params[1:]
  parts = []
  star_done = False
  for i, p in enumerate(params):
    if p.kind is p.KEYWORD_ONLY and not star_done:
      parts.append("*")
      star_done = True
    text = p.name
    if p.kind is p.VAR_POSITIONAL:
      text, star_done = "*" + text, True
    elif p.kind is p.VAR_KEYWORD:
      text = "**" + text
    if p.annotation is not p.empty:
      text += f": {annotation(p.annotation)}"
    if p.default is not p.empty:
      text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
    parts.append(text)
    if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
      parts.append("/")
  text = f"({', '.join(parts)})"
  if sig.return_annotation is not sig.empty:
    text += f" -> {annotation(sig.return_annotation)}"
  return text


def signature_of(obj: Any, skip_first: bool = False) -> str | None:
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):  # a class whose signature is that of a builtin
    return None
  if inspect.isclass(obj):
    sig = sig.replace(return_annotation=inspect.Signature.empty)
  return format_signature(sig, skip_first)


def base_name(base: type) -> str:
  if getattr(rdt_jax, base.__name__, None) is base and base.__name__ in rdt_jax.__all__:
    return f"`rdt_jax.{base.__name__}`"
  if getattr(builtins, base.__name__, None) is base:
    return f"`{base.__name__}`"
  return f"`{base.__module__}.{base.__qualname__}`"


# ---- docstrings


def convert_docstring(doc: str) -> list[str]:
  """A Google-style docstring as Markdown lines: sections become a bold label
  and, for arguments, attributes and exceptions, a list."""
  out: list[str] = []
  lines = doc.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    m = SECTION_LINE.match(line)
    following = lines[i + 1] if i + 1 < len(lines) else ""
    if m and m.group(1) in SECTION_NAMES and following.startswith("  "):
      label = SECTION_NAMES[m.group(1)]
      i += 1
      body = []
      while i < len(lines) and (lines[i].startswith("  ") or not lines[i].strip()):
        if not lines[i].strip() and (i + 1 >= len(lines) or not lines[i + 1].startswith("  ")):
          break
        body.append(lines[i])
        i += 1
      out.extend(convert_section(label, body))
      continue
    out.append(line)
    i += 1
  return out


def convert_section(label: str, body: list[str]) -> list[str]:
  if label not in LIST_SECTIONS:
    return [f"**{label}:**", *(line[2:] for line in body), ""]
  out = [f"**{label}:**", ""]
  for line in body:
    m = ITEM_LINE.match(line)
    if m:
      out.append(f"* `{m.group(1)}`: {m.group(2)}".rstrip())
    elif line.strip():
      out.append("  " + line.strip())
    else:
      out.append("")
  out.append("")
  return out


class Linker:
  """Turns code spans that name a documented entry into links to its anchor."""

  def __init__(self, targets: set[str]):
    self.targets = targets  # dotted names under rdt_jax: "register", "DlpackTransport.release"

  def target(self, code: str) -> str | None:
    name = code.removesuffix("()").removeprefix("rdt_jax.")
    if "\n" in name or " " in name:
      return None
    return name if name in self.targets else None

  def __call__(self, text: str, own: str) -> str:
    def link(m: re.Match) -> str:
      name = self.target(m.group(1))
      if name is None or name == own:
        return m.group(0)
      return f"[{m.group(0)}](#{anchor(name)})"

    return CODE_SPAN.sub(link, ROLE.sub(r"`\1`", text))


# ---- entries


def docstring(obj: Any) -> str:
  return inspect.getdoc(obj) or ""


def render_doc(obj: Any, linker: Linker, own: str) -> list[str]:
  doc = docstring(obj)
  if not doc:
    return []
  text = "\n".join(convert_docstring(doc)).strip("\n")
  return [*linker(text, own).splitlines(), ""]


def resolve(name: str) -> Any:
  """The object an entry names: `rdt_jax.NAME`, or `rdt_jax.MODULE.NAME`."""
  module, _, attr = name.rpartition(".")
  if module:
    return getattr(importlib.import_module(f"rdt_jax.{module}"), attr)
  return getattr(rdt_jax, name)


def render_member(cls: type, owner: str, name: str, linker: Linker) -> list[str]:
  dotted = f"{owner}.{name}"
  raw = inspect.getattr_static(cls, name)
  out = [f'<a id="{anchor(dotted)}"></a>', "", f"#### `{dotted}`", ""]
  if isinstance(raw, property):
    kind = "property"
    returns = inspect.signature(raw.fget).return_annotation if raw.fget else inspect.Signature.empty
    shown = f"{dotted}: {annotation(returns)}" if returns is not inspect.Signature.empty else dotted
    value: Any = raw
  else:
    if isinstance(raw, staticmethod):
      kind, value, skip = "static method", raw.__func__, False
    elif isinstance(raw, classmethod):
      kind, value, skip = "class method", raw.__func__, True
    else:
      kind, value, skip = "method", raw, True
    if getattr(value, "__isabstractmethod__", False):
      kind = f"abstract {kind}"
    shown = f"{dotted}{signature_of(value, skip_first=skip)}"
  out += [f"{kind} `{shown}`", ""]
  return out + render_doc(value, linker, dotted)


def render_entry(entry: Entry, linker: Linker) -> list[str]:
  obj = resolve(entry.name)
  qualified = f"rdt_jax.{entry.name}"
  out = [f'<a id="{anchor(entry.name)}"></a>', "", f"### `{qualified}`", ""]
  if inspect.isclass(obj):
    kind = "exception" if issubclass(obj, BaseException) else "class"
    sig = signature_of(obj)
    out.append(f"{kind} `{qualified}{sig or ''}`")
    bases = [b for b in obj.__bases__ if b is not object]
    if bases:
      out += ["", "Bases: " + ", ".join(base_name(b) for b in bases)]
    out.append("")
  else:
    out += [f"function `{qualified}{signature_of(obj)}`", ""]
  out += render_doc(obj, linker, entry.name)
  if inspect.isclass(obj):
    for member in documented_members(obj, entry):
      out += render_member(obj, entry.name, member, linker)
  return out


def render() -> str:
  """The text of docs/api.md."""
  targets: set[str] = set()
  for section in SECTIONS:
    for entry in section.entries:
      targets.add(entry.name)
      obj = resolve(entry.name)
      if inspect.isclass(obj):
        targets.update(f"{entry.name}.{m}" for m in documented_members(obj, entry))
  linker = Linker(targets)
  lines = [*HEADER.format(refresh=REFRESH).splitlines(), ""]
  for section in SECTIONS:
    lines += [f"## {section.title}", ""]
    if section.intro:
      lines += [linker(section.intro, ""), ""]
    for entry in section.entries:
      lines += render_entry(entry, linker)
  text = "\n".join(lines)
  text = re.sub(r"\n{3,}", "\n\n", text)
  return text.rstrip("\n") + "\n"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from what it writes")
  args = parser.parse_args()
  text = render()
  if args.check:
    if PAGE.read_text() != text:
      print(f"docs/api.md is out of date: run {REFRESH}", file=sys.stderr)
      return 1
    return 0
  PAGE.write_text(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
