"""Weights under the engine's names and layouts (`WeightSubscriber(source=)`,
`rdt_jax.From`, `rdt_jax.Fuse`), between real actors.

A trainer publishes Flax-style parameters (`(in, out)` kernels, separate
q/k/v, an embedding, a bf16 leaf, a scalar); generators pull them into a
torch engine's own tensors, named as torch names them and laid out as torch
stores them: transposed kernels, one fused qkv tensor, a tied output
projection, a cast, and tensor-parallel ranks each taking their part of the
fused tensor. Every check compares values with numpy's transform of what the
trainer published, on each route (node-local, buckets through Ray, the
pytree through Ray), with `atomic` off and on.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

import rdt_jax
from conftest import OUT_OF_BAND_ENV, worker_env

rdt_jax.register()

pytestmark = pytest.mark.usefixtures("ray_session")
RAY_NUM_CPUS = 8

D, H = 64, 48  # model width, q/k/v width
BUCKET = 16 << 10


def published(version: int) -> dict:
  """The trainer's parameters of `version` as numpy (the jax ones are made from these)."""
  r = np.random.default_rng(version)
  import ml_dtypes

  return {
      "params": {
          "embed": {"embedding": r.standard_normal((100, D), np.float32)},
          "attn": {n: {"kernel": r.standard_normal((D, H), np.float32)} for n in ("q", "k", "v")},
          "fc": {"kernel": r.standard_normal((D, 2 * D), np.float32), "bias": r.standard_normal(2 * D, np.float32)},
          "norm": {"scale": r.standard_normal(D).astype(ml_dtypes.bfloat16)},
          # Larger than a bucket: read in parts of rows (transposed, cut), or whole (reshaped).
          "big": r.standard_normal((300, 50), np.float32),
          "big2": r.standard_normal((60, 100), np.float32),
      },
      "lora": {"a": r.standard_normal((D, 4), np.float32), "b": r.standard_normal((4, D), np.float32)},
      "step": np.int32(version),
  }


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self, pack: bool = True):
    self.pub = rdt_jax.WeightPublisher(keep=2, pack=pack)
    self.params = None

  def publish(self, version: int, subtree: str | None = None):
    import jax
    import jax.numpy as jnp

    value = jax.tree_util.tree_map(jnp.asarray, published(version))
    self.params = value if subtree is None else value[subtree]
    return self.pub.publish(self.params, version=version)

  def recreate(self, pack: bool) -> None:
    """A new publisher with another `pack` setting replaces this one: the
    same structure now travels the other way."""
    self.pub.close()
    self.pub = rdt_jax.WeightPublisher(keep=2, pack=pack)

  def publish_sparse(self, version: int):
    """A tree whose mapped leaves are an empty one, early in the buffer
    (inside a bucket no mapped byte lies in), and one in a later bucket."""
    import jax.numpy as jnp

    r = np.random.default_rng(version)
    tree = {"a": r.standard_normal(4000, np.float32),  # 16,000 bytes: most of bucket 0
            "b": np.zeros((0, 4), np.float32),  # empty, at offset 16,000 (bucket 0)
            "c": r.standard_normal(96, np.float32),  # 384 bytes: the rest of bucket 0
            "d": r.standard_normal(256, np.float32)}  # bucket 1
    return self.pub.publish({k: jnp.asarray(v) for k, v in tree.items()}, version=version), tree


def engine_source(name: str):
  """The torch engine's names and layouts of the published tree: `name` is
  the template leaf's name as a mapping writes it (`"qkv.weight"`)."""
  return {
      "embed.weight": "params.embed.embedding",
      "lm_head.weight": "['params']['embed']['embedding']",  # tied: one published leaf, two engine tensors
      "qkv.weight": rdt_jax.Fuse(*(rdt_jax.From(f"params.attn.{n}.kernel", transpose=(1, 0)) for n in "qkv")),
      "fc.weight": rdt_jax.From("params.fc.kernel", transpose=(1, 0)),
      "fc.bias": "params.fc.bias",
      "norm.weight": "params.norm.scale",  # bf16 published, float32 in the engine: cast
      "rotary.cache": None,  # the engine's own buffer: left alone
      "big.T": rdt_jax.From("params.big", transpose=(1, 0)),
      "big.cut": rdt_jax.From("params.big", transpose=(1, 0), index=(slice(10, 40), slice(7, 290))),
      "big2.heads": rdt_jax.From("params.big2", transpose=(1, 0), reshape=(4, 25, 60)),
  }[name]


def engine_expected(version: int) -> dict:
  p = published(version)["params"]
  return {
      "embed.weight": p["embed"]["embedding"],
      "lm_head.weight": p["embed"]["embedding"],
      "qkv.weight": np.concatenate([p["attn"][n]["kernel"].T for n in "qkv"], axis=0),
      "fc.weight": p["fc"]["kernel"].T,
      "fc.bias": p["fc"]["bias"],
      "norm.weight": p["norm"]["scale"].astype(np.float32),
      "rotary.cache": np.full(8, 7.0, np.float32),
      "big.T": p["big"].T,
      "big.cut": p["big"].T[10:40, 7:290],
      "big2.heads": p["big2"].T.reshape(4, 25, 60),
  }


#: Bytes of the published leaves the engine maps (read node-locally; the LoRA leaves and the step are not).
MAPPED_BYTES = sum(a.nbytes for k, a in published(0)["params"].items() if k != "attn" for a in (
    [a] if isinstance(a, np.ndarray) else a.values())) + 3 * D * H * 4


def tp_source(rank: int, world: int):
  """Tensor-parallel rank `rank` of `world`: its rows of q, k and v, fused."""
  n = H // world
  rows = (slice(rank * n, (rank + 1) * n),)
  return {"['qkv.weight']": rdt_jax.Fuse(*(rdt_jax.From(f"params.attn.{x}.kernel", transpose=(1, 0), index=rows)
                                            for x in "qkv"))}


@ray.remote(enable_tensor_transport=True)
class Engine:
  """A torch engine: its tensors, a subscriber mapping the published tree into them."""

  def __init__(self, atomic: bool = False, tp: tuple[int, int] | None = None):
    import torch

    if tp is None:
      self.tensors = {
          "embed.weight": torch.zeros(100, D), "lm_head.weight": torch.zeros(100, D),
          "qkv.weight": torch.nn.Parameter(torch.zeros(3 * H, D)), "fc.weight": torch.zeros(2 * D, D),
          "fc.bias": torch.zeros(2 * D), "norm.weight": torch.zeros(D), "rotary.cache": torch.full((8,), 7.0),
          "big.T": torch.zeros(50, 300), "big.cut": torch.zeros(30, 283), "big2.heads": torch.zeros(4, 25, 60),
      }
      source = engine_source
    else:
      self.tensors = {"qkv.weight": torch.zeros(3 * H // tp[1], D)}
      source = tp_source(*tp)
    self.sub = rdt_jax.WeightSubscriber(self.tensors, atomic=atomic, source=source)

  def pull(self, handle) -> dict:
    error = None
    try:
      out = self.sub.pull(handle)
      assert out is self.tensors
    except Exception as e:
      error = " | ".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])])
    return {"values": {k: t.detach().numpy().copy() for k, t in self.tensors.items()}, "version": self.sub.version,
            "last": self.sub.last_pull, "error": error, "pooled": rdt_jax._memory.host_pool.pooled_bytes()}


def engine(atomic: bool = False, tp: tuple[int, int] | None = None, **env: str):
  return Engine.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET), **env)).remote(atomic, tp)


def check(result: dict, version: int) -> None:
  assert result["error"] is None, result["error"]
  want = engine_expected(version)
  for name, got in result["values"].items():
    np.testing.assert_array_equal(got, want[name], err_msg=name)
  assert result["version"] == version


@pytest.mark.parametrize(("pack", "env", "route"), [
    (True, {}, "node_local"),
    (True, {**OUT_OF_BAND_ENV}, "buckets"),
    (False, {}, "ray"),
], ids=["node_local", "buckets", "ray"])
@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_a_torch_engine_receives_its_names_and_layouts(pack, env, route, atomic):
  t = Trainer.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET), **env)).remote(pack)
  g = engine(atomic, **env)
  for version in (1, 2):
    r = ray.get(g.pull.remote(ray.get(t.publish.remote(version))))
    check(r, version)
    last = r["last"]
    assert (last.version, last.route) == (version, route), last
    # Only the leaves the engine maps are read where the route allows (the LoRA leaves and the step are not).
    assert last.nbytes >= MAPPED_BYTES, last
    if route == "node_local":
      assert last.nbytes == MAPPED_BYTES, last
      # No buffer held a leaf larger than a bucket whole: "big" came in parts of its rows.
      assert r["pooled"] < published(0)["params"]["big"].nbytes, r["pooled"]
  for a in (t, g):
    ray.kill(a)


def test_an_atomic_mapped_pull_whose_commit_fails_leaves_version_none():
  """The engine tensors take the staging arrays at an atomic pull's end: a
  copy that fails there leaves `version` None, not the old version."""
  t = Trainer.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET))).remote(True)
  g = engine(True, RDT_JAX_FAULTS="weights.commit:fail@2*1")
  check(ray.get(g.pull.remote(ray.get(t.publish.remote(1)))), 1)
  r = ray.get(g.pull.remote(ray.get(t.publish.remote(2))))
  assert "injected fault at weights.commit" in r["error"] and "may hold some of its bytes" in r["error"], r
  assert r["version"] is None, r
  check(ray.get(g.pull.remote(ray.get(t.publish.remote(3)))), 3)
  for a in (t, g):
    ray.kill(a)


@pytest.mark.parametrize("env", [{}, {**OUT_OF_BAND_ENV}], ids=["node_local", "buckets"])
def test_tensor_parallel_ranks_each_take_their_rows_of_a_fused_tensor(env):
  t = Trainer.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET), **env)).remote()
  ranks = [engine(tp=(rank, 2), **env) for rank in range(2)]
  h = ray.get(t.publish.remote(3))
  full = engine_expected(3)["qkv.weight"].reshape(3, 2, H // 2, D)  # (q/k/v, rank, rows, D)
  for rank, g in enumerate(ranks):
    r = ray.get(g.pull.remote(h))
    assert r["error"] is None, r["error"]
    np.testing.assert_array_equal(r["values"]["qkv.weight"], full[:, rank].reshape(-1, D))
  for a in (t, *ranks):
    ray.kill(a)


@pytest.mark.parametrize("first", [True, False], ids=["packed_then_pytree", "pytree_then_packed"])
def test_a_structure_that_changes_route_keeps_its_mapped_pulls(first):
  """The same structure, from a publisher created again with the other
  `pack` setting: the engine's plan of it is the route's own, so every pull
  succeeds, as a fresh subscriber's does."""
  t = Trainer.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET))).remote(first)
  g = engine()
  check(ray.get(g.pull.remote(ray.get(t.publish.remote(1)))), 1)
  ray.get(t.recreate.remote(not first))
  for version in (2, 3):
    check(ray.get(g.pull.remote(ray.get(t.publish.remote(version)))), version)
  ray.get(t.recreate.remote(first))
  check(ray.get(g.pull.remote(ray.get(t.publish.remote(4)))), 4)
  for a in (t, g):
    ray.kill(a)


@ray.remote(enable_tensor_transport=True)
class Sparse:
  """An engine mapping an empty leaf and one in a later bucket."""

  def __init__(self, atomic: bool):
    import torch

    self.tensors = {"empty": torch.ones(0, 4), "d": torch.zeros(256)}
    self.sub = rdt_jax.WeightSubscriber(self.tensors, atomic=atomic, source={"empty": "b", "d": "d"})

  def pull(self, handle) -> dict:
    try:
      self.sub.pull(handle)
      error = None
    except Exception as e:
      error = f"{type(e).__name__}: {e}"
    return {"error": error, "version": self.sub.version, "d": self.tensors["d"].numpy().copy(),
            "objects": None if self.sub.last_pull is None else self.sub.last_pull.objects}


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_an_empty_mapped_leaf_in_a_bucket_not_fetched_arrives_empty(atomic):
  env = worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET), **OUT_OF_BAND_ENV)
  t, g = Trainer.options(runtime_env=env).remote(), Sparse.options(runtime_env=env).remote(atomic)
  for version in (1, 2):
    handle, tree = ray.get(t.publish_sparse.remote(version))
    r = ray.get(g.pull.remote(handle))
    assert r["error"] is None and r["version"] == version, r
    np.testing.assert_array_equal(r["d"], tree["d"])
    assert r["objects"] == 1, r  # bucket 1 only
  for a in (t, g):
    ray.kill(a)


@ray.remote(enable_tensor_transport=True)
class Adapter:
  """An engine holding only LoRA adapters, from a stream of their own."""

  def __init__(self):
    import torch

    self.tensors = {"lora_A": torch.zeros(4, D), "lora_B": torch.zeros(D, 4)}
    self.sub = rdt_jax.WeightSubscriber(self.tensors, source={  # template paths as keystr prints them, or dotted
        "['lora_A']": rdt_jax.From("['a']", transpose=(1, 0)),
        "lora_B": rdt_jax.From("b", transpose=(1, 0)),
    })

  def pull(self, handle) -> dict:
    self.sub.pull(handle)
    return {k: t.numpy().copy() for k, t in self.tensors.items()} | {"version": self.sub.version}


def test_a_lora_stream_has_its_own_versions():
  base, lora = Trainer.remote(), Trainer.remote()
  g, a = engine(), Adapter.remote()
  check(ray.get(g.pull.remote(ray.get(base.publish.remote(1)))), 1)
  for version in (1, 2, 3):  # adapters move on; the base stays at version 1
    r = ray.get(a.pull.remote(ray.get(lora.publish.remote(version, "lora"))))
    want = published(version)["lora"]
    np.testing.assert_array_equal(r["lora_A"], want["a"].T)
    np.testing.assert_array_equal(r["lora_B"], want["b"].T)
    assert r["version"] == version
  # Each stream keeps its own version rules: an older adapter version is refused.
  old = ray.get(lora.publish.remote(4, "lora"))
  ray.get(a.pull.remote(ray.get(lora.publish.remote(5, "lora"))))
  with pytest.raises(rdt_jax.StaleWeightsError):
    ray.get(a.pull.remote(old))
  check(ray.get(g.pull.remote(ray.get(base.publish.remote(2)))), 2)
  for x in (base, lora, g, a):
    ray.kill(x)


@ray.remote(enable_tensor_transport=True)
class Checked:
  """A subscriber whose mapping is wrong: the first pull says where."""

  def pull(self, tensors, source) -> str:
    sub = rdt_jax.WeightSubscriber(tensors() if callable(tensors) else tensors, source=source)
    try:
      sub.pull(self.handle)
    except (ValueError, TypeError, rdt_jax.UnsupportedLeafError) as e:
      assert sub.version is None and sub.last_pull is None
      return f"{type(e).__name__}: {e}"
    return "pulled"

  def set_handle(self, handle) -> None:
    self.handle = handle


def test_the_first_pull_checks_every_mapping_naming_the_leaf():
  import jax
  import torch

  t = Trainer.remote()
  c = Checked.remote()
  ray.get(c.set_handle.remote(ray.get(t.publish.remote(1))))
  z = torch.zeros

  def error(tensors, source) -> str:
    return ray.get(c.pull.remote(tensors, source))

  assert "['w'] maps to 'params.nope', which is not a published leaf" in error(
      {"w": z(3)}, {"['w']": "params.nope"})
  assert "['w'] has shape (48, 64); its source ['params']['attn']['q']['kernel'] gives (64, 48)" in error(
      {"w": z(H, D)}, {"['w']": "params.attn.q.kernel"})
  assert "not a permutation" in error({"w": z(H, D)}, {"['w']": rdt_jax.From("params.attn.q.kernel", transpose=(1, 1))})
  assert "another number of elements" in error(
      {"w": z(H, D)}, {"['w']": rdt_jax.From("params.attn.q.kernel", reshape=(5, 5))})
  assert "has 144 along axis 0; its Fuse parts give 96" in error(
      {"w": z(3 * H, D)}, {"['w']": rdt_jax.Fuse(*(rdt_jax.From(f"params.attn.{n}.kernel", transpose=(1, 0))
                                                  for n in "qk"))})
  assert "dtype int32; its source ['params']['fc']['bias'] is float32" in error(
      {"w": z(2 * D, dtype=torch.int32)}, {"['w']": "params.fc.bias"})
  assert "['w'] has no entry in source" in error({"w": z(3), "v": z(3)}, {"['v']": None})
  assert "['w'] has 2 axes; its Fuse axis 2 is not one" in error(
      {"w": z(H, D)}, {"w": rdt_jax.Fuse(rdt_jax.From("params.attn.q.kernel", transpose=(1, 0)), axis=2)})
  assert "UnsupportedLeafError" in error({"w": z(D)}, {"w": rdt_jax.From("params.fc.bias", index=(slice(0, 500),))})
  assert "is a ArrayImpl" in error({"w": jax.numpy.zeros(2 * D)}, {"['w']": "params.fc.bias"})

  def views(n: int):  # made in the actor: two template leaves over one tensor's memory
    return lambda: (lambda shared: {"a": shared, "b": shared[:n]})(torch.zeros(2 * D))

  assert "['b'] and ['a'] share memory" in error(views(D), {
      "['a']": "params.fc.bias", "['b']": rdt_jax.From("params.fc.bias", index=(slice(0, D),))})
  assert "['a'] and ['b'] are one tensor with different sources" in error(views(2 * D), {
      "['a']": "params.fc.bias", "['b']": rdt_jax.From("params.fc.bias", index=(slice(0, 2 * D),))})
  assert error(views(2 * D), {"['a']": "params.fc.bias", "['b']": "params.fc.bias"}) == "pulled"  # tied names
  assert error({"w": z(2 * D)}, {"['w']": "params.fc.bias"}) == "pulled"
  # Empty tensors share no memory: two of them map to different sources.
  assert error({"w": z(0), "v": z(0)}, {"w": rdt_jax.From("params.fc.bias", index=(slice(0, 0),)), "v": rdt_jax.From(
      "params.fc.bias", index=(slice(1, 1),))}) == "pulled"
  for x in (t, c):
    ray.kill(x)


def test_from_and_fuse_refuse_what_they_cannot_mean():
  with pytest.raises(TypeError, match="path must be a str"):
    rdt_jax.From(3)  # type: ignore[arg-type]
  with pytest.raises(TypeError, match="transpose must be a sequence of ints"):
    rdt_jax.From("a", transpose="10")  # type: ignore[arg-type]
  with pytest.raises(ValueError, match="at least one part"):
    rdt_jax.Fuse()
  with pytest.raises(TypeError, match="source must be a mapping"):
    rdt_jax.WeightSubscriber({"w": np.zeros(3)}, source=3)  # type: ignore[arg-type]
  with pytest.raises(ValueError, match="give the template too"):
    rdt_jax.WeightSubscriber(None, source={})
  assert rdt_jax.From("a", transpose=[1, 0], index=rdt_jax.Slice[0:2]) == rdt_jax.From(
      "a", transpose=(1, 0), index=(slice(0, 2),))
  assert rdt_jax.Fuse("a", "b", axis=1).parts == (rdt_jax.From("a"), rdt_jax.From("b"))


@pytest.mark.parametrize(("path", "name"), [
    ("['params']['layers'][0].kernel", "params.layers.0.kernel"),  # dict keys, an index, an attribute
    ("['fc.weight']", "fc.weight"),  # a key with dots is the key itself
    ("[3]['w']", "3.w"),  # an integer key or index
    ("['a\\\\b']", "a\\b"),  # keystr's escapes undone: the key holds one backslash
    ("['a'][b]", "['a'][b]"),  # not a keystr path: itself
    ("[(1, 2)]", "[(1, 2)]"),  # a tuple key has no dotted form
    ("[\"it's\"]", "[\"it's\"]"),  # a key keystr prints in double quotes
])
def test_leaf_names_join_keys_with_dots(path, name):
  from rdt_jax.weights._mapping import leaf_name

  assert leaf_name(path) == name


def test_a_source_function_gets_the_name_a_mapping_is_keyed_by():
  """The function form and the mapping form see one name per template leaf
  (`leaf_name`), for nested dicts, list indices, integer keys and keys with
  dots; a key with no dotted form is given as `keystr` prints it."""
  from rdt_jax.weights._handle import flatten
  from rdt_jax.weights._mapping import MappedPlan

  entries = [("['params']['fc']['bias']", "array", (4,), "float32")]
  template = {"model": {"layers": [{"fc.bias": np.zeros(4, np.float32)}], "by_id": {7: np.zeros(4, np.float32)}},
              "head": {(1, 2): np.zeros(4, np.float32)}}
  flat = flatten(template)
  asked: list[str] = []

  def source(name: str) -> str:
    asked.append(name)
    return "params.fc.bias"

  plan = MappedPlan(entries, flat, source, atomic=False)
  assert sorted(asked) == sorted(["model.layers.0.fc.bias", "model.by_id.7", "['head'][(1, 2)]"]), asked
  assert len(plan.writes["['params']['fc']['bias']"]) == 3
  by_name = {name: "params.fc.bias" for name in asked}  # the same names key a mapping
  assert len(MappedPlan(entries, flat, by_name, atomic=False).writes["['params']['fc']['bias']"]) == 3
  with pytest.raises(rdt_jax.MappingError, match=r"\['head'\]\[\(1, 2\)\] has no entry"):
    MappedPlan(entries, flat, {"model.layers.0.fc.bias": None, "model.by_id.7": None}, atomic=False)


@ray.remote(enable_tensor_transport=True)
class Colocated:
  """A trainer and an engine in one process: the engine maps the trainer's own versions."""

  def __init__(self):
    import torch

    self.pub = rdt_jax.WeightPublisher(keep=2)
    self.tensors = {"fc.weight": torch.zeros(2 * D, D), "fc.bias": torch.zeros(2 * D)}
    self.sub = rdt_jax.WeightSubscriber(self.tensors, source={
        "['fc.weight']": rdt_jax.From("params.fc.kernel", transpose=(1, 0)), "['fc.bias']": "params.fc.bias"})

  def step(self, version: int) -> dict:
    import jax
    import jax.numpy as jnp

    self.sub.pull(self.pub.publish(jax.tree_util.tree_map(jnp.asarray, published(version)), version=version))
    return {k: t.numpy().copy() for k, t in self.tensors.items()}


def test_a_colocated_engine_maps_its_trainers_versions():
  c = Colocated.remote()
  for version in (1, 2):
    got = ray.get(c.step.remote(version))
    want = engine_expected(version)
    np.testing.assert_array_equal(got["fc.weight"], want["fc.weight"])
    np.testing.assert_array_equal(got["fc.bias"], want["fc.bias"])
  ray.kill(c)


@ray.remote(enable_tensor_transport=True)
class Bias:
  """An engine that maps one small leaf of a large version."""

  def __init__(self):
    import torch

    self.bias = torch.zeros(2 * D)
    self.sub = rdt_jax.WeightSubscriber({"bias": self.bias}, source={"bias": "params.fc.bias"})

  def pull(self, handle) -> tuple[np.ndarray, int, str]:
    self.sub.pull(handle)
    return self.bias.numpy().copy(), self.sub.last_pull.objects, self.sub.last_pull.route


def test_through_ray_only_the_buckets_holding_mapped_leaves_are_fetched():
  t = Trainer.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET), **OUT_OF_BAND_ENV)).remote()
  g = Bias.options(runtime_env=worker_env(RDT_JAX_WEIGHT_BUCKET_BYTES=str(BUCKET), **OUT_OF_BAND_ENV)).remote()
  total = sum(a.nbytes for a in jax_leaves(published(1)))
  for version in (1, 2):
    bias, objects, route = ray.get(g.pull.remote(ray.get(t.publish.remote(version))))
    np.testing.assert_array_equal(bias, published(version)["params"]["fc"]["bias"])
    assert route == "buckets" and 1 <= objects <= 2 < total // BUCKET, (objects, total // BUCKET)
  for a in (t, g):
    ray.kill(a)


def jax_leaves(tree) -> list[np.ndarray]:
  import jax

  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
