"""Reproduces a stall the weight-sync soak found: a pull through Ray of a packed
version that its publisher frees while the pull still has buckets to fetch.

A trainer publishes versions of 3 MiB (three buckets of
`RDT_JAX_WEIGHT_BUCKET_BYTES` = 1 MiB) with `keep=1`. A generator whose
node-local reads are off (`RDT_JAX_NIXL_CMA=0`, as on another host) pulls
version 1 (a warm-up: its connection to the trainer is made), then version 2
with `timeout=None`; fault injection holds that pull 2 s after it copied its
first bucket (`weights.bucket:delay=2@4*1`: the fourth bucket copied).
Meanwhile the trainer publishes version 3, which frees version 2 and its bucket
objects (`rdt_jax._ray.state.free_now`). The
contract (docs/weight_sync.md) is a failed pull: "a version freed while it was
read is refused too". What happens: the fetch of the third bucket posts a NIXL
READ of memory its producer has deregistered; the READ does not end until Ray
gives up on the fetch (`RAY_rdt_fetch_fail_timeout_milliseconds`, 60 s by
default, whatever the rdt_jax settings), and only then does the pull raise
`StaleWeightsError` ("was freed while it was being read"): about 62 s after it
began, where a freed version found by the subscriber's own checks is refused at
once. Since the pull asks its publisher every 2 s while a bucket's fetch runs
(`rdt_jax.weights._routes.await_bucket`), it raises `StaleWeightsError` within
seconds (4.2 s here, 2 of them the injected delay).

`--object` shows the same below weight sync: a plain jax_nixl RDT object freed
with `free_now` before a consumer (node-local reads off) fetches it: `ray.get`
raises Ray's `ObjectFetchTimedOutError` only after the same 60 s.

Usage:
  PYTHONPATH=. python scripts/repro_freed_bucket.py [--object] [--wait 90]

Prints what the pull (or fetch) did within `--wait` seconds, e.g.
  pull of version 1: returned after 1.2 s: 1.0
  pull of version 2: raised StaleWeightsError after 4.2 s: Version 2 was freed while it was being read ...
(with `--wait 45`: "HANG (no answer after 45 s)").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import time

import numpy as np
import ray

import rdt_jax

rdt_jax.register()  # before the actor classes: their methods name jax_nixl


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self) -> None:
    self.publisher = rdt_jax.WeightPublisher("jax_nixl", keep=1)
    self.refs: list = []

  def publish(self, version: int) -> rdt_jax.WeightsHandle:
    return self.publisher.publish({"w": np.full(3 << 18, version, np.float32)}, version)

  def put(self) -> list:
    self.refs = [ray.put(np.full(1 << 20, 7, np.uint8), _tensor_transport="jax_nixl")]
    return self.refs

  def free(self) -> None:
    from rdt_jax import _ray

    _ray.state.free_now(self.refs[0].hex())


def _bounded(fn, wait: float) -> str:
  t0 = time.monotonic()
  try:
    out = concurrent.futures.ThreadPoolExecutor(1).submit(fn).result(timeout=wait)
    return f"returned after {time.monotonic() - t0:.1f} s: {out}"
  except concurrent.futures.TimeoutError:
    return f"HANG (no answer after {wait:.0f} s)"
  except Exception as e:
    return f"raised {type(e).__name__} after {time.monotonic() - t0:.1f} s: {str(e)[:300]}"


@ray.remote(enable_tensor_transport=True)
class Generator:
  def pull(self, handle: rdt_jax.WeightsHandle, wait: float) -> str:
    """Pulls `handle` into a new subscriber; what happened within `wait` s."""
    sub = rdt_jax.WeightSubscriber({"w": np.zeros(3 << 18, np.float32)})
    return _bounded(lambda: float(sub.pull(handle)["w"][0]), wait)

  def get(self, refs: list, wait: float) -> str:
    return _bounded(lambda: int(ray.get(refs[0])[0]), wait)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--object", action="store_true", help="a plain RDT object freed, then fetched")
  parser.add_argument("--wait", type=float, default=90.0, help="seconds to wait for an answer")
  args = parser.parse_args()
  ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level=logging.ERROR)
  trainer = Trainer.options(runtime_env={"env_vars": {"RDT_JAX_WEIGHT_BUCKET_BYTES": str(1 << 20)}}).remote()
  env = {"RDT_JAX_NIXL_CMA": "0", "RDT_JAX_FAULTS": "weights.bucket:delay=2@4*1", "RDT_JAX_FAULTS_ENABLE": "1"}
  generator = Generator.options(runtime_env={"env_vars": env}).remote()
  if args.object:
    refs = ray.get(trainer.put.remote())
    ray.get(trainer.free.remote())
    print(f"fetch of a freed object: {ray.get(generator.get.remote(refs, args.wait))}")
  else:
    print(f"pull of version 1: {ray.get(generator.pull.remote(trainer.publish.remote(1), args.wait))}")
    pull = generator.pull.remote(trainer.publish.remote(2), args.wait)
    time.sleep(1.0)  # the generator has copied bucket 0 of version 2 and waits 2 s before the next
    ray.get(trainer.publish.remote(3))  # keep=1: version 2 and its buckets are freed
    print(f"pull of version 2: {ray.get(pull)}")
  ray.shutdown()


if __name__ == "__main__":
  main()
