"""How old the GPU evidence is: the revision the last GPU run measured, and how
many commits since changed device code, from git.

CPU CI skips tests/gpu, so the GPU results under docs/benchmarks/gpu/ say
nothing of device code changed after them. docs/gpu.md shows `text()` in a
generated block (scripts/sync_docs.py runs this script for it), and
tests/test_gpu_age.py checks that block against git, so the page cannot keep an
age that is no longer true: a commit that changes device code refreshes it
(`python scripts/sync_docs.py`).

  python scripts/gpu_age.py   # print the sentence
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Final

REPO = pathlib.Path(__file__).resolve().parent.parent

#: The code that only a GPU run exercises (CPU CI skips tests/gpu), with why.
#: A rename here must follow the code: tests/test_gpu_age.py checks each exists.
DEVICE_CODE: Final = (
    # the device pool, CUDA allocations and their IPC handles, stream waits before reuse
    "rdt_jax/_memory/",
    # how CUDA leaves of jax, torch and cupy are recognised, exported and rebuilt
    "rdt_jax/_dlpack/",
    # an object's CUDA chunks packed into one region per device
    "rdt_jax/_layout/_packing.py",
    # a fetch's plan: device checks, copies into CUDA targets after queued work
    "rdt_jax/transports/_plan.py",
    # jax_nccl, which moves CUDA memory only
    "rdt_jax/transports/_collective.py",
    # jax_nixl's READs of device memory: UCX's CUDA IPC settings, views rebuilt for device READs
    "rdt_jax/transports/nixl/",
    # jax_transfer with a GPU jax (tests/gpu moves device arrays through it)
    "rdt_jax/transports/transfer/",
    # weight versions packed in device memory, and the CUDA IPC route that reads them
    "rdt_jax/weights/_device.py",
    "rdt_jax/weights/_device_route.py",
    # whether a version is packed in device memory
    "rdt_jax/weights/_packed.py",
    # the publisher's device copies, the subscriber's route choice and commit into CUDA templates
    "rdt_jax/weights/_publisher.py",
    "rdt_jax/weights/_subscriber.py",
    "rdt_jax/weights/_routes.py",
    "rdt_jax/weights/_staging.py",
    # the GPU tests themselves: a changed test has not run on a GPU either
    "tests/gpu/",
)

#: Where GPU runs keep their results; every JSON result there records the
#: revision it measured (`environment.git` or the top-level `commit`).
GPU_RESULTS: Final = ("docs/benchmarks/gpu", "docs/development/benchmarks/gpu-first-run")


class Unavailable(LookupError):
  """The history the age is computed from is not here: no git, not a clone
  (a wheel or sdist install), a shallow clone, or a clone without the last
  GPU run's revision. Fetch the full history (`git fetch --unshallow`) to
  compute it."""


@dataclass(frozen=True)
class GpuRun:
  """One GPU run's results file and what it recorded of its revision."""

  path: str  # from the repository root
  date: str  # ISO 8601, as recorded
  commit: str  # the checkout's HEAD when it ran
  uncommitted: int  # rdt_jax files that differed from `commit`


def _recorded(doc: Any) -> tuple[str, str, int] | None:
  """(date, commit, uncommitted files) a results document records, or None."""
  if not isinstance(doc, dict):
    return None
  env = doc.get("environment") if isinstance(doc.get("environment"), dict) else {}
  git = env.get("git") if isinstance(env.get("git"), dict) else doc
  date = env.get("date") or doc.get("when") or doc.get("date")
  if not (isinstance(git.get("commit"), str) and isinstance(date, str)):
    return None
  return date, git["commit"], len(git.get("uncommitted_rdt_jax_files") or [])


def runs(root: pathlib.Path = REPO) -> list[GpuRun]:
  """Every GPU results file under GPU_RESULTS that records its revision."""
  found = []
  for folder in GPU_RESULTS:
    for path in sorted((root / folder).rglob("*.json")):
      recorded = _recorded(json.loads(path.read_text()))
      if recorded is not None:
        found.append(GpuRun(path.relative_to(root).as_posix(), *recorded))
  return found


def last_run(root: pathlib.Path = REPO) -> GpuRun:
  """The newest GPU run by its recorded date.

  Raises:
    LookupError: if no results file under GPU_RESULTS records a revision.
  """
  found = runs(root)
  if not found:
    raise LookupError(f"no GPU results recording a commit under {', '.join(GPU_RESULTS)}")
  return max(found, key=lambda r: r.date)


def _git(root: pathlib.Path, *args: str) -> str:
  try:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.SubprocessError) as e:
    raise Unavailable(f"git {' '.join(args)} did not run in {root}: {e}") from None
  if out.returncode != 0:
    raise Unavailable(f"git {' '.join(args)} failed in {root}: {out.stderr.strip()}")
  return out.stdout.strip()


def device_commits_since(commit: str, root: pathlib.Path = REPO, paths: tuple[str, ...] = DEVICE_CODE) -> int:
  """The commits after `commit` up to HEAD that changed `paths` (merges
  aside: they change nothing of their own), plus one where the working tree
  or index changes them (the commit those changes will become, so a page
  refreshed before that commit is still true after it).

  Raises:
    Unavailable: if `root` is not a full clone holding `commit`.
  """
  if _git(root, "rev-parse", "--is-shallow-repository") != "false":
    raise Unavailable(f"{root} is a shallow clone: the commits since {commit[:7]} are not all here")
  _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
  count = int(_git(root, "rev-list", "--count", "--no-merges", "--full-history", f"{commit}..HEAD", "--", *paths))
  pending = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *paths)
  return count + (1 if pending else 0)


def text(root: pathlib.Path = REPO, paths: tuple[str, ...] = DEVICE_CODE) -> str:
  """The sentence docs/gpu.md shows: the last GPU run's date and revision,
  and how many device-code commits (`device_commits_since` of `paths`) old
  its results are.

  Raises:
    Unavailable: if git or the history since that run is not here.
  """
  run = last_run(root)
  n = device_commits_since(run.commit, root, paths)
  short = run.commit[:7]
  s = "" if n == 1 else "s"
  commits = f"{n} commit{s}"
  if run.uncommitted:
    return (
        f"The last GPU run ({run.date[:10]}, `{run.path}`) measured revision {short} with changes "
        f"to {run.uncommitted} rdt_jax files not yet committed; {commits} since {short} changed "
        f"device code or the GPU tests (`scripts/gpu_age.py` lists the paths), so the GPU results "
        f"are at most {n} device-code commit{s} old."
    )
  return (
      f"The last GPU run ({run.date[:10]}, `{run.path}`) measured revision {short}; {commits} since "
      f"changed device code or the GPU tests (`scripts/gpu_age.py` lists the paths), so the GPU "
      f"results are {n} device-code commit{s} old."
  )


def main() -> int:
  try:
    print(text())
  except Unavailable as e:
    print(f"gpu_age: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
