"""`TransportContract`: the checks every rdt_jax transport passes, as a pytest
class a user subclasses with their transport.

The values it sends, and their fingerprints, are in `_values`. Builders (the
functions that make the values sent) run on the producer and the actor
classes on Ray workers: both are pickled by reference to their module, which
every worker can import with rdt_jax.
"""

from __future__ import annotations

import gc
import logging
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import ray

import rdt_jax
from rdt_jax import _limits, _ray
from rdt_jax.testing._values import (
  every_dtype,
  expected,
  fingerprint,
  float32_tree,
  int4_leaf,
  int64_leaf,
  mixed_tree,
  odd_shapes,
  sharded_leaf,
  sharded_values,
  torch_importable,
)
from rdt_jax.transports._base import DlpackTransport

FOUR_CPUS = "--xla_force_host_platform_device_count=4"


# ---- actors


def _resources() -> dict[str, int]:
  """Open file descriptors and threads of this process."""
  gc.collect()
  return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Producer:
  def make(self, build: Callable[..., Any], *args: Any) -> Any:
    return build(*args)

  def exports(self, name: str) -> int:
    """Objects the backend exported and Ray has not freed yet."""
    gc.collect()
    return int(_ray.state.transport_manager(name).counters()["exports"])

  def resources(self) -> dict[str, int]:
    return _resources()


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class _Consumer:
  def fingerprint(self, value: Any) -> Any:
    return fingerprint(value)

  def receive_as(self, mode: str) -> None:
    rdt_jax.receive_as(mode)

  def placement(self, value: Any) -> tuple[dict[str, int], tuple[Any, ...], list[int]]:
    x = value["x"]
    return dict(x.sharding.mesh.shape), tuple(x.sharding.spec), sorted(d.id for d in x.sharding.device_set)

  def get_into_target(self, refs: list[ray.ObjectRef]) -> tuple[bool, Any]:
    """`ray.get` of refs[0] into caller-owned NumPy buffers (a target)."""
    target = {"x": np.zeros((32, 32), np.float32), "n": np.zeros(32, np.float32)}
    rdt_jax.set_target_for_ref(refs[0], target)
    value = ray.get(refs[0])
    landed = all(np.shares_memory(value[k], target[k]) for k in target)
    return landed, fingerprint(value)

  def resources(self) -> dict[str, int]:
    return _resources()


def _module_root(cls: type) -> str | None:
  """The directory a worker needs on its path to import `cls`'s module."""
  module = sys.modules.get(cls.__module__)
  path = getattr(module, "__file__", None)
  if path is None:
    return None
  root = pathlib.Path(path).resolve().parent
  for _ in cls.__module__.split(".")[1:]:
    root = root.parent
  return str(root)


class _Actors:
  """The suite's Ray session (its own, unless one is up) and actors."""

  def __init__(self, contract: type[TransportContract]) -> None:
    cls = contract.transport
    self.name = rdt_jax.register_transport(cls)
    self.one_sided = cls.is_one_sided()
    paths = [p for p in (_module_root(cls), os.environ.get("PYTHONPATH")) if p]
    self.started_ray = not ray.is_initialized()
    if self.started_ray:
      ray.init(
          address="local",
          num_cpus=8,
          include_dashboard=False,
          logging_level=logging.WARNING,
          runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}},
          **contract.ray_init,
      )
    else:
      job_paths = (ray.get_runtime_context().runtime_env or {}).get("env_vars", {}).get("PYTHONPATH")
      if job_paths:
        paths.insert(0, job_paths)
    env = {"PYTHONPATH": os.pathsep.join(paths), **contract.actor_env}
    wide = {"env_vars": {**env, "JAX_ENABLE_X64": "1", "XLA_FLAGS": FOUR_CPUS}}
    narrow = {"env_vars": {**env, "JAX_ENABLE_X64": "0", "XLA_FLAGS": ""}}
    self.producer_env = wide  # a second producer's (the lifetime check's)
    self.producer = _Producer.options(runtime_env=wide).remote()  # type: ignore[attr-defined]
    self.wide = _Consumer.options(runtime_env=wide).remote()  # type: ignore[attr-defined]
    self.narrow = _Consumer.options(runtime_env=narrow).remote()  # type: ignore[attr-defined]
    self.teardown = contract.setup_actors([self.producer, self.wide, self.narrow])

  def make(self, build: Callable[..., Any], *args: Any, producer: Any = None) -> ray.ObjectRef:
    producer = producer or self.producer
    return producer.make.options(tensor_transport=self.name).remote(build, *args)

  def close(self) -> None:
    if self.teardown is not None:
      self.teardown()
    for actor in (self.producer, self.wide, self.narrow):
      ray.kill(actor)
    if self.started_ray:
      ray.shutdown()


def _wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.2)
  return predicate()


def _settled(read: Callable[[], Any], timeout: float = 30.0) -> Any:
  """`read()` once three reads in a row agree (Ray frees objects asynchronously)."""
  values = [read()]
  deadline = time.monotonic() + timeout
  while (len(values) < 3 or len({repr(v) for v in values[-3:]}) > 1) and time.monotonic() < deadline:
    time.sleep(0.3)
    values.append(read())
  return values[-1]


# ---- the suite


class TransportContract:
  """The transport contract as a pytest class: subclass it with `transport`.

  Every `test_` method runs your transport through Ray with three actors (a
  producer and a consumer with 4 CPU devices and 64-bit jax, a consumer with
  1 device and 64-bit jax off) and checks what every rdt_jax transport
  guarantees:

  * round trips, compared by a sha256 of every leaf's bytes in order: every
    dtype (bool to complex64, bfloat16 and float8 included) in each of jax,
    NumPy and torch; mixed pytrees with non-array leaves, each leaf arriving
    as its source type; 0-d and empty arrays; one ref read by several
    consumers; a sharded `jax.Array` keeping its mesh and spec;
    `rdt_jax.receive_as` in each mode; a target (caller-owned buffers) that
    receives the bytes in place; the driver's `ray.get` and `ray.put`;
  * errors that name the leaf and the fix, with the transport usable
    afterwards: a 64-bit leaf into a consumer with x64 off, a sharded leaf
    on too few devices, a sub-byte dtype;
  * the lifetime contract: the backend's `release` runs once Ray frees an
    object, and a dead producer's object fails fast instead of hanging;
  * leaks: after 20 transfers the producer's and the consumer's open file
    descriptors and threads, and the objects the backend holds, are back at
    their baseline.

  Set, on your subclass:

  * `transport` (required): your `rdt_jax.DlpackTransport` subclass. The
    suite registers it; it must be importable on the workers by its module
    path (the suite puts the directory of its top-level module on their
    `PYTHONPATH`).
  * `ray_init`: keyword arguments for `ray.init` when the suite starts Ray
    (it starts a local one, for the class, unless Ray is already
    initialized).
  * `actor_env`: environment variables for the three actors.
  * `setup_actors(actors)`: a class method run once the actors exist (a
    two-sided transport creates its communicator here); it returns a
    callable that undoes it, or None.

  Checks that do not apply to a transport (the driver's `ray.get` of a
  two-sided one) skip, saying why. torch leaves are sent where torch is
  installed.
  """

  transport: ClassVar[type[DlpackTransport]]
  ray_init: ClassVar[dict[str, Any]] = {}
  actor_env: ClassVar[dict[str, str]] = {}

  @classmethod
  def setup_actors(cls, actors: list[Any]) -> Callable[[], None] | None:
    """Runs once the producer and consumers exist; returns their undo, or None."""
    return None

  @pytest.fixture(scope="class")
  @classmethod
  def rdt(cls) -> Iterator[_Actors]:
    transport = getattr(cls, "transport", None)
    if not (isinstance(transport, type) and issubclass(transport, DlpackTransport)):
      pytest.fail(
          f"{cls.__qualname__}: set `transport = YourTransport` (a subclass of "
          f"rdt_jax.DlpackTransport) on the class, not {transport!r}."
      )
    actors = _Actors(cls)
    try:
      yield actors
    finally:
      actors.close()

  def _one_sided(self, rdt: _Actors, what: str) -> None:
    if not rdt.one_sided:
      pytest.skip(f"{rdt.name} is two-sided: {what} needs a one-sided transport")

  # -- registration

  def test_registers_under_its_lower_case_name(self, rdt: _Actors) -> None:
    assert rdt.name == self.transport.name.lower()
    assert rdt_jax.register_transport(self.transport) == rdt.name  # a second call changes nothing

  # -- round trips

  def test_every_dtype_of_every_framework_arrives_bit_exact(self, rdt: _Actors) -> None:
    got = ray.get(rdt.wide.fingerprint.remote(rdt.make(every_dtype)))
    assert got == expected(every_dtype)

  def test_mixed_leaves_arrive_as_their_source_type(self, rdt: _Actors) -> None:
    got = ray.get(rdt.wide.fingerprint.remote(rdt.make(mixed_tree)))
    assert got == expected(mixed_tree)
    assert [got[k][0] for k in ("w", "b", "n")] == ["jax", "jax", "numpy"]
    assert got["nested"][0][0] == "jax" and got["nested"][1][0][0] == "numpy"
    assert got["step"] == 3 and got["name"] == "learner"
    if "t" in got:
      assert got["t"][0] == got["tb"][0] == "torch"

  def test_zero_d_and_empty_arrays(self, rdt: _Actors) -> None:
    got = ray.get(rdt.wide.fingerprint.remote(rdt.make(odd_shapes)))
    assert got == expected(odd_shapes)
    assert got["scalar"][2] == () and got["empty3"][2] == (4, 0, 3)

  def test_several_consumers_of_one_ref(self, rdt: _Actors) -> None:
    ref = rdt.make(float32_tree, 48, 1)
    got = ray.get([c.fingerprint.remote(ref) for c in (rdt.wide, rdt.narrow, rdt.wide)])
    assert got == [expected(float32_tree, 48, 1)] * 3

  def test_sharded_leaf_keeps_mesh_and_spec(self, rdt: _Actors) -> None:
    ref = rdt.make(sharded_leaf)
    assert ray.get(rdt.wide.placement.remote(ref)) == ({"a": 2, "b": 2}, ("a", None), [0, 1, 2, 3])
    assert ray.get(rdt.wide.fingerprint.remote(ref)) == expected(sharded_values)

  @pytest.mark.parametrize("mode", ["numpy", "torch", "jax"])
  def test_receive_as_converts_every_leaf(self, rdt: _Actors, mode: str) -> None:
    if mode == "torch" and not torch_importable():
      pytest.skip("torch is not installed")
    ray.get(rdt.wide.receive_as.remote(mode))
    try:
      got = ray.get(rdt.wide.fingerprint.remote(rdt.make(float32_tree, 16, 5)))
    finally:
      ray.get(rdt.wide.receive_as.remote("source"))
    want = expected(float32_tree, 16, 5)
    assert {k: (mode, *v[1:]) for k, v in want.items()} == got

  def test_a_target_receives_the_bytes_in_place(self, rdt: _Actors) -> None:
    self._one_sided(rdt, "a ray.get inside an actor")
    ref = rdt.make(float32_tree, 32, 6)
    ray.wait([ref])  # a ref inside a list is sent once its object exists
    landed, got = ray.get(rdt.wide.get_into_target.remote([ref]))
    assert landed, "the leaves are not views of the caller's target buffers"
    assert got == {k: ("numpy", *v[1:]) for k, v in expected(float32_tree, 32, 6).items()}

  def test_driver_get(self, rdt: _Actors) -> None:
    self._one_sided(rdt, "the driver's ray.get")
    value = ray.get(rdt.make(mixed_tree))
    assert fingerprint(value) == expected(mixed_tree)

  def test_driver_put_to_an_actor(self, rdt: _Actors) -> None:
    self._one_sided(rdt, "ray.put with a tensor transport")
    import jax.numpy as jnp

    value = {"a": jnp.arange(10, dtype=jnp.float32), "n": np.arange(4.0)}
    ref = ray.put(value, _tensor_transport=rdt.name)
    assert ray.get(rdt.wide.fingerprint.remote(ref)) == fingerprint(value)

  # -- errors: named, not hung, and the transport usable afterwards

  def test_a_64_bit_leaf_into_an_x64_off_consumer_names_leaf_and_fix(self, rdt: _Actors) -> None:
    with pytest.raises(Exception, match=r"\['i'\].*int64.*receive_as\('numpy'\)"):
      ray.get(rdt.narrow.fingerprint.remote(rdt.make(int64_leaf)), timeout=_limits.CONTRACT_FAIL_WITHIN_S)
    ref = rdt.make(float32_tree, 8, 3)
    got = ray.get(rdt.narrow.fingerprint.remote(ref), timeout=_limits.CONTRACT_FAIL_WITHIN_S)
    assert got == expected(float32_tree, 8, 3)

  def test_a_sharded_leaf_on_too_few_devices_names_both_counts(self, rdt: _Actors) -> None:
    with pytest.raises(Exception, match=r"\['x'\].*over 4 devices.*only 1 cpu device"):
      ray.get(rdt.narrow.fingerprint.remote(rdt.make(sharded_leaf)), timeout=_limits.CONTRACT_FAIL_WITHIN_S)
    ref = rdt.make(float32_tree, 8, 2)
    got = ray.get(rdt.narrow.fingerprint.remote(ref), timeout=_limits.CONTRACT_FAIL_WITHIN_S)
    assert got == expected(float32_tree, 8, 2)

  def test_a_sub_byte_dtype_names_leaf_and_dtype(self, rdt: _Actors) -> None:
    with pytest.raises(Exception, match=r"\['q'\].*int4.*int8"):
      ray.get(rdt.wide.fingerprint.remote(rdt.make(int4_leaf)), timeout=_limits.CONTRACT_FAIL_WITHIN_S)

  # -- the lifetime contract

  def test_release_runs_once_ray_frees_the_object(self, rdt: _Actors) -> None:
    exports = lambda: ray.get(rdt.producer.exports.remote(rdt.name))  # noqa: E731
    before = _settled(exports)
    refs = [rdt.make(float32_tree, 8, i) for i in range(3)]
    ray.get([rdt.wide.fingerprint.remote(r) for r in refs])
    assert exports() == before + 3
    del refs
    assert _wait_for(lambda: exports() == before), "the backend still holds objects Ray freed"

  def test_a_dead_producers_object_fails_fast(self, rdt: _Actors) -> None:
    self._one_sided(rdt, "reading a dead producer's object")
    doomed = _Producer.options(runtime_env=rdt.producer_env).remote()  # type: ignore[attr-defined]
    ray.get(rdt.wide.fingerprint.remote(rdt.make(float32_tree, 8, producer=doomed)))  # it works first
    ref = rdt.make(float32_tree, 8, 7, producer=doomed)
    ray.wait([ref])
    ray.kill(doomed)
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayError, match=r"has died: the object died with it"):
      ray.get(rdt.wide.fingerprint.remote(ref), timeout=_limits.CONTRACT_FAIL_WITHIN_S)
    assert time.monotonic() - start < _limits.CONTRACT_FAIL_WITHIN_S / 2

  def test_no_leaks_over_many_transfers(self, rdt: _Actors) -> None:
    """File descriptors and threads of producer and consumer, and the
    backend's exported objects, return to their baseline."""
    exports = lambda: ray.get(rdt.producer.exports.remote(rdt.name))  # noqa: E731
    actors = (rdt.producer, rdt.wide)
    both = lambda: [ray.get(a.resources.remote()) for a in actors]  # noqa: E731
    for i in range(5):  # warm-up: connections, pools and threads made on first use
      ray.get(rdt.wide.fingerprint.remote(rdt.make(float32_tree, 16, i)))
    before, exported = _settled(both), _settled(exports)
    for i in range(20):
      ray.get(rdt.wide.fingerprint.remote(rdt.make(float32_tree, 16, i)))
    assert _wait_for(lambda: exports() == exported), "the backend still holds objects Ray freed"

    def back() -> bool:
      now = both()
      return all(n["fds"] <= b["fds"] + 2 and n["threads"] <= b["threads"] + 2 for n, b in zip(now, before))

    # Ray has freed every object by now: what the backend closes on release is closed.
    assert _wait_for(back, timeout=5), f"before: {before}, after 20 transfers: {both()}"
