"""Weight sync (`rdt_jax.WeightPublisher` / `WeightSubscriber`) and typed PRNG
keys, between real actors.

A trainer holds parameters sharded over 4 forced host devices (a typed PRNG
key among them) and publishes versions; generators pull them into torch
tensors in place, or as jax arrays on a 2-device mesh of their own. Every
check compares bytes (sha256 of each leaf) with what the trainer published.

Host parameters published through `jax_nixl` are packed versions
(`rdt_jax.weights._packed`): on this host generators copy them from the
trainer's memory (node-local, the default), or, with node-local reads off
(`READ_PATH`), fetch them with one NIXL READ. `jax_transfer` versions travel
as pytrees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

import rdt_jax
from conftest import OUT_OF_BAND_ENV, wait_for, worker_env

rdt_jax.register()

pytestmark = pytest.mark.usefixtures("ray_session")
RAY_NUM_CPUS = 12

FOUR = "--xla_force_host_platform_device_count=4"
TWO = "--xla_force_host_platform_device_count=2"
#: A failure must reach the caller within this many seconds.
ERROR_BOUND_S = 30.0


def leaf_sha(x) -> str:
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  a = np.ascontiguousarray(rdt_jax.to_numpy(x))
  return hashlib.sha256(f"{a.shape}|{a.dtype.name}|".encode() + a.tobytes()).hexdigest()


def tree_shas(tree) -> dict:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(p): leaf_sha(x) for p, x in flat}


def make_params(version: int) -> dict:
  """Deterministic parameters of `version`, the big leaf sharded over 4 devices."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  w = jnp.arange(256 * 512, dtype=jnp.float32).reshape(256, 512) + version
  return {
      "layer": {
          "w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("x", None))),
          "b": jnp.full((512,), version, jnp.float32),
      },
      "emb": (jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) * version).astype(jnp.bfloat16),
      "rng": jax.random.fold_in(jax.random.key(0), version),
      "step": version,
  }


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self, keep: int = 2, transport: str = "jax_nixl", pack: bool = True):
    self.pub = rdt_jax.WeightPublisher(transport=transport, keep=keep, pack=pack)
    self.params: dict | None = None

  def publish(self, version: int, params_version: int | None = None):
    self.params = make_params(version if params_version is None else params_version)
    return self.pub.publish(self.params, version=version)

  def donate_step(self) -> tuple[bool, bool]:
    """A jitted step donating the current (published) parameters: whether
    its values are right, and whether the donation took the inputs'
    buffers (they are deleted then)."""
    old = self.params
    arrays = {"layer": old["layer"], "emb": old["emb"]}
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x + 1, p), donate_argnums=0)
    new = step(arrays)
    jax.block_until_ready(new)
    self.params = {**old, **new}
    right = tree_shas(new) == tree_shas({"layer": make_params(2)["layer"], "emb": (make_params(1)["emb"] + 1)})
    return right, all(x.is_deleted() for x in jax.tree_util.tree_leaves(arrays))

  def shas(self, version: int) -> dict:
    return tree_shas(make_params(version))

  def versions(self) -> tuple:
    return self.pub.versions

  def objects(self) -> int:
    """RDT objects this process exports now."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return get_tensor_transport_manager("JAX_NIXL").counters()["objects"]

  def stats(self):
    return self.pub.stats

  def bad_publish(self, version: int) -> str:
    try:
      self.pub.publish(make_params(version), version=version)
    except ValueError as e:
      return str(e)
    return "published"


def torch_template(atomic: bool = False):
  import torch

  return {
      "layer": {"w": torch.zeros((256, 512)), "b": torch.zeros(512)},
      "emb": torch.zeros((64, 32), dtype=torch.bfloat16),
      "rng": jax.random.key(0),
      "step": 0,
  }


def jax_template():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(np.array(jax.devices()[:2]), ("y",))
  return {
      "layer": {
          "w": NamedSharding(mesh, PartitionSpec(None, "y")),
          "b": NamedSharding(mesh, PartitionSpec()),
      },
      "emb": jnp.zeros((64, 32), jnp.bfloat16),
      "rng": jax.random.key(0),
      "step": 0,
  }


@ray.remote(enable_tensor_transport=True, concurrency_groups={"probe": 1})
class Generator:
  def __init__(self, kind: str = "torch", atomic: bool = False, template: str = "ok"):
    self.kind = kind
    tree = torch_template() if kind == "torch" else jax_template()
    if template == "bad_shape":
      import torch

      tree["layer"]["w"] = torch.zeros((256, 256))
    elif template == "missing":
      del tree["emb"]
    self.sub = rdt_jax.WeightSubscriber(tree, atomic=atomic)
    self.addresses = self._addresses()

  def _addresses(self) -> list:
    if self.kind != "torch":
      return []
    t = self.sub.template
    return [t["layer"]["w"].data_ptr(), t["layer"]["b"].data_ptr()]

  def pull(self, handle, timeout: float | None = None) -> dict:
    params = self.sub.pull(handle, timeout=timeout)
    out = {"version": self.sub.version, "shas": tree_shas(params), "rng_impl": str(jax.random.key_impl(params["rng"])),
           "step": params["step"]}
    if self.kind == "torch":
      t = self.sub.template
      out["in_place"] = params["layer"]["w"] is t["layer"]["w"] and self._addresses() == self.addresses
    else:
      out["w_devices"] = len(params["layer"]["w"].sharding.device_set)
      out["w_spec"] = tuple(params["layer"]["w"].sharding.spec)
    return out

  def try_pull(self, handle, timeout: float | None = None) -> dict:
    """A pull expected to fail: the error, and the state it left."""
    before = tree_shas(self.sub.template)
    t0 = time.monotonic()
    try:
      self.sub.pull(handle, timeout=timeout)
      error = None
    except Exception as e:
      error = e
    return {
        "error": None if error is None else " | ".join([f"{type(error).__name__}: {error}",
                                                          *getattr(error, "__notes__", [])]),
        "stale": isinstance(error, rdt_jax.StaleWeightsError),
        "attrs": (error.version, error.current) if isinstance(error, rdt_jax.StaleWeightsError) else None,
        "elapsed": time.monotonic() - t0,
        "version": self.sub.version,
        "template_unchanged": tree_shas(self.sub.template) == before,
    }

  def version(self):
    return self.sub.version

  def faults(self, spec: str | None) -> None:
    """Replaces this process's fault rules (`RDT_JAX_FAULTS`'s syntax)."""
    from rdt_jax import _faults

    _faults.configure(spec)

  @ray.method(concurrency_group="probe")
  def acted(self, point: str) -> int:
    """How often fault point `point` acted (answered while a pull runs)."""
    from rdt_jax import _faults

    return _faults.injected().get(point, 0)

  def last_pull(self):
    return self.sub.last_pull

  def memory(self) -> dict:
    """The pooled host bytes here, and the plan's staging and version sizes."""
    plan = next(iter(self.sub._plans.values()))
    return {"pooled": rdt_jax._memory.host_pool.pooled_bytes(), "staging": plan.staging_bytes,
            "total": plan.info.layout.total}


@ray.remote(enable_tensor_transport=True)
class NamedLoader:
  """An engine that loads weights by name, with no template."""

  def __init__(self, bucket_bytes: int | None = None):
    self.sub = rdt_jax.WeightSubscriber(None, bucket_bytes=bucket_bytes)

  def load(self, handle, rename=None, stop_after=None, framework="torch", publish_after_first=None) -> dict:
    shas, kinds, peak, error = {}, set(), 0, None
    it = self.sub.pull_named(handle, rename=rename, framework=framework)
    try:
      for i, (name, x) in enumerate(it):
        shas[name] = leaf_sha(x)
        kinds.add(type(x).__module__.split(".")[0])
        peak = max(peak, rdt_jax._memory.host_pool.pooled_bytes())
        del x
        if i == 0 and publish_after_first is not None:
          publisher, version = publish_after_first
          ray.get(publisher.publish.remote(version))
        if stop_after is not None and i + 1 >= stop_after:
          it.close()
          break
    except Exception as e:
      error = f"{type(e).__name__}: {e}"
    return {"shas": shas, "kinds": kinds, "version": self.sub.version, "last": self.sub.last_pull, "peak": peak,
            "error": error}

  def plain_pull(self, handle) -> str:
    try:
      self.sub.pull(handle)
    except ValueError as e:
      return str(e)
    return "pulled"


def trainer(keep: int = 2, transport: str = "jax_nixl", pack: bool = True, **env: str):
  return Trainer.options(runtime_env=worker_env(XLA_FLAGS=FOUR, **env)).remote(keep, transport, pack)


def generator(kind: str = "torch", atomic: bool = False, template: str = "ok", **env: str):
  flags = TWO if kind == "jax" else FOUR
  return Generator.options(runtime_env=worker_env(XLA_FLAGS=flags, **env)).remote(kind, atomic, template)


# Out of band and through NIXL's READ (no node-local read): the fault points
# of the READ path fire for every pull.
READ_PATH = dict(OUT_OF_BAND_ENV)


def expected(shas: dict) -> dict:
  return {k: v for k, v in shas.items() if k != "['step']"}


def pulled(result: dict) -> dict:
  return {k: v for k, v in result["shas"].items() if k != "['step']"}


# ---- without actors


def test_publisher_lives_in_an_actor_and_keeps_at_least_one():
  with pytest.raises(RuntimeError, match="lives in a Ray actor"):
    rdt_jax.WeightPublisher()
  with pytest.raises(ValueError, match="keep=0"):
    rdt_jax.WeightPublisher(keep=0)
  with pytest.raises(ValueError, match="two-sided"):
    rdt_jax.WeightPublisher(transport="jax_gloo")


def test_bucket_runs_cut_copies_at_bucket_boundaries():
  from rdt_jax.weights import _packed_plan

  runs = _packed_plan.bucket_runs([(1000, 0, 10), (2000, 60, 10), (3000, 100, 28)], 64, 2)
  assert runs == [[(1000, 0, 10), (2000, 60, 4)], [(2004, 0, 6), (3000, 36, 28)]]
  with pytest.raises(ValueError, match="outside 2 buckets of 64 bytes"):
    _packed_plan.bucket_runs([(0, 120, 16)], 64, 2)


def test_bucket_size_is_a_multiple_of_the_alignment(monkeypatch):
  from rdt_jax.weights import _publisher as _weights

  monkeypatch.setenv("RDT_JAX_WEIGHT_BUCKET_BYTES", "5000")
  assert _weights.bucket_size() == 4992
  assert _weights.bucket_size(8100) == 8064  # an argument is rounded the same way
  monkeypatch.delenv("RDT_JAX_WEIGHT_BUCKET_BYTES")
  assert _weights.bucket_size() == 256 << 20


def test_stream_arguments_refuse_bad_values_naming_the_argument(monkeypatch):
  template = {"w": np.zeros(4, np.float32)}
  with pytest.raises(ValueError, match=r"^bucket_bytes=100 is out of range: give 4 KiB to 1 TiB \(4096 to "):
    rdt_jax.WeightPublisher(bucket_bytes=100)
  with pytest.raises(ValueError, match=r"^bucket_bytes=2199023255552 is out of range: .*RDT_JAX_WEIGHT_BUCKET_BYTES"):
    rdt_jax.WeightSubscriber(template, bucket_bytes=2 << 40)
  with pytest.raises(ValueError, match=r"^bucket_bytes=-1 is not a byte count"):
    rdt_jax.WeightSubscriber(template, bucket_bytes=-1)
  for bad in ("1MiB", 65536.0, True):
    says = rf"^bucket_bytes={bad!r} is of type {type(bad).__name__}; bucket_bytes takes a byte count"
    with pytest.raises(TypeError, match=says):
      rdt_jax.WeightSubscriber(None, bucket_bytes=bad)  # type: ignore[arg-type]
  with pytest.raises(TypeError, match=r"^device_pack=.0. is of type str; device_pack takes True or False"):
    rdt_jax.WeightPublisher(device_pack="0")  # type: ignore[arg-type]
  for error in (ValueError, TypeError):  # plain argument errors, not the family's
    assert not issubclass(error, rdt_jax.RdtJaxError)
  # Given, an argument wins over its setting, even a bad one; left out, the setting is read at construction.
  monkeypatch.setenv("RDT_JAX_WEIGHT_BUCKET_BYTES", "lots")
  assert rdt_jax.WeightSubscriber(template, bucket_bytes=np.int64(8192)).bucket_bytes == 8192
  with pytest.raises(rdt_jax.SettingError, match="RDT_JAX_WEIGHT_BUCKET_BYTES='lots'"):
    rdt_jax.WeightSubscriber(template)
  monkeypatch.setenv("RDT_JAX_WEIGHT_BUCKET_BYTES", str(BUCKET))
  sub = rdt_jax.WeightSubscriber(template)
  monkeypatch.delenv("RDT_JAX_WEIGHT_BUCKET_BYTES")
  assert sub.bucket_bytes == BUCKET  # read when the subscriber was made


def test_template_check_names_the_leaf():
  from rdt_jax.weights import _handle as _weights

  published = _weights.structure_of(make_params(1) | {"layer": {"w": jnp.zeros((256, 512)), "b": jnp.zeros(512)}})
  template = _weights.flatten(torch_template())
  _weights.check_template(template, published)  # matches
  key_rbg = dict(template) | {"['rng']": jax.random.key(0, impl="rbg")}
  with pytest.raises(ValueError, match=r"\['rng'\].*impl rbg.*impl threefry2x32"):
    _weights.check_template(list(key_rbg.items()), published)
  extra = [*template, ("['extra']", np.zeros(3))]
  with pytest.raises(ValueError, match=r"leaf at \['extra'\] that the published value lacks"):
    _weights.check_template(extra, published)
  sliced = dict(template) | {"['layer']['w']": rdt_jax.Slice[0:300]}
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['layer'\]\['w'\]"):
    _weights.check_template(list(sliced.items()), published)
  with pytest.raises(ValueError, match="holds no jax, torch or numpy arrays"):
    rdt_jax.WeightSubscriber({"step": 3})


# ---- between actors


@pytest.mark.parametrize(
    ("transport", "env"),
    [("jax_nixl", {}), ("jax_nixl", READ_PATH), ("jax_transfer", {})],
    ids=["packed-node-local", "packed-nixl-read", "pytree-jax_transfer"],
)
def test_versions_reach_torch_in_place_and_jax_on_another_mesh(transport, env):
  t = trainer(transport=transport, **env)
  gens = [generator("torch", **env), generator("jax", **env)]
  for version in (1, 2, 5):
    handle = ray.get(t.publish.remote(version))
    assert handle.version == version
    assert (handle.packed is not None) == (transport == "jax_nixl")
    want = expected(ray.get(t.shas.remote(version)))
    torch_result, jax_result = ray.get([g.pull.remote(handle) for g in gens])
    for result in (torch_result, jax_result):
      assert result["version"] == version
      assert pulled(result) == want
      assert result["rng_impl"] == "threefry2x32"
      assert result["step"] == version  # a non-array leaf travels too
    assert torch_result["in_place"]
    assert jax_result["w_devices"] == 2 and jax_result["w_spec"] == (None, "y")
  for a in [t, *gens]:
    ray.kill(a)


def test_handle_moves_no_weight_bytes():
  t = trainer()
  handle = ray.get(t.publish.remote(1))
  assert isinstance(handle, rdt_jax.WeightsHandle)
  assert len(ray.cloudpickle.dumps(handle)) < 4096  # the weights are 640 KiB
  ray.kill(t)


def test_a_packed_version_becomes_an_rdt_object_only_for_a_pull_that_needs_one():
  t = trainer()
  local = generator("torch")
  through_ray = [generator("torch", **READ_PATH), generator("torch", **READ_PATH)]
  handle = ray.get(t.publish.remote(1))
  assert handle.ref is None and handle.packed is not None
  want = expected(ray.get(t.shas.remote(1)))
  # On the trainer's host a pull reads the trainer's memory: no object is made.
  assert pulled(ray.get(local.pull.remote(handle))) == want
  assert ray.get(t.objects.remote()) == 0
  # A pull that reads through Ray asks for the object; the next one shares it.
  for g in through_ray:
    r = ray.get(g.pull.remote(handle))
    assert r["version"] == 1 and pulled(r) == want and r["in_place"], r
  assert ray.get(t.objects.remote()) == 1
  # The object is freed with its version; asking for a version no longer kept is stale.
  ray.get([t.publish.remote(2), t.publish.remote(3)])
  assert ray.get(t.objects.remote()) == 0
  late = generator("torch", **READ_PATH)
  r = ray.get(late.try_pull.remote(handle))
  assert r["stale"] and r["attrs"] == (1, None) and r["template_unchanged"], r
  for a in [t, local, late, *through_ray]:
    ray.kill(a)


#: A bucket size that cuts the test's version (about 520 KiB) into several.
BUCKET = 64 << 10


@pytest.mark.parametrize("atomic", [False, True], ids=["in-place", "atomic"])
def test_a_pull_through_ray_moves_the_version_in_buckets(atomic):
  t = trainer(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET))
  g = generator("torch", atomic=atomic, **READ_PATH)
  for version in (1, 2):
    handle = ray.get(t.publish.remote(version))
    r = ray.get(g.pull.remote(handle))
    assert r["version"] == version and pulled(r) == expected(ray.get(t.shas.remote(version))), r
    assert r["in_place"], r
  mem = ray.get(g.memory.remote())
  buckets = -(-mem["total"] // BUCKET)
  assert buckets >= 4, mem
  # Both kept versions were read through Ray: their buckets are the trainer's objects.
  assert ray.get(t.objects.remote()) == 2 * buckets
  # The generator held at most two buckets (and the last, shorter one) besides its staging.
  assert mem["pooled"] <= mem["staging"] + 3 * BUCKET, mem
  if not atomic:
    assert mem["pooled"] < mem["total"], mem  # never the whole version at once
  for a in (t, g):
    ray.kill(a)


@pytest.mark.parametrize("atomic", [False, True], ids=["in-place", "atomic"])
def test_a_pull_that_fails_between_buckets_is_torn_or_unchanged(atomic):
  t = trainer(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET))
  g = generator("torch", atomic=atomic, **READ_PATH)
  assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
  ray.get(g.faults.remote("weights.bucket:fail@2*1"))  # fails once two buckets are copied out
  r = ray.get(g.try_pull.remote(ray.get(t.publish.remote(2))))
  assert "injected fault at weights.bucket" in r["error"], r
  if atomic:
    assert r["version"] == 1 and r["template_unchanged"], r
  else:
    assert r["version"] is None and not r["template_unchanged"], r  # torn: part of version 2 is in
  ray.get(g.faults.remote(None))
  r = ray.get(g.pull.remote(ray.get(t.publish.remote(3))))
  assert r["version"] == 3 and pulled(r) == expected(ray.get(t.shas.remote(3))), r
  for a in (t, g):
    ray.kill(a)


@pytest.mark.parametrize(("pack", "env", "route"), [
    (True, {}, "node_local"),
    (True, {**READ_PATH, "RDT_JAX_WEIGHT_BUCKET_BYTES": str(BUCKET)}, "buckets"),
    (False, {}, "ray"),
], ids=["node_local", "buckets", "ray"])
def test_last_pull_says_what_the_pull_did(pack, env, route):
  t = trainer(keep=2, pack=pack, RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET))
  g = generator("torch", **env)
  assert ray.get(g.last_pull.remote()) is None
  h1, h2 = (ray.get(t.publish.remote(v)) for v in (1, 2))
  assert ray.get(g.pull.remote(h1))["version"] == 1
  first = ray.get(g.last_pull.remote())
  assert isinstance(first, rdt_jax.PullStats)
  assert (first.version, first.route, first.lag) == (1, route, 1), first  # version 2 was kept too
  # Array leaves as published: w and b in float32, emb in bfloat16, the key's data.
  assert first.nbytes >= 256 * 512 * 4 + 512 * 4 + 64 * 32 * 2, first
  assert first.objects == {"node_local": 0, "buckets": -(-first.nbytes // BUCKET), "ray": 1}[route], first
  assert 0 < first.seconds < 60, first
  assert ray.get(g.pull.remote(h2))["version"] == 2
  second = ray.get(g.last_pull.remote())
  assert (second.version, second.lag, second.nbytes) == (2, 0, first.nbytes), second
  assert ray.get(g.try_pull.remote(h1))["stale"]  # a refused pull leaves the record as it was
  assert ray.get(g.last_pull.remote()) == second
  st = ray.get(t.stats.remote())
  assert isinstance(st, rdt_jax.PublishStats)
  assert (st.published, st.last_version, st.last_kind) == (2, 2, "packed" if pack else "pytree"), st
  assert st.last_nbytes >= 256 * 512 * 4 + 512 * 4 + 64 * 32 * 2 and 0 < st.last_seconds < 60, st
  if pack:
    assert st.last_nbytes == second.nbytes, (st, second)
  # Subscribers off the host (buckets) ask for the versions' bucket objects; pytree versions are
  # objects from their publish; node-local pulls ask nothing.
  assert st.objects == {"node_local": 0, "buckets": 2 * first.objects, "ray": 2}[route], st
  # A node-local subscriber asks once, for the structure at its first pull; the others ask each pull.
  assert st.answered == 1 if route == "node_local" else st.answered >= 4, st
  for a in (t, g):
    ray.kill(a)


@pytest.mark.parametrize(("pack", "env", "route"), [
    (True, {}, "node_local"),
    (True, {**READ_PATH}, "buckets"),
    (False, {}, "ray"),
], ids=["node_local", "buckets", "ray"])
def test_pull_named_yields_every_leaf_by_name_a_bucket_at_a_time(pack, env, route):
  t = trainer(keep=2, pack=pack, RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET))
  g = NamedLoader.options(runtime_env=worker_env(
      XLA_FLAGS=FOUR, RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET), **env)).remote()
  want = expected(ray.get(t.shas.remote(1)))
  r = ray.get(g.load.remote(ray.get(t.publish.remote(1))))
  assert r["error"] is None and r["shas"] == want and r["kinds"] == {"torch"}, r
  assert (r["version"], r["last"].version, r["last"].route) == (1, 1, route), r
  assert r["last"].nbytes >= 256 * 512 * 4 + 512 * 4 + 64 * 32 * 2, r
  if pack:  # one bucket (and the one leaf larger than it) at a time
    assert r["peak"] <= 256 * 512 * 4 + 3 * BUCKET, r
  # The engine's names; a leaf mapped to None is skipped; numpy arrays.
  r = ray.get(g.load.remote(ray.get(t.publish.remote(2)), rename=lambda p: None if "emb" in p else "model" + p,
                            framework="numpy"))
  assert r["error"] is None and r["kinds"] == {"numpy"} and r["version"] == 2, r
  assert r["shas"] == {"model" + p: v for p, v in expected(ray.get(t.shas.remote(2))).items() if "emb" not in p}
  # Stopped early: the engine holds part of version 3, so no version; the next pull runs.
  r = ray.get(g.load.remote(ray.get(t.publish.remote(3)), stop_after=1))
  assert r["error"] is None and len(r["shas"]) == 1 and r["version"] is None, r
  assert r["last"].version == 2, r  # the record of the last pull that ended
  r = ray.get(g.load.remote(ray.get(t.publish.remote(4))))
  assert r["error"] is None and r["version"] == 4 and r["shas"] == expected(ray.get(t.shas.remote(4))), r
  if pack:  # a handle changed on the way is refused before anything is read
    h = ray.get(t.publish.remote(5))
    bad = dataclasses.replace(h, packed=dataclasses.replace(h.packed, buffer=h.packed.buffer + 64))
    r = ray.get(g.load.remote(bad))
    assert r["error"].startswith("MetadataError") and not r["shas"] and r["version"] == 4, r
  assert "no template" in ray.get(g.plain_pull.remote(ray.get(t.publish.remote(6))))
  with_template = rdt_jax.WeightSubscriber({"w": np.zeros(4, np.float32)})
  with pytest.raises(ValueError, match="has a template"):
    with_template.pull_named(ray.get(t.publish.remote(7)))
  with pytest.raises(ValueError, match="'torch' or 'numpy'"):
    rdt_jax.WeightSubscriber(None).pull_named(ray.get(t.publish.remote(8)), framework="jax")
  for a in (t, g):
    ray.kill(a)


@pytest.mark.parametrize(("env", "route"), [({}, "node_local"), ({**READ_PATH}, "buckets")],
                         ids=["node_local", "buckets"])
def test_pull_named_of_a_version_freed_meanwhile_stops_before_its_next_bucket(env, route):
  t = trainer(keep=1, RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET))
  g = NamedLoader.options(runtime_env=worker_env(
      XLA_FLAGS=FOUR, RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET), **env)).remote()
  old = ray.get(t.publish.remote(1))
  # Refused before anything moves once a newer version replaced it (keep=1).
  ray.get(t.publish.remote(2))
  r = ray.get(g.load.remote(old))
  assert r["error"].startswith("StaleWeightsError") and not r["shas"] and r["version"] is None, r
  # Freed after the first pair was taken: the next bucket's pairs never come.
  h = ray.get(t.publish.remote(3))
  want = expected(ray.get(t.shas.remote(3)))
  r = ray.get(g.load.remote(h, publish_after_first=(t, 4)))
  assert r["error"].startswith("StaleWeightsError"), r
  assert 1 <= len(r["shas"]) < len(want) and all(want[p] == v for p, v in r["shas"].items()), r
  assert r["version"] is None, r
  for a in (t, g):
    ray.kill(a)


#: The leaves of `StreamTrainer`'s versions: 16 of 16 KiB (256 KiB in all).
SMALL_LEAVES, SMALL_LEAF = 16, 16 << 10


@ray.remote(enable_tensor_transport=True)
class StreamTrainer:
  """A publisher made with the stream's keyword arguments, publishing host
  versions of many small leaves."""

  def __init__(self, **options):
    self.pub = rdt_jax.WeightPublisher(keep=1, **options)

  def publish(self, version: int):
    tree = {f"l{i:02d}": np.full(SMALL_LEAF // 4, version * 100 + i, np.float32) for i in range(SMALL_LEAVES)}
    return self.pub.publish(tree, version=version)

  def settings(self) -> tuple[int, bool]:
    return self.pub.bucket_bytes, self.pub.device_pack


def test_a_stream_s_arguments_take_effect_over_the_environment():
  """`bucket_bytes` and `device_pack` given to a publisher or subscriber
  decide for that stream, whatever the process's variables say; left out,
  the variable decides."""
  total = SMALL_LEAVES * SMALL_LEAF
  env = {"RDT_JAX_WEIGHT_BUCKET_BYTES": str(64 << 10), "RDT_JAX_WEIGHT_DEVICE_PACK": "0"}
  by_env = StreamTrainer.options(runtime_env=worker_env(**env)).remote()
  by_argument = StreamTrainer.options(runtime_env=worker_env(**env)).remote(bucket_bytes=32 << 10, device_pack=True)
  assert ray.get(by_env.settings.remote()) == (64 << 10, False)
  assert ray.get(by_argument.settings.remote()) == (32 << 10, True)
  # Off the publisher's host (buckets through Ray): the publisher's bucket size cuts the version.
  remote = NamedLoader.options(runtime_env=worker_env(**READ_PATH)).remote()
  for version, publisher, size in ((1, by_env, 64 << 10), (2, by_argument, 32 << 10)):
    r = ray.get(remote.load.remote(ray.get(publisher.publish.remote(version))))
    assert r["error"] is None and len(r["shas"]) == SMALL_LEAVES, r
    assert (r["last"].route, r["last"].objects) == ("buckets", total // size), r
  # On the publisher's host: the subscriber's bucket size bounds what one copy holds.
  small = NamedLoader.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(1 << 20))).remote(32 << 10)
  whole = NamedLoader.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(32 << 10))).remote(1 << 20)
  handle = ray.get(by_env.publish.remote(3))
  r_small, r_whole = ray.get([small.load.remote(handle), whole.load.remote(handle)])
  for r in (r_small, r_whole):
    assert r["error"] is None and len(r["shas"]) == SMALL_LEAVES and r["last"].route == "node_local", r
  assert r_small["peak"] <= 3 * (32 << 10) < total <= r_whole["peak"], (r_small["peak"], r_whole["peak"])
  for a in (by_env, by_argument, remote, small, whole):
    ray.kill(a)


def test_versions_increase_and_old_ones_are_stale():
  t = trainer(keep=2)
  g = generator("torch")
  handles = [ray.get(t.publish.remote(v)) for v in (1, 2, 3)]
  assert ray.get(t.versions.remote()) == (2, 3)
  assert "not newer" in ray.get(t.bad_publish.remote(3))

  # Version 1 left the keep window: refused before anything moves.
  r = ray.get(g.try_pull.remote(handles[0]))
  assert r["stale"] and r["attrs"] == (1, None) and r["version"] is None and r["template_unchanged"], r
  assert "Version 1 is no longer kept" in r["error"] and "[2, 3]" in r["error"]

  assert ray.get(g.pull.remote(handles[2]))["version"] == 3
  # Not newer than the version held: refused, nothing changes.
  for old in handles[1:]:
    r = ray.get(g.try_pull.remote(old))
    assert r["stale"] and r["attrs"] == (old.version, 3) and r["version"] == 3 and r["template_unchanged"], r
  ray.kill(t)
  ray.kill(g)


def test_first_pull_checks_the_template_naming_the_leaf():
  t = trainer()
  handle = ray.get(t.publish.remote(1))
  bad = generator("torch", template="bad_shape")
  r = ray.get(bad.try_pull.remote(handle))
  assert "['layer']['w']" in r["error"] and "(256, 256)" in r["error"] and "(256, 512)" in r["error"], r
  assert r["version"] is None and r["template_unchanged"]
  missing = generator("torch", template="missing")
  r = ray.get(missing.try_pull.remote(handle))
  assert "no leaf at ['emb']" in r["error"] and "bfloat16" in r["error"], r
  for a in (t, bad, missing):
    ray.kill(a)


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_a_failed_read_changes_nothing(atomic):
  """A packed version fetched through NIXL is copied into the template only
  after its READ completed and the publisher still kept it: a READ that
  fails leaves the template and the version as they were, in both modes."""
  t = trainer(**READ_PATH)
  g = generator("torch", atomic=atomic, RDT_JAX_FAULTS="nixl.complete:fail@2*1", **READ_PATH)
  first = ray.get(t.publish.remote(1))
  assert ray.get(g.pull.remote(first))["version"] == 1
  r = ray.get(g.try_pull.remote(ray.get(t.publish.remote(2))))
  assert "injected fault at nixl.complete" in r["error"], r
  assert r["version"] == 1 and r["template_unchanged"], r
  # The next pull succeeds.
  result = ray.get(g.pull.remote(ray.get(t.publish.remote(3))))
  assert result["version"] == 3 and pulled(result) == expected(ray.get(t.shas.remote(3)))
  ray.kill(t)
  ray.kill(g)


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_failed_node_local_pull_leaves_torn_or_unchanged(atomic):
  """A node-local pull copies straight into the template (`atomic=False`):
  one that fails after its copy leaves version None (torn: version 2's bytes
  arrived); `atomic=True` copies into staging first and changes nothing."""
  t = trainer()
  g = generator("torch", atomic=atomic, RDT_JAX_FAULTS="weights.copied:fail@2*1")
  assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
  r = ray.get(g.try_pull.remote(ray.get(t.publish.remote(2))))
  assert "injected fault at weights.copied" in r["error"], r
  if atomic:
    assert r["version"] == 1 and r["template_unchanged"], r
  else:
    assert r["version"] is None and not r["template_unchanged"], r
  result = ray.get(g.pull.remote(ray.get(t.publish.remote(3))))
  assert result["version"] == 3 and pulled(result) == expected(ray.get(t.shas.remote(3)))
  ray.kill(t)
  ray.kill(g)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "pytree"])
def test_an_atomic_pull_whose_commit_fails_leaves_version_none(pack):
  """An atomic pull copies its staging arrays into the template at its end:
  a copy that fails there (a device error; injected here after the copy)
  leaves bytes of the new version in the template, so `version` is None,
  never the old version, and the error says the template may hold them."""
  t = trainer(pack=pack)
  g = generator("torch", atomic=True, RDT_JAX_FAULTS="weights.commit:fail@2*1")
  assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
  r = ray.get(g.try_pull.remote(ray.get(t.publish.remote(2))))
  assert "injected fault at weights.commit" in r["error"], r
  assert "may hold some of its bytes" in r["error"], r
  assert r["version"] is None and not r["template_unchanged"], r
  result = ray.get(g.pull.remote(ray.get(t.publish.remote(3))))
  assert result["version"] == 3 and pulled(result) == expected(ray.get(t.shas.remote(3)))
  ray.kill(t)
  ray.kill(g)


def test_a_version_freed_during_a_node_local_pull_is_stale():
  """The publisher drops a version (two newer ones published, keep=2) while
  a generator copies it: the pull's second look at the publisher's table of
  kept versions refuses it, naming both versions; the template is torn."""
  t = trainer()
  g = generator("torch", RDT_JAX_FAULTS="weights.copied:delay=4@2*1")
  assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
  handle = ray.get(t.publish.remote(2))
  pending = g.try_pull.remote(handle)
  # The copy is done once the pull waits in the injected delay (4 s: the two
  # publishes below take well under that, even on a loaded host).
  assert wait_for(lambda: ray.get(g.acted.remote("weights.copied")) >= 1, ERROR_BOUND_S)
  ray.get([t.publish.remote(3), t.publish.remote(4)])
  r = ray.get(pending, timeout=ERROR_BOUND_S)
  assert r["stale"] and r["attrs"] == (2, 1), r
  assert "was freed while it was being read" in r["error"] and "[3, 4]" in r["error"], r
  assert r["version"] is None, r
  ray.kill(t)
  ray.kill(g)


def test_trainer_killed_mid_pull_is_an_error_within_the_bound():
  t = trainer(**READ_PATH)
  # Each wait on the READ sleeps 1 s: the trainer dies while the pull runs.
  g = generator("torch", RDT_JAX_FAULTS="nixl.wait:delay=1", UCX_TLS="tcp", **READ_PATH)
  handle = ray.get(t.publish.remote(1))
  call = g.try_pull.remote(handle)
  assert wait_for(lambda: ray.get(g.acted.remote("nixl.wait")) >= 1, ERROR_BOUND_S)  # the READ is in flight
  ray.kill(t)
  r = ray.get(call, timeout=ERROR_BOUND_S * 2)
  assert r["error"] is not None and r["elapsed"] < ERROR_BOUND_S, r
  assert r["version"] is None  # in place: the pull had started
  ray.kill(g)


def test_trainer_killed_before_a_node_local_pull_is_the_lifetime_error():
  t = trainer()
  g = generator("torch")
  pid = ray.get(t.__ray_call__.remote(lambda self: os.getpid()))
  assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
  handle = ray.get(t.publish.remote(2))
  ray.kill(t)
  assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30)  # gone before the pull starts
  r = ray.get(g.try_pull.remote(handle), timeout=ERROR_BOUND_S * 2)
  assert "has died: the object died with it" in r["error"] and r["elapsed"] < ERROR_BOUND_S, r
  assert r["version"] == 1 and r["template_unchanged"], r  # refused before any byte moved
  ray.kill(g)


@contextlib.contextmanager
def loaded_host() -> Iterator[None]:
  """Two processes spinning on this host's two cores (`yes > /dev/null`)."""
  import subprocess

  spinners = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(2)]
  try:
    yield
  finally:
    for p in spinners:
      p.kill()
      p.wait()


def test_a_pull_after_ray_reports_the_trainer_dead_is_the_lifetime_error():
  """`ray.kill` has returned and the driver sees `ActorDiedError`, while the
  trainer's process still exists and its memory is readable (stopped here,
  as a killed process on a loaded host may still be exiting): a node-local
  pull refuses the bytes it can read, as every RDT fetch does. The host is
  loaded from the kill to the pull's answer (the actors start before: their
  start-up under load only costs minutes)."""
  import signal

  t = trainer()
  g = generator("torch")
  pid = ray.get(t.__ray_call__.remote(lambda self: os.getpid()))
  try:
    assert ray.get(g.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
    handle = ray.get(t.publish.remote(2))
    with loaded_host():
      os.kill(pid, signal.SIGSTOP)
      ray.kill(t)
      with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(t.publish.remote(3), timeout=ERROR_BOUND_S)
      r = ray.get(g.try_pull.remote(handle), timeout=ERROR_BOUND_S * 2)
    assert r["error"] is not None and "has died: the object died with it" in r["error"], r
    assert r["version"] in (1, None), r  # refused: before the copy, or after it (torn)
  finally:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    ray.kill(g)


def test_timeout_mid_pull_is_a_failed_pull():
  t = trainer(**READ_PATH)
  g = generator("torch", RDT_JAX_FAULTS="nixl.wait:delay=3", UCX_TLS="tcp", **READ_PATH)
  r = ray.get(g.try_pull.remote(ray.get(t.publish.remote(1)), 1.0), timeout=ERROR_BOUND_S * 2)
  assert "GetTimeoutError" in r["error"] and r["elapsed"] < ERROR_BOUND_S and r["version"] is None, r
  ray.kill(t)
  ray.kill(g)


def test_generator_killed_and_restarted_pulls_the_next_version():
  t = trainer()
  g1, g2 = generator("torch"), generator("jax")
  assert ray.get(g1.pull.remote(ray.get(t.publish.remote(1))))["version"] == 1
  ray.kill(g1)
  handle = ray.get(t.publish.remote(2))
  assert ray.get(g2.pull.remote(handle))["version"] == 2
  g1 = generator("torch")
  result = ray.get(g1.pull.remote(ray.get(t.publish.remote(3))))
  assert result["version"] == 3 and pulled(result) == expected(ray.get(t.shas.remote(3)))
  for a in (t, g1, g2):
    ray.kill(a)


@ray.remote(enable_tensor_transport=True)
class SmallTrainer:
  """Publishes small versions fast (2 leaves, 64 KiB) and reports what it holds."""

  def __init__(self):
    self.pub = rdt_jax.WeightPublisher(keep=2)

  def publish(self, version: int):
    tree = {"w": jnp.full((128, 64), version, jnp.float32), "b": jnp.full((64,), -version, jnp.float32)}
    return self.pub.publish(tree, version=version)

  def held(self) -> dict:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    c = get_tensor_transport_manager("JAX_NIXL").counters()
    return {"objects": c["objects"], "registrations": c["registrations"], "versions": len(self.pub.versions),
            "pool_bytes": rdt_jax._memory.host_pool.pooled_bytes()}


@ray.remote(enable_tensor_transport=True)
class SmallGenerator:
  def __init__(self):
    import torch

    self.template = {"w": torch.zeros((128, 64)), "b": torch.zeros(64)}
    self.sub = rdt_jax.WeightSubscriber(self.template)

  def pull(self, handle) -> bool:
    self.sub.pull(handle)
    return bool((self.template["w"] == handle.version).all() and (self.template["b"] == -handle.version).all())

  def held(self) -> dict:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    c = get_tensor_transport_manager("JAX_NIXL").counters()
    return {"pool_bytes": rdt_jax._memory.host_pool.pooled_bytes(), "plans": len(self.sub._plans),
            "views": c["views"], "inflight": c["inflight"], "registrations": c["registrations"]}


def test_hundred_versions_with_generators_killed_at_random_leave_nothing_behind():
  """100 versions to two generators, one killed at random (seeded) now and
  then and replaced: every pull is exact, and what the trainer and the
  generators hold stays bounded by the keep window, not the version count."""
  import random

  rand = random.Random(0)
  t = SmallTrainer.remote()
  gens = [SmallGenerator.remote(), SmallGenerator.remote()]
  held = []
  kills = 0
  for version in range(1, 101):
    if version > 1 and kills < 3 and rand.random() < 0.04:
      victim = rand.randrange(2)
      ray.kill(gens[victim])
      gens[victim] = SmallGenerator.remote()
      kills += 1
    handle = ray.get(t.publish.remote(version))
    assert ray.get([g.pull.remote(handle) for g in gens]) == [True, True], version
    if version in (10, 100):
      held.append((ray.get(t.held.remote()), ray.get([g.held.remote() for g in gens])))
  assert kills >= 1
  (trainer_10, gens_10), (trainer_100, gens_100) = held
  # Node-local pulls need no RDT object: a packed version gets one only on request.
  assert trainer_100["versions"] == 2 and trainer_100["objects"] <= 2, trainer_100
  assert trainer_100["registrations"] <= 2 and trainer_100["pool_bytes"] <= trainer_10["pool_bytes"], held
  for g in gens_100:
    assert g["plans"] == 1 and g["inflight"] == 0 and g["registrations"] == 0, gens_100
    assert g["pool_bytes"] <= max(x["pool_bytes"] for x in gens_10), held
  for a in [t, *gens]:
    ray.kill(a)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "pytree"])
def test_donated_step_never_changes_a_published_version(pack):
  t = trainer(pack=pack)
  g = generator("torch")
  handle = ray.get(t.publish.remote(1))
  assert (handle.packed is not None) == pack
  # The published arrays are donated to a jitted step: no error, the step's
  # values are right, and version 1's bytes stay. A packed version is a
  # copy, so the donation takes the input buffers; a pytree version holds
  # the leaves it reads in place (XLA then writes the step's outputs into
  # new buffers) and copied its small leaves at publish.
  right, donated = ray.get(t.donate_step.remote())
  assert right and (donated or not pack)
  result = ray.get(g.pull.remote(handle))
  assert pulled(result) == expected(ray.get(t.shas.remote(1)))
  ray.kill(t)
  ray.kill(g)


# ---- typed PRNG keys through plain returns


@ray.remote(enable_tensor_transport=True)
class KeyProducer:
  @ray.method(tensor_transport="jax_nixl")
  def keys(self, sharded: bool):
    return self._keys(sharded)

  @staticmethod
  def _keys(sharded: bool):
    keys = {"k": jax.random.key(0), "rbg": jax.random.key(3, impl="rbg"), "w": jnp.ones(4)}
    if sharded:
      from jax.sharding import Mesh, NamedSharding, PartitionSpec

      mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
      split = jax.random.split(jax.random.key(7), 8)
      keys["split"] = jax.device_put(split, NamedSharding(mesh, PartitionSpec("x")))
    return keys

  def expected(self, sharded: bool) -> dict:
    return key_summary(self._keys(sharded))


def key_summary(tree) -> dict:
  """Each leaf's sha256 and, for a typed key, its implementation's name."""
  out = {}
  for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    is_key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    out[jax.tree_util.keystr(p)] = (leaf_sha(x), str(jax.random.key_impl(x)) if is_key else None)
  return out


@ray.remote(enable_tensor_transport=True)
class KeyConsumer:
  def get(self, refs, mode: str) -> dict:
    rdt_jax.receive_as(mode)
    value = ray.get(refs[0])
    return {**key_summary(value), "sharded": len(value["split"].sharding.device_set)}


@pytest.mark.parametrize("out_of_band", [False, True], ids=["defaults", "out_of_band"])
def test_typed_keys_cross_as_typed_keys(out_of_band):
  env = OUT_OF_BAND_ENV if out_of_band else {}
  producer = KeyProducer.options(runtime_env=worker_env(XLA_FLAGS=FOUR, **env)).remote()
  # The driver (one device): plain ray.get.
  value = ray.get(producer.keys.remote(False))
  assert jax.random.key_impl(value["rbg"]) == jax.random.key_impl(jax.random.key(0, impl="rbg"))
  assert key_summary(value) == ray.get(producer.expected.remote(False))
  assert key_summary(value)["['k']"][1] == "threefry2x32"
  # An actor with 4 devices: a sharded key array keeps its sharding; keys
  # arrive as typed jax keys whatever the receive mode.
  want = ray.get(producer.expected.remote(True))
  ref = producer.keys.remote(True)
  ray.wait([ref])  # a ref passed inside a list is borrowed: it must be ready
  consumer = KeyConsumer.options(runtime_env=worker_env(XLA_FLAGS=FOUR, **env)).remote()
  assert ray.get(consumer.get.remote([ref], "source")) == {**want, "sharded": 4}
  assert ray.get(consumer.get.remote([ref], "numpy")) == {**want, "sharded": 1}  # numpy assembles it
  ray.kill(producer)
  ray.kill(consumer)


def test_nnx_rngs_state_crosses():
  nnx = pytest.importorskip("flax.nnx")
  rngs = nnx.Rngs(0, dropout=1)
  state = nnx.state(rngs)
  ref = ray.put(state, _tensor_transport="jax_nixl")
  back = ray.get(ref)
  assert pickle.dumps(jax.tree_util.tree_map(leaf_sha, back)) == pickle.dumps(jax.tree_util.tree_map(leaf_sha, state))
