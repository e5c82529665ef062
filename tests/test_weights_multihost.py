"""One weight version published by every process of a multi-controller JAX
trainer (`WeightsHandle.combine`), between real actors.

Two trainer actors run `jax.distributed` together (CPU collectives through
gloo, two forced CPU devices each): global arrays sharded over all four
devices, a jitted step, and each process publishing the shards it holds. The
driver combines their handles; generators pull the version: torch tensors
written in place, jax arrays on a 3-device mesh, and two tensor-parallel
`Slice` ranks. Every check compares with the global array's own bytes for
that version, gathered across the trainer's processes.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import ray

import rdt_jax
from _multihost import THREE, TWO, Generator, Trainer, free_port, sha
from conftest import OUT_OF_BAND_ENV, wait_for, worker_env
from rdt_jax.weights._combine import layouts_of

rdt_jax.register()

pytestmark = pytest.mark.usefixtures("ray_session")
RAY_NUM_CPUS = 10

def trainers(keep: int = 2, pack: bool = True, **env: str) -> list:
  coordinator = f"127.0.0.1:{free_port()}"
  actors = [Trainer.options(runtime_env=worker_env(XLA_FLAGS=TWO, **env)).remote(i, 2, coordinator, keep, pack)
            for i in range(2)]
  assert ray.get([a.devices.remote() for a in actors], timeout=120) == [(2, 4), (2, 4)]
  return actors


def gone(actor) -> bool:
  try:
    ray.get(actor.devices.remote(), timeout=5)
  except ray.exceptions.RayActorError:
    return True
  return False


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def publish(actors: list, version: int) -> rdt_jax.WeightsHandle:
  return rdt_jax.WeightsHandle.combine(ray.get([a.step.remote(version) for a in actors]))


def expected(actors: list) -> dict:
  return ray.get([a.expected.remote() for a in actors])[0]


def want(whole: dict, kind: str, rank: int = 0) -> dict:
  if kind == "tp":
    return {"w": sha(whole["w"][4 * rank:4 * rank + 4]), "b": sha(whole["b"]),
            "emb": sha(whole["emb"][3 * rank:3 * rank + 3])}
  return {k: sha(v) for k, v in whole.items()}


@pytest.mark.parametrize(("pack", "env"), [(True, {}), (True, OUT_OF_BAND_ENV), (False, {})],
                         ids=["node_local", "buckets", "pytree"])
def test_every_generator_kind_pulls_a_version_of_two_trainer_processes(pack, env):
  ts = trainers(pack=pack, **env)
  gens = {
      "torch": Generator.options(runtime_env=worker_env(**env)).remote("torch"),
      "atomic": Generator.options(runtime_env=worker_env(**env)).remote("torch", atomic=True),
      "jax": Generator.options(runtime_env=worker_env(XLA_FLAGS=THREE, **env)).remote("jax"),
      "tp0": Generator.options(runtime_env=worker_env(**env)).remote("tp", rank=0),
      "tp1": Generator.options(runtime_env=worker_env(**env)).remote("tp", rank=1),
  }
  for version in (1, 2):
    handle = publish(ts, version)
    assert len(handle.parts) == 2 and handle.version == version
    whole = expected(ts)
    results = dict(zip(gens, ray.get([g.pull.remote(handle) for g in gens.values()])))
    for name, r in results.items():
      assert r["error"] is None, (name, r["error"])
      kind = "tp" if name.startswith("tp") else "torch" if name == "atomic" else name
      assert r["shas"] == want(whole, kind, int(name[-1]) if kind == "tp" else 0), name
      assert r["version"] == version and r["step"] == version and r["in_place"], (name, r)
    assert results["jax"]["devices"] == {"w": 3, "b": 3, "emb": 3}
    route = {"node_local": "node_local", "buckets": "buckets", "pytree": "ray"}[
        "pytree" if not pack else ("buckets" if env else "node_local")]
    assert results["torch"]["last"].route == route, results["torch"]["last"]
  # A tensor-parallel rank reads only its rows (and b): fewer bytes than the whole version.
  assert results["tp0"]["last"].nbytes < results["torch"]["last"].nbytes
  for a in [*ts, *gens.values()]:
    ray.kill(a)


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_an_engine_maps_a_version_of_two_trainer_processes(atomic):
  """A subscriber with `source=` (an engine's own names and layouts) pulls a
  combined version: the leaves it maps assembled from both processes, then
  transposed and renamed into its tensors; the leaf it does not map is not read."""
  ts = trainers()
  g = Generator.remote("engine", atomic=atomic)
  for version in (1, 2):
    handle = publish(ts, version)
    whole = expected(ts)
    r = ray.get(g.pull.remote(handle))
    assert r["error"] is None, r["error"]
    assert r["shas"] == {"dense.weight": sha(whole["w"].T), "dense.bias": sha(whole["b"])}, r
    assert r["version"] == version and r["last"].nbytes == whole["w"].nbytes + whole["b"].nbytes, r
  for a in [*ts, g]:
    ray.kill(a)


@ray.remote(enable_tensor_transport=True)
class Single:
  """A one-process trainer whose versions the engine maps too, each of a
  structure of its own (a non-array leaf named after it)."""

  def __init__(self):
    self.pub = rdt_jax.WeightPublisher(keep=2)

  def publish(self, version: int, k: int) -> tuple:
    import jax.numpy as jnp

    w = np.arange(48, dtype=np.float32).reshape(8, 6) * 0.25 + version
    b = np.arange(6, dtype=np.float32) - version
    handle = self.pub.publish({"w": jnp.asarray(w), "b": jnp.asarray(b), f"tag{k}": k}, version=version)
    return handle, {"dense.weight": sha(w.T), "dense.bias": sha(b)}


def test_an_engine_keeps_one_plan_per_combined_structure_and_route():
  """A combined structure, then four one-process structures (more than the
  subscriber keeps plans of), then the combined structure again: its plan
  is made anew as one piece, never half of it kept. Then the trainer
  processes' parts change route (their publishers created again with
  pack=False): the plans of the packed parts are not used for them."""
  ts = trainers()
  single = Single.remote()
  engine, torch_gen = Generator.remote("engine"), Generator.remote("torch")

  def combined(version: int) -> None:
    handle = publish(ts, version)
    whole = expected(ts)
    r, t = ray.get([engine.pull.remote(handle), torch_gen.pull.remote(handle)])
    assert r["error"] is None and t["error"] is None, (r["error"], t["error"])
    assert r["shas"] == {"dense.weight": sha(whole["w"].T), "dense.bias": sha(whole["b"])}, version
    assert t["shas"] == want(whole, "torch") and r["version"] == t["version"] == version

  combined(1)
  for k, version in enumerate(range(2, 6)):
    handle, shas = ray.get(single.publish.remote(version, k))
    r = ray.get(engine.pull.remote(handle))
    assert r["error"] is None and r["shas"] == shas and r["version"] == version, r
  combined(6)
  ray.get([t.recreate.remote(False) for t in ts])
  combined(7)
  for a in [*ts, single, engine, torch_gen]:
    ray.kill(a)


def test_combine_checks_the_parts_naming_the_process():
  ts = trainers()
  h1 = ray.get([a.step.remote(1) for a in ts])
  with pytest.raises(ValueError, match=r"lacks the parts of trainer processes \[1\]"):
    rdt_jax.WeightsHandle.combine(h1[:1])
  with pytest.raises(ValueError, match="gave two parts"):
    rdt_jax.WeightsHandle.combine([h1[0], h1[0]])
  h2 = ray.get([a.step.remote(2) for a in ts])
  with pytest.raises(ValueError, match="different versions"):
    rdt_jax.WeightsHandle.combine([h1[0], h2[1]])
  with pytest.raises(ValueError, match="needs the handles"):
    rdt_jax.WeightsHandle.combine([])
  with pytest.raises(TypeError, match="takes WeightsHandles"):
    rdt_jax.WeightsHandle.combine([h2[0], "v2"])
  combined = rdt_jax.WeightsHandle.combine(list(reversed(h2)))  # any order
  assert [p.shards.process for p in combined.parts] == [0, 1]
  assert len(pickle.dumps(combined)) < 8192  # the parts' layouts are not in it
  with pytest.raises(ValueError, match="pull_named takes the handle of one publisher"):
    rdt_jax.WeightSubscriber(None).pull_named(combined)
  errors = ray.get([a.publish_key.remote() for a in ts])
  assert all("['rng']" in e and "typed PRNG key array in a tree that spans processes" in e for e in errors), errors
  # Each process publishes what it holds with replica_id 0: w's rows of both its devices; b (replicated
  # on all four) once, by process 0; emb's two column blocks (replicated over dp) by process 0 alone.
  layouts = layouts_of(combined.parts, 60)
  index = {path: i for i, (path, *_) in enumerate(layouts[0].entries)}
  counts = {lay.process: [[i for i, _ in lay.pieces].count(index[f"['{k}']"]) for k in ("w", "b", "emb")]
            for lay in layouts}
  assert counts == {0: [2, 1, 2], 1: [2, 0, 0]}, counts
  for a in ts:
    ray.kill(a)


def test_a_stale_part_changes_nothing_and_a_dead_process_is_named():
  ts = trainers(keep=1)
  g = Generator.remote("torch")
  h1 = publish(ts, 1)
  assert ray.get(g.pull.remote(h1))["version"] == 1
  h2 = publish(ts, 2)
  publish(ts, 3)
  r = ray.get(g.pull.remote(h2))
  assert "StaleWeightsError" in r["error"] and "trainer process" in r["error"], r
  assert r["version"] == 1, r
  h4 = publish(ts, 4)
  pid = ray.get(ts[1].pid.remote())
  ray.kill(ts[1])
  assert wait_for(lambda: gone(ts[1]) and not alive(pid), 60)  # Ray says so, and the process has exited
  r = ray.get(g.pull.remote(h4, 60), timeout=120)
  assert r["error"] is not None and "trainer process 1" in r["error"], r
  assert r["elapsed"] < 60, r
  ray.kill(ts[0])
  ray.kill(g)


def test_coverage_errors_name_the_leaf_and_the_processes():
  from rdt_jax.weights._parts import PartLayout, check_coverage

  entries = (("['w']", "array", (4, 2), "float32"),)
  part = lambda p, *boxes: PartLayout(p, "d", entries, None, (0,), tuple((0, b) for b in boxes))  # noqa: E731
  check_coverage([part(0, ((0, 2), (0, 2))), part(1, ((2, 4), (0, 2)))])
  with pytest.raises(ValueError, match=r"Leaf \['w'\] has two pieces .* process 0 .* process 1"):
    check_coverage([part(0, ((0, 3), (0, 2))), part(1, ((2, 4), (0, 2)))])
  with pytest.raises(ValueError, match=r"Leaf \['w'\] \(shape \(4, 2\)\) is not covered: .* \[0\] hold 4 of its 8"):
    check_coverage([part(0, ((0, 2), (0, 2))), part(1)])
