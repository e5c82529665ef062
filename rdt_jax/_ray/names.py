"""Transport names: Ray's check of a `tensor_transport` name explains an
rdt_jax name that is not registered here, or a near miss.
"""

from __future__ import annotations

from typing import Any

from rdt_jax import _errors
from rdt_jax._errors import TransportNotRegisteredError
from rdt_jax._ray import state, version, wrapping

__all__ = ["install_name_check", "wrap_transport_name_check"]


def _invalid_transport_error(name: Any, error: ValueError) -> TransportNotRegisteredError | None:
  """rdt_jax's account of Ray's "Invalid tensor transport" for `name`, or
  None where the name has nothing to do with rdt_jax (Ray's error stands)."""
  if not isinstance(name, str):
    return None
  explanation, suggestion = _errors.explain_unregistered(name, state.registered_transports(), state.in_ray_worker())
  if explanation is None:
    return None
  return TransportNotRegisteredError(f"{error}. {explanation}", name, suggestion)


def wrap_transport_name_check() -> None:
  """Ray checks a `tensor_transport` name (`@ray.method`, `.options`,
  `ray.put`) with `util.normalize_and_validate_tensor_transport`, whose error
  names only the upper-cased name. For an rdt_jax transport name, or one close
  to a registered name, the wrapper raises `TransportNotRegisteredError` (a
  `ValueError`) saying why the name is missing here and what to do.

  Touches: `ray.experimental.rdt.util.normalize_and_validate_tensor_transport`
    (wrapped).
  Why: the commonest first mistake (a class defined before `register()`, an
    actor without `enable_tensor_transport=True`, a typo) otherwise gets
    Ray's bare `Invalid tensor transport: NAME`.
  Retire when: Ray lets a registered plug-in explain an unknown name, or
    names the registered transports in its error.
  """
  from ray.experimental.rdt import util

  original = util.normalize_and_validate_tensor_transport
  if wrapping.is_ours(original):
    return

  def normalize_and_validate_tensor_transport(tensor_transport: str) -> str:
    try:
      return str(original(tensor_transport))
    except ValueError as e:
      error = _invalid_transport_error(tensor_transport, e)
      if error is None:
        raise
      raise error from None

  wrapping.mark(normalize_and_validate_tensor_transport, original)
  util.normalize_and_validate_tensor_transport = normalize_and_validate_tensor_transport


def install_name_check() -> None:
  """Installs only the transport-name check (see `wrap_transport_name_check`).

  `import rdt_jax` calls it where Ray is already imported, so a class defined
  before `rdt_jax.register()` gets the error that says so; `install()`
  installs it too. Does nothing on a Ray whose check function has another
  shape (`install()` then refuses that Ray).
  """
  from ray.experimental.rdt import util

  with wrapping.lock:
    if version.params(util, "normalize_and_validate_tensor_transport", ("tensor_transport",)) is None:
      wrap_transport_name_check()
