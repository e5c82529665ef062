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
