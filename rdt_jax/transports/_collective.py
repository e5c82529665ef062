"""`jax_gloo` and `jax_nccl`: two-sided transfers over Ray's collective groups.

One backend, two communicators, chosen by the transport's name:

| name        | devices | group made with                                         |
| ----------- | ------- | ------------------------------------------------------- |
| `jax_gloo`  | cpu     | `create_collective_group(actors, backend="torch_gloo")` |
| `jax_nccl`  | cuda    | `create_collective_group(actors, backend="nccl")`       |

The group comes from `ray.experimental.collective.create_collective_group`,
as for Ray's own GLOO and NCCL transports. Ray asks the transport for the
group by the transport's name ("JAX_GLOO"), which is no collective backend, so
the transport maps its name to the group's backend (`GROUP_BACKENDS`).

Two-sided means what Ray documents for GLOO and NCCL: an object moves only as
an argument of a task on another actor of the same group. Ray runs
`send_multiple_tensors` on the producer and `recv_multiple_tensors` on the
consumer; each non-empty chunk crosses as one uint8 message, in leaf order,
zero-copy on both sides (`_dlpack.torch_bytes`: host memory through DLPack,
cuda memory through the CUDA Array Interface). `ray.get` of such a ref and
`ray.put(..., _tensor_transport="jax_gloo")` are refused, naming the fixes.

Stream order (`rdt_jax._memory._cuda`): the base waits for queued work on the
leaves once per object and device before `send_buffers`; the consumer
synchronizes each receiving device once per object after the receives (Ray's
NCCL stream is private to its group).

What of `jax_nccl` has not run on a GPU yet (docs/gpu.md lists it): the cuda
branch of `_dlpack.torch_bytes`, the waits above on cuda, and Ray's NCCL group
itself. Everything else (metadata, ordering, ranks, scratch receives,
rebuilding) is the code `jax_gloo` runs in the tests.

Dependencies: both need torch (Ray's collective groups move torch tensors),
and both are registered wherever torch is importable, a CPU-only driver
included: the driver only names the transport, the actors move the bytes.
NCCL additionally needs cupy and a GPU on the actors; Ray's
`create_collective_group(..., backend="nccl")` reports their absence there.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from ray.experimental.rdt.collective_tensor_transport import CollectiveCommunicatorMetadata

from rdt_jax import _dlpack, _memory, _ray
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports._base import Destination, DlpackTransport

#: The collective backend whose group each transport uses.
GROUP_BACKENDS: Final[dict[str, str]] = {"jax_gloo": "torch_gloo", "jax_nccl": "nccl"}


def torch_importable() -> bool:
  """True if torch can be imported here (checked without importing it)."""
  return _dlpack.importable("torch")


class CollectiveTransport(DlpackTransport):
  """The shared two-sided backend; subclasses only pick name and devices."""

  name: ClassVar[str]

  @staticmethod
  def is_one_sided() -> bool:
    return False

  @staticmethod
  def can_abort_transport() -> bool:
    # A blocked send/recv cannot be interrupted: on failure Ray kills both
    # actors and destroys the group, as for its own GLOO and NCCL.
    return False

  @classmethod
  def available_in_process(cls) -> bool:
    return torch_importable()

  @property
  def group_backend(self) -> str:
    """The backend of the collective group this transport needs."""
    return GROUP_BACKENDS[self.name]

  # ---- groups

  def _groups(self, actors: list[Any]) -> list[Any]:
    from ray.experimental.collective import get_collective_groups

    return get_collective_groups(actors, backend=self.group_backend)

  def _no_group(self, actors: str) -> ValueError:
    return ValueError(
        f"The {self.name} transport moves objects only between actors of one "
        f"collective group, and {actors} in none with backend "
        f"{self.group_backend!r}. Create one in this process before calling "
        "the actors' methods: ray.experimental.collective."
        f"create_collective_group([producer, consumer, ...], "
        f"backend={self.group_backend!r}). Or use jax_nixl, which needs no group."
    )

  def actor_has_tensor_transport(self, actor: Any) -> bool:
    """Ray calls this in the caller before an RDT method runs on `actor`.

    Raises:
      ValueError: if `actor` is in no group of this transport's backend, saying
        how to create one (Ray's own message names only "nccl" and "gloo").
    """
    if not self._groups([actor]):
      raise self._no_group(f"actor {actor} is")
    return True

  def get_communicator_metadata(
      self, src_actor: Any, dst_actor: Any, backend: str | None = None
  ) -> CollectiveCommunicatorMetadata:
    """The group holding both actors and their ranks in it.

    Ray passes this transport's name as `backend`; the group is looked up by
    `group_backend` instead. Returns Ray's own metadata class, so Ray's
    failure handling destroys the group as it does for its GLOO and NCCL.

    Raises:
      ValueError: if no group, or more than one, holds both actors.
    """
    groups = self._groups([src_actor, dst_actor])
    if not groups:
      raise self._no_group(f"actors {src_actor} and {dst_actor} are")
    if len(groups) > 1:
      raise ValueError(
          f"{len(groups)} {self.group_backend!r} groups hold both {src_actor} "
          f"and {dst_actor}; the {self.name} transport needs exactly one. "
          "Destroy the others with ray.experimental.collective."
          "destroy_collective_group."
      )
    group = groups[0]
    return CollectiveCommunicatorMetadata(
        communicator_name=group.name,
        src_rank=group.get_rank(src_actor),
        dst_rank=group.get_rank(dst_actor),
    )

  # ---- producer

  def send_buffers(
      self,
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
      communicator_metadata: CollectiveCommunicatorMetadata,
  ) -> None:
    from ray.util import collective

    dst_rank = communicator_metadata.dst_rank
    assert dst_rank is not None
    for leaf in leaves:
      for pointer, chunk, index in zip(leaf.pointers, leaf.spec.chunks, leaf.device_indices):
        if chunk.nbytes == 0:
          continue
        tensor = _dlpack.torch_bytes(pointer, chunk.nbytes, _dlpack.Device(leaf.device, index))
        collective.send(tensor, dst_rank, communicator_metadata.communicator_name)

  # ---- consumer

  def start_receive(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CollectiveCommunicatorMetadata,
      destinations: list[Destination],
  ) -> tuple[CollectiveCommunicatorMetadata, list[Destination]]:
    # Two-sided: the bytes arrive when the consumer asks; wait_receive asks.
    return communicator_metadata, [d for d in destinations if d.nbytes > 0]

  def wait_receive(
      self,
      handle: tuple[CollectiveCommunicatorMetadata, list[Destination]],
      obj_id: str,
      timeout: float,
  ) -> None:
    from ray.util import collective

    communicator_metadata, destinations = handle
    src_rank = communicator_metadata.src_rank
    assert src_rank is not None
    for d in destinations:
      tensor = _dlpack.torch_bytes(d.pointer, d.nbytes, d.device)
      collective.recv(tensor, src_rank, communicator_metadata.communicator_name)
    self._after_receive(destinations)

  def _after_receive(self, destinations: list[Destination]) -> None:
    """Waits until received bytes are visible to the arrays built from them
    (once per cuda device of the object; nothing on cpu)."""
    _memory.wait_received(d.device for d in destinations)


class GlooTransport(CollectiveTransport):
  """`jax_gloo`: cpu arrays over a `torch_gloo` collective group."""

  name = "jax_gloo"
  devices = ("cpu",)


class NcclTransport(CollectiveTransport):
  """`jax_nccl`: cuda arrays over an `nccl` collective group.

  Not yet run on a GPU: Ray's NCCL group, the cuda branch of
  `_dlpack.torch_bytes` and the stream waits; the rest is `jax_gloo`'s code.
  """

  name = "jax_nccl"
  devices = ("cuda",)

  @classmethod
  def available_in_process(cls) -> bool:
    if not torch_importable() or not _dlpack.importable("cupy"):
      return False
    import torch

    return torch.cuda.is_available()


# --------------------------------------------------------------------------
# ray.get of a two-sided ref: Ray refuses it; say what to do instead.


def get_refused_message(transport: str) -> str:
  """The error `ray.get` raises for a ref of a two-sided rdt_jax transport."""
  name = transport.lower()
  return (
      f"ray.get cannot fetch an object of the two-sided transport {name}: its "
      "bytes move only as an argument of a task on another actor of the same "
      "collective group. Pass the ref to such an actor's method; or fetch it "
      "through Ray's object store with ray.get(ref, _use_object_store=True); "
      f"or return the value with tensor_transport='jax_nixl' instead of {name!r}, "
      "which ray.get can fetch in any process."
  )


for _name in GROUP_BACKENDS:
  _ray.fetch.refuse_driver_get(_name, get_refused_message)
