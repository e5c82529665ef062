"""The backend hooks a transport must implement, and the check that refuses a
transport class missing one.

Which hooks a transport needs depends on its kind, known from its base
(`DlpackTransport` moves bytes, `WholeArrayTransport` whole arrays) and from
`is_one_sided()`: each base lists them by kind (`_required_hooks`), and marks
its placeholder of every hook some kind requires with `abstract_hook`. A hook
is missing when the class resolves it to such a placeholder. The other hooks
have defaults and say so ("Optional: ...").

The check runs twice: when a class is defined, once its kind is known (it sets
`name` and implements `is_one_sided()`; a class without a `name` is a base for
others), and when it is registered (`rdt_jax.register_transport`), which also
refuses a class that leaves Ray's own static methods unimplemented. Both raise
`TypeError`, naming the class, the missing hooks and every hook its kind
needs, as Python does for a class that leaves an abstract method.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
  from rdt_jax.transports._base import DlpackTransport

__all__ = ["abstract_hook", "check_defined", "check_registered", "missing_hooks"]

F = TypeVar("F", bound=Callable[..., Any])

#: Where the hooks are described, for the errors below.
GUIDE = 'docs/custom_transport.md, "The hooks"'


def abstract_hook(fn: F) -> F:
  """Marks a base's placeholder of a hook that subclasses implement (for the
  kinds its base's `_required_hooks` names)."""
  fn.__rdt_jax_abstract_hook__ = True  # type: ignore[attr-defined]
  return fn


def _is_placeholder(member: Any) -> bool:
  return getattr(member, "__rdt_jax_abstract_hook__", False)


def _kind_known(cls: type[DlpackTransport]) -> bool:
  return not getattr(cls.is_one_sided, "__isabstractmethod__", False)


def _hook_base(cls: type[DlpackTransport]) -> type:
  """The nearest base that lists the hooks (`WholeArrayTransport` or `DlpackTransport`)."""
  return next(c for c in cls.__mro__ if "_required_hooks" in vars(c))


def required_hooks(cls: type[DlpackTransport]) -> tuple[str, ...]:
  """The hooks a transport of `cls`'s kind must implement (kind known)."""
  return _hook_base(cls)._required_hooks[bool(cls.is_one_sided())]  # type: ignore[attr-defined]


def missing_hooks(cls: type[DlpackTransport]) -> list[str]:
  """The required hooks `cls` leaves to its base's placeholder (kind known)."""
  return [name for name in required_hooks(cls) if _is_placeholder(getattr(cls, name))]


def _unimplemented_ray_methods(cls: type) -> list[str]:
  """Ray's abstract methods (`is_one_sided`, `can_abort_transport`) `cls`
  leaves unimplemented."""
  abstract = {n for base in cls.__mro__[1:] for n in getattr(base, "__abstractmethods__", ())}
  return sorted(n for n in abstract if getattr(getattr(cls, n, None), "__isabstractmethod__", False))


def _call(cls: type, name: str) -> str:
  """`name(arg, ...)`, as the base's placeholder declares it."""
  params = list(inspect.signature(getattr(cls, name)).parameters)[1:]  # without self
  return f"{name}({', '.join(params)})"


def _error(cls: type[DlpackTransport], missing: list[str]) -> TypeError:
  base = _hook_base(cls)
  kind = "one-sided" if cls.is_one_sided() else "two-sided"
  needed = [_call(base, n) for n in required_hooks(cls)]
  return TypeError(
      f"{cls.__module__}.{cls.__qualname__} is a {kind} rdt_jax.{base.__name__} but does not "
      f"implement {', '.join(missing)}. A {kind} {base.__name__} implements "
      f"{', '.join(needed[:-1])} and {needed[-1]}; the other hooks are optional ({GUIDE})."
  )


def check_defined(cls: type[DlpackTransport]) -> None:
  """At class definition: refuses a transport whose kind is known (it sets
  `name` and implements `is_one_sided()`) but which misses a required hook.

  Raises:
    TypeError: naming the class, the missing hooks and the hooks to implement.
  """
  if not getattr(cls, "name", None) or not _kind_known(cls):
    return  # a base for other transports: checked in its subclasses, and on registration
  missing = missing_hooks(cls)
  if missing:
    raise _error(cls, missing)


def check_registered(cls: type[DlpackTransport]) -> None:
  """At registration: refuses a transport that leaves Ray's static methods
  or a required hook unimplemented.

  Raises:
    TypeError: naming the class and what it does not implement.
  """
  unimplemented = _unimplemented_ray_methods(cls)
  if unimplemented:
    calls = [f"{n}()" for n in unimplemented]
    raise TypeError(
        f"{cls.__module__}.{cls.__qualname__} does not implement {' and '.join(calls)}: every "
        "transport implements the static methods is_one_sided() and can_abort_transport(), "
        "which Ray calls (docs/custom_transport.md, \"The class\")."
    )
  missing = missing_hooks(cls)
  if missing:
    raise _error(cls, missing)
