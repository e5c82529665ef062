"""Box geometry of resharded pulls.

A box is one `(start, stop)` per axis of an array. A consumer that needs other
pieces than the producer's shards (a target sharding, an `rdt_jax.Slice`)
names the boxes it needs; the producer checks that each `fits` the array and
offers each non-empty one (`volume`) as a single-device array `cut` from it,
so only those bytes cross.
"""

from __future__ import annotations

import math
from typing import Any


def fits(box: Any, shape: tuple[int, ...]) -> bool:
  """Whether `box` lies inside an array of `shape`."""
  return len(box) == len(shape) and all(0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape))


def volume(box: Any) -> int:
  """The number of elements in `box`."""
  return math.prod(hi - lo for lo, hi in box)


def cut(array: Any, box: Any) -> Any:
  """`array[box]` as a single-device array on the producer (a copy)."""
  import jax

  part = array[tuple(slice(lo, hi) for lo, hi in box)]
  return jax.device_put(part, next(iter(array.devices())))
