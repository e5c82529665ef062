"""The bookkeeping a jax_nixl READ and a cached registration cost, before and
after a change: no NIXL, no Ray, one process per side, sides alternated.

Times `RemoteViews.open_read` + `close_read` on a loaded view (what every
READ pays), and `Registrations.register` of a registered region +
`unregister` (what every export of pooled or shared memory pays), with
agents that do nothing. Prints each side's median per call, in
microseconds, and the ratio (this checkout / baseline).

Run:  python scripts/room_locks_ab.py [--baseline HEAD] [--rounds 7] [--calls 20000]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from weights_ab import extract  # scripts/ is this script's sys.path[0]

REPO = pathlib.Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import rdt_jax.transports.nixl.views as V
import rdt_jax.transports.nixl.registrations as R
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata
from rdt_jax import _dlpack
assert V.__file__.startswith(sys.argv[1]), V.__file__

class Agent:
  def add_remote_agent(self, m): pass
  def remove_remote_agent(self, n): pass
  def register_memory(self, d, mem_type): return object()
  def deregister_memory(self, h): pass

agent, calls = Agent(), int(sys.argv[2])
shared = "lock" in V.RemoteViews.__init__.__code__.co_varnames  # one transport lock passed in
extra = (threading.RLock(),) if shared else ()
views = V.RemoteViews(lambda: agent, *extra, lambda: None)
regs = R.Registrations(lambda: agent, *extra, lambda: None)
meta = NixlTransportMetadata(tensor_meta=[], agent_name="p", agent_meta=b"m", agent_version=1)
cpu = _dlpack.Device("cpu")
views.close_read(views.open_read(meta))
regs.register(0x1000, 4096, cpu)
t = time.perf_counter()
for _ in range(calls):
  views.close_read(views.open_read(meta))
read = (time.perf_counter() - t) / calls * 1e6
t = time.perf_counter()
for _ in range(calls):
  regs.unregister([regs.register(0x1000, 4096, cpu)])
reg = (time.perf_counter() - t) / calls * 1e6
print(json.dumps({"read": read, "register": reg}))
"""


def _short(rev: str) -> str:
  return subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                        check=True).stdout.strip()


def run(source: str, calls: int) -> dict[str, float]:
  out = subprocess.run([sys.executable, "-c", CHILD, source, str(calls)], capture_output=True, text=True,
                       check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--baseline", default="HEAD")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--calls", type=int, default=20000)
  args = p.parse_args()
  commit, head = (_short(rev) for rev in (args.baseline, "HEAD"))
  with tempfile.TemporaryDirectory() as base:
    extract(args.baseline, pathlib.Path(base))
    samples: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    for i in range(args.rounds):
      order = [("baseline", base), ("this", str(REPO))]
      for side, source in order if i % 2 == 0 else order[::-1]:
        samples[side].append(run(source, args.calls))
  print(f"baseline {commit}, this checkout {head} (HEAD; uncommitted changes included), "
        f"{args.rounds} rounds of {args.calls} calls, sides alternated")
  for what, label in (("read", "open_read + close_read, loaded view"),
                      ("register", "register (cached) + unregister")):
    b = statistics.median(s[what] for s in samples["baseline"])
    t = statistics.median(s[what] for s in samples["this"])
    print(f"  {label:<38} baseline {b:.2f} us  this {t:.2f} us  ratio {t / b:.3f}x")


if __name__ == "__main__":
  main()
