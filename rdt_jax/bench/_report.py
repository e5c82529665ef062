"""The outputs of a run: a JSON document, a Markdown report, and a PNG plot.

Every figure in the Markdown and the plot is computed from the JSON document's
`summary`, so the three always agree.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any, Final

from rdt_jax.bench import _cases, _env, _paths, _results

#: Column order of the tables: our transports first, then the baselines.
_BASELINE_ORDER: Final = (
    _paths.RAY_NIXL, _paths.RAY_FLOOR, _paths.RAY_CUDA_IPC, _paths.OS_NUMPY, _paths.OS_NUMPY_JAX, _paths.OS_JAX,
    _paths.MEMCPY, _paths.DEVICE_MEMCPY,
)


def write_json(doc: dict[str, Any], path: pathlib.Path) -> None:
  """Writes `doc` (all samples and the summary) as compact JSON (`_results.write`)."""
  _results.write(path, doc, default=_json_default)


def _json_default(x: Any) -> Any:
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if hasattr(x, "tolist"):
    return x.tolist()
  return str(x)


# --------------------------------------------------------------------------
# Markdown.


def _ms(seconds: float | None) -> str:
  if seconds is None:
    return ""
  if seconds >= 1:
    return f"{_num(seconds)} s"
  return f"{_num(seconds * 1e3)} ms"


def _num(x: float) -> str:
  """Three significant digits, without exponents."""
  return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _spread(s: dict[str, Any]) -> str:
  """`median [min-max] unit` in one unit chosen by the median."""
  scale, unit = (1.0, "s") if s["median_s"] >= 1 else (1e3, "ms")
  return f"{_num(s['median_s'] * scale)} [{_num(s['min_s'] * scale)}-{_num(s['max_s'] * scale)}] {unit}"


def _column_order(doc: dict[str, Any]) -> list[str]:
  present = {s["path"] for s in doc["summary"]}
  ours = [p["id"] for p in doc["paths"] if p["kind"] == "rdt_jax" and p["id"] in present]
  return ours + [b for b in _BASELINE_ORDER if b in present]


def _labels(doc: dict[str, Any]) -> dict[str, str]:
  return {p["id"]: p["label"] for p in doc["paths"]}


def _rows(doc: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
  """(case, variant) rows in run order, excluding the plain check."""
  rows: list[tuple[dict[str, Any], str]] = []
  for case in doc["cases"]:
    if case["kind"] == "plain":
      continue
    rows.extend((case, v) for v in case["variants"])
  return rows


def _row_name(case: dict[str, Any], variant: str) -> str:
  name = case["description"]
  if variant == "batch":
    return f"{name}, one ray.get"
  if variant == "loop":
    return f"{name}, get one by one"
  if variant:
    n = int(variant[1:])
    return f"{name} -> {n} consumer{'s' if n > 1 else ''}"
  return name


def _target_value(t: dict[str, Any]) -> str:
  if t["value"] is None:
    return ""
  return f"{t['value']:.2f}" + ("" if t["name"].startswith("idle CPU") else "x")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
  out += ["| " + " | ".join(r) + " |" for r in rows]
  return out


def markdown(doc: dict[str, Any]) -> str:
  """The report as Markdown: times, bandwidth, ratios, targets, checks."""
  index = {(s["case"], s["path"], s["variant"]): s for s in doc["summary"]}
  cols = _column_order(doc)
  labels = _labels(doc)
  skip_index = {(k["case"], k["path"]): k["reason"] for k in doc["skips"]}
  env = doc["environment"]
  lines = [
      f"# rdt-jax bench ({doc['config']['label']})",
      "",
      f"{env['date']} · {env['cpus']} CPUs · Ray {env['versions'].get('ray')} · "
      f"jax {env['versions'].get('jax')} · torch {env['versions'].get('torch')} · "
      f"nixl {env['versions'].get('nixl')} · wall time {doc['wall_s']:.0f} s",
      "",
      "End to end: producer method call -> ref passed to a consumer actor that "
      + (
          "reads every byte into a checksum (a sum of 64-bit words per 4 KiB block, each "
          "block weighted by its place: a changed byte or misplaced block fails the run)"
          if doc["config"].get("checksum") == "block-weighted"
          else "sums every byte"
      )
      + " -> result in the driver. Paths interleaved per repetition in "
      "rotating order; actors of the paths not being measured are paused"
      f"{'' if doc['config']['pause'] else ' (off in this run)'}. "
      "Median [min-max] over the measured repetitions (warm-up excluded); "
      "(n=...) marks a slow path that ran fewer repetitions than the others, to "
      "stay within its time budget per case.",
      "",
  ]
  if env.get("ucx") is not None:
    lines += [_env.ucx_text(env["ucx"]), ""]
  device_notes = _device_notes({s["path"] for s in doc["summary"]})
  if device_notes:
    lines += [device_notes, ""]
  lines += ["## End-to-end time", ""]

  def cell(case, variant, col, fmt) -> str:
    s = index.get((case["id"], col, variant))
    if s is not None:
      return fmt(s)
    return "skipped" if (case["id"], col) in skip_index else ""

  def timed(case: dict[str, Any]):
    def fmt(s: dict[str, Any]) -> str:
      fewer = case["reps"] is not None and s["n"] < case["reps"]
      return _spread(s) + (f" (n={s['n']})" if fewer else "")
    return fmt

  rows = _rows(doc)
  lines += _table(
      ["case", *(labels[c] for c in cols)],
      [
          [_row_name(c, v), *(cell(c, v, col, timed(c)) for col in cols)]
          for c, v in rows
      ],
  )
  lines += ["", "## Bandwidth (GB/s: payload bytes read / median time)", ""]
  lines += _table(
      ["case", *(labels[c] for c in cols)],
      [[_row_name(c, v), *(cell(c, v, col, lambda s: f"{s['gbps']:.2f}") for col in cols)] for c, v in rows],
  )
  ours = [p["id"] for p in doc["paths"] if p["kind"] == "rdt_jax" and p["id"] in cols]
  baselines = [b for b in _BASELINE_ORDER if b in cols]
  for t in ours:
    lines += ["", f"## {t}: ratio of medians to each baseline (below 1: {t} is faster)", ""]
    table_rows = []
    for c, v in rows:
      s = index.get((c["id"], t, v))
      if s is None:
        continue
      table_rows.append([_row_name(c, v), *(f"{s['ratios'][b]:.2f}x" if b in s["ratios"] else "" for b in baselines)])
    lines += _table(["case", *(f"vs {labels[b]}" for b in baselines)], table_rows)
  lines += _overhead_lines(doc, labels)
  lines += ["", "## Targets (ratios of medians in this run)", ""]
  lines += _table(
      ["target", "goal", "measured", "met", "from"],
      [
          [t["name"], t["goal"], _target_value(t),
           {True: "met", False: "NOT met", None: "n/a"}[t["met"]], t["detail"]]
          for t in doc["targets"]
      ],
  )
  if doc.get("plain_check"):
    p = doc["plain_check"]
    lines += [
        "",
        "## Plain method without tensor_transport",
        "",
        f"A {_cases.format_bytes(p['nbytes'])} NumPy array returned by a method without "
        "`tensor_transport` and read by the driver, from a producer process that never "
        "imported rdt_jax vs one that imported it and called `register()`: "
        f"{_ms(p['without_rdt_jax_median_s'])} without, {_ms(p['with_rdt_jax_median_s'])} "
        f"with, ratio {p['ratio']:.2f}x (medians).",
    ]
  mem_rows = _memory_rows(doc, cols, labels)
  if mem_rows:
    lines += [
        "",
        "## Peak extra memory per side (peak-RSS growth during a transfer / payload)",
        "",
        "First: the first transfer of the case (warm-up). Warm: the largest over the "
        "measured repetitions, when buffers a path keeps for reuse already exist. "
        "RSS counts object-store pages a process maps.",
        "",
    ]
    lines += _table(["case", "path", "first", "warm"], mem_rows)
  if doc["idle_cpu"]:
    lines += [
        "",
        "## Idle CPU per actor group (cores, after each path ran once)",
        "",
        ", ".join(f"{k}: {v:.2f}" for k, v in doc["idle_cpu"].items()),
    ]
  if doc["skips"]:
    lines += ["", "## Skipped", ""]
    seen = set()
    for k in doc["skips"]:
      key = (k["path"], k["reason"])
      cases = [x["case"] for x in doc["skips"] if (x["path"], x["reason"]) == key]
      if key in seen:
        continue
      seen.add(key)
      lines.append(f"* {k['path']} on {', '.join(dict.fromkeys(cases))}: {k['reason']}")
  notes = [p for p in doc["paths"] if p.get("note")]
  if notes:
    lines += ["", "## Notes", ""]
    lines += [f"* {p['id']}: {p['note']}" for p in notes]
  return "\n".join(lines) + "\n"


def _device_notes(measured: set[str]) -> str:
  """What the device baselines among the `measured` paths compare, or ""."""
  notes = []
  if _paths.RAY_CUDA_IPC in measured:
    notes.append(
        "Ray cuda_ipc maps the producer's tensor instead of copying it (both actors hold a share of the "
        "same GPU); its consumer reads every byte on the GPU, as every path's consumer does."
    )
  if _paths.DEVICE_MEMCPY in measured:
    notes.append(
        "Device memcpy: torch copies of the same bytes between two tensors on the GPU in one actor, "
        "synchronized before and after, timed in that actor: the limit for device cases."
    )
  return " ".join(notes)


def _overhead_lines(doc: dict[str, Any], labels: dict[str, str]) -> list[str]:
  """The per-object and per-leaf cost section (empty if not computable)."""
  rows = doc.get("overhead") or []
  if not rows:
    return []
  first = rows[0]
  fixed_case = next((r["fixed_case"] for r in rows if r["fixed_case"]), None)
  slope_cases = next((r["slope_cases"] for r in rows if r["slope_cases"]), None)
  lines = [
      "",
      "## Per-object and per-leaf cost",
      "",
      "Fixed cost per object: the median end-to-end time of "
      + (f"`{fixed_case}`" if fixed_case else "the smallest single-array case (not in this run)")
      + ". Per added leaf: the difference of the medians of "
      + (f"`{slope_cases[0]}` and `{slope_cases[1]}` (same payload)" if slope_cases
         else "two tree cases of the same payload (not in this run)")
      + " over the difference of their leaf counts. For one-sided rdt_jax transports "
      "the same figures per side, from separate interleaved transfers timed inside the "
      "actors: the producer's `ray.put`, the consumer's `ray.get`, its reading every "
      "byte, and Ray's rest of the driver's time (two actor calls, the owner's metadata).",
      "",
  ]
  del first

  def us(x: float | None) -> str:
    return "" if x is None else f"{x:.1f} us"

  def side(r: dict[str, Any], name: str) -> str:
    s = (r.get("sides") or {}).get(name)
    if not s:
      return ""
    return f"{_ms(s['fixed_s'])} / {us(s['slope_us'])}".strip(" /")

  lines += _table(
      ["path", "per object", "per added leaf", "producer", "Ray", "consumer", "read"],
      [
          [labels.get(r["path"], r["path"]), _ms(r["fixed_s"]), us(r["slope_us"]),
           *(side(r, s) for s in ("producer", "ray", "consumer", "read"))]
          for r in rows
      ],
  )
  lines += ["", "Per side: per object / per added leaf."]
  return lines


def _memory_rows(doc: dict[str, Any], cols: list[str], labels: dict[str, str]) -> list[list[str]]:
  rows = []
  for s in doc["summary"]:
    if not s["memory_peak"]:
      continue
    case = next(c for c in doc["cases"] if c["id"] == s["case"])
    payload = case["object_nbytes"] * (case["count"] if case["kind"] == "refs" else 1)

    def sides(mem: dict[str, int] | None, payload: int = payload) -> str:
      return ", ".join(f"{side} {max(0, v) / payload:.2f}x" for side, v in (mem or {}).items())

    rows.append([_row_name(case, s["variant"]), labels.get(s["path"], s["path"]),
                 sides(s["memory_first"]), sides(s["memory_peak"])])
  return rows


# --------------------------------------------------------------------------
# Plot.


def plot(doc: dict[str, Any], path: pathlib.Path) -> bool:
  """Draws bandwidth vs payload size per path (single-array cases, log axes).

  Returns False (and draws nothing) if matplotlib is not installed.
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  labels = _labels(doc)
  devices = [d for d in ("cpu", "cuda") if any(
      c["kind"] == "single" and c["device"] == d for c in doc["cases"])]
  fig, axes = plt.subplots(1, max(1, len(devices)), figsize=(7.5 * max(1, len(devices)), 5), squeeze=False)
  for ax, device in zip(axes[0], devices or ["cpu"]):
    singles = {c["id"]: c for c in doc["cases"] if c["kind"] == "single" and c["device"] == device}
    for pid in _column_order(doc):
      pts = sorted(
          (singles[s["case"]]["object_nbytes"], s)
          for s in doc["summary"]
          if s["case"] in singles and s["path"] == pid
      )
      if not pts:
        continue
      x = [n for n, _ in pts]
      y = [s["gbps"] for _, s in pts]
      lo = [max(0.0, s["gbps"] - n / s["max_s"] / 1e9) for n, s in pts]
      hi = [n / s["min_s"] / 1e9 - s["gbps"] for n, s in pts]
      style = "-" if pid in doc.get("rdt_jax_paths", []) else "--"
      ax.errorbar(x, y, yerr=[lo, hi], fmt="o" + style, capsize=3, label=labels.get(pid, pid),
                  linewidth=2.2 if style == "-" else 1.2, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload (bytes)")
    ax.set_ylabel("GB/s (payload / median end-to-end time)")
    ax.set_title(f"{'device-to-device' if device == 'cuda' else 'host'} arrays, one ref, one consumer")
    ax.grid(True, which="both", alpha=0.3)
    ticks = sorted(singles[c]["object_nbytes"] for c in singles)
    if ticks:
      ax.set_xticks(ticks)
      ax.set_xticklabels([_cases.format_bytes(t).replace(" ", "") for t in ticks], rotation=45)
    ax.legend(fontsize=8)
  env = doc["environment"]
  fig.suptitle(
      f"rdt-jax bench ({doc['config']['label']}), {env['date']}, {env['cpus']} CPUs", fontsize=10)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True
