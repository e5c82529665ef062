"""Registration, and `install()`: rdt_jax's transports known in every
process that meets them (a new actor, a consumer-only worker), and every
wrap of this package put in place once per process.
"""

from __future__ import annotations

from typing import Any

from rdt_jax import _hooks
from rdt_jax._ray import aio, failures, fetch, names, serialization, state, version, wrapping

__all__ = ["install"]

_installed = False


def install() -> None:
  """Checks Ray, then installs the reducers and Ray wrappers in this process, once.

  Raises:
    UnsupportedRayError: see `check_ray`.
  """
  global _installed
  with wrapping.lock:
    if _installed:
      return
    version.check_ray()
    serialization.import_layers()
    serialization.install_reducers()
    names.wrap_transport_name_check()
    fetch.wrap_fetch_and_get()
    serialization.wrap_serialize_rdt_objects()
    _wrap_register_on_actor()
    _wrap_default_registration()
    fetch.wrap_trigger_fetch()
    fetch.wrap_set_target_device()
    aio.wrap_deserialize_objects()
    aio.wrap_object_ref_reducer()
    failures.wrap_failure_monitor()
    _installed = True


def _register_transports_on_actor(self: Any, info: dict[str, Any]) -> None:
  """Runs on a new actor: registers the creator's custom transports there."""
  from ray.experimental.rdt import util

  install()
  util._ensure_default_transports_registered()
  with wrapping.lock:
    for name, transport in info.items():
      if name not in util.transport_manager_info:
        util.register_tensor_transport(
            name, transport.devices, transport.transport_manager_class, transport.data_type
        )


def _wrap_register_on_actor() -> None:
  """Registers the creator's custom transports on a new actor, on the
  `_ray_system` group (what Ray waits on) and as an ordinary task.

  Touches: `RDTManager.register_custom_transports_on_actor` (wrapped),
    `actor_id_to_transports_registered` (written), `util.has_custom_transports`
    and `util.transport_manager_info` (read), `util.register_tensor_transport`
    (called on the actor).
  Why: Ray registers them on `_ray_system` only, which races with a fresh
    actor's first method: a first-action `ray.put(x, _tensor_transport=...)`
    could run before the registration (the race found in the review of ray-project/ray#59255).
  Retire when: Ray registers custom transports on an actor before its first
    method runs.
  """
  from ray.experimental.rdt import rdt_manager

  cls = rdt_manager.RDTManager
  original = cls.register_custom_transports_on_actor
  if wrapping.is_ours(original):
    return

  def register_custom_transports_on_actor(self: Any, actor: Any) -> None:
    from ray.experimental.rdt import util

    util._ensure_default_transports_registered()
    if not util.has_custom_transports:
      self.actor_id_to_transports_registered[actor._actor_id] = True
      return
    info = dict(util.transport_manager_info)
    # What Ray waits on before it submits an RDT method or sends an RDT
    # argument to the actor: on the `_ray_system` concurrency group, as Ray
    # does, so it never waits behind a running method.
    ref = state.call_on_system_group(actor, _register_transports_on_actor, info)
    # And an ordinary task nobody waits on: on an actor with one thread, it
    # runs before any method its creator calls afterwards, so even a first
    # action `ray.put(x, _tensor_transport=...)` finds the transport (the
    # `_ray_system` copy alone may run after that method started). On a busy
    # actor it just runs later, as a no-op.
    actor.__ray_call__.remote(_register_transports_on_actor, info)
    self.actor_id_to_transports_registered[actor._actor_id] = ref

  wrapping.mark(register_custom_transports_on_actor, original)
  cls.register_custom_transports_on_actor = register_custom_transports_on_actor  # type: ignore[method-assign]


def _wrap_default_registration() -> None:
  """Registers rdt_jax's transports in a Ray worker on its first RDT use.

  Ray registers custom transports on an actor only if it was created with
  `enable_tensor_transport=True` after the creator registered them. A
  consumer-only actor created without it still receives rdt_jax refs (their
  metadata imports rdt_jax there), so Ray's first RDT lookup in that worker
  registers rdt_jax's transports instead of failing with `KeyError: JAX_NIXL`.

  Touches: `ray.experimental.rdt.util._ensure_default_transports_registered`
    (wrapped).
  Why: Ray has no hook for a plug-in's transports in a worker that did not
    get them from its creator (a consumer-only actor; compare
    ray-project/ray#66264).
  Retire when: Ray registers every plug-in transport known to the job in
    each worker, or offers a worker-start hook for it.
  """
  from ray.experimental.rdt import util

  original = util._ensure_default_transports_registered
  if wrapping.is_ours(original):
    return
  started: list[bool] = []
  finished: list[bool] = []

  def _ensure_default_transports_registered() -> None:
    original()
    if finished or not state.in_ray_worker():
      return
    # Another thread waits here until the registration it would look up is
    # complete; the registering thread's own lookups (`started`) return.
    with wrapping.lock:
      if started:
        return
      started.append(True)
      try:
        # The registry sits above this module: reached through `_hooks`.
        _hooks.register_transports()
      finally:
        finished.append(True)

  wrapping.mark(_ensure_default_transports_registered, original)
  util._ensure_default_transports_registered = _ensure_default_transports_registered
