"""Registration with Ray: `register()` and `register_transport()`
(`rdt_jax._receive` has `receive_as()` and `receive_stats()`).

The registry knows rdt_jax's transports and registers each with Ray under the
concrete class of live jax arrays (Ray matches serializers on the exact class;
`jax.Array` itself would catch nothing). Leaves of every other array class
are extracted by the reducers `rdt_jax._ray.serialization` installs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdt_jax import _compat, _ray

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
    from rdt_jax.transports.transfer import TransferTransport

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
    TypeError: if `cls` is not a `DlpackTransport` subclass, does not
      implement Ray's `is_one_sided()` and `can_abort_transport()`, or
      misses a hook its kind needs, naming what is missing (a class that
      sets `name` and `is_one_sided()` is refused for a missing hook when
      it is defined already).
    ValueError: if `cls` sets no `name`, or another class is registered
      under its name in this process (rdt_jax's own names included).
  """
  from rdt_jax.transports import _required
  from rdt_jax.transports._base import DlpackTransport

  if not (isinstance(cls, type) and issubclass(cls, DlpackTransport)):
    raise TypeError(
        f"register_transport takes a subclass of rdt_jax.DlpackTransport (or "
        f"rdt_jax.WholeArrayTransport), not {cls!r}."
    )
  name = getattr(cls, "name", None)
  if not isinstance(name, str) or not name:
    raise ValueError(
        f"{cls.__qualname__} has no transport name: set the class attribute `name` "
        "(e.g. name = \"my_shm\"), the name users pass as tensor_transport."
    )
  _ray.install()
  name = name.lower()
  info = _ray.state.transport_info(name)
  if info is not None and _qualified(info.transport_manager_class) != _qualified(cls):
    raise ValueError(
        f"Transport name {name!r} is already registered in this process by "
        f"{_qualified(info.transport_manager_class)}; give {_qualified(cls)} another `name`."
    )
  _required.check_registered(cls)
  _ray.state.register_tensor_transport(name, list(cls.devices), cls, _compat.array_impl_type())
  return name


def _qualified(cls: type) -> str:
  return f"{cls.__module__}.{cls.__qualname__}"


def register() -> list[str]:
  """Registers every rdt_jax transport whose dependencies are importable.

  Idempotent: a second call changes nothing and returns the same names. Call
  it before defining classes whose methods name an rdt_jax transport
  (`@ray.method(tensor_transport="jax_nixl")` checks the name when the class
  is defined) and before creating the actors that use the transports, in the
  process that creates them (usually the driver). It may be called before or
  after `ray.init`, and inside actors.

  Where `jax_nixl` is registered, it also sets the UCX defaults for device
  memory in this process's environment (`RDT_JAX_UCX_DEFAULTS`, see
  docs/configuration.md), before any NIXL agent exists here.

  Returns:
    The registered transport names in lower case, e.g. `["jax_nixl"]`.
  """
  names = [register_transport(cls) for cls in _transport_classes().values()]
  if "jax_nixl" in names:
    from rdt_jax.transports.nixl import ucx

    ucx.apply_defaults()  # before any NIXL agent here, Ray's own included (docs/configuration.md)
  return names
