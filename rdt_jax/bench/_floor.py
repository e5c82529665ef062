"""Ray's own cost of an RDT object: a transport that moves no bytes.

`ray_rdt_floor` returns torch tensors with `tensor_transport="rdt_floor"`,
a Ray tensor transport (Ray's interface, none of rdt_jax's code) whose every
hook does the least Ray allows: the producer records each tensor's shape and
dtype, the consumer gets an empty tensor of that shape and dtype, nothing is
copied or registered. What a transfer over it costs is what Ray's RDT
machinery costs per object and per leaf (the producer's extract, the owner's
metadata, the consumer's fetch) with no transport work at all: the floor
under every RDT transport on this host, measured in the same run as the
others. The consumer reads nothing (the bytes never arrive), so the path's
data is not checked.
"""

from __future__ import annotations

from typing import Any, cast

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

#: The transport's name in `tensor_transport=` (Ray upper-cases it).
NAME = "rdt_floor"


class FloorTransport(TensorTransportManager):
  """A one-sided Ray tensor transport that moves nothing (see the module)."""

  def tensor_transport_backend(self) -> str:
    return NAME.upper()

  @staticmethod
  def is_one_sided() -> bool:
    return True

  @staticmethod
  def can_abort_transport() -> bool:
    return False

  def actor_has_tensor_transport(self, actor: Any) -> bool:
    return True

  def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> TensorTransportMetadata:
    return TensorTransportMetadata(
        tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
        tensor_device="cpu",
    )

  def get_communicator_metadata(self, src_actor: Any, dst_actor: Any, backend: str | None = None) -> Any:
    return CommunicatorMetadata()

  def recv_multiple_tensors(
      self,
      obj_id: str,
      tensor_transport_metadata: TensorTransportMetadata,
      communicator_metadata: Any,
      target_buffers: list[Any] | None = None,
  ) -> list[Any]:
    import torch

    meta = tensor_transport_metadata.tensor_meta
    # Our extract records torch shapes and dtypes only.
    return [torch.empty(shape, dtype=cast(torch.dtype, dtype)) for shape, dtype in meta]

  def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                            communicator_metadata: Any) -> None:
    raise NotImplementedError("rdt_floor is one-sided")

  def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
    return None

  def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
    return None


def register() -> str | None:
  """Registers `rdt_floor` with Ray in this process (before the actors that
  use it are made); None, or why it cannot run here."""
  try:
    import torch
  except ImportError:
    return "needs torch"
  from ray.experimental.rdt import util

  if NAME.upper() not in util.transport_manager_info:
    util.register_tensor_transport(NAME, ["cpu"], FloorTransport, torch.Tensor)
  return None
