"""rdt_jax: Ray Direct Transport for JAX, PyTorch and NumPy arrays.

Call :func:`register` in the driver before creating actors, then return
`jax.Array`s (or pytrees of any mix of jax, torch and numpy arrays) from
methods decorated with `@ray.method(tensor_transport="jax_nixl")`.
"""

from rdt_jax._arrays import UnsupportedLeafError as UnsupportedLeafError
from rdt_jax._convert import to_jax as to_jax
from rdt_jax._convert import to_numpy as to_numpy
from rdt_jax._convert import to_torch as to_torch
from rdt_jax._metadata import DlpackTransportMetadata as DlpackTransportMetadata
from rdt_jax._registry import receive_as as receive_as
from rdt_jax._registry import register as register
from rdt_jax._registry import register_transport as register_transport
from rdt_jax._targets import set_target_device_for_ref as set_target_device_for_ref
from rdt_jax._targets import set_target_for_ref as set_target_for_ref
from rdt_jax.transports._base import Destination as Destination
from rdt_jax.transports._base import DlpackTransport as DlpackTransport

__version__ = "0.1.0"

__all__ = [
    "Destination",
    "DlpackTransport",
    "DlpackTransportMetadata",
    "UnsupportedLeafError",
    "receive_as",
    "register",
    "register_transport",
    "set_target_device_for_ref",
    "set_target_for_ref",
    "to_jax",
    "to_numpy",
    "to_torch",
]


def __dir__() -> list[str]:
  return __all__
