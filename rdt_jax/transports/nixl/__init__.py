"""The `jax_nixl` backend: one-sided NIXL READs, and node-local reads.

Rooms (each module readable alone): `agent` (the process's agent and its
progress poll), `registrations` (registration cache and pools), `export` (the
producer's side), `read` (the consumer's two read strategies, NIXL and
node-local through `rdt_jax._node_local`, behind one interface),
`staleness` (the check every read strategy makes), `views` (the consumer's
view of producers' agents), `inflight` (a posted READ's lifecycle), and
`transport` (`NixlTransport`, composing them).
"""

from rdt_jax.transports.nixl.metadata import NixlTransportMetadata as NixlTransportMetadata
from rdt_jax.transports.nixl.read import coalesce as coalesce
from rdt_jax.transports.nixl.read import read_pairs as read_pairs
from rdt_jax.transports.nixl.transport import NixlTransport as NixlTransport

__all__ = ["NixlTransport", "NixlTransportMetadata", "coalesce", "read_pairs"]
