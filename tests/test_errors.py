"""The commonest mistakes end in an error that says what to do.

Each test makes one mistake for real (real Ray, real actors, small arrays)
and checks the message: what happened, and the fix. Errors raised where Ray
checks first subclass Ray's exception type, so code catching Ray's
`ValueError` keeps working. docs/errors.md lists the same errors.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
import ray

import conftest
import rdt_jax
from _unregistered_actor import Plain

rdt_jax.register()

SMALL = 4  # elements: every value here is a few bytes


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):
  yield


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def make(self):
    return {"w": np.arange(SMALL, dtype=np.float32)}

  @ray.method(tensor_transport="jax_nixl")
  def bare(self):
    return np.arange(SMALL, dtype=np.float32)

  def plain(self):
    return 1


@pytest.fixture(scope="module")
def producer():
  """One producer for the cases that only need objects made (none kills it)."""
  p = Producer.remote()
  yield p
  ray.kill(p)


# ---- transport names Ray does not know


def _run(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_class_defined_before_register_names_the_fix():
  code = """
import ray
import rdt_jax
try:
  @ray.remote
  class Learner:
    @ray.method(tensor_transport="jax_nixl")
    def params(self):
      return {}
except ValueError as e:
  print(type(e).__name__, isinstance(e, rdt_jax.TransportNotRegisteredError))
  print(e)
"""
  out = _run(code)
  assert out.returncode == 0, out.stderr
  first, message = out.stdout.split("\n", 1)
  assert first == "TransportNotRegisteredError True"
  assert message.startswith("Invalid tensor transport: JAX_NIXL. 'jax_nixl' is an rdt_jax transport")
  assert "rdt_jax.register() has not run in this process yet. Call rdt_jax.register() first" in message


def test_a_typo_suggests_the_closest_name():
  with pytest.raises(rdt_jax.TransportNotRegisteredError) as info:

    @ray.remote
    class Learner:
      @ray.method(tensor_transport="jax_nixll")
      def params(self):
        return {}

  assert str(info.value).startswith("Invalid tensor transport: JAX_NIXLL. Did you mean 'jax_nixl'?")
  assert "jax_nixl" in str(info.value).split("Transports registered here: ")[1]
  assert isinstance(info.value, ValueError)
  assert (info.value.transport, info.value.suggestion) == ("jax_nixll", "jax_nixl")


def test_a_typo_in_put_and_options_suggests_the_closest_name(producer):
  with pytest.raises(rdt_jax.TransportNotRegisteredError, match=r"JAX-NIXL\. Did you mean 'jax_nixl'\?"):
    ray.put(np.ones(SMALL), _tensor_transport="jax-nixl")
  with pytest.raises(rdt_jax.TransportNotRegisteredError, match=r"Did you mean 'jax_nixl'\?"):
    producer.plain.options(tensor_transport="jax_nicl").remote()


def test_a_name_unrelated_to_rdt_jax_keeps_rays_error():
  with pytest.raises(ValueError) as info:
    ray.put(np.ones(SMALL), _tensor_transport="carrier_pigeon")
  assert type(info.value) is ValueError
  assert str(info.value) == "Invalid tensor transport: CARRIER_PIGEON"


def test_put_in_an_actor_without_enable_tensor_transport_names_the_flag():
  actor = Plain.remote()
  with pytest.raises(rdt_jax.TransportNotRegisteredError) as info:
    ray.get(actor.put.remote(SMALL))
  message = str(info.value)
  assert "Invalid tensor transport: JAX_NIXL. 'jax_nixl' is an rdt_jax transport, and this actor has none" in message
  assert "Add enable_tensor_transport=True to the actor's class, or call rdt_jax.register() in the actor" in message


def test_a_method_with_a_transport_on_an_actor_without_the_flag_names_it():
  actor = Plain.remote()
  with pytest.raises(ValueError, match=r"Please set @ray\.remote\(enable_tensor_transport=True\)"):
    actor.value.options(tensor_transport="jax_nixl").remote()


def test_a_consumer_without_the_flag_receives(producer):
  """Receiving needs no flag: a ref as an argument registers rdt_jax there."""
  consumer = Plain.remote()
  assert ray.get(consumer.take.remote(producer.bare.remote())) == float(sum(range(SMALL)))


def test_jax_gloo_without_a_collective_group_names_the_call():
  if "jax_gloo" not in rdt_jax.register():
    pytest.skip("jax_gloo needs torch")

  @ray.remote(enable_tensor_transport=True)
  class GlooProducer:
    @ray.method(tensor_transport="jax_gloo")
    def make(self):
      return np.ones(SMALL)

  producer, consumer = GlooProducer.remote(), Plain.remote()
  with pytest.raises(ValueError) as info:
    ray.get(consumer.take.remote(producer.make.remote()))
  message = str(info.value)
  assert "is in none with backend 'torch_gloo'" in message
  fix = "ray.experimental.collective.create_collective_group([producer, consumer, ...], backend='torch_gloo')"
  assert fix in message


# ---- objects this process does not know


def test_get_of_an_object_this_process_forgot_says_why(producer):
  """Simulates what a freed object leaves: a live ref whose RDT metadata this
  process no longer has (restored afterwards, so Ray frees it normally)."""
  ref = producer.bare.remote()
  ray.get(ref)
  manager = ray._private.worker.global_worker.rdt_manager
  with manager._lock:
    meta = manager._managed_rdt_metadata.pop(ref.hex())
  try:
    with pytest.raises(rdt_jax.UnknownObjectError) as info:
      ray.get(ref)
  finally:
    with manager._lock:
      manager._managed_rdt_metadata[ref.hex()] = meta
  assert isinstance(info.value, AssertionError)
  assert info.value.object_id == ref.hex()
  message = str(info.value)
  assert message.startswith(f"No metadata found for {ref.hex()}: this process knows no RDT object")
  assert "Keep the ref that the method or ray.put returned alive until every consumer has fetched" in message


# ---- targets and receive modes


def test_a_target_of_another_shape_or_dtype_names_leaf_and_fix(producer):
  ref = producer.make.remote()
  conftest.wait_meta(ref)
  with pytest.raises(ValueError) as info:
    rdt_jax.set_target_for_ref(ref, {"w": np.zeros(SMALL + 1, np.float32)})
  assert str(info.value) == (
      f"Target for leaf ['w'] has shape ({SMALL + 1},) and dtype float32, but the value's leaf has "
      f"shape ({SMALL},) and dtype float32. Pass an array of shape ({SMALL},) and dtype float32 "
      f"(e.g. np.empty(({SMALL},), np.float32)), or, to receive part of the leaf, an rdt_jax.Slice."
  )
  bare = producer.bare.remote()
  conftest.wait_meta(bare)
  with pytest.raises(ValueError, match=r"Target for leaf \(the value itself\) has shape \(4,\) and dtype float64"):
    rdt_jax.set_target_for_ref(bare, np.zeros(SMALL, np.float64))


def test_a_target_on_a_ref_that_is_no_rdt_object_says_which_refs_work():
  with pytest.raises(ValueError, match=r"is not an RDT object.*ray\.put\(\.\.\., _tensor_transport=\.\.\.\)"):
    rdt_jax.set_target_for_ref(ray.put(1), np.zeros(SMALL))


def test_receive_as_names_the_modes():
  with pytest.raises(ValueError) as info:
    rdt_jax.receive_as("nump")
  assert str(info.value).startswith(
      "Unknown receive mode 'nump'; expected one of 'source', 'jax', 'torch', 'numpy'. Did you mean 'numpy'?"
  )
  not_a_string = r"a string, one of 'source', 'jax', 'torch', 'numpy', not a module \(receive_as\('numpy'\)\)"
  with pytest.raises(TypeError, match=not_a_string):
    rdt_jax.receive_as(np)  # type: ignore[arg-type]
  rdt_jax.receive_as("source")


# ---- receive_stats


def test_receive_stats_counts_this_processes_fetches(producer):
  ref = producer.make.remote()
  ray.wait([ref])
  rdt_jax.receive_stats("jax_nixl", reset=True)
  assert ray.get(ref)["w"].tolist() == list(range(SMALL))
  stats = rdt_jax.receive_stats("jax_nixl", reset=True)
  assert set(stats) == {
      "fetches", "bytes", "destinations", "descriptors", "inline", "direct", "cuda_ipc", "cuda_ipc_fallback"
  }
  assert all(type(v) is int for v in stats.values())
  assert stats["inline"] == 0 and stats["fetches"] == 1  # out of band: in-band sending is opt-in
  assert rdt_jax.receive_stats() == dict.fromkeys(stats, 0)


def test_receive_stats_refuses_unknown_and_foreign_transports():
  with pytest.raises(rdt_jax.TransportNotRegisteredError) as info:
    rdt_jax.receive_stats("jax_nixxl")
  assert str(info.value).startswith("No transport 'jax_nixxl' is registered in this process. Did you mean 'jax_nixl'?")
  assert info.value.suggestion == "jax_nixl"
  with pytest.raises(ValueError, match=r"'nixl' is one of Ray's own transports, which rdt_jax does not count"):
    rdt_jax.receive_stats("nixl")


def test_receive_stats_in_an_actor_without_transports_names_the_fix():
  with pytest.raises(rdt_jax.TransportNotRegisteredError, match=r"Add enable_tensor_transport=True"):
    ray.get(Plain.remote().stats.remote())


# ---- the error types themselves


@pytest.mark.parametrize(
    "error",
    [
        rdt_jax.TransportNotRegisteredError("m", "jax_nixll", "jax_nixl"),
        rdt_jax.UnknownObjectError("m", "ab12"),
        rdt_jax.UnsupportedRayError("m"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_attributes(error):
  copy = pickle.loads(pickle.dumps(error))
  assert type(copy) is type(error) and copy.__dict__ == error.__dict__ and str(copy) == "m"
  assert type(error).__module__ == "rdt_jax"
