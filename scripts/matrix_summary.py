"""Turns the output of scripts/matrix.sh into the Markdown table that
docs/ray_integration.md includes (docs/matrix/ray_matrix.md).

  bash scripts/matrix.sh 2>&1 | tee matrix.log
  python scripts/matrix_summary.py matrix.log > docs/matrix/ray_matrix.md

Only lines matrix.sh and pytest print are read: nothing here is typed by hand.
"""

from __future__ import annotations

import re
import sys

LEG = re.compile(r"^=== matrix leg (\w+): (.*)$")
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s")


def main(path: str) -> None:
  legs: dict[str, dict[str, str]] = {}
  current = None
  for line in open(path, encoding="utf-8"):
    line = line.rstrip("\n")
    m = LEG.match(line)
    if m:
      current, text = m.group(1), m.group(2)
      leg = legs.setdefault(current, {})
      if text.startswith("Python "):
        leg["versions"] = text
      elif text.startswith("venv ready in "):
        leg["venv"] = text.removeprefix("venv ready in ")
      elif text.startswith("exit "):
        leg["exit"], _, leg["tests"] = (p.strip() for p in text.partition(", tests "))
      continue
    m = SUMMARY.match(line.strip())
    if m and current is not None:
      legs[current]["counts"] = m.group(1)
  print("| leg | versions | pytest | exit | tests wall time | venv setup |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name, leg in legs.items():
    print(
        f"| {name} | {leg.get('versions', '?')} | {leg.get('counts', '?')} | "
        f"{leg.get('exit', '?')} | {leg.get('tests', '?')} | {leg.get('venv', '?')} |"
    )


if __name__ == "__main__":
  main(sys.argv[1])
