"""Registration with Ray: `register()`, `register_transport()`, `receive_as()`,
`receive_stats()`, and the account of a transport name Ray does not know.

The registry knows rdt_jax's transports and registers each with Ray under the
concrete class of live jax arrays (Ray matches serializers on the exact class;
`jax.Array` itself would catch nothing). Leaves of every other array class
are extracted by the reducers `rdt_jax._ray.serialization` installs.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from rdt_jax import _compat, _ray, _state
from rdt_jax._dlpack._specs import RECEIVE_MODES
from rdt_jax._errors import TransportNotRegisteredError, explain_unregistered

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


def receive_as(mode: str) -> None:
  """Sets the array type every leaf arriving in this process becomes.

  Args:
    mode: "jax", "torch" or "numpy" to convert every arriving leaf to that
      type, or "source" (the default) to keep each leaf's original type.

  Applies process-wide to every leaf that arrives by an rdt_jax transfer
  (task arguments and `ray.get`, driver included), from the next transfer
  on. Call it in the process that receives: in the driver for the driver's
  `ray.get`, in an actor's method (or `__init__`) for what that actor
  receives. A process reading its own RDT object gets the stored objects
  back, unconverted (Ray's semantics).

  Raises:
    TypeError: if `mode` is not a string (a module or type, say), naming
      the string to pass.
    ValueError: for any other string, naming the modes (and the closest
      one).
  """
  if not isinstance(mode, str):
    hint = getattr(mode, "__name__", type(mode).__name__).split(".")[0].lower()
    suggestion = f" (receive_as({hint!r}))" if hint in RECEIVE_MODES else ""
    raise TypeError(
        f"receive_as takes the mode's name as a string, one of "
        f"{', '.join(repr(m) for m in RECEIVE_MODES)}, not a {type(mode).__name__}{suggestion}."
    )
  if mode not in RECEIVE_MODES:
    close = difflib.get_close_matches(mode.lower(), RECEIVE_MODES, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unknown receive mode {mode!r}; expected one of "
        f"{', '.join(repr(m) for m in RECEIVE_MODES)}.{hint} 'source' (the default) keeps "
        "each leaf's type; the others convert every arriving leaf to that framework."
    )
  _state.set_receive_mode(mode)


def receive_stats(transport: str = "jax_nixl", reset: bool = False) -> dict[str, int]:
  """What this process's fetches over `transport` asked it to move.

  Counts every fetch that arrived in the calling process (the driver's
  `ray.get`, or an actor's task arguments and `ray.get`, wherever it is
  called) since the process started or since the last `reset=True`:

  * `fetches`: objects fetched out of band;
  * `bytes`: payload bytes the backend was asked to move;
  * `destinations`: receive buffers (chunks, or parts of them) it filled;
  * `descriptors`: transfer descriptors the backend posted (jax_nixl counts
    them; other backends report 0);
  * `inline`: objects that arrived in band, inside their metadata (small
    host objects where in-band sending is turned on: nothing moved out of
    band);
  * `direct`: jax_nixl fetches read node-locally from the producer's memory.

  Args:
    transport: an rdt_jax transport registered in this process, e.g.
      "jax_nixl", "jax_gloo", "jax_transfer", or a name given to
      `register_transport`.
    reset: set every counter to zero after reading it.

  Returns:
    The counters by name, each an `int`.

  Raises:
    TransportNotRegisteredError: (a `ValueError`) if no transport of that
      name is registered in this process, saying why (`register()` not called
      here yet, a missing dependency) or which name was meant.
    ValueError: if `transport` names one of Ray's own transports ("nixl",
      "gloo", ...), which rdt_jax does not count.
  """
  _ray.install()
  name = str(transport)
  registered = _ray.state.registered_transports()
  if name.lower() not in registered:
    explanation, suggestion = explain_unregistered(name, registered, _ray.state.in_ray_worker())
    raise TransportNotRegisteredError(
        f"No transport {name!r} is registered in this process. "
        + (explanation or f"Transports registered here: {', '.join(registered) or 'none'}."),
        name,
        suggestion,
    )
  if not _ray.state.is_rdt_jax_transport(name):
    ours = [n for n in registered if _ray.state.is_rdt_jax_transport(n)]
    raise ValueError(
        f"{name!r} is one of Ray's own transports, which rdt_jax does not count; "
        f"receive_stats reads rdt_jax transports: {', '.join(ours) or 'none registered here'}."
    )
  stats: dict[str, int] = _ray.state.transport_manager(name).receive_stats(reset=reset)
  return stats
