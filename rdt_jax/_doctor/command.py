"""The `rdt-jax doctor` command: its options (`add_arguments`) and the run
that prints the report, as text or JSON (`run`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rdt_jax._doctor.checks import collect
from rdt_jax._doctor.render import render_text


def _positive(kind: type) -> Any:
  """An argparse type: a `kind` number above 0."""

  def parse(text: str) -> Any:
    try:
      value = kind(text)
    except ValueError:
      value = 0
    if value <= 0:
      raise argparse.ArgumentTypeError(f"{text!r} is not a positive {kind.__name__}")
    return value

  return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The `rdt-jax doctor` options."""
  parser.add_argument("--json", action="store_true", help="print the report as JSON (for bug reports and tools)")
  parser.add_argument("--mb", type=_positive(int), default=16, help="MiB per loopback READ (default 16)")
  parser.add_argument("--timeout", type=_positive(float), default=60.0,
                      help="seconds the loopback READ may take before it counts as failed (default 60)")
  parser.add_argument("--jax-processes-per-gpu", type=_positive(int), default=1, metavar="N",
                      help="jax processes that will share each GPU (actors with fractional num_gpus); "
                           "checks that XLA's preallocation leaves room for them (default 1)")


def run(args: argparse.Namespace) -> int:
  """Runs every check, prints the report (text, or JSON with `--json`) on
  stdout and returns the exit status: 1 if any finding is a fail, else 0.

  While the checks run, each one's name as it starts and then its result go to
  stderr, a line each, so that stdout holds the report alone."""
  report = collect(args.mb, args.timeout, args.jax_processes_per_gpu, progress=sys.stderr)
  print(json.dumps(report, indent=2) if args.json else render_text(report))
  sys.stdout.flush()
  return int(report["exit_status"])
