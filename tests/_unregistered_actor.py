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
