"""The transport contract kit (`rdt_jax.testing`) catches what it claims to:
it fails a transport that delivers chunks out of order, or keeps a file open
for every object it exported. (The kit passing the example transport, as a
user runs it: examples/test_shm_transport.py, run by tests/test_examples.py.)"""

import os

import pytest
import ray

import conftest
from rdt_jax.testing import TransportContract
from shm_transport import ShmTransport


class ReversedLeakyTransport(ShmTransport):
  """Two bugs: each object's leaves are written last first, and `release`
  keeps the file open."""

  name = "shm_reversed_leaky"

  def export_buffers(self, obj_id, leaves, meta):
    super().export_buffers(obj_id, list(leaves)[::-1], meta)

  def release(self, obj_id):
    self.files.pop(obj_id, None)  # never closed


class BrokenContract(TransportContract):
  transport = ReversedLeakyTransport
  __test__ = False  # run by hand below, its checks expected to fail


def test_the_kit_fails_a_transport_that_reorders_chunks_or_leaks_files():
  from rdt_jax.testing._contract import _Actors

  conftest.start_ray(num_cpus=8)
  actors = _Actors(BrokenContract)
  try:
    contract = BrokenContract()
    with pytest.raises(AssertionError):
      contract.test_mixed_leaves_arrive_as_their_source_type(actors)
    with pytest.raises(AssertionError, match=r"after 20 transfers"):
      contract.test_no_leaks_over_many_transfers(actors)
    # The check that the bugs do not touch still passes.
    contract.test_release_runs_once_ray_frees_the_object(actors)
  finally:
    actors.close()
    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
