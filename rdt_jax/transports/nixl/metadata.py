"""`jax_nixl` metadata: what a consumer needs to read a producer's object."""

from __future__ import annotations

from dataclasses import dataclass, field

from rdt_jax._metadata import DlpackTransportMetadata

__all__ = ["NixlTransportMetadata"]


@dataclass
class NixlTransportMetadata(DlpackTransportMetadata):
  """`jax_nixl` metadata: where the producer's chunks are and who has them.

  Attributes:
    agent_name: the producer's NIXL agent.
    agent_meta: that agent's metadata (for `add_remote_agent`).
    agent_version: bumped whenever the producer registers new memory, so a
      consumer extends its view of the agent only when needed.
    dereg_epoch: bumped whenever the producer deregisters memory, so a
      consumer knows its view holds regions that are gone.
    addresses: the address of each non-empty chunk, in leaf order.
    device_ids: the device index of each non-empty chunk.
    regions: for each non-empty chunk, the registered region it lies in
      (chunks of one region may be read with one descriptor).
    serial: the object's export serial on its producer (never reused).
    live: the producer's live export serials when this object was exported,
      as inclusive (first, last) ranges: a consumer that holds metadata of an
      object whose serial is missing from the newest `live` it has seen
      from that producer knows the object was freed, and refuses to read it.
  """

  agent_name: str | None = None
  agent_meta: bytes | None = None
  agent_version: int = 0
  dereg_epoch: int = 0
  addresses: list[int] = field(default_factory=list)
  device_ids: list[int] = field(default_factory=list)
  regions: list[int] = field(default_factory=list)
  serial: int = 0
  live: list[tuple[int, int]] = field(default_factory=list)

  __eq__ = object.__eq__
  __hash__ = object.__hash__
