"""A subscriber's plans: one entry per plan, keyed by all that decides it.

A plan says where each byte of a version goes, and it depends on the
version's structure and on the route its bytes take: a packed host buffer,
a buffer in device memory or a pytree, for the one publisher or for each
trainer process's part of a combined version. `PlanKey` names both, so a
structure whose route changes (a publisher created again with another
`pack` setting, one trainer process's part falling back to a pytree) gets a
plan of its own and never one made for the other route.

`Plans` keeps each plan whole in one entry: a plan made of pieces (a mapped
pull of a combined version: its mapping, its staging arrays and the reads
into them) is built before it is stored and dropped as one, so no piece of
it outlives another, and a plan whose making failed is not stored at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rdt_jax import _limits
from rdt_jax.weights._handle import WeightsHandle

__all__ = ["PlanKey", "Plans", "route_of"]


def _kind(handle: WeightsHandle) -> str:
  """How one publisher's part of a version travels: "pytree", "host"
  (packed in host memory) or "device" (packed in device memory)."""
  packed = handle.packed
  if packed is None:
    return "pytree"
  return "device" if getattr(packed, "device", -1) != -1 else "host"


def route_of(handle: WeightsHandle) -> tuple[str, ...]:
  """Each part's way of travelling (one part for a one-publisher handle)."""
  return tuple(_kind(part) for part in handle.parts) if handle.parts else (_kind(handle),)


@dataclass(frozen=True)
class PlanKey:
  """What decides a plan: the version's structure (its digest), the route
  of each of its parts, and whether it combines trainer processes."""

  structure: str
  route: tuple[str, ...]
  combined: bool

  @classmethod
  def of(cls, handle: WeightsHandle) -> PlanKey:
    return cls(handle.structure, route_of(handle), bool(handle.parts))


_MISSING = object()


class Plans:
  """A subscriber's plans, at most `_limits.WEIGHTS_PLANS_KEPT`, the least
  recently used dropped first. Used with the subscriber's pull lock held."""

  def __init__(self, kept: int = _limits.WEIGHTS_PLANS_KEPT):
    self._kept = kept
    self._plans: OrderedDict[PlanKey, Any] = OrderedDict()

  def get(self, key: PlanKey, make: Callable[[], Any]) -> Any:
    """The plan under `key`, made by `make()` and stored if there is none
    (a plan may be None: a route that needs none). A `make` that raises
    stores nothing."""
    plan = self._plans.get(key, _MISSING)
    if plan is not _MISSING:
      self._plans.move_to_end(key)
      return plan
    plan = make()
    self._plans[key] = plan
    while len(self._plans) > self._kept:
      self._plans.popitem(last=False)
    return plan

  def __contains__(self, key: PlanKey) -> bool:
    return key in self._plans

  def __len__(self) -> int:
    return len(self._plans)

  def keys(self) -> list[PlanKey]:
    """The keys kept, least recently used first."""
    return list(self._plans)

  def values(self) -> list[Any]:
    """The plans kept, least recently used first."""
    return list(self._plans.values())
