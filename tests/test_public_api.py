"""The public surface: every name in `rdt_jax.__all__` loads, states its
contract, and is the object rdt_jax itself uses (no private duplicate)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import pickle
import time

import numpy as np
import pytest
from ray.exceptions import ActorDiedError, RayError
from ray.experimental.rdt.tensor_transport_manager import TensorTransportManager

import rdt_jax
from rdt_jax import _dlpack, _ray
from rdt_jax import weights as _weights
from rdt_jax.transports import _destinations, _whole_array


@pytest.mark.parametrize("name", rdt_jax.__all__)
def test_every_public_name_loads_and_has_a_docstring(name):
  value = getattr(rdt_jax, name)
  assert inspect.getdoc(value), f"rdt_jax.{name} has no docstring"
  assert name in dir(rdt_jax)


def test_unknown_names_raise_attribute_error():
  with pytest.raises(AttributeError, match="module 'rdt_jax' has no attribute 'NixlTransport'"):
    rdt_jax.NixlTransport  # noqa: B018


def test_public_names_are_the_objects_rdt_jax_uses():
  assert rdt_jax.UnsupportedRayError is _ray.version.UnsupportedRayError
  assert rdt_jax.WholeArrayTransport is _whole_array.WholeArrayTransport
  assert rdt_jax.DescribedLeaf is _dlpack.DescribedLeaf
  assert rdt_jax.LeafSpec is _dlpack.LeafSpec
  assert rdt_jax.Destination is _destinations.Destination
  assert rdt_jax.Placement is _destinations.Placement
  assert rdt_jax.WeightPublisher is _weights.WeightPublisher
  assert rdt_jax.StaleWeightsError is _weights.StaleWeightsError


def test_error_types_subclass_what_ray_raises():
  assert issubclass(rdt_jax.TransportNotRegisteredError, ValueError)
  assert issubclass(rdt_jax.UnknownObjectError, AssertionError)
  assert issubclass(rdt_jax.UnsupportedRayError, RuntimeError)
  assert issubclass(rdt_jax.UnsupportedLeafError, ValueError)
  assert issubclass(rdt_jax.SettingError, ValueError)
  assert issubclass(rdt_jax.StaleWeightsError, RuntimeError)
  # Ray's future raises a RayError its callback receives (and returns anything else).
  assert issubclass(rdt_jax.AwaitNotSupportedError, RayError)
  assert issubclass(rdt_jax.RefNotReadyError, NotImplementedError)


def _public_errors() -> list[type[BaseException]]:
  values = [getattr(rdt_jax, n) for n in rdt_jax.__all__]
  return [v for v in values if isinstance(v, type) and issubclass(v, BaseException)]


def test_every_public_error_is_in_the_family_and_keeps_its_old_parents():
  errors = _public_errors()
  assert {e.__name__ for e in errors} >= {"NixlError", "ProducerDiedError", "ProducerActorDiedError", "DeviceViewBusy"}
  for error in errors:
    assert issubclass(error, rdt_jax.RdtJaxError), error
    assert error.__module__ == "rdt_jax", f"{error.__name__} is named by a private path in tracebacks"
  # The parents code caught before the family (and Ray's, where Ray sets them) stay.
  assert issubclass(rdt_jax.MetadataError, rdt_jax.UnsupportedLeafError)
  assert issubclass(rdt_jax.UnknownObjectError, AssertionError)
  assert issubclass(rdt_jax.RefNotReadyError, NotImplementedError)
  assert issubclass(rdt_jax.ProducerActorDiedError, ActorDiedError)
  assert issubclass(rdt_jax.NixlError, RuntimeError) and issubclass(rdt_jax.ProducerDiedError, RuntimeError)
  # The right parents, beside the misleading (deprecated) ones.
  assert issubclass(rdt_jax.UnknownObjectError, LookupError)
  assert issubclass(rdt_jax.RefNotReadyError, ValueError)
  assert rdt_jax.MetadataError._deprecated_parents == (rdt_jax.UnsupportedLeafError,)
  # Ray refuses `await` of an RDT ref in the driver with a ValueError: so does rdt_jax.
  assert issubclass(rdt_jax.AwaitNotSupportedError, ValueError)


def test_public_errors_survive_pickling_with_their_attributes():
  cases = [
      rdt_jax.NixlError("m", "register", "o1"),
      rdt_jax.ProducerDiedError("m"),
      rdt_jax.DeviceViewBusy("m"),
      rdt_jax.MetadataError("o1", "addresses", "is short", "['w']"),
      rdt_jax.UnknownObjectError("m", "o2"),
  ]
  for error in cases:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)


def _base_name(cls: type) -> str:
  if cls.__module__ == "builtins":
    return cls.__name__
  return f"{cls.__module__}.{cls.__qualname__}"


def family_tree() -> list[str]:
  """The family as `docs/errors.md` draws it, from the classes: each error
  under its first public parent in the family, then its other parents, the
  deprecated ones marked."""
  errors = [e for e in _public_errors() if e is not rdt_jax.RdtJaxError]
  children: dict[type, list[type]] = {}
  for error in errors:
    deprecated = error._deprecated_parents
    parent = next((b for b in error.__bases__ if b in errors and b not in deprecated), rdt_jax.RdtJaxError)
    children.setdefault(parent, []).append(error)

  def lines(cls: type, depth: int) -> list[str]:
    out = []
    for error in sorted(children.get(cls, []), key=lambda c: c.__name__):
      deprecated = error._deprecated_parents
      others = [_base_name(b) for b in error.__bases__ if b not in (cls, rdt_jax.RdtJaxError, *deprecated)]
      marks = [f"{_base_name(b)} (deprecated)" for b in deprecated]
      out.append(f"{'    ' * depth}{error.__name__}({', '.join(others + marks)})")
      out.extend(lines(error, depth + 1))
    return out

  return ["RdtJaxError(Exception)", *lines(rdt_jax.RdtJaxError, 1)]


def test_errors_page_draws_the_family_as_the_code_defines_it():
  page = (pathlib.Path(__file__).parent.parent / "docs" / "errors.md").read_text()
  block = page.split("<!-- family tree: generated from the code, tests/test_public_api.py checks it -->\n```text\n")[1]
  drawn = block.split("```")[0].splitlines()
  assert drawn == family_tree(), "docs/errors.md's family tree should read:\n" + "\n".join(family_tree())


def test_type_checking_imports_name_exactly_the_exports():
  """`rdt_jax/__init__.py` lists its public names for type checkers (the
  `TYPE_CHECKING` imports) and for loading (`_EXPORTS`): the two agree."""
  tree = ast.parse(pathlib.Path(rdt_jax.__file__).read_text())
  block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
  imported = {
      alias.asname or alias.name: node.module
      for node in block.body if isinstance(node, ast.ImportFrom)
      for alias in node.names
  }
  assert imported == rdt_jax._EXPORTS
  assert all(a.name == a.asname for n in block.body for a in n.names)  # type: ignore[attr-defined]


def test_get_async_is_awaitable():
  assert inspect.iscoroutinefunction(rdt_jax.get_async)
  assert list(inspect.signature(rdt_jax.get_async).parameters) == ["refs", "timeout"]


def test_transport_base_classes():
  assert issubclass(rdt_jax.DlpackTransport, TensorTransportManager)
  assert issubclass(rdt_jax.WholeArrayTransport, rdt_jax.DlpackTransport)


def test_hook_argument_types_have_their_documented_fields():
  assert rdt_jax.LeafSpec._fields == ("path", "shape", "dtype", "framework", "device", "chunks", "sharding")
  assert rdt_jax.DescribedLeaf._fields == ("spec", "pointers", "device_indices", "arrays")
  fields = {f.name for f in dataclasses.fields(rdt_jax.Destination)}
  assert {"pointer", "nbytes", "device", "keepalive", "region", "source", "source_offset", "part"} <= fields
  # `array` is the older, read-only name of `keepalive`.
  assert isinstance(rdt_jax.Destination.array, property) and rdt_jax.Destination.array.fset is None


# Ray's TensorTransportManager methods that Ray calls and DlpackTransport implements.
RAY_INTERFACE = [
    "tensor_transport_backend",
    "actor_has_tensor_transport",
    "extract_tensor_transport_metadata",
    "get_communicator_metadata",
    "fetch_multiple_tensors",
    "wait_fetch_complete",
    "recv_multiple_tensors",
    "send_multiple_tensors",
    "garbage_collect",
    "abort_transport",
]


@pytest.mark.parametrize("method", RAY_INTERFACE)
def test_ray_interface_methods_have_rdt_jax_docstrings(method):
  """Each says who calls it (not Ray's inherited text, which documents the
  abstract interface's arguments)."""
  own = rdt_jax.DlpackTransport.__dict__[method].__doc__
  assert own and own.startswith("Ray calls this"), own
  assert own != getattr(TensorTransportManager, method).__doc__


def test_metadata_signature_is_framework_neutral():
  signature = str(inspect.signature(rdt_jax.DlpackTransportMetadata))
  assert "torch" not in signature
  assert "tensor_meta: 'list[tuple[tuple[int, ...], np.dtype]]'" in signature


# ---- register_transport's documented errors (its success path: test_backends, the shm example)


class _Nameless(rdt_jax.DlpackTransport):
  pass


class _Clash(rdt_jax.DlpackTransport):
  name = "jax_nixl"


def test_register_transport_refuses_what_is_no_transport():
  with pytest.raises(TypeError, match=r"takes a subclass of rdt_jax\.DlpackTransport .*not <class 'int'>"):
    rdt_jax.register_transport(int)  # type: ignore[arg-type]


def test_register_transport_refuses_a_class_without_a_name():
  with pytest.raises(ValueError, match=r"_Nameless has no transport name: set the class attribute `name`"):
    rdt_jax.register_transport(_Nameless)


def test_register_transport_refuses_a_name_taken_by_another_class():
  if "jax_nixl" not in rdt_jax.register():
    pytest.skip("jax_nixl needs NIXL")
  with pytest.raises(ValueError, match=r"'jax_nixl' is already registered in this process by rdt_jax\.transports\."):
    rdt_jax.register_transport(_Clash)


# ---- a transport that misses a hook its kind needs is refused (docs/custom_transport.md, "The hooks")


def test_a_one_sided_transport_without_export_buffers_is_refused_when_defined():
  with pytest.raises(
      TypeError,
      match=r"\._NoExport is a one-sided rdt_jax\.DlpackTransport but does not implement export_buffers, "
      r"release\. A one-sided DlpackTransport implements export_buffers\(obj_id, leaves, meta\), "
      r"start_receive\(obj_id, meta, communicator_metadata, destinations\) and release\(obj_id\); "
      r"the other hooks are optional",
  ):

    class _NoExport(rdt_jax.DlpackTransport):
      name = "no_export_example"

      @staticmethod
      def is_one_sided() -> bool:
        return True

      @staticmethod
      def can_abort_transport() -> bool:
        return False

      def start_receive(self, obj_id, meta, communicator_metadata, destinations):
        pass


def test_a_two_sided_transport_without_send_buffers_is_refused_when_defined():
  with pytest.raises(
      TypeError,
      match=r"\._NoSend is a two-sided rdt_jax\.DlpackTransport but does not implement send_buffers\. "
      r"A two-sided DlpackTransport implements send_buffers\(leaves, meta, communicator_metadata\) and "
      r"start_receive\(obj_id, meta, communicator_metadata, destinations\)",
  ):

    class _NoSend(rdt_jax.DlpackTransport):
      name = "no_send_example"

      @staticmethod
      def is_one_sided() -> bool:
        return False

      @staticmethod
      def can_abort_transport() -> bool:
        return False

      def start_receive(self, obj_id, meta, communicator_metadata, destinations):
        pass


def test_a_whole_array_transport_without_wait_pull_is_refused_when_defined():
  with pytest.raises(
      TypeError,
      match=r"\._NoWait is a one-sided rdt_jax\.WholeArrayTransport but does not implement wait_pull\. "
      r"A one-sided WholeArrayTransport implements export_arrays\(obj_id, arrays, leaves, meta\), "
      r"start_pull\(obj_id, meta, communicator_metadata, placements\), wait_pull\(handle, obj_id, timeout\) "
      r"and release\(obj_id\)",
  ):

    class _NoWait(rdt_jax.WholeArrayTransport):
      name = "no_wait_example"

      @staticmethod
      def is_one_sided() -> bool:
        return True

      @staticmethod
      def can_abort_transport() -> bool:
        return False

      def export_arrays(self, obj_id, arrays, leaves, meta):
        pass

      def start_pull(self, obj_id, meta, communicator_metadata, placements):
        pass

      def release(self, obj_id):
        pass


class _KindlessBase(rdt_jax.DlpackTransport):
  """No `is_one_sided()`: its kind is unknown when it is defined."""

  name = "kindless_example"


def test_register_transport_refuses_a_transport_without_ray_s_static_methods():
  with pytest.raises(
      TypeError,
      match=r"\._KindlessBase does not implement can_abort_transport\(\) and is_one_sided\(\): every "
      r"transport implements the static methods",
  ):
    rdt_jax.register_transport(_KindlessBase)


class _OneSidedBase(rdt_jax.DlpackTransport):
  """A base for transports (no `name`): its hooks are its subclasses'."""

  @staticmethod
  def is_one_sided() -> bool:
    return True

  @staticmethod
  def can_abort_transport() -> bool:
    return False


def test_a_base_without_a_name_is_checked_in_its_subclasses():
  with pytest.raises(TypeError, match=r"\._Named is a one-sided .* does not implement export_buffers, "
                                      r"start_receive, release\."):

    class _Named(_OneSidedBase):
      name = "named_example"


def test_rdt_jax_s_transports_and_the_example_implement_their_hooks():
  from rdt_jax import _registry
  from rdt_jax.transports import _required
  from shm_transport import ShmTransport

  for cls in (*_registry._transport_classes().values(), ShmTransport, _NeverArrives):
    assert _required.missing_hooks(cls) == [], cls
    _required.check_registered(cls)


#: The hooks each base declares.
HOOKS = {
    "DlpackTransport": ("export_buffers", "send_buffers", "start_receive", "wait_receive", "finish_receive",
                        "cancel_receive", "release"),
    "WholeArrayTransport": ("export_arrays", "start_pull", "wait_pull", "cancel_pull"),
}


@pytest.mark.parametrize("base", sorted(HOOKS))
def test_hooks_are_abstract_or_say_they_are_optional(base):
  """A hook that some kind requires is an abstract placeholder; every other
  has a default, and its docstring starts with "Optional:"."""
  cls = getattr(rdt_jax, base)
  required = set().union(*cls._required_hooks.values())
  for name in HOOKS[base]:
    hook = vars(cls)[name]
    if name in required:
      assert getattr(hook, "__rdt_jax_abstract_hook__", False), name
    else:
      assert not hasattr(hook, "__rdt_jax_abstract_hook__") and hook.__doc__.startswith("Optional:"), name


class _NeverArrives(rdt_jax.DlpackTransport):
  """A two-sided transport whose bytes never arrive: `send_buffers` sends
  nothing, and `wait_receive` waits out the timeout it is given, as the
  hook's contract says."""

  name = "never_arrives_example"
  devices = ("cpu",)

  @staticmethod
  def is_one_sided() -> bool:
    return False

  @staticmethod
  def can_abort_transport() -> bool:
    return False

  def send_buffers(self, leaves, meta, communicator_metadata):
    pass

  def start_receive(self, obj_id, meta, communicator_metadata, destinations):
    return object()

  def wait_receive(self, handle, obj_id, timeout):
    self.waited = timeout
    if timeout < 0:
      raise AssertionError("waited with no bound")
    time.sleep(timeout)
    raise TimeoutError(f"nothing arrived for {obj_id} within {timeout}s")


def test_a_two_sided_receive_waits_at_most_ray_s_fetch_timeout(monkeypatch):
  """Ray runs `recv_multiple_tensors` (its `__ray_recv__`) with no timeout:
  the wait is bounded by Ray's RDT fetch timeout all the same."""
  from rdt_jax import _handoff

  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", "0")
  monkeypatch.setattr(_ray.state, "rdt_fetch_timeout_s", lambda: 0.2)
  t = _NeverArrives()
  tree = [np.arange(64, dtype=np.float32)]
  _handoff.record_described(tree[0], _dlpack.describe(tree[0], "[0]"))
  meta = t.extract_tensor_transport_metadata("never", tree)
  start = time.monotonic()
  with pytest.raises(TimeoutError, match=r"within 0\.2s"):
    t.recv_multiple_tensors("never", meta, None)
  assert t.waited == 0.2 and time.monotonic() - start < 10
