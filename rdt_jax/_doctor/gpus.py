"""The GPUs of this host: as torch (else jax) sees them, with peer access
between each pair, and `nvidia-smi`'s list, NVLink status and topology where
the tool exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any


def active_nvlinks(text: str) -> int:
  """Active links in `nvidia-smi nvlink -s` output (lines "Link N: <rate> GB/s")."""
  return len(re.findall(r"Link \d+:\s*[0-9.]+\s*GB/s", text))


def _run_tool(args: list[str], timeout_s: float = 10.0) -> str | None:
  """A command's stdout (stderr appended on failure), or None if the tool is missing."""
  if shutil.which(args[0]) is None:
    return None
  try:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return f"(`{' '.join(args)}` did not answer within {timeout_s:.0f} s)"
  except OSError as e:
    return f"(`{' '.join(args)}` failed: {e})"
  return proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr


def collect_gpus() -> dict[str, Any]:
  """GPUs as torch (else jax) sees them: count, names, peer access between
  each ordered pair (torch), and `nvidia-smi`'s list, NVLink status and
  topology where the tool exists (each call under a 10 s timeout)."""
  info: dict[str, Any] = {"count": 0, "names": [], "seen_by": "", "peer_access": {}}
  try:
    import torch

    if torch.cuda.is_available():
      n = torch.cuda.device_count()
      info.update(count=n, seen_by="torch", names=[torch.cuda.get_device_name(i) for i in range(n)])
      info["peer_access"] = {
          f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j))
          for i in range(n) for j in range(n) if i != j
      }
  except Exception as e:  # no torch, or a broken CUDA
    info["torch_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
  if not info["count"]:
    try:
      import jax

      gpus = jax.devices("gpu")
      info.update(count=len(gpus), seen_by="jax", names=[d.device_kind for d in gpus])
    except Exception:  # no jax GPU backend
      pass
  listing = _run_tool(["nvidia-smi", "-L"])
  info["nvidia_smi"] = listing is not None
  if listing is not None:
    info["smi_count"] = len(re.findall(r"^GPU \d+:", listing, re.MULTILINE))
    info["smi_list"] = listing.strip()
    nvlink = _run_tool(["nvidia-smi", "nvlink", "-s"]) or ""
    info["nvlink"] = nvlink.strip()
    info["active_nvlinks"] = active_nvlinks(nvlink)
    info["topology"] = (_run_tool(["nvidia-smi", "topo", "-m"]) or "").strip()
  return info
