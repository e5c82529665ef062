"""Back-to-back jax_nixl transfers of one pytree: time per transfer and the
consumers' pooled host buffers.

A learner returns the demo's parameters (256 MiB in 48 leaves) over
`jax_nixl` to two workers, in the order given by `--sequence` (`n` a jax_nixl
transfer, `o` one through the object store). Each line prints the transfer's
wall time and, per worker, (pooled host buffers it holds, how many of
them are free). A steady state keeps one buffer per worker: a second one means
the previous object's buffer still looked in use when the next one arrived,
and that transfer paid a fresh allocation, its page faults and a new NIXL
registration.

Run:  python scripts/back_to_back.py [--mb 256] [--leaves 48] [--sequence nonoonnonn]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import ray

import rdt_jax

rdt_jax.register()
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import demo  # noqa: E402


@ray.remote(enable_tensor_transport=True)
class Worker:
  def receive(self, params: dict) -> int:
    import jax

    return len(jax.tree_util.tree_leaves(params))

  def pool(self) -> tuple[int, int]:
    from rdt_jax import _memory

    p = _memory.host_pool
    c = p.counters()
    return c["buffers"], c["free_buffers"]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mb", type=int, default=256)
  parser.add_argument("--leaves", type=int, default=48)
  parser.add_argument("--sequence", default="nonoonnonn")
  args = parser.parse_args()
  ray.init(num_cpus=4, include_dashboard=False, logging_level="warning",
           runtime_env={"env_vars": {"PYTHONPATH": str(EXAMPLES)}})
  learner = demo.Learner.remote(args.mb, args.leaves)
  workers = [Worker.remote() for _ in range(2)]
  ray.get(learner.summary.remote())
  print(f"{'#':>2} {'path':<13}{'seconds':>8}  buffers per worker (free?)")
  for i, step in enumerate(args.sequence):
    method = learner.params_rdt if step == "n" else learner.params_object_store
    t0 = time.perf_counter()
    ref = method.remote()
    ray.get([w.receive.remote(ref) for w in workers])
    elapsed = time.perf_counter() - t0
    del ref
    pools = ray.get([w.pool.remote() for w in workers])
    name = "jax_nixl" if step == "n" else "object store"
    print(f"{i:>2} {name:<13}{elapsed:>8.3f}  {pools}", flush=True)
  ray.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
