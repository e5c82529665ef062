"""Registration with Ray: `register()`, `register_transport()`, `receive_as()`.

The registry knows rdt_jax's transports and registers each with Ray under the
concrete class of live jax arrays (Ray matches serializers on the exact class;
`jax.Array` itself would catch nothing). Leaves of every other array class
are extracted by the reducers `rdt_jax._seam` installs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdt_jax import _compat, _seam, _state

if TYPE_CHECKING:
  from rdt_jax.transports._base import DlpackTransport


def _transport_classes() -> dict[str, type[DlpackTransport]]:
  """The rdt_jax transports this process can run, by lower-case name."""
  from rdt_jax.transports import _collective
  from rdt_jax.transports.nixl import NixlTransport

  classes: dict[str, type[DlpackTransport]] = {}
  if _compat.nixl_available():
    classes[NixlTransport.name] = NixlTransport
  if _collective.torch_importable():  # Ray's collective groups move torch tensors
    classes[_collective.GlooTransport.name] = _collective.GlooTransport
    classes[_collective.NcclTransport.name] = _collective.NcclTransport
  if _compat.has_jax_transfer():
    from rdt_jax.transports._transfer import TransferTransport

    classes[TransferTransport.name] = TransferTransport
  return classes


def register_transport(cls: type[DlpackTransport]) -> str:
  """Registers one DlpackTransport subclass with Ray, once per process.

  Use it for your own transports, as `register()` does for rdt_jax's. Call it
  where you would call `register()`: before defining classes whose methods
  name the transport (`@ray.method(tensor_transport=...)` checks the name on
  definition) and before creating the actors that use it, in the process that
  creates them. A second call for the same class changes nothing.

  Args:
    cls: a `DlpackTransport` subclass with `name` and `devices` set. It must
      be importable by module path on every worker (Ray pickles it by
      reference), e.g. defined in a module on the workers' `PYTHONPATH`.

  Returns:
    The transport's lower-case name, to pass as `tensor_transport`.

  Raises:
    ValueError: if `cls` is not a `TensorTransportManager` subclass (Ray's check).
  """
  _seam.install()
  name = cls.name.lower()
  _seam.register_tensor_transport(name, list(cls.devices), cls, _compat.array_impl_type())
  return name


def register() -> list[str]:
  """Registers every rdt_jax transport whose dependencies are importable.

  Idempotent: a second call changes nothing and returns the same names. Call
  it before defining classes whose methods name an rdt_jax transport
  (`@ray.method(tensor_transport="jax_nixl")` checks the name when the class
  is defined) and before creating the actors that use the transports, in the
  process that creates them (usually the driver). It may be called before or
  after `ray.init`, and inside actors.

  Returns:
    The registered transport names in lower case, e.g. `["jax_nixl"]`.
  """
  return [register_transport(cls) for cls in _transport_classes().values()]


def receive_as(mode: str) -> None:
  """Sets the array type every leaf arriving in this process becomes.

  Args:
    mode: "jax", "torch" or "numpy" to convert every arriving leaf to that
      type, or "source" (the default) to keep each leaf's original type.

  Applies process-wide to every leaf that arrives by an rdt_jax transfer
  (task arguments and `ray.get`, driver included). A process reading its own
  RDT object gets the stored objects back, unconverted (Ray's semantics).

  Raises:
    ValueError: for any other mode.
  """
  _state.set_receive_mode(mode)
