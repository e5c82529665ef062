"""`jax_transfer` metadata: where a consumer asks for an offer and where it
pulls, and the checks it passes on arrival (`TransferTransportMetadata.validate`)."""

from __future__ import annotations

from dataclasses import dataclass

from rdt_jax._metadata import DlpackTransportMetadata, MetadataError


@dataclass
class TransferTransportMetadata(DlpackTransportMetadata):
  """`jax_transfer` metadata: where to ask for an offer and where to pull.

  Attributes:
    server_address: the producer's transfer server for the leaves' platform.
    offer_address: `(host, port)` of the producer's offer service.
    authkey: the key the offer service's challenge asks for (see
      `rdt_jax.transports.transfer.protocol` for what it protects, and what not).
  """

  server_address: str | None = None
  offer_address: tuple[str, int] | None = None
  authkey: bytes | None = None

  __eq__ = object.__eq__
  __hash__ = object.__hash__

  def validate(self, obj_id: str) -> None:
    """Consumer: refuses metadata that cannot name a producer to pull from
    (extends `DlpackTransportMetadata.validate`).

    Raises:
      MetadataError: naming the object and the field.
    """
    super().validate(obj_id)
    if self.inline is not None:
      return
    if not isinstance(self.server_address, str) or not 0 < len(self.server_address) <= 256:
      raise MetadataError(obj_id, "server_address", f"is {self.server_address!r}, not host:port")
    address = self.offer_address
    if not (
        type(address) is tuple and len(address) == 2 and isinstance(address[0], str)
        and type(address[1]) is int and 0 < address[1] < 1 << 16
    ):
      raise MetadataError(obj_id, "offer_address", f"is {address!r}, not (host, port)")
    if type(self.authkey) is not bytes or len(self.authkey) != 32:
      raise MetadataError(obj_id, "authkey", "is not the 32-byte key of the offer service")
