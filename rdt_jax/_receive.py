"""What this process receives: the array type arriving leaves become
(`receive_as`), and what its fetches over a transport moved (`receive_stats`).
"""

from __future__ import annotations

import difflib

from rdt_jax import _ray, _receive_mode
from rdt_jax._dlpack import RECEIVE_MODES
from rdt_jax._errors import TransportNotRegisteredError, explain_unregistered

__all__ = ["receive_as", "receive_stats"]


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
  _receive_mode.set_receive_mode(mode)


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
