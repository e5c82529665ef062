"""The `jax_transfer` backend: one-sided pulls with JAX's own transfer server.

Rooms (each module readable alone): `metadata` (what the producer publishes
and the checks it passes on arrival), `protocol` (the offer protocol's wire
format, HMAC challenge and limits), `server` (the offer service, this
process's transfer servers and the address they bind), `offers` (the
producer's offered objects and pending offers), `boxes` (box geometry of
resharded pulls), `peers` (the consumer's connections to producers and the
offer request), `pull` (what a consumer pulls and how the leaves are made),
and `transport` (`TransferTransport`, composing them).
"""

from rdt_jax.transports.transfer.metadata import TransferTransportMetadata as TransferTransportMetadata
from rdt_jax.transports.transfer.transport import TransferTransport as TransferTransport

__all__ = ["TransferTransport", "TransferTransportMetadata"]
