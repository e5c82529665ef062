"""Every `RDT_JAX_*` setting, declared once: type, default, bounds, when it is read.

rdt_jax is configured by environment variables only, so that the driver and
every worker (whose environment Ray sets from `runtime_env={"env_vars": ...}`)
agree. This module is the one place that reads them: code asks
`value("RDT_JAX_...")`, which parses and checks the variable and raises
`SettingError` (naming the variable, the value, what is allowed and how to
fix it) for a bad one. `docs/configuration.md` is generated from `SETTINGS`
(`python -m rdt_jax._settings`) and a test keeps the two equal.

A setting is read when its `read` field says: `"per use"` settings are
parsed every time the code consults them (changing the variable in a running
process takes effect at the next object); `"once"` settings are parsed the
first time the process needs them (the pools' sizes, the NIXL agent's
timings) and then kept; `"at construction"` settings are the defaults of a
keyword argument (`arguments`), read when an object is made without it
(`argument`): a weight stream's own settings, which one publisher or
subscriber may set apart from the others in its process.

This module imports neither Ray nor any array framework: the DLPack layer may
use it.
"""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from rdt_jax._error_base import RdtJaxError

__all__ = ["SETTINGS", "Setting", "SettingError", "argument", "markdown_table", "value"]

_KIB: Final = 1 << 10
_MIB: Final = 1 << 20
_GIB: Final = 1 << 30
_TIB: Final = 1 << 40


class SettingError(RdtJaxError, ValueError):
  """An `RDT_JAX_*` environment variable holds a value rdt_jax cannot use."""


SettingError.__module__ = "rdt_jax"  # public as rdt_jax.SettingError


@dataclass(frozen=True)
class Setting:
  """One environment variable rdt_jax reads.

  Attributes:
    name: the variable (`RDT_JAX_...`).
    kind: how its text is parsed: "bytes" and "int" (a non-negative integer),
      "seconds" (a number), "bool" ("1"/"0", also "true"/"false"), "text".
    default: the value when the variable is unset (or set to "").
    minimum, maximum: inclusive bounds of a numeric setting.
    read: "per use", "once" or "at construction" (see the module docstring).
    side: where it matters: "producer", "consumer", "both" or "driver".
    arguments: the keyword arguments whose default it is, as
      `"Class(argument=)"` (an "at construction" setting has at least one).
    doc: one line on its effect, as the configuration page shows it.
    test_only: True for settings that exist for rdt_jax's own tests (fault
      injection); users never need them.
  """

  name: str
  kind: Literal["bytes", "int", "seconds", "bool", "text"]
  default: Any
  doc: str
  read: Literal["per use", "once", "at construction"] = "per use"
  side: Literal["producer", "consumer", "both", "driver"] = "both"
  arguments: tuple[str, ...] = ()
  minimum: float | None = None
  maximum: float | None = None
  test_only: bool = False

  def parse(self, text: str) -> Any:
    """The value of `text` for this setting.

    Raises:
      SettingError: if `text` does not parse or lies outside the bounds.
    """
    parser = _PARSERS[self.kind]
    try:
      result = parser(text.strip())
    except ValueError:
      raise SettingError(f"{self.name}={text!r} is not {_DESCRIBE[self.kind]}: {self._fix()}") from None
    if (self.minimum is not None and result < self.minimum) or (self.maximum is not None and result > self.maximum):
      raise SettingError(f"{self.name}={text!r} is out of range: {self._fix()}")
    return result

  def check(self, argument: str, given: Any) -> Any:
    """`given`, the value of keyword argument `argument` whose default is
    this setting, checked against the setting's type and bounds.

    Raises:
      TypeError: `given` is not of the setting's type (a bool is not a
        number); the message names the argument and what it takes.
      ValueError: `given` lies outside the bounds; the message names the
        argument, the value and the allowed range.
    """
    try:
      result = _ARGUMENT_CHECKS[self.kind](given)
    except TypeError:
      raise TypeError(f"{argument}={given!r} is of type {type(given).__name__}; {argument} takes "
                      f"{_DESCRIBE_ARGUMENT[self.kind]}, or leave it out for {self._default_text()}.") from None
    except ValueError:
      raise ValueError(f"{argument}={given!r} is not {_DESCRIBE_ARGUMENT[self.kind]}: give "
                       f"{self._allowed()}, or leave it out for {self._default_text()}.") from None
    if (self.minimum is not None and result < self.minimum) or (self.maximum is not None and result > self.maximum):
      raise ValueError(f"{argument}={given!r} is out of range: give {self._allowed()}, or leave it out for "
                       f"{self._default_text()}.")
    return result

  def _allowed(self) -> str:
    if self.kind == "bytes" and self.minimum is not None and self.maximum is not None:
      return f"{self.bounds()} ({int(self.minimum)} to {int(self.maximum)} bytes)"
    return self.bounds() or _DESCRIBE_ARGUMENT[self.kind]

  def _default_text(self) -> str:
    return f"the setting {self.name} (default {_show(self.kind, self.default)})"

  def bounds(self) -> str:
    """The allowed range as the configuration page shows it ("" if none)."""
    if self.minimum is None and self.maximum is None:
      return ""
    return f"{_show(self.kind, self.minimum)} to {_show(self.kind, self.maximum)}"

  def _fix(self) -> str:
    allowed = f"{_DESCRIBE[self.kind]}" + (f" from {self.bounds()}" if self.bounds() else "")
    return f"set it to {allowed}, or unset it for the default ({_show(self.kind, self.default)})."


def _parse_bool(text: str) -> bool:
  lowered = text.lower()
  if lowered in ("1", "true", "yes", "on"):
    return True
  if lowered in ("0", "false", "no", "off"):
    return False
  raise ValueError(text)


def _parse_count(text: str) -> int:
  result = int(text)
  if result < 0:
    raise ValueError(text)
  return result


def _parse_seconds(text: str) -> float:
  result = float(text)
  if result != result or result < 0:  # NaN, negative
    raise ValueError(text)
  return result


_PARSERS: Final[dict[str, Callable[[str], Any]]] = {
    "bytes": _parse_count,
    "int": _parse_count,
    "seconds": _parse_seconds,
    "bool": _parse_bool,
    "text": str,
}


def _integer_argument(given: Any) -> int:
  if isinstance(given, bool):
    raise TypeError(given)
  result = operator.index(given)  # an int or a numpy integer; TypeError for anything else
  if result < 0:
    raise ValueError(given)
  return result


def _seconds_argument(given: Any) -> float:
  if isinstance(given, bool) or not isinstance(given, numbers.Real):
    raise TypeError(given)
  result = float(given)
  if result != result or result < 0:  # NaN, negative
    raise ValueError(given)
  return result


def _bool_argument(given: Any) -> bool:
  if not isinstance(given, bool):
    raise TypeError(given)
  return given


def _text_argument(given: Any) -> str:
  if not isinstance(given, str):
    raise TypeError(given)
  return given


#: How a keyword argument whose default is a setting of each kind is checked
#: (`Setting.check`): TypeError for another type, ValueError for a bad value.
_ARGUMENT_CHECKS: Final[dict[str, Callable[[Any], Any]]] = {
    "bytes": _integer_argument,
    "int": _integer_argument,
    "seconds": _seconds_argument,
    "bool": _bool_argument,
    "text": _text_argument,
}
_DESCRIBE_ARGUMENT: Final = {
    "bytes": "a byte count (an int)",
    "int": "a non-negative int",
    "seconds": "a number of seconds",
    "bool": "True or False",
    "text": "a str",
}
_DESCRIBE: Final = {
    "bytes": "a byte count (a non-negative integer)",
    "int": "a non-negative integer",
    "seconds": "a number of seconds",
    "bool": "1 or 0",
    "text": "text",
}


def _show(kind: str, v: Any) -> str:
  if v is None:
    return "unbounded"
  if kind == "bytes":
    for unit, size in (("TiB", _TIB), ("GiB", _GIB), ("MiB", _MIB), ("KiB", _KIB)):
      if v and v % size == 0:
        return f"{v // size} {unit}"
    return f"{v} bytes"
  if kind == "seconds":
    return f"{v:g} s"
  if kind == "bool":
    return "1" if v else "0"
  if kind == "text":
    return repr(v) if v else "unset"
  return str(v)


#: Every setting, in the order the configuration page lists them.
SETTINGS: Final[dict[str, Setting]] = {
    s.name: s
    for s in (
        Setting(
            "RDT_JAX_INLINE_MAX_BYTES", "bytes", 0,
            "Opt-in: objects of one-sided transports (jax_nixl, jax_transfer) whose leaves are all host "
            "memory and hold at most this many bytes in all travel in band, inside their metadata, as a "
            "copy taken at return; 0 (the default) sends every object out of band.",
            side="producer", minimum=0, maximum=64 * _MIB,
        ),
        Setting(
            "RDT_JAX_PACK_MIN_LEAVES", "int", 64,
            "A returned value of at least this many leaves sends its small host jax.Arrays (each at most "
            "256 KiB) as one buffer, copied at return: Ray and the transport see one leaf instead of "
            "many; 0 sends every leaf on its own.",
            side="producer", minimum=0, maximum=1 << 30,
        ),
        Setting(
            "RDT_JAX_NIXL_CMA", "bool", True,
            "jax_nixl: a consumer on the producer's host reads host memory directly "
            "(`process_vm_readv`); 0 sends every read through NIXL.",
            side="consumer",
        ),
        Setting(
            "RDT_JAX_NIXL_CUDA_IPC", "bool", False,
            "jax_nixl, opt-in until it has passed tests/gpu on a GPU: a producer puts the CUDA IPC handle "
            "of the device memory it exports in each object's metadata, and a consumer on its host whose "
            "receive memory is device memory maps that memory (once per allocation, kept) and copies the "
            "object with one device-to-device copy instead of a NIXL READ. Set it in producer and "
            "consumer; an object whose memory CUDA IPC cannot map is read through NIXL, counted as "
            "`cuda_ipc_fallback` in `receive_stats()`.",
        ),
        Setting(
            "RDT_JAX_NIXL_VIEW_REBUILD_S", "seconds", 30.0,
            "jax_nixl: a consumer rebuilds its view of a producer that deregistered host memory at most "
            "this often; a stale descriptor stops working within this time. A producer that deregistered "
            "device memory has its view rebuilt at the next READ.",
            read="once", side="consumer", minimum=0.0, maximum=300.0,
        ),
        Setting(
            "RDT_JAX_NIXL_PRODUCER_IDLE_S", "seconds", 60.0,
            "jax_nixl: what a consumer keeps per producer (its view of the producer's agent, what it knows "
            "of the producer's freed objects) is dropped once no read from it ran for this long, or once "
            "a producer on this host exited.",
            read="once", side="consumer", minimum=0.5, maximum=3600.0,
        ),
        Setting(
            "RDT_JAX_NIXL_PARK_END_S", "seconds", 10.0,
            "jax_nixl: a READ given up while in flight and still running after this long is ended by "
            "dropping the producer's agent from this process's view.",
            read="once", side="consumer", minimum=0.1, maximum=600.0,
        ),
        Setting(
            "RDT_JAX_UCX_DEFAULTS", "bool", True,
            "jax_nixl: before this process's first NIXL agent exists, set `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` "
            "where it is unset, so a READ of another process's GPU memory on this host uses CUDA IPC "
            "instead of being emulated through host memory and TCP (UCX turns it off where no NVLink is "
            "active); a variable you set is never changed. 0 leaves UCX's environment alone.",
            read="per use",
        ),
        Setting(
            "RDT_JAX_HOST_POOL_BYTES", "bytes", 1 * _GIB,
            "Free host buffers (receive and staging memory, registered once) kept for reuse; 0 disables "
            "reuse.",
            read="once", minimum=0, maximum=1 * _TIB,
        ),
        Setting(
            "RDT_JAX_DEVICE_POOL_BYTES", "bytes", 1 * _GIB,
            "Free device regions (receive and staging memory on GPUs, registered once) kept for reuse per "
            "process; 0 disables reuse.",
            read="once", minimum=0, maximum=1 * _TIB,
        ),
        Setting(
            "RDT_JAX_WEIGHT_DEVICE_PACK", "bool", True,
            "Weight sync: a version whose array leaves all live on one CUDA device is packed into device "
            "memory of the publisher's own, which subscribers on its host copy into their CUDA tensors "
            "through CUDA IPC (no Ray object); 0 sends such versions as a pytree, one RDT object each.",
            read="at construction", side="producer", arguments=("WeightPublisher(device_pack=)",),
        ),
        Setting(
            "RDT_JAX_WEIGHT_BUCKET_BYTES", "bytes", 256 * _MIB,
            "Weight sync: a packed version read through Ray (a subscriber off the trainer's host) moves "
            "in RDT objects of at most this many bytes (the publisher's), fetched one after the other "
            "while the last one is copied out, so a subscriber holds at most two of them at once; a "
            "`pull_named` or `source=` pull on the trainer's host copies at most this many bytes at a "
            "time (the subscriber's). Rounded down to a multiple of 64 bytes. Each bucket costs one more "
            "fetch or copy: smaller buckets bound memory tighter and cost more time.",
            read="at construction", minimum=4 * _KIB, maximum=1 * _TIB,
            arguments=("WeightPublisher(bucket_bytes=)", "WeightSubscriber(bucket_bytes=)"),
        ),
        Setting(
            "RDT_JAX_METRICS", "bool", True,
            "Ray metrics of rdt_jax's transfers and weight streams (`ray_rdt_jax_*` on Ray's metrics "
            "endpoint, docs/jax_to_torch.md): counted in each process and flushed to `ray.util.metrics` "
            "by a background thread; 0 counts nothing.",
            read="once",
        ),
        Setting(
            "RDT_JAX_METRICS_FLUSH_S", "seconds", 5.0,
            "Seconds between two flushes of a process's counted metrics to Ray (Ray then exports them "
            "at its own interval); counts of a process that dies between two flushes are lost.",
            read="once", minimum=0.05, maximum=3600.0,
        ),
        Setting(
            "RDT_JAX_ALLOW_UNTESTED_RAY", "bool", False,
            "1 lets `register()` run on a Ray minor version outside the tested range (with a warning) "
            "when the Ray internals it wraps pass their checks.",
        ),
        Setting(
            "RDT_JAX_FAULTS", "text", "",
            "Fault injection rules for rdt_jax's own tests (`point:action,...`, see `rdt_jax._faults`); "
            "unset in production.",
            read="once", test_only=True,
        ),
        Setting(
            "RDT_JAX_FAULTS_ENABLE", "bool", False,
            "1 lets a process honour `RDT_JAX_FAULTS`; without it the rules are ignored (with a "
            "warning), so one stray variable cannot make a production process fail or kill itself.",
            read="once", test_only=True,
        ),
        Setting(
            "RDT_JAX_FAULTS_SEED", "int", 0,
            "Seed of the random choices of probabilistic fault rules.",
            read="once", test_only=True, minimum=0, maximum=2**32 - 1,
        ),
    )
}


def value(name: str) -> Any:
  """The current value of setting `name`, parsed and checked.

  Reads the environment at each call (callers of "once" settings keep the
  result themselves); an unset or empty variable gives the default.

  Raises:
    KeyError: if `name` is not declared in `SETTINGS` (a bug in rdt_jax).
    SettingError: if the variable is set to a value the setting does not allow.
  """
  setting = SETTINGS[name]
  text = os.environ.get(name)
  if text is None or not text.strip():
    return setting.default
  return setting.parse(text)


def argument(name: str, given: Any, argument: str) -> Any:
  """The value of keyword argument `argument`, whose default is setting
  `name`: `given` checked against the setting's type and bounds
  (`Setting.check`), or, when `given` is None, the setting's current value
  (`value`).

  Raises:
    KeyError: if `name` is not declared in `SETTINGS` (a bug in rdt_jax).
    TypeError, ValueError: `given` is of another type, or outside the
      bounds; the message names the argument, the value and what is allowed.
    SettingError: `given` is None and the variable is set to a value the
      setting does not allow.
  """
  if given is None:
    return value(name)
  return SETTINGS[name].check(argument, given)


def markdown_table() -> str:
  """The settings table of `docs/configuration.md`."""
  rows = [
      "| variable | type | default | allowed | read | matters on | argument | effect |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for s in SETTINGS.values():
    if s.test_only:
      continue
    arguments = ", ".join(f"`{a}`" for a in s.arguments) or "none"
    rows.append(
        f"| `{s.name}` | {s.kind} | {_show(s.kind, s.default)} | {s.bounds() or _DESCRIBE[s.kind]} | "
        f"{s.read} | {s.side} | {arguments} | {s.doc} |"
    )
  tests = [s for s in SETTINGS.values() if s.test_only]
  if tests:
    rows.append("")
    rows.append("For rdt_jax's own tests only: " + ", ".join(f"`{s.name}`" for s in tests) + ".")
  return "\n".join(rows) + "\n"


if __name__ == "__main__":
  print(markdown_table(), end="")
