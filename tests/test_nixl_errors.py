"""A NIXL or UCX failure reaches the user as an error that names the
operation, the object, the producer and what to do (never a bare
`nixlBackendError`), forced for real without Ray: a registration NIXL
refuses, and a producer whose agent metadata NIXL cannot load."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from ray.exceptions import RayDirectTransportError
from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

from rdt_jax import _dlpack, _handoff
from rdt_jax.transports.nixl import NixlTransport
from rdt_jax.transports.nixl.metadata import where_digest
from rdt_jax.transports.nixl.registrations import NixlError

pytest.importorskip("nixl")


def test_a_refused_registration_names_the_region_purpose_and_fix():
  transport = NixlTransport()
  with pytest.raises(NixlError, match=r"could not register 64 bytes of DRAM at 0x0 .*for object o1.*ulimit -l") as e:
    transport._registrations.register(0, 64, _dlpack.Device("cpu"), purpose="for object o1")
  assert e.value.operation == "register"
  assert transport.counters()["registrations"] == 0
  back = pickle.loads(pickle.dumps(e.value))
  assert str(back) == str(e.value) and back.operation == "register"


def test_an_unloadable_producer_agent_names_the_object_and_producer(monkeypatch):
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "0")
  monkeypatch.setenv("RDT_JAX_NIXL_CMA", "0")  # the NIXL READ path
  prod, cons = NixlTransport(), NixlTransport()
  tree = [np.arange(1000, dtype=np.float32)]
  _handoff.record_described(tree[0], _dlpack.describe(tree[0], "['w']"))
  meta = prod.extract_tensor_transport_metadata("o2", tree)
  bad = pickle.loads(pickle.dumps(meta))
  bad.agent_meta = b"not an agent's metadata" * 4
  bad.digest = where_digest(bad, [tree[0].nbytes])  # as a producer would send it
  with pytest.raises(RayDirectTransportError) as e:
    cons.wait_fetch_complete(cons.fetch_multiple_tensors("o2", bad, CommunicatorMetadata()), 10)
  message = str(e.value)
  assert "NixlError: jax_nixl could not load the agent metadata to read object o2 from producer agent" in message
  assert meta.agent_name in message and "run one NIXL version everywhere" in message
  # The genuine metadata still reads.
  got = cons.wait_fetch_complete(cons.fetch_multiple_tensors("o2", meta, CommunicatorMetadata()), 30)
  np.testing.assert_array_equal(got[0], tree[0])
  prod.garbage_collect("o2", meta, tree)
