"""Keeps the committed benchmark results in the form the policy asks for.

One raw run per benchmark kind is current evidence and keeps every sample:
the results under docs/benchmarks/, except the runs named in SUPERSEDED. A
superseded run keeps its summary and the commit it measured, under the same
path (pages cite it, and quoted figures are checked against its summary
fields), but drops its raw samples. Every results file is written as the
benchmark writers write it (`rdt_jax.bench._results.dumps`).

  python scripts/prune_results.py          # rewrite every results file in that form
  python scripts/prune_results.py --check  # exit 1, naming the files, if one is not

Superseding a run: add its path (or its folder) to SUPERSEDED, then run this
script. Imports no Ray.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Final

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rdt_jax.bench import _results  # noqa: E402  (after the repository is on the path)

#: Where committed results live.
RESULTS: Final = ("docs/benchmarks", "docs/development/benchmarks")

#: Runs kept for their summary only: every earlier run under docs/development/,
#: and the GPU runs that the 2026-11-28 run under docs/benchmarks/gpu/ replaced
#: (its results are the current GPU evidence).
SUPERSEDED: Final = (
    "docs/development/benchmarks/",
    "docs/benchmarks/gpu/2026-11-27/",
    "docs/benchmarks/gpu/bench-gpu.json",
    "docs/benchmarks/gpu/bench-weight-sync-gpu.json",
)

#: The keys under which the writers record raw measurements, one entry per
#: repetition: `rdt-jax bench`'s and `--reshard`'s top-level `samples`, the
#: two-host benchmark's `samples` per result. (A count under the same name,
#: the weight-sync rows' `"samples": 6`, is a summary field and stays.)
RAW: Final = frozenset({"samples"})


def results(root: pathlib.Path = REPO) -> list[pathlib.Path]:
  """Every committed results file (`*.json` under RESULTS), sorted."""
  return sorted(p for folder in RESULTS for p in (root / folder).rglob("*.json"))


def superseded(path: pathlib.Path, root: pathlib.Path = REPO) -> bool:
  """Whether the run at `path` is superseded (named, or under a folder named,
  in SUPERSEDED)."""
  name = path.resolve().relative_to(root.resolve()).as_posix()
  return any(name == s or (s.endswith("/") and name.startswith(s)) for s in SUPERSEDED)


def strip(doc: Any) -> Any:
  """`doc` without its raw measurements: every RAW key whose value is a list,
  at any depth. Everything else (summaries, medians, ratios, targets,
  overhead, splits, config, environment, the commit) is kept as it is."""
  if isinstance(doc, dict):
    return {k: strip(v) for k, v in doc.items() if not (k in RAW and isinstance(v, list))}
  if isinstance(doc, list):
    return [strip(v) for v in doc]
  return doc


def form(path: pathlib.Path, root: pathlib.Path = REPO) -> str:
  """The text the results file at `path` should hold: its content (stripped
  if superseded) as the writers write it.

  Raises:
    ValueError: if the file is not JSON, naming it.
  """
  try:
    doc = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not JSON ({e}); fix or remove the file, then run this script again") from None
  return _results.dumps(strip(doc) if superseded(path, root) else doc)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if a results file is not in its form")
  args = parser.parse_args()
  differ = []
  for path in results():
    text = form(path)
    if path.read_text() != text:
      differ.append(str(path.relative_to(REPO)))
      if not args.check:
        path.write_text(text)
  if args.check and differ:
    print(f"results not in their committed form: {', '.join(differ)}; run python scripts/prune_results.py",
          file=sys.stderr)
    return 1
  for name in differ:
    print(f"rewrote {name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
