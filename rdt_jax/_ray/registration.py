"""Registration, and `install()`: rdt_jax's transports known in every
process that meets them (a new actor, a consumer-only worker), and every
wrap of this package put in place once per process.
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

from rdt_jax import _compat, _hooks
from rdt_jax._ray import aio, failures, fetch, names, serialization, state, version, wrapping

__all__ = ["TorchTensorLater", "install", "ray_default_transports"]

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
    # Ray's own transports are registered on the actor by the actor itself
    # (and their `torch.Tensor` would import torch there when unpickled).
    defaults = set(getattr(util, "DEFAULT_TRANSPORTS", ()))
    info = {name: t for name, t in util.transport_manager_info.items() if name not in defaults}
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


class TorchTensorLater:
  """The data type of Ray's own transports (NIXL, GLOO, NCCL, CUDA_IPC) in
  Ray's registry until something asks for it: `torch.Tensor`, imported then
  (`_wrap_default_registration`). No value is ever of this type."""


#: One of Ray's own transports as its default registration names it:
#: (name, devices, the class's name in `ray.experimental.rdt.util`).
_Default = tuple[str, list[str], str]

_REGISTRATION = re.compile(
    r"register_tensor_transport\(\s*\"(\w+)\",\s*(\[[^\]]*\]),\s*(\w+),\s*torch\.Tensor,?\s*\)"
)


def ray_default_transports(ensure: Any) -> list[_Default] | None:
  """Ray's own transports as `util._ensure_default_transports_registered`
  (`ensure`) registers them, read from its source; None where the source
  cannot be read or registers anything else than transports of
  `torch.Tensor` that `util.DEFAULT_TRANSPORTS` lists (then rdt_jax lets
  Ray register them itself, torch imported)."""
  from ray.experimental.rdt import util

  try:
    source = inspect.getsource(wrapping.unwrapped(ensure))
  except (OSError, TypeError):
    return None
  found = [(name, ast.literal_eval(devices), cls) for name, devices, cls in _REGISTRATION.findall(source)]
  if (
      source.count("register_tensor_transport(") != len(found)
      or sorted(name for name, _, _ in found) != sorted(getattr(util, "DEFAULT_TRANSPORTS", ()))
      or not all(isinstance(getattr(util, cls, None), type) for _, _, cls in found)
  ):
    return None
  return found


def _register_ray_defaults_lazily(defaults: list[_Default]) -> None:
  """What Ray's `_ensure_default_transports_registered` does, but with
  `TorchTensorLater` for `torch.Tensor`, so nothing imports torch here:
  Ray's own transports are registered once per process, where torch is
  installed (as Ray does: without it, they are not registered)."""
  from ray.experimental.rdt import util

  with util.transport_managers_lock:
    if util._default_transports_registered:
      return
    util._default_transports_registered = True
    if not _compat.importable("torch"):
      return
    for name, devices, cls in defaults:
      util.register_tensor_transport(name, devices, getattr(util, cls), TorchTensorLater)


def _wrap_data_type_lookup() -> None:
  """Gives `torch.Tensor` for `TorchTensorLater`, importing torch then.

  Touches: `ray.experimental.rdt.util.get_transport_data_type` (wrapped)
    and `transport_manager_info` (its entries of Ray's own transports
    rewritten with `torch.Tensor`).
  Why: Ray imports torch in every process the first time it looks up any
    transport, to register its own transports' data type, `torch.Tensor`;
    an actor that moves only jax arrays paid for that import at start
    (docs/performance.md, "Memory and CPU"). The data type is read only when an RDT value is serialized with
    that transport (`SerializationContext.serialize_rdt_objects`).
  Retire when: Ray registers its own transports' data type lazily.
  """
  from ray.experimental.rdt import util

  original = util.get_transport_data_type
  if wrapping.is_ours(original):
    return

  def get_transport_data_type(tensor_transport: str) -> type:
    data_type = original(tensor_transport)
    if data_type is not TorchTensorLater:
      return data_type
    import torch

    with util.transport_managers_lock:
      for name, info in list(util.transport_manager_info.items()):
        if info.data_type is TorchTensorLater:
          util.transport_manager_info[name] = info._replace(data_type=torch.Tensor)
    return torch.Tensor

  wrapping.mark(get_transport_data_type, original)
  util.get_transport_data_type = get_transport_data_type


def _wrap_default_registration() -> None:
  """Registers rdt_jax's transports in a Ray worker on its first RDT use.

  Ray registers custom transports on an actor only if it was created with
  `enable_tensor_transport=True` after the creator registered them. A
  consumer-only actor created without it still receives rdt_jax refs (their
  metadata imports rdt_jax there), so Ray's first RDT lookup in that worker
  registers rdt_jax's transports instead of failing with `KeyError: JAX_NIXL`.

  Ray's own transports are registered as Ray registers them, but without
  importing torch where Ray's source says what they are
  (`ray_default_transports`): their data type is `TorchTensorLater` until
  a lookup asks for it (`_wrap_data_type_lookup`).

  Touches: `ray.experimental.rdt.util._ensure_default_transports_registered`
    (wrapped), `_default_transports_registered` and
    `transport_managers_lock` (as the original uses them).
  Why: Ray has no hook for a plug-in's transports in a worker that did not
    get them from its creator (a consumer-only actor; compare
    ray-project/ray#66264); and Ray imports torch to register its own.
  Retire when: Ray registers every plug-in transport known to the job in
    each worker, or offers a worker-start hook for it, and registers its
    own transports without importing torch.
  """
  from ray.experimental.rdt import util

  original = util._ensure_default_transports_registered
  if wrapping.is_ours(original):
    return
  defaults = ray_default_transports(original)
  if defaults is not None:
    _wrap_data_type_lookup()
  started: list[bool] = []
  finished: list[bool] = []

  def _ensure_default_transports_registered() -> None:
    if defaults is None:
      original()
    else:
      _register_ray_defaults_lazily(defaults)
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
