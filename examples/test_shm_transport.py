"""The transport contract (`rdt_jax.testing`) on the example transport, as a
user runs it on theirs: `pytest examples/test_shm_transport.py`."""

from rdt_jax.testing import TransportContract
from shm_transport import ShmTransport


class TestShmTransport(TransportContract):
  transport = ShmTransport
