"""The `rdt-jax` command line (also `python -m rdt_jax`).

Subcommands:
  bench   measure every way of moving arrays between Ray actors, side by side
          (see `rdt-jax bench --help` and `rdt_jax.bench`).
  soak    run the trainer -> generators weight-sync loop for N minutes and
          report transfers, bytes, errors and memory high-water marks
          (--chaos, --churn, --weight-sync: the checks under faults).
  doctor  check this host before the first transfer (versions, transports,
          GPUs, the UCX paths NIXL reads with); exit status 1 on a
          configuration that will fail or be slow (see `rdt_jax._doctor`).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
  """Entry point of the `rdt-jax` console script; returns the exit status."""
  parser = argparse.ArgumentParser(prog="rdt-jax", description="rdt_jax command line tools.")
  commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  bench = commands.add_parser(
      "bench",
      help="benchmark rdt_jax transports against Ray's paths",
      description="Measure rdt_jax transports, Ray's nixl (torch), the object store "
                  "(NumPy, jax.Array) and memcpy in one interleaved run; write JSON, "
                  "Markdown and a PNG plot.",
  )
  from rdt_jax.bench import _soak, add_arguments, run_from_args

  add_arguments(bench)
  soak = commands.add_parser(
      "soak",
      help="run the weight-sync loop for N minutes and report errors and memory",
      description=_soak.__doc__.split("\n\n")[0],
  )
  _soak.add_arguments(soak)
  from rdt_jax import _doctor

  doctor = commands.add_parser(
      "doctor",
      help="check versions, transports, GPUs and UCX's paths before the first transfer",
      description="Print what rdt_jax will do on this host: versions and CUDA builds, registered "
                  "transports, GPUs and their peer access, and which UCX protocol a NIXL READ of host "
                  "and device memory uses (a loopback READ between two processes). Exit status 1 if "
                  "a finding is a fail: a configuration that will fail or be slow.",
  )
  _doctor.add_arguments(doctor)
  args = parser.parse_args(argv)
  if args.command == "soak":
    return _soak.run(args)
  if args.command == "doctor":
    return _doctor.run(args)
  return run_from_args(args, bench)


if __name__ == "__main__":
  sys.exit(main())
