"""A weight publisher's life as its subscribers see it, between real actors.

* when the publisher a subscriber planned against no longer exists (closed,
  replaced without `close()`), every route answers the same way:
  `StaleWeightsError`, the template and `sub.version` unchanged;
* a failed node-local read fails by one rule (`_routes.read_failure`),
  whichever route made it;
* a publisher checks its actor at construction;
* the errors of templates, mappings and handles are in the error family;
* `pull_async` in an async actor logs no advice against a blocking `ray.get`;
* rdt_jax's DEBUG log says what each transfer and each pull did.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import ray

import rdt_jax
from conftest import OUT_OF_BAND_ENV, worker_env
from rdt_jax.weights import _packed, _routes
from rdt_jax.weights._pull import Pull

rdt_jax.register()

pytestmark = pytest.mark.usefixtures("ray_session")
N = 4096


def values(version: int, n: int = N) -> np.ndarray:
  return (np.arange(n, dtype=np.float32) % 89) + version


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self, pack: bool = True):
    self.pack = pack
    self.pub = rdt_jax.WeightPublisher(keep=2, pack=pack)

  def publish(self, version: int):
    import jax.numpy as jnp

    return self.pub.publish({"w": jnp.asarray(values(version)), "step": version}, version=version)

  def replace(self) -> None:
    """A rollback without `close()`: the old publisher ends as its last reference goes."""
    self.pub = rdt_jax.WeightPublisher(keep=2, pack=self.pack)


@ray.remote(enable_tensor_transport=True)
class Generator:
  def __init__(self, kind: str):
    import torch

    self.kind = kind
    if kind == "named":
      self.sub = rdt_jax.WeightSubscriber(None)
      self.w = torch.zeros(N)
    elif kind == "mapped":
      self.w = torch.zeros(N)
      self.sub = rdt_jax.WeightSubscriber({"weight": self.w}, source={"weight": "w"})
    else:
      self.sub = rdt_jax.WeightSubscriber({"w": torch.zeros(N)})
      self.w = self.sub.template["w"]

  def pull(self, handle) -> dict:
    before = self.w.numpy().copy()
    try:
      if self.kind == "named":
        for name, x in self.sub.pull_named(handle):
          if name == "['w']":
            self.w.copy_(x)
      else:
        self.sub.pull(handle)
      error = None
    except Exception as e:
      error = e
    return {"error": None if error is None else f"{type(error).__name__}: {error}",
            "stale": isinstance(error, rdt_jax.StaleWeightsError), "version": self.sub.version,
            "unchanged": bool(np.array_equal(before, self.w.numpy())),
            "route": None if self.sub.last_pull is None else self.sub.last_pull.route}


ROUTES = {
    "node_local": (True, "plain", {}),
    "buckets": (True, "plain", OUT_OF_BAND_ENV),
    "pytree": (False, "plain", {}),
    "named_node_local": (True, "named", {}),
    "named_buckets": (True, "named", OUT_OF_BAND_ENV),
    "mapped_node_local": (True, "mapped", {}),
    "mapped_pytree": (False, "mapped", {}),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_route_refuses_a_handle_of_a_publisher_that_ended(route):
  """The generator planned the structure against a publisher; that publisher
  is replaced without `close()` and the new one publishes into its pooled
  memory. An old handle newer than the generator's version: stale on every
  route, before any byte reaches the engine's tensors."""
  pack, kind, env = ROUTES[route]
  t = Trainer.options(runtime_env=worker_env(**env)).remote(pack)
  g = Generator.options(runtime_env=worker_env(**env)).remote(kind)
  try:
    first = ray.get(g.pull.remote(ray.get(t.publish.remote(1))))
    assert first["error"] is None and first["version"] == 1, first
    old = ray.get(t.publish.remote(2))
    ray.get(t.replace.remote())
    ray.get([t.publish.remote(v) for v in (3, 4)])
    r = ray.get(g.pull.remote(old))
    assert r["stale"], r
    assert r["version"] == 1 and r["unchanged"], r
    r = ray.get(g.pull.remote(ray.get(t.publish.remote(5))))
    assert r["error"] is None and r["version"] == 5, r
  finally:
    for a in (t, g):
      ray.kill(a)


# --------------------------------------------------------------------------
# The one rule of a failed node-local read


@ray.remote
class Bystander:
  def ping(self) -> int:
    return 1


def _pull_of(table: _packed.KeptTable, publisher: str, version: int, actor) -> tuple[Pull, _packed.PackedSource]:
  from rdt_jax import _process
  from rdt_jax.weights._handle import WeightsHandle

  source = _packed.PackedSource(_process.identity(), 4096, 64, table.address, table.slots)
  handle = WeightsHandle(version, None, publisher, actor, "digest", source)
  versions: list = []
  return Pull(handle, f"v{version} of publisher {publisher}", None, 1, None, versions.append, 1 << 20), source


def test_a_failed_node_local_read_fails_by_one_rule():
  import uuid

  from ray.exceptions import RayDirectTransportError

  publisher = uuid.uuid4().hex
  table = _packed.KeptTable(2, publisher)
  table.add(7)
  alive = Bystander.remote()
  ray.get(alive.ping.remote())
  pull, source = _pull_of(table, publisher, 7, alive)
  # The table names another publisher, or none: closed or replaced.
  e = _routes.read_failure(pull, source, _packed.ForeignTable("foreign"))
  assert isinstance(e, rdt_jax.StaleWeightsError) and "closed or replaced" in str(e)
  # Memory that could not be read while the version is kept: the publisher's account.
  e = _routes.read_failure(pull, source, OSError(14, "Bad address"))
  assert isinstance(e, RayDirectTransportError) and "Bad address" in str(e), e
  # ... and once the version left the table: freed while it was read.
  table.drop(7)
  e = _routes.read_failure(pull, source, OSError(14, "Bad address"))
  assert isinstance(e, rdt_jax.StaleWeightsError) and "freed while it was being read" in str(e)
  # The kernel's refusal, and what is not about the read, pass as they are.
  for error in (PermissionError(1, "refused"), ValueError("other")):
    assert _routes.read_failure(pull, source, error) is error
  # A process gone, whose actor Ray reports dead: the lifetime error.
  dead = Bystander.remote()
  ray.get(dead.ping.remote())
  ray.kill(dead)
  pull, source = _pull_of(table, publisher, 7, dead)
  e = _routes.read_failure(pull, source, ProcessLookupError(3, "No such process"))
  assert isinstance(e, RayDirectTransportError) and "has died: the object died with it" in str(e), e
  assert isinstance(e.__cause__, rdt_jax.ProducerDiedError)
  ray.kill(alive)


def test_every_node_local_route_uses_the_one_rule():
  """No route keeps a failure path of its own: each reads inside
  `node_local_read` and checks after with `checked_after_read`."""
  import inspect

  from rdt_jax.weights import _device_route, _named

  for fn in (_routes.pull_node_local, _device_route.pull_device_local, _named._node_local):
    code = inspect.getsource(fn)
    assert "node_local_read(" in code and "checked_after_read(" in code, fn.__qualname__
    assert "ForeignTable" not in code and "except OSError" not in code, fn.__qualname__


# --------------------------------------------------------------------------
# A publisher checks its set-up


class Maker:
  def make(self, transport: str = "jax_nixl") -> str:
    try:
      rdt_jax.WeightPublisher(transport)
    except Exception as e:
      return f"{type(e).__name__}: {e}"
    return "made"


NoTensorTransport = ray.remote(Maker)
WithTensorTransport = ray.remote(enable_tensor_transport=True)(Maker)


def test_a_publisher_checks_its_actor_at_construction():
  a, b = NoTensorTransport.remote(), WithTensorTransport.remote()
  try:
    error = ray.get(a.make.remote())
    assert error.startswith("SetupError: ") and "enable_tensor_transport=True" in error, error
    assert "Add enable_tensor_transport=True to the trainer's @ray.remote(...)" in error
    assert ray.get(b.make.remote()) == "made"
    error = ray.get(b.make.remote("jax_nixll"))
    assert error.startswith("TransportNotRegisteredError: ") and "'jax_nixll'" in error, error
  finally:
    for x in (a, b):
      ray.kill(x)
  with pytest.raises(rdt_jax.SetupError, match="lives in a Ray actor"):
    rdt_jax.WeightPublisher()  # the driver
  assert issubclass(rdt_jax.SetupError, RuntimeError)


# --------------------------------------------------------------------------
# The error family


def test_template_mapping_and_handle_errors_are_in_the_family():
  import torch

  from rdt_jax.weights._handle import check_template

  with pytest.raises(rdt_jax.TemplateError, match=r"template leaf at \['w'\] has shape \(3,\)"):
    check_template([("['w']", np.zeros(3, np.float32))], (("['w']", "array", (4,), "float32"),))
  with pytest.raises(rdt_jax.TemplateError, match="holds no jax, torch or numpy arrays"):
    rdt_jax.WeightSubscriber({"step": 1})
  with pytest.raises(rdt_jax.MappingError, match="give the template too"):
    rdt_jax.WeightSubscriber(None, source={})
  with pytest.raises(rdt_jax.MappingError, match="at least one part"):
    rdt_jax.Fuse()
  with pytest.raises(rdt_jax.ArgumentTypeError, match="got NoneType"):
    rdt_jax.WeightSubscriber({"w": torch.zeros(3)}).pull(None)  # type: ignore[arg-type]
  with pytest.raises(rdt_jax.ArgumentTypeError, match="path must be a str"):
    rdt_jax.From(3)  # type: ignore[arg-type]
  with pytest.raises(rdt_jax.ArgumentTypeError, match="takes WeightsHandles"):
    rdt_jax.WeightsHandle.combine([None])  # type: ignore[list-item]
  # Each keeps the parent code caught before the family.
  assert issubclass(rdt_jax.TemplateError, ValueError) and issubclass(rdt_jax.MappingError, rdt_jax.TemplateError)
  assert issubclass(rdt_jax.ArgumentTypeError, TypeError)
  for cls in (rdt_jax.TemplateError, rdt_jax.MappingError, rdt_jax.ArgumentTypeError, rdt_jax.SetupError):
    assert issubclass(cls, rdt_jax.RdtJaxError) and cls.__module__ == "rdt_jax"


# --------------------------------------------------------------------------
# Logs


class _Records(logging.Handler):
  def __init__(self) -> None:
    super().__init__(logging.DEBUG)
    self.lines: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    self.lines.append(f"{record.name} {record.levelname} {record.getMessage()}")


@ray.remote(enable_tensor_transport=True)
class AsyncGenerator:
  def __init__(self):
    import torch

    self.sub = rdt_jax.WeightSubscriber({"w": torch.zeros(N)})
    self.records = _Records()
    for name in ("ray", "rdt_jax"):
      logging.getLogger(name).addHandler(self.records)
    logging.getLogger("rdt_jax").setLevel(logging.DEBUG)

  async def pull(self, handle) -> dict:
    await self.sub.pull_async(handle)
    return {"version": self.sub.version, "lines": list(self.records.lines)}


def test_pull_async_logs_no_blocking_get_advice_and_debug_shows_transfers_and_pulls():
  """In an async actor whose `rdt_jax` logger is at DEBUG: a pull through
  Ray (node-local reads off) logs its bucket's transfer and the pull, and
  Ray's "Using blocking ray.get inside async actor" advice never appears
  (the pull's `ray.get`s run in a worker thread, not on the event loop)."""
  t = Trainer.options(runtime_env=worker_env(**OUT_OF_BAND_ENV)).remote()
  g = AsyncGenerator.options(runtime_env=worker_env(**OUT_OF_BAND_ENV)).remote()
  try:
    for version in (1, 2):
      r = ray.get(g.pull.remote(ray.get(t.publish.remote(version))))
    assert r["version"] == 2
    lines = r["lines"]
    assert not [line for line in lines if "blocking ray.get" in line], lines
    transfers = [line for line in lines if "jax_nixl received object" in line]
    assert len(transfers) == 2 and all(f"{N * 4} bytes in" in line and "(NIXL READ)" in line
                                       for line in transfers), lines
    pulls = [line for line in lines if "pulled version" in line]
    assert [p.split("pulled version ")[1].split(" ")[0] for p in pulls] == ["1", "2"], lines
    assert all(f"{N * 4} bytes" in p and "route buckets, 1 RDT objects" in p for p in pulls), pulls
  finally:
    for a in (t, g):
      ray.kill(a)
