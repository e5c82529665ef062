"""Statistics of a run: per-path summaries, ratios to baselines, and targets.

All ratios are of medians from the same run. A ratio "x to baseline B" is
`median(x) / median(B)` (below 1: x is faster); "speed-up" targets are
written the other way round and say so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from rdt_jax.bench import _cases, _paths

#: The rdt_jax transport the issue-5 targets are about.
TARGET_TRANSPORT: Final = "jax_nixl"


@dataclass(frozen=True)
class Summary:
  """Statistics of the measured samples of one (case, path, variant).

  `memory_peak` is the largest peak-RSS growth per side over the measured
  samples (warm: buffers a transport keeps for reuse are already there);
  `memory_first` the growth in the first sample, warm-up included (cold).
  """

  case: str
  path: str
  variant: str
  n: int
  median_s: float
  min_s: float
  max_s: float
  q1_s: float
  q3_s: float
  moved_bytes: int
  gbps: float
  read_median_s: float | None
  memory_peak: dict[str, int] | None
  memory_first: dict[str, int] | None
  ratios: dict[str, float]

  def to_json(self) -> dict[str, Any]:
    return dict(self.__dict__)


def summarize(samples: list[Any], cases: list[_cases.Case]) -> list[Summary]:
  """One Summary per (case, path, variant) with at least one good sample."""
  by_case = {c.id: c for c in cases}
  groups: dict[tuple[str, str, str], list[Any]] = {}
  first: dict[tuple[str, str, str], Any] = {}
  for s in samples:
    if s.seconds is None or s.error:
      continue
    key = (s.case, s.path, s.variant)
    first.setdefault(key, s)
    if not s.warmup:
      groups.setdefault(key, []).append(s)
  medians = {k: float(np.median([s.seconds for s in v])) for k, v in groups.items()}
  out = []
  for (case_id, path, variant), ss in groups.items():
    t = np.array([s.seconds for s in ss])
    reads = [s.read_seconds for s in ss if s.read_seconds is not None]
    moved = by_case[case_id].moved_nbytes(variant)
    median = medians[(case_id, path, variant)]
    ratios = {}
    for b in _paths.BASELINES:
      base = medians.get((case_id, b, variant))
      if base and b != path:
        ratios[b] = median / base
    out.append(Summary(
        case=case_id,
        path=path,
        variant=variant,
        n=len(ss),
        median_s=median,
        min_s=float(t.min()),
        max_s=float(t.max()),
        q1_s=float(np.percentile(t, 25)),
        q3_s=float(np.percentile(t, 75)),
        moved_bytes=moved,
        gbps=moved / median / 1e9 if median > 0 else float("inf"),
        read_median_s=float(np.median(reads)) if reads else None,
        memory_peak=_memory_peak(ss),
        memory_first=first[(case_id, path, variant)].memory,
        ratios=ratios,
    ))
  return out


def _memory_peak(samples: list[Any]) -> dict[str, int] | None:
  """The largest peak-RSS growth per side over the samples."""
  peaks: dict[str, int] = {}
  for s in samples:
    for side, v in (s.memory or {}).items():
      peaks[side] = max(peaks.get(side, v), v)
  return peaks or None


# --------------------------------------------------------------------------
# Targets (issue 5).


@dataclass(frozen=True)
class Target:
  """One performance target, evaluated on one run.

  Attributes:
    name: what is compared, in words.
    goal: the condition, e.g. "<= 1.0x".
    value: the measured ratio (None if it could not be computed).
    met: whether `value` satisfies `goal` (None if not computable).
    detail: the medians it came from, or why it is missing.
  """

  name: str
  goal: str
  value: float | None
  met: bool | None
  detail: str

  def to_json(self) -> dict[str, Any]:
    return dict(self.__dict__)


def _find(summaries: list[Summary], case: str, path: str, variant: str = "") -> Summary | None:
  for s in summaries:
    if s.case == case and s.path == path and s.variant == variant:
      return s
  return None


def _ratio_target(
    summaries: list[Summary],
    name: str,
    case: str,
    num: tuple[str, str],
    den: tuple[str, str],
    goal: str,
    ok: Callable[[float], bool | None],
) -> Target:
  a = _find(summaries, case, *num)
  b = _find(summaries, case, *den)
  if a is None or b is None:
    missing = [f"{p}{'/' + v if v else ''}" for (p, v), s in ((num, a), (den, b)) if s is None]
    return Target(name, goal, None, None, f"not measured in this run: {case} {', '.join(missing)}")
  value = a.median_s / b.median_s
  detail = (
      f"{_ms(a.median_s)} / {_ms(b.median_s)} "
      f"({num[0]}{'/' + num[1] if num[1] else ''} / {den[0]}{'/' + den[1] if den[1] else ''})"
  )
  return Target(name, goal, value, ok(value), detail)


def _ms(seconds: float) -> str:
  return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def targets(
    summaries: list[Summary],
    transport: str = TARGET_TRANSPORT,
    idle_cpu: dict[str, float] | None = None,
    splits: list[dict[str, Any]] | None = None,
) -> list[Target]:
  """The targets for `transport`, each met or not, from one run: plain returns
  at the cost of the bytes (against the object store with NumPy, and with NumPy
  made `jax.Array`s on the consumer), Ray's nixl, memory and idle CPU.
  `idle_cpu` is the run's idle CPU per actor group of rdt_jax transports;
  `splits` its per-side splits (`_without_jax_cost` takes jax's own cost from
  them)."""
  t = transport
  os_np, os_np_jax, os_jax = _paths.OS_NUMPY, _paths.OS_NUMPY_JAX, _paths.OS_JAX
  ray_nixl, floor = _paths.RAY_NIXL, _paths.RAY_FLOOR
  out = []
  for case, label in (("tree1000", "1,000 leaves / 64 MiB"), ("tree10000", "10,000 leaves / 64 MiB")):
    out += [
        _ratio_target(summaries, f"{t} {label} / object store NumPy made jax.Array", case,
                      (t, ""), (os_np_jax, ""), "<= 1.0x", lambda r: r <= 1.0),
        _ratio_target(summaries, f"{t} {label} / object store NumPy", case,
                      (t, ""), (os_np, ""), "<= 1.5x", lambda r: r <= 1.5),
        _without_jax_cost(summaries, splits or [], t, case, label),
        _ratio_target(summaries, f"{t} {label} / Ray nixl torch", case,
                      (t, ""), (ray_nixl, ""), "<= 0.5x", lambda r: r <= 0.5),
    ]
  out += [
      _ratio_target(summaries, f"{t} 4 KiB / object store NumPy", "4KiB",
                    (t, ""), (os_np, ""), "<= 1.5x", lambda r: r <= 1.5),
      _ratio_target(summaries, "Ray's floor: an RDT object that moves nothing, 4 KiB / object store NumPy",
                    "4KiB", (floor, ""), (os_np, ""), "(measured, no goal)", lambda r: None),
      _ratio_target(summaries, f"{t} 4 KiB / object store jax.Array", "4KiB",
                    (t, ""), (os_jax, ""), "< 1.0x", lambda r: r < 1.0),
      _ratio_target(summaries, f"{t} 256 MiB / object store NumPy", "256MiB",
                    (t, ""), (os_np, ""), "<= 1.0x", lambda r: r <= 1.0),
      _ratio_target(summaries, f"object store jax.Array / {t}, 256 MiB (speed-up)", "256MiB",
                    (os_jax, ""), (t, ""), ">= 10x", lambda r: r >= 10.0),
      _ratio_target(summaries, f"{t} 256 MiB / Ray nixl torch", "256MiB",
                    (t, ""), (ray_nixl, ""), "<= 0.5x", lambda r: r <= 0.5),
      _ratio_target(summaries, f"{t} one 64 MiB ref, 4 consumers / object store NumPy", "fanout4",
                    (t, "x4"), (os_np, "x4"), "<= 1.2x", lambda r: r <= 1.2),
      _ratio_target(summaries, f"{t} 64 refs: one by one / one ray.get (speed-up)", "refs64",
                    (t, "loop"), (t, "batch"), ">= 1.5x", lambda r: r >= 1.5),
      _ratio_target(summaries, f"{t} 8 refs: one by one / one ray.get (speed-up)", "refs8",
                    (t, "loop"), (t, "batch"), ">= 1.5x", lambda r: r >= 1.5),
  ]
  out.append(_memory_target(summaries, t))
  out.append(_idle_target(idle_cpu))
  return out


def _without_jax_cost(
    summaries: list[Summary], splits: list[dict[str, Any]], t: str, case: str, label: str
) -> Target:
  """`t` against the object store with NumPy, with jax's own cost of the
  consumer's `jax.Array`s taken off: making them from host memory as rdt_jax
  does and exposing them to NumPy for the read (`_cases.jax_cost_s`), the
  median over the run's per-side splits of `t` on `case`. (What a user of the
  object store pays to make them, one `jnp.asarray` each, is the NumPy made
  `jax.Array` path: several times more per array.)"""
  name = f"{t} {label} / object store NumPy, jax's own cost of the jax.Arrays subtracted"
  goal = "<= 1.5x"
  a, n = (_find(summaries, case, p) for p in (t, _paths.OS_NUMPY))
  costs = [s["jax_s"] for s in splits if s["case"] == case and s["path"] == t and "jax_s" in s]
  if a is None or n is None or not costs:
    return Target(name, goal, None, None, f"not measured in this run: {case}")
  jax_cost = float(np.median(costs))
  value = (a.median_s - jax_cost) / n.median_s
  detail = f"({_ms(a.median_s)} - {_ms(jax_cost)}) / {_ms(n.median_s)}"
  return Target(name, goal, value, value <= 1.5, detail)


#: "Idle CPU stays ~0": at most this many cores per actor group, idle.
IDLE_CORES_MAX: Final = 0.05


def _idle_target(idle_cpu: dict[str, float] | None) -> Target:
  name = "idle CPU per rdt_jax actor group (cores, worst group)"
  goal = f"<= {IDLE_CORES_MAX}"
  if not idle_cpu:
    return Target(name, goal, None, None, "not measured in this run")
  group, worst = max(idle_cpu.items(), key=lambda kv: kv[1])
  return Target(name, goal, worst, worst <= IDLE_CORES_MAX, f"worst: {group} {worst:.3f} cores")


#: Slack on the 1x memory target: RSS moves in 4 KiB pages, and a receive
#: buffer of exactly the payload plus a page of bookkeeping must pass.
MEMORY_SLACK: Final = 0.01


def _memory_target(summaries: list[Summary], transport: str) -> Target:
  name = f"{transport} peak extra memory per side / payload, 256 MiB"
  goal = f"<= 1.0x (+{MEMORY_SLACK:.0%} for page rounding)"
  s = _find(summaries, "256MiB", transport)
  if s is None or not s.memory_peak:
    return Target(name, goal, None, None, "not measured in this run: 256MiB memory")
  per_side: dict[str, float] = {}
  for mem in (s.memory_first or {}, s.memory_peak):
    for side, v in mem.items():
      per_side[side] = max(per_side.get(side, 0.0), max(0, v) / s.moved_bytes)
  worst = max(per_side.values())
  detail = ", ".join(f"{side} {r:.4f}x" for side, r in per_side.items())
  return Target(name, goal, worst, worst <= 1.0 + MEMORY_SLACK, f"max over samples, first included: {detail}")


def plain_check(summaries: list[Summary], case_id: str) -> dict[str, Any] | None:
  """Issue 3's check: plain method with rdt_jax registered / without."""
  without = _find(summaries, case_id, _paths.PLAIN_WITHOUT)
  with_ = _find(summaries, case_id, _paths.PLAIN_WITH)
  if without is None or with_ is None:
    return None
  return {
      "case": case_id,
      "without_rdt_jax_median_s": without.median_s,
      "with_rdt_jax_median_s": with_.median_s,
      "ratio": with_.median_s / without.median_s,
  }


# --------------------------------------------------------------------------
# Per-object and per-leaf cost (issue 14).

#: The sides a transfer's time is split into (see `ActorPath.run_split`).
SIDES: Final = ("producer", "ray", "consumer", "read")


def _slope_pair(cases: list[_cases.Case]) -> tuple[_cases.Case, _cases.Case] | None:
  """The two host tree cases of the same payload (within 1%) whose leaf
  counts differ most, or None."""
  trees = [c for c in cases if c.kind == "tree" and c.device == "cpu"]
  best = None
  for a in trees:
    for b in trees:
      if a.leaves < b.leaves and abs(a.object_nbytes - b.object_nbytes) <= 0.01 * b.object_nbytes:
        if best is None or b.leaves - a.leaves > best[1].leaves - best[0].leaves:
          best = (a, b)
  return best


def _fixed_case(cases: list[_cases.Case]) -> _cases.Case | None:
  """The smallest single-array host case: its time is the cost per object."""
  singles = [c for c in cases if c.kind == "single" and c.device == "cpu"]
  return min(singles, key=lambda c: c.object_nbytes, default=None)


def overhead(
    summaries: list[Summary], splits: list[dict[str, Any]], cases: list[_cases.Case]
) -> list[dict[str, Any]]:
  """Per path: the fixed cost per object and the cost per added leaf.

  The fixed cost is the median end-to-end time of the smallest single-array
  case; the per-leaf slope is the difference of the medians of two tree
  cases with the same payload divided by the difference of their leaf counts
  (microseconds per added leaf). Where per-side splits were measured (one-
  sided rdt_jax transports), both figures are also given per side: the
  producer's `ray.put`, Ray's rest, the consumer's `ray.get`, and reading.
  """
  fixed = _fixed_case(cases)
  pair = _slope_pair(cases)
  split_medians: dict[tuple[str, str], dict[str, float]] = {}
  keys = {(s["case"], s["path"]) for s in splits}
  for case_id, path in keys:
    rows = [s for s in splits if s["case"] == case_id and s["path"] == path]
    split_medians[(case_id, path)] = {
        side: float(np.median([r[f"{side}_s"] for r in rows])) for side in SIDES
    }
  out = []
  for path in dict.fromkeys(s.path for s in summaries):
    entry: dict[str, Any] = {"path": path, "fixed_case": None, "fixed_s": None,
                             "slope_cases": None, "slope_us": None, "sides": None}
    if fixed is not None and (f := _find(summaries, fixed.id, path)) is not None:
      entry["fixed_case"], entry["fixed_s"] = fixed.id, f.median_s
    if pair is not None:
      a, b = (_find(summaries, c.id, path) for c in pair)
      if a is not None and b is not None:
        entry["slope_cases"] = [pair[0].id, pair[1].id]
        entry["slope_us"] = (b.median_s - a.median_s) / (pair[1].leaves - pair[0].leaves) * 1e6
    sides: dict[str, dict[str, float | None]] = {}
    for side in SIDES:
      row: dict[str, float | None] = {"fixed_s": None, "slope_us": None}
      if fixed is not None and (fixed.id, path) in split_medians:
        row["fixed_s"] = split_medians[(fixed.id, path)][side]
      if pair is not None and all((c.id, path) in split_medians for c in pair):
        ma, mb = (split_medians[(c.id, path)][side] for c in pair)
        row["slope_us"] = (mb - ma) / (pair[1].leaves - pair[0].leaves) * 1e6
      sides[side] = row
    if any(v is not None for row in sides.values() for v in row.values()):
      entry["sides"] = sides
    if entry["fixed_s"] is not None or entry["slope_us"] is not None:
      out.append(entry)
  return out
