"""An actor class whose module imports rdt_jax but never registers it.

Its actors are created without `enable_tensor_transport=True`, so their
workers hold no rdt_jax transport until something registers one there
(receiving an rdt_jax ref does). Kept out of the test modules, which call
`rdt_jax.register()` on import (also in the workers that import them).
"""

from __future__ import annotations

import numpy as np
import ray

import rdt_jax


@ray.remote
class Plain:
  def put(self, n: int) -> list:
    return [ray.put(np.ones(n), _tensor_transport="jax_nixl")]

  def stats(self) -> dict[str, int]:
    return rdt_jax.receive_stats("jax_nixl")

  def take(self, x) -> float:
    return float(np.asarray(x).sum())

  def value(self) -> int:
    return 1


@ray.remote
class Borrower:
  def receive_with_rays_target(self, refs, target: str):
    """`ray.get` of the borrowed `refs[0]` after Ray's `set_target_for_ref`
    (numpy or torch buffers) or `set_target_device_for_ref` (a jax device).

    Returns whether jax_nixl was registered here before, and per leaf its
    type, values and whether it is the target buffer itself."""
    import jax
    from ray.experimental import set_target_device_for_ref, set_target_for_ref

    from rdt_jax import _ray

    [ref] = refs
    known_before = "jax_nixl" in _ray.state.registered_transports()
    buffers = []
    if target == "numpy":
      buffers = [np.zeros(3, np.int64), np.zeros(3, np.int64)]
    elif target == "torch":
      import torch

      buffers = [torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    if buffers:
      set_target_for_ref(ref, buffers)
    else:
      set_target_device_for_ref(ref, jax.devices("cpu")[0])
    got = ray.get(ref)
    same = [g is b for g, b in zip(got, buffers)]
    return known_before, [(type(g).__name__, np.asarray(g).tolist()) for g in got], same
