"""The `jax_transfer` backend: one-sided pulls with JAX's own transfer server
(`transport`, whose docstring says how rdt_jax uses it)."""

from rdt_jax.transports.transfer.transport import TransferTransport as TransferTransport
from rdt_jax.transports.transfer.transport import TransferTransportMetadata as TransferTransportMetadata

__all__ = ["TransferTransport", "TransferTransportMetadata"]
