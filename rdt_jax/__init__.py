"""rdt_jax: Ray Direct Transport for JAX, PyTorch and NumPy arrays.

Call :func:`register` in the driver before creating actors, then return
`jax.Array`s (or pytrees of any mix of jax, torch and numpy arrays) from
methods decorated with `@ray.method(tensor_transport="jax_nixl")`.

The public names are loaded on first use: `import rdt_jax` imports neither
Ray nor any array framework, so the array layer (`rdt_jax._dlpack`,
`rdt_jax._memory`, `rdt_jax._layout`) can be used, and tested, where Ray is
not installed.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from rdt_jax import _hooks

# For type checkers: the public names of `_EXPORTS` below, one import each
# (`tests/test_public_api.py` checks that the two name the same objects).
if TYPE_CHECKING:
  from rdt_jax._aio import get_async as get_async
  from rdt_jax._aio_errors import AwaitNotSupportedError as AwaitNotSupportedError
  from rdt_jax._aio_errors import RefNotReadyError as RefNotReadyError
  from rdt_jax._convert import to_jax as to_jax
  from rdt_jax._convert import to_numpy as to_numpy
  from rdt_jax._convert import to_torch as to_torch
  from rdt_jax._dlpack import DescribedLeaf as DescribedLeaf
  from rdt_jax._dlpack import LeafSpec as LeafSpec
  from rdt_jax._dlpack import UnsupportedLeafError as UnsupportedLeafError
  from rdt_jax._error_base import RdtJaxError as RdtJaxError
  from rdt_jax._errors import ArgumentTypeError as ArgumentTypeError
  from rdt_jax._errors import SetupError as SetupError
  from rdt_jax._errors import TransportNotRegisteredError as TransportNotRegisteredError
  from rdt_jax._errors import UnknownObjectError as UnknownObjectError
  from rdt_jax._errors import UnsupportedRayError as UnsupportedRayError
  from rdt_jax._layout import Slice as Slice
  from rdt_jax._metadata import DlpackTransportMetadata as DlpackTransportMetadata
  from rdt_jax._metadata import MetadataError as MetadataError
  from rdt_jax._receive import receive_as as receive_as
  from rdt_jax._receive import receive_stats as receive_stats
  from rdt_jax._registry import register as register
  from rdt_jax._registry import register_transport as register_transport
  from rdt_jax._settings import SettingError as SettingError
  from rdt_jax._targets import set_target_device_for_ref as set_target_device_for_ref
  from rdt_jax._targets import set_target_for_ref as set_target_for_ref
  from rdt_jax.transports._base import DlpackTransport as DlpackTransport
  from rdt_jax.transports._destinations import Destination as Destination
  from rdt_jax.transports._destinations import Placement as Placement
  from rdt_jax.transports._lifetime import ProducerActorDiedError as ProducerActorDiedError
  from rdt_jax.transports._lifetime import ProducerDiedError as ProducerDiedError
  from rdt_jax.transports._whole_array import WholeArrayTransport as WholeArrayTransport
  from rdt_jax.transports.nixl.registrations import NixlError as NixlError
  from rdt_jax.transports.nixl.views import DeviceViewBusy as DeviceViewBusy
  from rdt_jax.weights import From as From
  from rdt_jax.weights import Fuse as Fuse
  from rdt_jax.weights import MappingError as MappingError
  from rdt_jax.weights import PublishStats as PublishStats
  from rdt_jax.weights import PullStats as PullStats
  from rdt_jax.weights import StaleWeightsError as StaleWeightsError
  from rdt_jax.weights import TemplateError as TemplateError
  from rdt_jax.weights import WeightPublisher as WeightPublisher
  from rdt_jax.weights import WeightsHandle as WeightsHandle
  from rdt_jax.weights import WeightSubscriber as WeightSubscriber
  from rdt_jax.weights import latest_handle as latest_handle

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ArgumentTypeError": "rdt_jax._errors",
    "AwaitNotSupportedError": "rdt_jax._aio_errors",
    "DescribedLeaf": "rdt_jax._dlpack",
    "Destination": "rdt_jax.transports._destinations",
    "DeviceViewBusy": "rdt_jax.transports.nixl.views",
    "DlpackTransport": "rdt_jax.transports._base",
    "DlpackTransportMetadata": "rdt_jax._metadata",
    "From": "rdt_jax.weights",
    "Fuse": "rdt_jax.weights",
    "LeafSpec": "rdt_jax._dlpack",
    "MappingError": "rdt_jax.weights",
    "MetadataError": "rdt_jax._metadata",
    "NixlError": "rdt_jax.transports.nixl.registrations",
    "Placement": "rdt_jax.transports._destinations",
    "ProducerActorDiedError": "rdt_jax.transports._lifetime",
    "PublishStats": "rdt_jax.weights",
    "PullStats": "rdt_jax.weights",
    "ProducerDiedError": "rdt_jax.transports._lifetime",
    "RdtJaxError": "rdt_jax._error_base",
    "RefNotReadyError": "rdt_jax._aio_errors",
    "SettingError": "rdt_jax._settings",
    "SetupError": "rdt_jax._errors",
    "Slice": "rdt_jax._layout",
    "StaleWeightsError": "rdt_jax.weights",
    "TemplateError": "rdt_jax.weights",
    "TransportNotRegisteredError": "rdt_jax._errors",
    "UnknownObjectError": "rdt_jax._errors",
    "UnsupportedLeafError": "rdt_jax._dlpack",
    "UnsupportedRayError": "rdt_jax._errors",
    "WeightPublisher": "rdt_jax.weights",
    "WeightSubscriber": "rdt_jax.weights",
    "WeightsHandle": "rdt_jax.weights",
    "WholeArrayTransport": "rdt_jax.transports._whole_array",
    "get_async": "rdt_jax._aio",
    "latest_handle": "rdt_jax.weights",
    "receive_as": "rdt_jax._receive",
    "receive_stats": "rdt_jax._receive",
    "register": "rdt_jax._registry",
    "register_transport": "rdt_jax._registry",
    "set_target_device_for_ref": "rdt_jax._targets",
    "set_target_for_ref": "rdt_jax._targets",
    "to_jax": "rdt_jax._convert",
    "to_numpy": "rdt_jax._convert",
    "to_torch": "rdt_jax._convert",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'rdt_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return __all__


# The seam's calls into the layers above it (`rdt_jax._hooks` says why), set
# here because every process imports this module before any rdt_jax module.
def _register_transports() -> list[str]:
  return importlib.import_module("rdt_jax._registry").register()


def _set_target_buffers(obj_id: str, buffers: list[Any]) -> None:
  importlib.import_module("rdt_jax._targets").set_target_for_obj_id(obj_id, buffers)


def _set_target_device(obj_id: str, device: Any) -> None:
  importlib.import_module("rdt_jax._targets").set_target_device_for_obj_id(obj_id, device)


_hooks.register_transports = _register_transports
_hooks.set_target_buffers = _set_target_buffers
_hooks.set_target_device = _set_target_device


def _check_transport_names() -> None:
  """Where Ray is already imported, its transport-name check explains rdt_jax
  names from now on (`rdt_jax._ray.names.install_name_check`): a class defined
  before `register()` then fails saying so. Imports nothing new (`import ray`
  imports the checked module); `register()` installs it in any case."""
  if "ray.experimental.rdt.util" in sys.modules:
    importlib.import_module("rdt_jax._ray.names").install_name_check()


_check_transport_names()
