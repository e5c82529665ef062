"""Which NIXL module rdt_jax loads, and what loading it costs a process: with
one NIXL build installed, that build directly, never the `nixl` meta package
(which imports torch to read a CUDA version when torch is a CPU build)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rdt_jax import _compat


def test_one_build_installed_is_imported_directly():
  assert _compat.nixl_api_candidates(lambda name: name == "nixl_cu12") == ("nixl_cu12._api",)
  assert _compat.nixl_api_candidates(lambda name: name == "nixl_cu13") == ("nixl_cu13._api",)


def test_both_builds_installed_take_the_meta_package_s_choice_first():
  assert _compat.nixl_api_candidates(lambda name: True) == ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def test_no_build_installed_tries_every_name():
  # Each is tried and named in the ImportError (test_nixl.py::test_nixl_missing_on_consumer).
  assert _compat.nixl_api_candidates(lambda name: False) == ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def test_registering_in_a_fresh_process_imports_neither_torch_nor_the_meta_package():
  pytest.importorskip("nixl_cu12")
  code = (
      "import sys, rdt_jax; rdt_jax.register();"
      "from rdt_jax import _compat; api = _compat.nixl_api();"
      "print(api.__name__, 'torch' in sys.modules, 'nixl' in sys.modules)"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
  # The meta package, where installed, gives the same module: it aliases the build's.
  assert out.stdout.split() == ["nixl_cu12._api", "False", "False"], out.stdout + out.stderr


def test_the_meta_package_and_the_build_are_one_module_where_both_are_installed():
  pytest.importorskip("nixl")
  import nixl._api

  assert _compat.nixl_api() is nixl._api
