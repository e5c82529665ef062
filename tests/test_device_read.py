"""Device memory at device speed, the parts a CPU host can check.

* The UCX settings jax_nixl applies before an agent exists
  (`nixl.ucx`): set where unset on a host with a CUDA driver, never over a
  user's value, off with `RDT_JAX_UCX_DEFAULTS=0`; the environments under
  which a device READ would still be emulated are told apart, and warned
  about once.
* Which device chunks a producer copies into a pooled region at export
  (`export.device_chunks_to_copy`).
* Copies into caller arrays (`_memory.copy_into_many`) on host memory.
* No reconnect in the steady state: a consumer reading repeated objects
  through NIXL READs (node-local reads off, as for a producer on another
  host) never rebuilds its view of the producer, counted by
  `counters()["view_rebuilds"]`; the host path's equivalent of the device
  path's pooled regions is the pooled staging buffer of small chunks.

tests/gpu runs the device side on a GPU host.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import ray

import rdt_jax
from conftest import wait_meta, worker_env
from rdt_jax import _limits, _memory, _settings
from rdt_jax.transports.nixl import export, ucx

rdt_jax.register()

GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


# --------------------------------------------------------------------------
# UCX settings


def test_defaults_are_set_where_unset_on_a_cuda_host(monkeypatch):
  monkeypatch.delenv("RDT_JAX_UCX_DEFAULTS", raising=False)
  env: dict[str, str] = {"UCX_TLS": "all"}
  assert ucx.apply_defaults(env, cuda=True) == {GET_ZCOPY: "y"}
  assert env == {"UCX_TLS": "all", GET_ZCOPY: "y"}
  assert ucx.apply_defaults(env, cuda=True) == {}  # already set: nothing more


def test_a_value_the_user_set_is_never_changed(monkeypatch):
  monkeypatch.delenv("RDT_JAX_UCX_DEFAULTS", raising=False)
  env = {GET_ZCOPY: "n"}
  assert ucx.apply_defaults(env, cuda=True) == {}
  assert env == {GET_ZCOPY: "n"}


def test_defaults_can_be_turned_off_and_are_not_set_without_a_cuda_driver(monkeypatch):
  env: dict[str, str] = {}
  assert ucx.apply_defaults(env, cuda=False) == {} and env == {}
  monkeypatch.setenv("RDT_JAX_UCX_DEFAULTS", "0")
  assert ucx.apply_defaults(env, cuda=True) == {} and env == {}
  monkeypatch.setenv("RDT_JAX_UCX_DEFAULTS", "maybe")
  with pytest.raises(_settings.SettingError, match="RDT_JAX_UCX_DEFAULTS='maybe'"):
    ucx.apply_defaults(env, cuda=True)


def test_register_sets_nothing_on_a_host_without_a_cuda_driver(monkeypatch):
  """UCX without its CUDA modules warns at every agent about a `UCX_CUDA_*`
  variable it does not use: on this CPU host `register()` leaves it unset."""
  if ucx.cuda_driver_present():
    pytest.skip("this host has a CUDA driver")
  monkeypatch.delenv(GET_ZCOPY, raising=False)
  monkeypatch.delenv("RDT_JAX_UCX_DEFAULTS", raising=False)
  rdt_jax.register()
  assert GET_ZCOPY not in os.environ


@pytest.mark.parametrize(
    ("env", "found"),
    [
        ({}, None),
        ({GET_ZCOPY: "y"}, None),
        ({GET_ZCOPY: "n"}, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n turns CUDA IPC READs off"),
        ({GET_ZCOPY: "0"}, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=0 turns CUDA IPC READs off"),
        ({"UCX_TLS": "tcp,cuda_copy"}, "UCX_TLS=tcp,cuda_copy leaves out cuda_ipc"),
        ({"UCX_TLS": "tcp,cuda_ipc,cuda_copy"}, None),
        ({"UCX_TLS": "all"}, None),
        ({"UCX_TLS": "^cuda_ipc"}, "UCX_TLS=^cuda_ipc excludes cuda_ipc"),
        ({"UCX_TLS": "^ib"}, None),
    ],
)
def test_device_read_problem_names_the_variable(monkeypatch, env, found):
  monkeypatch.delenv("RDT_JAX_UCX_DEFAULTS", raising=False)
  problem = ucx.device_read_problem(env)
  if found is None:
    assert problem is None
  else:
    assert problem is not None and found in problem


def test_defaults_turned_off_with_the_variable_unset_is_a_problem(monkeypatch):
  monkeypatch.setenv("RDT_JAX_UCX_DEFAULTS", "0")
  problem = ucx.device_read_problem({})
  assert problem is not None and "RDT_JAX_UCX_DEFAULTS=0" in problem
  assert ucx.device_read_problem({GET_ZCOPY: "y"}) is None


def test_the_warning_comes_once_and_only_with_a_gpu(monkeypatch):
  monkeypatch.setattr(ucx, "_warned", False)
  monkeypatch.setenv(GET_ZCOPY, "no")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert ucx.warn_once(has_gpu=False) is None
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=no" in (ucx.warn_once(has_gpu=True) or "")
    ucx.warn_once(has_gpu=True)
  assert [str(w.message).count("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=no") for w in caught] == [1]


def test_device_read_env_is_what_a_process_without_rdt_jax_needs(monkeypatch):
  monkeypatch.delenv(GET_ZCOPY, raising=False)
  monkeypatch.delenv("RDT_JAX_UCX_DEFAULTS", raising=False)
  want = {GET_ZCOPY: "y"} if ucx.cuda_driver_present() else {}
  assert ucx.device_read_env() == want
  assert GET_ZCOPY not in os.environ  # asked, not applied


# --------------------------------------------------------------------------
# Export: which device chunks are copied


def test_every_device_chunk_is_copied_while_the_object_fits_one_pooled_region():
  big = 64 << 20
  assert export.device_chunks_to_copy([big, 100, big], pool_bytes=1 << 30) == [0, 1, 2]


def test_an_object_larger_than_the_pool_copies_only_its_small_chunks():
  big = 600 << 20
  small = _limits.PACK_MAX_CHUNK
  assert export.device_chunks_to_copy([big, small, big, small + 1], pool_bytes=1 << 30) == [1]
  assert export.device_chunks_to_copy([], pool_bytes=0) == []


# --------------------------------------------------------------------------
# Copies into caller arrays


def test_copy_into_many_fills_host_targets_of_any_framework():
  import torch

  a, b = np.zeros(4, np.float32), torch.zeros(3, dtype=torch.int64)
  _memory.copy_into_many([(a, np.arange(4, dtype=np.float32)), (b, np.arange(3, dtype=np.int64))])
  assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [0, 1, 2]
  _memory.copy_into_many([])


# --------------------------------------------------------------------------
# No reconnect in the steady state


@ray.remote(enable_tensor_transport=True)
class Producer:
  @ray.method(tensor_transport="jax_nixl")
  def small(self, seed: int):
    """Small leaves: packed into the pooled staging buffer (registered once)."""
    return {f"x{i}": np.full(1 << 14, (seed + i) % 251, np.uint8) for i in range(8)}

  @ray.method(tensor_transport="jax_nixl")
  def large(self, seed: int):
    """One leaf read in place: registered for the object, deregistered after."""
    return {"x": np.full(4 << 20, seed % 251, np.uint8)}


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def take(self, refs: list) -> list[int]:
    tree = ray.get(refs[0])
    return sorted({int(v[0]) for v in tree.values() if bool((v == v[0]).all())})

  def view_rebuilds(self) -> int:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return get_tensor_transport_manager("JAX_NIXL").counters()["view_rebuilds"]


@pytest.mark.usefixtures("ray_session")
def test_repeated_objects_cost_no_reconnect_and_the_counter_sees_one():
  producer = Producer.remote()
  # NIXL READs (node-local reads off, as from another host); views rebuilt at
  # once after a producer deregistered memory, so the count can grow.
  consumer = Consumer.options(
      runtime_env=worker_env(RDT_JAX_NIXL_CMA="0", RDT_JAX_NIXL_VIEW_REBUILD_S="0")).remote()
  try:
    def take(method, seed: int) -> list[int]:
      ref = method.remote(seed)
      wait_meta(ref)
      return ray.get(consumer.take.remote([ref]), timeout=120)

    assert take(producer.small, 0) == list(range(8))
    before = ray.get(consumer.view_rebuilds.remote())
    for seed in range(1, 6):
      assert take(producer.small, seed) == [(seed + i) % 251 for i in range(8)]
    assert ray.get(consumer.view_rebuilds.remote()) == before
    # An object read in place is deregistered once freed: the next READ
    # rebuilds the view (the count the check above relies on moves).
    for seed in range(1, 4):
      assert take(producer.large, seed) == [seed]
    assert ray.get(consumer.view_rebuilds.remote()) > before
  finally:
    ray.kill(producer)
    ray.kill(consumer)
