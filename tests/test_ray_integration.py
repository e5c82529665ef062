"""rdt_jax beside Ray: the seam's checks, the thread-free hand-off, Ray's own
API and transports in a process where rdt_jax is registered, and actors as
users write them (threaded, async, busy)."""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

import conftest
import rdt_jax
from _unregistered_actor import Borrower
from rdt_jax import _handoff, _limits, _ray

rdt_jax.register()

pytestmark = pytest.mark.usefixtures("ray_session")


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh interpreter with this checkout first on the path."""
  full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(conftest.REPO), str(conftest.TESTS_DIR)])}
  full_env.pop(_ray.version.ALLOW_UNTESTED_ENV, None)
  full_env.update(env or {})
  return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------
# The seam's install-time checks.


def test_every_shape_check_passes_on_this_ray():
  assert _ray.version.check_ray_shapes() == []
  _ray.version.check_ray()  # a tested minor: no error, no warning


def test_a_changed_signature_is_reported(monkeypatch):
  from ray._private.serialization import SerializationContext

  monkeypatch.setattr(SerializationContext, "serialize_rdt_objects", lambda self, value: None)
  problems = _ray.version.check_ray_shapes()
  assert len(problems) >= 1
  assert any("serialize_rdt_objects" in p and "no longer takes" in p for p in problems)


def test_rays_own_transports_are_read_from_its_source():
  from ray.experimental.rdt import util

  found = _ray.registration.ray_default_transports(
      _ray.wrapping.unwrapped(util._ensure_default_transports_registered)
  )
  assert found is not None and sorted(n for n, _, _ in found) == sorted(util.DEFAULT_TRANSPORTS)
  assert ("NIXL", ["cuda", "cpu"], "NixlTensorTransport") in found


def _registers_more():
  import torch
  from ray.experimental.rdt.util import NixlTensorTransport, register_tensor_transport

  register_tensor_transport("NIXL", ["cpu"], NixlTensorTransport, torch.Tensor)
  register_tensor_transport("EXTRA", ["cpu"], NixlTensorTransport, object)


def _registers_an_unknown_class():
  import torch
  from ray.experimental.rdt.util import register_tensor_transport

  for name in ("NIXL", "GLOO", "NCCL", "CUDA_IPC"):
    register_tensor_transport(name, ["cpu"], NoSuchClass, torch.Tensor)  # noqa: F821


@pytest.mark.parametrize(
    "ensure", [_registers_more, _registers_an_unknown_class, len], ids=["more", "unknown", "no-source"]
)
def test_a_default_registration_rdt_jax_cannot_read_is_left_to_ray(ensure):
  """Where Ray's default registration registers anything else, or has no
  source to read, rdt_jax calls it as it is (torch imported), never a guess."""
  assert _ray.registration.ray_default_transports(ensure) is None


def test_ray_s_own_transports_are_registered_without_importing_torch_until_asked():
  out = run_python(
      "import sys, rdt_jax; rdt_jax.register()\n"
      "from ray.experimental.rdt import util\n"
      "util._ensure_default_transports_registered()\n"
      "print(sorted(util.transport_manager_info), 'torch' in sys.modules)\n"
      "print(util.get_transport_data_type('JAX_NIXL').__name__, 'torch' in sys.modules)\n"
      "import torch\n"
      "print(util.get_transport_data_type('GLOO') is torch.Tensor,\n"
      "      util.transport_manager_info['NIXL'].data_type is torch.Tensor)\n"
  )
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].endswith("False") and "'NIXL'" in lines[0] and "'CUDA_IPC'" in lines[0], lines
  assert lines[1] == "ArrayImpl False"
  assert lines[2] == "True True"


def test_an_actor_that_moves_jax_arrays_never_imports_torch():
  """Ray imported torch in every worker at its first transport lookup, to
  register its own transports (about 2 s of CPU per actor); rdt_jax
  registers them with torch's type looked up only when asked. Run in a Ray
  of its own: in the full suite's shared session a fresh actor did import
  torch when it received (likely through a custom transport an earlier
  test registered, whose class is sent to every new actor; not confirmed)."""
  script = conftest.REPO / "scripts" / "actor_start_cpu.py"
  out = subprocess.run(
      [sys.executable, str(script), "--pairs", "1"], capture_output=True, text=True, timeout=300,
      env={**os.environ, "PYTHONPATH": str(conftest.REPO)}, cwd=conftest.TESTS_DIR.parent,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "torch imported in a worker: [False]" in out.stdout, out.stdout


def test_rays_failure_monitor_survives_an_abort_that_raises(monkeypatch):
  """Ray's abort of a failed two-sided transfer kills both actors with
  `ray.kill`; one that raises (the handle already gone) no longer ends Ray's
  failure monitor: the other actor is still killed."""
  from ray.experimental.rdt import rdt_manager as rm

  killed = []

  def kill(actor, *args, **kwargs):
    killed.append(actor)
    if actor == "src":
      raise ValueError("Failed to find a corresponding actor handle")

  monkeypatch.setattr(ray, "kill", kill)
  monkeypatch.setattr(rm.RDTManager, "__init__", lambda self: None)
  info = rm.TransferMetadata(
      src_actor="src", dst_actor="dst", send_ref=None, recv_ref=None, communicator_meta=None,
      backend="JAX_GLOO", obj_id="x", timeout=0.0,
  )

  class Ref:
    def hex(self):
      return "ab"

  rm.RDTManager._abort_transport(rm.RDTManager(), Ref(), {"ab": info}, RuntimeError("send failed"))
  assert killed[0] == "src" and killed[-1] == "dst"


def test_shutdown_drops_what_rays_failure_monitor_had_not_taken():
  """A transfer queued for Ray's failure monitor when Ray shut down would end
  the next session's monitor thread ("owner is unknown"): shutdown drops it."""
  manager = ray._private.worker.global_worker.rdt_manager
  manager._unmonitored_transfers.put("a transfer of the ended session")
  manager.shutdown()
  assert manager._unmonitored_transfers.empty()


BREAK_TRIGGER_FETCH = """
from ray.experimental.rdt import rdt_manager
del rdt_manager.RDTManager._trigger_fetch
import rdt_jax
try:
  rdt_jax.register()
except RuntimeError as e:
  print(type(e).__name__, e)
else:
  print("registered")
"""


def test_register_refuses_a_ray_missing_an_internal():
  out = run_python(BREAK_TRIGGER_FETCH)
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("UnsupportedRayError"), out.stdout
  assert f"Ray {ray.__version__}" in out.stdout
  assert "RDTManager._trigger_fetch is missing" in out.stdout
  assert _ray.version.SUPPORTED_RAY in out.stdout


def test_a_failing_check_fails_even_when_untested_rays_are_allowed():
  out = run_python(BREAK_TRIGGER_FETCH, {_ray.version.ALLOW_UNTESTED_ENV: "1"})
  assert out.stdout.startswith("UnsupportedRayError"), out.stdout + out.stderr


UNTESTED_RAY = """
import warnings
import ray
ray.__version__ = "2.99.0"
import rdt_jax
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  try:
    print("registered", rdt_jax.register())
  except RuntimeError as e:
    print(type(e).__name__, e)
for w in caught:
  print("warning:", w.message)
"""


def test_an_untested_ray_is_refused_naming_the_setting():
  out = run_python(UNTESTED_RAY)
  assert out.stdout.startswith("UnsupportedRayError"), out.stdout + out.stderr
  assert "Ray 2.99.0" in out.stdout and _ray.version.SUPPORTED_RAY in out.stdout
  assert f"{_ray.version.ALLOW_UNTESTED_ENV}=1" in out.stdout


def test_an_untested_ray_runs_with_a_warning_when_allowed():
  out = run_python(UNTESTED_RAY, {_ray.version.ALLOW_UNTESTED_ENV: "1"})
  assert out.stdout.startswith("registered ["), out.stdout + out.stderr
  assert "jax_nixl" in out.stdout
  assert "warning: rdt_jax is tested with ray" in out.stdout and "2.99.0" in out.stdout


# --------------------------------------------------------------------------
# The serializer -> extract hand-off does not depend on the thread.


def _serialize(value):
  ctx = ray._private.worker.global_worker.get_serialization_context()
  return ctx.serialize_rdt_objects(value, "JAX_NIXL")


def _extract_on_another_thread(obj_id, leaves):
  from ray.experimental.rdt.util import get_tensor_transport_manager

  transport = get_tensor_transport_manager("JAX_NIXL")
  box = {}

  def extract():
    box["thread"] = threading.get_ident()
    box["meta"] = transport.extract_tensor_transport_metadata(obj_id, leaves)

  t = threading.Thread(target=extract)
  t.start()
  t.join(60)
  assert box["thread"] != threading.get_ident()
  transport.garbage_collect(obj_id, box["meta"], leaves)
  return box["meta"]


def test_extract_on_another_thread_gets_the_serializers_descriptions():
  value = {"w": jnp.ones((3, 2), jnp.float32), "b": np.arange(4, dtype=np.int16), "step": 3}
  _, leaves = _serialize(value)
  assert _handoff.pending_handoffs() == 1
  meta = _extract_on_another_thread("handoff-thread-test", leaves)
  # The pytree paths come only from the serializer: the fallback names leaves <leaf i>.
  assert sorted(leaf.path for leaf in meta.leaves) == ["['b']", "['w']"]
  assert _handoff.pending_handoffs() == 0


def test_a_failed_serialization_leaves_no_handoff():
  dead = jnp.ones(3)
  dead.delete()
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['dead'\]"):
    _serialize({"ok": jnp.zeros(2), "dead": dead})
  assert _handoff.pending_handoffs() == 0


def test_a_handoff_holds_no_leaf_alive():
  _, leaves = _serialize({"w": jnp.ones(1000)})
  assert _handoff.pending_handoffs() == 1
  del leaves
  gc.collect()
  assert _handoff.pending_handoffs() == 0


def test_an_expired_handoff_is_dropped(monkeypatch):
  _, leaves = _serialize({"w": jnp.ones(4)})
  monkeypatch.setattr(_limits, "HANDOFF_TTL_S", 0.0)
  assert _handoff.pending_handoffs() == 0
  # Extract still works: it describes the leaf again, without its path.
  meta = _extract_on_another_thread("handoff-expired-test", leaves)
  assert [leaf.path for leaf in meta.leaves] == ["<leaf 0>"]


def test_a_structure_seen_before_names_each_new_leaf_by_its_path():
  _, leaves = _serialize({"a": jnp.zeros(2), "b": {"c": jnp.ones(3)}})
  del leaves  # its hand-off goes with it
  gc.collect()
  dead = jnp.ones(3)
  dead.delete()
  # Same structure, new leaves: the kept paths are matched to these leaves.
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['b'\]\['c'\]"):
    _serialize({"a": jnp.zeros(2), "b": {"c": dead}})
  assert _handoff.pending_handoffs() == 0


def test_leaf_paths_are_kept_for_a_bounded_number_of_structures():
  for i in range(_limits.PATHS_KEPT + 5):
    shared = np.ones(1)
    tree = {f"k{i}": np.zeros(1), "x": [shared, shared]}
    paths = _handoff._paths_of(tree)
    assert paths[id(tree[f"k{i}"])] == f"['k{i}']"
    assert paths[id(shared)] == "['x'][0]"  # a leaf met twice: its first path
  assert _handoff.structures_kept() <= _limits.PATHS_KEPT


# --------------------------------------------------------------------------
# Reducers are chained, not overwritten.


def test_our_reducer_defers_to_the_one_it_replaced():
  torch = pytest.importorskip("torch")
  from ray import cloudpickle

  dispatch = cloudpickle.CloudPickler.dispatch
  saved = dispatch.get(torch.Tensor)
  seen = []

  def previous(t):
    seen.append(t)
    return torch.tensor, (t.tolist(),)

  try:
    dispatch[torch.Tensor] = previous  # as Ray's NIXL does on its first use
    _ray.serialization.install_reducers()
    ours = dispatch[torch.Tensor]
    assert ours is not previous and ours._rdt_jax_previous is previous
    x = torch.arange(3)
    assert cloudpickle.loads(cloudpickle.dumps(x)).tolist() == [0, 1, 2]
    assert seen == [x]
    _ray.serialization.install_reducers()  # idempotent: no second layer
    assert dispatch[torch.Tensor] is ours
  finally:
    if saved is None:
      dispatch.pop(torch.Tensor, None)
    else:
      dispatch[torch.Tensor] = saved
    _ray.serialization.install_reducers()


# --------------------------------------------------------------------------
# Ray's own NIXL keeps moving torch tensors out of band beside rdt_jax.


def _ray_nixl_available() -> bool:
  try:
    import nixl._api  # noqa: F401  (Ray's NIXL transport imports this package)
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


@pytest.mark.skipif(not _ray_nixl_available(), reason="Ray's NIXL transport needs torch and the nixl package")
@pytest.mark.parametrize(
    "order", [("torch", "rdt_jax"), ("rdt_jax", "torch"), ("torch", "ray-nixl", "rdt_jax")], ids="-then-".join
)
def test_ray_nixl_moves_torch_out_of_band_beside_rdt_jax(order):
  from _interop_actor import Mixer

  producer, consumer = Mixer.remote(order), Mixer.remote(order)
  try:
    # Ray's NIXL first (Ray installs its torch serializer), then jax_nixl with
    # a torch leaf (ours goes in front of it), then Ray's NIXL again.
    for step in range(2):
      ref = producer.torch_nixl.remote(4)
      conftest.wait_meta(ref)
      ray.get(producer.overwrite_kept.remote(10.0))
      # Out of band, the consumer reads the tensor's live memory: 4 x 10.
      # Pickled in band, it would get the values at return time (0+1+2+3).
      assert ray.get(consumer.sums.remote(ref)) == {"": 40.0}, f"step {step}: the tensor went in band"
      if step == 0:
        assert ray.get(consumer.sums.remote(producer.mixed_jax_nixl.remote(4))) == {"jax": 6.0, "torch": 6.0}
  finally:
    ray.kill(producer)
    ray.kill(consumer)


# --------------------------------------------------------------------------
# Ray's public set_target_for_ref / set_target_device_for_ref on rdt_jax refs.


@ray.remote(enable_tensor_transport=True)
class Maker:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, n: int):
    return {"a": jnp.arange(n, dtype=jnp.float32), "b": np.arange(n, dtype=np.int64)}

  @ray.method(tensor_transport="jax_nixl")
  def containers(self):
    return {
        1: [jnp.arange(2, dtype=jnp.int32), (np.arange(3, dtype=np.int16), "s")],
        (2, "t"): None,
        "empty": [],
        "z": {"b": 1.5, "a": [jnp.ones(1)]},
    }

  @ray.method(tensor_transport="jax_nixl")
  def a_list(self):
    return [jnp.arange(2, dtype=jnp.int32), {"k": (jnp.zeros(1),)}]

  def put_pair(self):
    return [ray.put([np.arange(3), np.arange(3, 6)], _tensor_transport="jax_nixl")]


@pytest.fixture(scope="module")
def maker():
  m = Maker.remote()
  yield m
  ray.kill(m)


def test_dict_and_list_values_keep_their_containers_keys_and_order(maker):
  # Ray's serializer is handed dicts and lists pickled whole (`_ray.serialization._whole`):
  # what arrives is the same value, container types, key types and order included.
  got = ray.get(maker.containers.remote())
  assert list(got) == [1, (2, "t"), "empty", "z"]
  assert type(got[1]) is list and type(got[1][1]) is tuple and got[1][1][1] == "s"
  np.testing.assert_array_equal(got[1][0], np.arange(2))
  assert isinstance(got[1][0], jax.Array) and isinstance(got[1][1][0], np.ndarray)
  np.testing.assert_array_equal(got[1][1][0], np.arange(3, dtype=np.int16))
  assert got[(2, "t")] is None and got["empty"] == []
  assert list(got["z"]) == ["b", "a"] and got["z"]["b"] == 1.5
  np.testing.assert_array_equal(got["z"]["a"][0], np.ones(1))
  listed = ray.get(maker.a_list.remote())
  assert type(listed) is list and type(listed[1]["k"]) is tuple
  np.testing.assert_array_equal(listed[0], np.arange(2))


def test_rays_set_target_for_ref_receives_into_the_buffers(maker):
  from ray.experimental import set_target_for_ref

  ref = maker.make.remote(8)
  conftest.wait_meta(ref)
  # Ray's function takes the leaves in order, as rdt_jax's does for a list.
  targets = [np.zeros(8, np.float32), np.zeros(8, np.int64)]
  set_target_for_ref(ref, targets)
  got = ray.get(ref)
  assert got["a"] is targets[0] and got["b"] is targets[1]
  np.testing.assert_array_equal(targets[0], np.arange(8, dtype=np.float32))
  np.testing.assert_array_equal(targets[1], np.arange(8))


def test_rays_set_target_for_ref_checks_the_buffers(maker):
  from ray.experimental import set_target_for_ref

  ref = maker.make.remote(8)
  conftest.wait_meta(ref)
  targets = [np.zeros(8, np.float32), np.zeros(8, np.int32)]  # Ray keeps weak references
  set_target_for_ref(ref, targets)
  with pytest.raises(ValueError, match=r"Target for leaf \['b'\].*int32.*int64"):
    ray.get(ref)


@pytest.mark.parametrize("device", ["cpu", "jax-cpu"])
def test_rays_set_target_device_for_ref_accepts_jax_devices(maker, device):
  from ray.experimental import set_target_device_for_ref

  ref = maker.make.remote(5)
  conftest.wait_meta(ref)
  set_target_device_for_ref(ref, jax.devices("cpu")[0] if device == "jax-cpu" else device)
  got = ray.get(ref)
  assert isinstance(got["a"], jax.Array) and got["a"].devices() == {jax.devices("cpu")[0]}
  assert got["a"].tolist() == [0, 1, 2, 3, 4]


def test_rays_set_target_device_for_ref_refuses_what_no_transport_moves(maker):
  from ray.experimental import set_target_device_for_ref

  ref = maker.make.remote(5)
  with pytest.raises(ValueError, match="tpu"):
    set_target_device_for_ref(ref, "tpu")


@pytest.mark.parametrize("target", ["numpy", "torch", "jax-device"])
def test_rays_targets_work_in_a_borrower_that_registered_nothing(maker, target):
  # An actor ray.puts the value; another, created without
  # enable_tensor_transport, borrows the ref nested in a list, so it meets
  # jax_nixl first in the ref's metadata, before any lookup of Ray's registry.
  if target == "torch":
    pytest.importorskip("torch")
  [ref] = ray.get(maker.put_pair.remote())
  borrower = Borrower.remote()
  try:
    known_before, got, same = ray.get(borrower.receive_with_rays_target.remote([ref], target))
  finally:
    ray.kill(borrower)
  assert not known_before  # the case under test: nothing registered jax_nixl there yet
  assert [values for _, values in got] == [[0, 1, 2], [3, 4, 5]]
  kind = "Tensor" if target == "torch" else "ndarray"  # a device target keeps the leaves' framework
  assert [k for k, _ in got] == [kind] * 2
  if target != "jax-device":
    assert same == [True, True]  # received into the buffers themselves


# --------------------------------------------------------------------------
# Actors as users write them.


@ray.remote(enable_tensor_transport=True, max_concurrency=4)
class ThreadedNode:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, n: int, seed: int):
    time.sleep(0.2)  # keep several calls running at once
    return {"x": jnp.full((n,), seed, jnp.float32), "i": np.full(n, seed, np.int32)}

  def total(self, value):
    return float(value["x"].sum()) + float(value["i"].sum())

  def get_total(self, refs):
    return self.total(ray.get(refs[0]))


@ray.remote(enable_tensor_transport=True)
class AsyncNode:
  @ray.method(tensor_transport="jax_nixl")
  async def make(self, n: int, seed: int):
    return {"x": jnp.full((n,), seed, jnp.float32)}

  async def total(self, value):
    return float(value["x"].sum())

  async def put_first(self, n: int):
    return [ray.put({"x": jnp.ones(n)}, _tensor_transport="jax_nixl")]


def test_threaded_actors_produce_and_consume():
  producer, consumer = ThreadedNode.remote(), ThreadedNode.remote()
  try:
    refs = [producer.make.remote(16, seed) for seed in range(8)]
    for r in refs:
      conftest.wait_meta(r)  # Ray lends a ref inside a list only once its metadata is here
    totals = ray.get([consumer.total.remote(r) for r in refs] + [consumer.get_total.remote([r]) for r in refs])
    assert totals == [32.0 * seed for seed in range(8)] * 2
  finally:
    ray.kill(producer)
    ray.kill(consumer)


def test_async_actors_produce_and_consume():
  producer, consumer = AsyncNode.remote(), AsyncNode.remote()
  try:
    refs = [producer.make.remote(16, seed) for seed in range(4)]
    assert ray.get([consumer.total.remote(r) for r in refs]) == [16.0 * seed for seed in range(4)]
    [put_ref] = ray.get(producer.put_first.remote(3))
    assert ray.get(consumer.total.remote(put_ref)) == 3.0
  finally:
    ray.kill(producer)
    ray.kill(consumer)


# Ray's out-of-order example (docs/ray_integration.md, "Known issues"): two
# actors with max_concurrency=10, a hundred refs passed straight from one to
# the other. Async actors taking the refs as arguments can stall inside Ray;
# the two ways around it the page gives must move every ref.
OUT_OF_ORDER_REFS = 100
OUT_OF_ORDER_N = 64 << 10  # float32: out of band, above the in-band threshold


@ray.remote(enable_tensor_transport=True, max_concurrency=10)
class ThreadedOutOfOrder:
  @ray.method(tensor_transport="jax_nixl")
  def make(self, seed: int):
    return jnp.full((OUT_OF_ORDER_N,), seed, jnp.float32)

  def sum(self, data) -> float:
    return float(data.sum())


@ray.remote(enable_tensor_transport=True, max_concurrency=10)
class AsyncOutOfOrder:
  @ray.method(tensor_transport="jax_nixl")
  async def make(self, seed: int):
    return jnp.full((OUT_OF_ORDER_N,), seed, jnp.float32)

  async def sum(self, data) -> float:
    return float(data.sum())


def _sums_out_of_order(cls, wait_first: bool) -> list[float]:
  producer, consumer = cls.remote(), cls.remote()
  try:
    refs = [producer.make.remote(seed) for seed in range(OUT_OF_ORDER_REFS)]
    if wait_first:
      ray.wait(refs, num_returns=len(refs), timeout=120)
    return ray.get([consumer.sum.remote(r) for r in refs], timeout=120)
  finally:
    ray.kill(producer)
    ray.kill(consumer)


@pytest.mark.parametrize(("cls", "wait_first"), [(ThreadedOutOfOrder, False), (AsyncOutOfOrder, True)],
                         ids=["threaded", "async-after-ray-wait"])
def test_rays_out_of_order_example_moves_every_ref_the_ways_the_docs_give(cls, wait_first):
  expected = [float(seed * OUT_OF_ORDER_N) for seed in range(OUT_OF_ORDER_REFS)]
  assert _sums_out_of_order(cls, wait_first) == expected


def test_a_by_value_actors_first_action_is_a_put():
  # Defined here, so Ray pickles it by value: the worker imports nothing of
  # rdt_jax before the method runs except what the registration brings.
  @ray.remote(enable_tensor_transport=True)
  class Fresh:
    def put(self, n):
      return [ray.put({"x": jnp.arange(n, dtype=jnp.float32)}, _tensor_transport="jax_nixl")]

  fresh = [Fresh.remote() for _ in range(3)]  # three new workers, started together
  refs = [ref for [ref] in ray.get([f.put.remote(5) for f in fresh])]
  for ref in refs:
    assert ray.get(ref)["x"].tolist() == [0, 1, 2, 3, 4]
  for f in fresh:
    ray.kill(f)


BUSY_S = 30


@ray.remote(enable_tensor_transport=True, concurrency_groups={"io": 1})
class BusyConsumer:
  def busy(self, flag: str, seconds: float):
    pathlib.Path(flag).touch()
    time.sleep(seconds)
    return "done"

  @ray.method(concurrency_group="io")
  def total(self, value):
    return float(value["a"].sum())


@ray.remote(enable_tensor_transport=True, max_concurrency=2)
class BusyThreadedConsumer:
  def busy(self, flag: str, seconds: float):
    pathlib.Path(flag).touch()
    time.sleep(seconds)
    return "done"

  def total(self, value):
    return float(value["a"].sum())


@ray.remote
class Spawner:
  """Creates actors in its own process, so the driver registers rdt_jax's
  transports on them only when it first sends them an RDT ref."""

  def spawn(self, cls):
    import rdt_jax

    rdt_jax.register()
    return [cls.remote()]


@pytest.mark.parametrize("cls", [BusyConsumer, BusyThreadedConsumer], ids=["concurrency-group", "threaded"])
def test_a_busy_consumer_receives_in_another_group_or_thread(cls, maker, tmp_path):
  spawner = Spawner.remote()  # owns the consumer: kept alive for the test
  [consumer] = ray.get(spawner.spawn.remote(cls))
  flag = tmp_path / "busy"
  busy = consumer.busy.remote(str(flag), BUSY_S)
  assert conftest.wait_for(flag.exists, timeout=60)
  start = time.monotonic()
  ref = maker.make.remote(6)
  total = ray.get(consumer.total.remote(ref), timeout=BUSY_S)
  elapsed = time.monotonic() - start
  assert total == 15.0
  # Well before the busy method ends: nothing waited behind it.
  assert elapsed < BUSY_S / 2, f"the ref arrived after {elapsed:.1f} s"
  assert ray.wait([busy], timeout=0)[1] == [busy]  # still busy
  ray.kill(consumer)
  ray.kill(spawner)
