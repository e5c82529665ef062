"""Devices: the one place that parses devices and maps them to frameworks.

A `Device` is framework-neutral (a kind and an index); strings, `jax.Device`s
and `torch.device`s become one through `parse_device`, and `jax_device` finds
the local jax device for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._lazy import importable, loaded_type
from rdt_jax._dlpack._specs import DeviceKind

if TYPE_CHECKING:
  import jax

#: jax platform names (and the strings users pass) -> our device kind.
PLATFORM_KIND: Final[dict[str, DeviceKind]] = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


@dataclass(frozen=True)
class Device:
  """A framework-neutral device: a kind and an index."""

  kind: DeviceKind
  index: int = 0

  def __str__(self) -> str:
    return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"


CPU: Final = Device("cpu")


def _name(device: Device) -> str:
  return f"{device.kind}:{device.index}"


def jax_platform(kind: DeviceKind) -> str:
  """The jax platform (backend) name of a device kind."""
  return "cpu" if kind == "cpu" else "gpu"


def parse_device(device: Any) -> Device:
  """Parses a device given as a string, a `jax.Device` or a `torch.device`.

  Accepts `"cpu"`, `"cuda"`, `"cuda:1"`, `"gpu"`, `"gpu:0"`, jax devices of the
  cpu and gpu platforms, and torch devices of type cpu and cuda.

  Raises:
    ValueError: for any other device, naming it.
  """
  if isinstance(device, Device):
    return device
  if isinstance(device, str):
    name, _, index = device.partition(":")
    kind = PLATFORM_KIND.get(name.lower())
    if kind is None or (index and not index.isdigit()):
      raise ValueError(
          f"Unsupported device {device!r}: rdt_jax moves arrays on 'cpu' and "
          "'cuda[:N]' (or 'gpu[:N]') devices."
      )
    return Device(kind, int(index) if index else 0)
  platform = getattr(device, "platform", None)
  if platform is not None:  # a jax.Device
    kind = PLATFORM_KIND.get(platform)
    if kind is None:
      raise ValueError(
          f"Unsupported device {device!r} (platform {platform!r}): rdt_jax "
          "moves arrays on cpu and gpu devices."
      )
    index = device.id if kind == "cpu" else device.local_hardware_id
    return Device(kind, index or 0)
  torch_device = loaded_type("torch", "device")
  if torch_device is not None and isinstance(device, torch_device):
    return parse_device(str(device))
  raise ValueError(
      f"Unsupported device {device!r}: pass a string ('cpu', 'cuda:0'), a "
      "jax.Device or a torch.device."
  )


def jax_device(device: Device, path: str = "") -> jax.Device:
  """The local jax device for `device`.

  Never silently another device: `cuda:3` is jax's gpu device with local
  hardware id 3 or an error.

  Raises:
    UnsupportedLeafError: if this process's jax has no such platform, or no
      such device on it, naming the device and those that exist.
  """
  import jax

  platform = jax_platform(device.kind)
  try:
    devices = jax.local_devices(backend=platform)
  except RuntimeError:
    raise UnsupportedLeafError(
        path,
        f"must arrive on {device}, but this process's jax has no {platform} backend",
        "Receive it as numpy or torch, or set a target device "
        "(rdt_jax.set_target_device_for_ref).",
    ) from None
  for d in devices:
    if (d.id if device.kind == "cpu" else d.local_hardware_id) == device.index:
      return d
  raise UnsupportedLeafError(
      path,
      f"must arrive on {device.kind}:{device.index}, but this process's jax has no such "
      f"{platform} device (it has {', '.join(_name(parse_device(d)) for d in devices)})",
      "Set a target device that exists here (rdt_jax.set_target_device_for_ref), "
      "or check CUDA_VISIBLE_DEVICES / the actor's num_gpus.",
  )


def check_device(device: Device, path: str = "") -> Device:
  """Returns `device` if this process has it; never another one.

  Host memory always exists. A cuda device is looked up through torch when it
  is importable (its ordinals are the ones `"cuda:N"` names), else through
  jax's gpu devices.

  Raises:
    UnsupportedLeafError: naming the device and those this process has.
  """
  if device.kind == "cpu":
    return device
  if not importable("torch"):
    jax_device(device, path)
    return device
  import torch

  count = torch.cuda.device_count() if torch.cuda.is_available() else 0
  if device.index < count:
    return device
  have = ", ".join(f"cuda:{i}" for i in range(count)) or "no cuda device"
  raise UnsupportedLeafError(
      path,
      f"must arrive on cuda:{device.index}, but this process has {have}",
      "Set a target device that exists here (rdt_jax.set_target_device_for_ref), "
      "or check CUDA_VISIBLE_DEVICES / the actor's num_gpus.",
  )
