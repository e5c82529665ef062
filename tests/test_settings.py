"""Every `RDT_JAX_*` setting is declared once (`rdt_jax._settings`), parsed,
bounded and documented from that declaration."""

from __future__ import annotations

import pathlib
import re

import pytest

import rdt_jax
from rdt_jax import _settings

REPO = pathlib.Path(__file__).parent.parent
MARKER = "<!-- settings-table"


def test_configuration_page_lists_every_setting_from_the_declarations():
  page = (REPO / "docs" / "configuration.md").read_text()
  assert MARKER in page
  table = page[page.index(MARKER):].split("\n", 1)[1]
  assert table == _settings.markdown_table(), "regenerate: python -m rdt_jax._settings"


def test_every_setting_the_package_names_is_declared():
  named = set()
  for path in (REPO / "rdt_jax").rglob("*.py"):
    named.update(re.findall(r"RDT_JAX_[A-Z0-9_]+", path.read_text()))
  assert named <= set(_settings.SETTINGS), sorted(named - set(_settings.SETTINGS))


def test_unset_and_empty_give_the_default(monkeypatch):
  monkeypatch.delenv("RDT_JAX_INLINE_MAX_BYTES", raising=False)
  assert _settings.value("RDT_JAX_INLINE_MAX_BYTES") == 0  # in-band sending is opt-in
  monkeypatch.setenv("RDT_JAX_INLINE_MAX_BYTES", " ")
  assert _settings.value("RDT_JAX_INLINE_MAX_BYTES") == 0


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("RDT_JAX_INLINE_MAX_BYTES", "0", 0),
        ("RDT_JAX_INLINE_MAX_BYTES", "4096", 4096),
        ("RDT_JAX_NIXL_CMA", "0", False),
        ("RDT_JAX_NIXL_CMA", "true", True),
        ("RDT_JAX_NIXL_PARK_END_S", "2.5", 2.5),
        ("RDT_JAX_FAULTS", "nixl.post:fail*1", "nixl.post:fail*1"),
    ],
)
def test_values_parse(monkeypatch, name, text, expected):
  monkeypatch.setenv(name, text)
  assert _settings.value(name) == expected


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("RDT_JAX_INLINE_MAX_BYTES", "lots", "is not a byte count"),
        ("RDT_JAX_INLINE_MAX_BYTES", "-1", "is not a byte count"),
        ("RDT_JAX_INLINE_MAX_BYTES", str(1 << 30), "is out of range"),
        ("RDT_JAX_NIXL_CMA", "maybe", "is not 1 or 0"),
        ("RDT_JAX_NIXL_VIEW_REBUILD_S", "3600", "is out of range"),
        ("RDT_JAX_NIXL_PARK_END_S", "nan", "is not a number of seconds"),
        ("RDT_JAX_HOST_POOL_BYTES", "1e9", "is not a byte count"),
    ],
)
def test_bad_values_name_the_variable_and_the_fix(monkeypatch, name, text, says):
  monkeypatch.setenv(name, text)
  with pytest.raises(rdt_jax.SettingError) as info:
    _settings.value(name)
  message = str(info.value)
  assert message.startswith(f"{name}={text!r} {says}")
  assert "unset it for the default" in message
  assert isinstance(info.value, ValueError)


def test_an_undeclared_name_is_a_bug():
  with pytest.raises(KeyError):
    _settings.value("RDT_JAX_NO_SUCH_SETTING")


def test_test_only_settings_are_not_in_the_users_table():
  table = _settings.markdown_table()
  for s in _settings.SETTINGS.values():
    assert (f"| `{s.name}` |" in table) != s.test_only


def test_an_argument_given_is_checked_against_its_setting_and_wins(monkeypatch):
  monkeypatch.setenv("RDT_JAX_WEIGHT_BUCKET_BYTES", "lots")
  assert _settings.argument("RDT_JAX_WEIGHT_BUCKET_BYTES", 1 << 20, "bucket_bytes") == 1 << 20
  assert _settings.argument("RDT_JAX_WEIGHT_DEVICE_PACK", False, "device_pack") is False
  assert _settings.argument("RDT_JAX_NIXL_PARK_END_S", 2, "park_s") == 2.0
  with pytest.raises(rdt_jax.SettingError, match="RDT_JAX_WEIGHT_BUCKET_BYTES='lots'"):
    _settings.argument("RDT_JAX_WEIGHT_BUCKET_BYTES", None, "bucket_bytes")  # left out: the variable


@pytest.mark.parametrize(
    ("name", "given", "error", "says"),
    [
        ("RDT_JAX_WEIGHT_BUCKET_BYTES", 4095, ValueError,
         "bucket_bytes=4095 is out of range: give 4 KiB to 1 TiB (4096 to 1099511627776 bytes), or leave it out "
         "for the setting RDT_JAX_WEIGHT_BUCKET_BYTES (default 256 MiB)."),
        ("RDT_JAX_WEIGHT_BUCKET_BYTES", -5, ValueError, "bucket_bytes=-5 is not a byte count (an int)"),
        ("RDT_JAX_WEIGHT_BUCKET_BYTES", True, TypeError,
         "bucket_bytes=True is of type bool; bucket_bytes takes a byte count"),
        ("RDT_JAX_WEIGHT_BUCKET_BYTES", 4096.0, TypeError, "bucket_bytes=4096.0 is of type float"),
        ("RDT_JAX_WEIGHT_DEVICE_PACK", 1, TypeError, "device_pack=1 is of type int; device_pack takes True or False"),
        ("RDT_JAX_NIXL_PARK_END_S", float("nan"), ValueError, "park_s=nan is not a number of seconds"),
        ("RDT_JAX_NIXL_PARK_END_S", 601, ValueError, "park_s=601 is out of range: give 0.1 s to 600 s"),
    ],
)
def test_a_bad_argument_names_itself_the_value_and_the_range(name, given, error, says):
  argument = {"RDT_JAX_WEIGHT_BUCKET_BYTES": "bucket_bytes", "RDT_JAX_WEIGHT_DEVICE_PACK": "device_pack"}.get(
      name, "park_s")
  with pytest.raises(error) as info:
    _settings.argument(name, given, argument)
  assert str(info.value).startswith(says), str(info.value)
  assert type(info.value) is error  # a plain argument error, not SettingError


def test_settings_read_at_construction_are_the_defaults_of_their_arguments():
  import inspect

  for s in _settings.SETTINGS.values():
    assert (s.read == "at construction") == bool(s.arguments), s.name
    for spelled in s.arguments:
      owner, argument = re.fullmatch(r"(\w+)\((\w+)=\)", spelled).groups()
      parameter = inspect.signature(getattr(rdt_jax, owner)).parameters[argument]
      assert parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and parameter.default is None, spelled
      assert s.name in (getattr(rdt_jax, owner).__doc__ or ""), (spelled, "names its setting in the docstring")
