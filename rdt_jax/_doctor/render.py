"""The report as a person reads it (`render_text`): versions, transports,
GPUs, UCX and XLA sections, then the findings with their why and fix, then the
exit status."""

from __future__ import annotations

from typing import Any


def _version_line(name: str, v: dict[str, Any]) -> str:
  version = v.get("version") or "missing"
  notes = []
  if name == "jax":
    notes.append(f"jaxlib {v.get('jaxlib') or 'missing'}")
    if v.get("plugins"):
      notes.append("plugins " + ", ".join(f"{k} {x}" for k, x in v["plugins"].items()))
    if v.get("backend"):
      notes.append(f"backend {v['backend']}")
  elif name == "torch" and v.get("version"):
    notes.append(f"CUDA {v['cuda']}" if v.get("cuda") else "CPU build")
  elif name == "cupy" and v.get("cuda"):
    notes.append(f"CUDA {v['cuda']}")
  elif name == "nixl" and v.get("module"):
    notes.append(f"{v['module'].split('.')[0]}" + (f", CUDA {v['cuda']} build" if v.get("cuda") else ""))
  if v.get("error") and v.get("version"):  # installed, but fails to import
    notes.append(v["error"].splitlines()[0][:160])
  if name == "ray" and v.get("tested_range"):
    notes.append(f"tested range ray{v['tested_range']}")
  return f"  {name:<10} {version}" + (f"  ({'; '.join(notes)})" if notes else "")


def render_text(report: dict[str, Any]) -> str:
  """The report as a person reads it: sections, then the findings with their
  why and fix, then the exit status."""
  lines = ["rdt-jax doctor", "", "Versions"]
  versions = {**report["versions"], "ray": {**report["versions"]["ray"], **report["ray"]}}
  lines += [_version_line(k, v) for k, v in versions.items()]
  t = report["transports"]
  lines += ["", "Transports",
            f"  rdt_jax    {', '.join(t['rdt_jax']) or 'none'}" + (f"  ({t['error']})" if t.get("error") else ""),
            "  Ray        " + ", ".join(k for k, v in t["ray_builtin"].items() if v["usable"]) + " usable here"]
  lines += [f"  {'':<10} {k}: needs {v['needs']}" for k, v in t["ray_builtin"].items() if not v["usable"]]
  g = report["gpus"]
  lines += ["", "GPUs"]
  if g["count"]:
    lines += [f"  {i}: {name}" for i, name in enumerate(g["names"])]
    if g["peer_access"]:
      lines.append("  peer access: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in g["peer_access"].items()))
    for key in ("nvlink", "topology"):
      if g.get(key):
        lines += [f"  nvidia-smi {'nvlink -s' if key == 'nvlink' else 'topo -m'}:"]
        lines += [f"    {line}" for line in g[key].splitlines()]
  else:
    lines.append("  none visible" + (" to torch or jax; nvidia-smi: " + g["smi_list"] if g.get("smi_list") else ""))
  u = report["ucx"]
  lines += ["", "UCX"]
  if u.get("error") and "reads" not in u:
    lines.append(f"  could not run: {u['error']}")
  if "env" in u:
    lines.append("  environment of a jax_nixl process: " + (" ".join(
        f"{k}={v}" + (" (set by rdt_jax)" if k in u["set_by_rdt_jax"] else "") for k, v in u["env"].items())
        or "no UCX_* variables"))
  if "reads" in u:
    lines.append(f"  loopback READ of {u['nbytes'] >> 20} MiB between two processes, UCX {u.get('version') or '?'}:")
    for memory, r in u["reads"].items():
      path = r["path"]
      how = f"{path['protocol']} over {path['transport']}" if path else "protocol not logged"
      rate = f"{r['gbps']:.2f} GB/s" if r["gbps"] else "no rate"
      state = "" if r["state"] == "DONE" else f", {r['state'].splitlines()[0][:200]}"
      lines.append(f"    {memory:<5} {how}, {rate}{state}")
    nl = u["node_local"]
    lines.append(f"  node-local host read (process_vm_readv): {nl['state']}"
                 + (f", {nl['gbps']:.2f} GB/s" if nl.get("gbps") else ""))
  if report["xla_memory"]:
    lines += ["", "XLA", *(f"  {k}={v}" for k, v in report["xla_memory"].items())]
  lines += ["", "Findings"]
  for f in report["findings"]:
    lines.append(f"  {f['severity']:<4}  {f['what']}")
    if f["severity"] != "ok" or f["why"]:
      lines += [f"        {label}: {f[label]}" for label in ("why", "fix") if f[label]]
  fails = sum(f["severity"] == "fail" for f in report["findings"])
  warns = sum(f["severity"] == "warn" for f in report["findings"])
  lines += ["", f"{fails} fail, {warns} warn: exit status {report['exit_status']}"]
  return "\n".join(lines)
