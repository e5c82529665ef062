"""An actor class defined outside rdt_jax, for the plain-method check of issue 3.

The check compares a method *without* `tensor_transport` returning a NumPy
array from a process that never imported rdt_jax with one that imported it and
called `register()` (which installs rdt_jax's pickling reducers); the driver
gets and reads the array. A class from
an importable module would be pickled by reference, and unpickling it on a
worker would import that module's package, rdt_jax included. So the class is
compiled here from source into a module name that does not exist; cloudpickle
then ships it by value and the worker imports only NumPy.
"""

from __future__ import annotations

from typing import Any, Final

_MODULE: Final = "rdt_jax_bench_plain_actor"

_SOURCE: Final = '''
import os
import sys

import numpy as np


class PlainActor:
  """Returns a NumPy array from a plain method; optionally imports rdt_jax first."""

  def __init__(self, use_rdt_jax):
    if use_rdt_jax:
      import rdt_jax

      rdt_jax.register()
    self._value = None

  def info(self):
    return {"pid": os.getpid(), "rdt_jax": "rdt_jax" in sys.modules}

  def ping(self):
    return None

  def prepare(self, nbytes):
    x = np.arange(nbytes // 4, dtype=np.uint32)
    x *= np.uint32(2654435761)
    x += np.uint32(1)
    self._value = x.view(np.int32)
    return [_checksum(self._value)]

  def drop(self, key=None):
    self._value = None

  def send(self):
    return self._value

  def reset_peak(self):
    try:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    except OSError:
      return -1
    return _status_kib("VmRSS") * 1024

  def peak(self):
    return _status_kib("VmHWM") * 1024


def _checksum(x):  # rdt_jax.bench._cases.host_checksum, which this module cannot import
  flat = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
  block_bytes = 512 * 8
  blocks = flat.size // block_bytes
  total = 0
  if blocks:
    sums = flat[: blocks * block_bytes].view(np.uint64).reshape(blocks, 512).sum(axis=1, dtype=np.uint64)
    total = int((sums * np.arange(1, blocks + 1, dtype=np.uint64)).sum(dtype=np.uint64))
  rest = flat[blocks * block_bytes:]
  words = rest.size // 8 * 8
  if words:
    total += int(rest[:words].view(np.uint64).sum(dtype=np.uint64)) * (blocks + 1)
  total += int(rest[words:].sum(dtype=np.uint64)) * (blocks + 2)
  return total % (1 << 64)


def _status_kib(field):
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return -1
'''


def plain_actor_class() -> Any:
  """The PlainActor class, defined in a module no worker can import.

  `prepare` returns the checksum `rdt_jax.bench._cases.host_checksum` gives
  for the array it builds.
  """
  namespace: dict[str, Any] = {"__name__": _MODULE}
  exec(compile(_SOURCE, f"<{_MODULE}>", "exec"), namespace)
  return namespace["PlainActor"]
