"""The doctor's progress, for a person waiting on it: each check's name as it
starts, then its result and time on the same line (`Progress`), written to a
stream of its own (stderr), so that the report on stdout stays as it was."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import TextIO

from rdt_jax._doctor.records import Finding

_RANK = {"ok": 0, "warn": 1, "fail": 2}


@dataclasses.dataclass
class Step:
  """One check in progress: what it concluded, for its progress line.

  Attributes:
    findings: the check's findings (its result is the worst of them).
    note: a result for a check that concludes nothing by itself (the versions
      it found), shown after the findings' verdict.
  """

  findings: list[Finding] = dataclasses.field(default_factory=list)
  note: str = ""

  def result(self) -> str:
    """The step's result in a few words: the worst finding's severity (with how
    many findings have it when several do), then the note."""
    parts = []
    if self.findings:
      worst = max((f.severity for f in self.findings), key=_RANK.__getitem__)
      count = sum(f.severity == worst for f in self.findings)
      parts.append(worst if count == 1 or worst == "ok" else f"{count} {worst}")
    if self.note:
      parts.append(self.note)
    return ", ".join(parts) or "done"


class Progress:
  """Writes `[i/n] name ... ` when a check starts and its result when it ends,
  flushed at once; a check that raises ends its line with the exception's type.

  Args:
    total: how many checks will run (the `n` of `[i/n]`).
    stream: where the lines go; None writes nothing.
  """

  def __init__(self, total: int, stream: TextIO | None):
    self._total = total
    self._stream = stream
    self._started = 0

  def _write(self, text: str) -> None:
    if self._stream is not None:
      self._stream.write(text)
      self._stream.flush()

  @contextlib.contextmanager
  def check(self, name: str) -> Iterator[Step]:
    """A context for one check named `name`: its line starts on entry, and ends
    on exit with what the check put in the `Step` it yields."""
    self._started += 1
    self._write(f"[{self._started}/{self._total}] {name} ... ")
    step, start = Step(), time.monotonic()
    try:
      yield step
    except BaseException as e:
      self._write(f"stopped by {type(e).__name__} ({time.monotonic() - start:.1f} s)\n")
      raise
    self._write(f"{step.result()} ({time.monotonic() - start:.1f} s)\n")
