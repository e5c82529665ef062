"""The actor behind every benchmark path: it produces, consumes, and measures.

One class plays each role (producer, consumer, extra fan-out consumer, or a
getter standing in for the driver); the path chooses the transport per call
with `.options(tensor_transport=...)`, so the class needs no transport names
at definition time. Memory is measured with Linux's peak-RSS counter
(`VmHWM`), which writing "5" to `/proc/self/clear_refs` resets.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from rdt_jax.bench import _cases


def rss_now() -> int:
  """This process's resident set size in bytes."""
  return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
  """This process's peak resident set size since the last `reset_peak_rss`."""
  return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> int:
  """Resets the peak-RSS counter to the current RSS; returns the RSS.

  Returns -1 where the kernel does not support the reset (not Linux).
  """
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    return -1
  return rss_now()


def _status_kib(field: str) -> int:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return -1


def make_value(case: _cases.Case, framework: str, index: int) -> Any:
  """The `index`-th object of `case`, built as `framework` arrays on its device."""
  seed = index * 100_003
  if case.kind == "tree":
    leaves = {f"l{i:05d}": _cases.host_leaf(case.leaf_nbytes, seed + i) for i in range(case.leaves)}
    return {k: _to_framework(v, framework, case.device) for k, v in leaves.items()}
  return _to_framework(_cases.host_leaf(case.leaf_nbytes, seed), framework, case.device)


def _to_framework(x: np.ndarray, framework: str, device: str) -> Any:
  if framework == "numpy":
    return x
  if framework == "torch":
    import torch

    t = torch.from_numpy(x)
    return t.cuda() if device == "cuda" else t
  import jax

  platform = "gpu" if device == "cuda" else "cpu"
  return jax.block_until_ready(jax.device_put(x, jax.devices(platform)[0]))


class BenchActor:
  """Producer and consumer of benchmark values (wrapped by `ray.remote`)."""

  def __init__(self, preload: tuple[str, ...] = ()) -> None:
    """Registers rdt_jax's transports and imports the `preload` modules
    ("jax", "torch") now, so that actors starting together import them in
    parallel rather than inside the first measurement."""
    import importlib

    import rdt_jax

    rdt_jax.register()
    for name in preload:
      importlib.import_module(name)
    self._values: dict[str, list[Any]] = {}

  def info(self) -> dict[str, Any]:
    """pid, and which frameworks and devices this process can use."""
    import sys

    return {"pid": os.getpid(), "rdt_jax": "rdt_jax" in sys.modules}

  def ping(self) -> None:
    """Returns at once; a barrier for the driver."""

  def device_support(self, framework: str) -> str | None:
    """None if `framework` can make cuda arrays here, else why not."""
    try:
      if framework == "torch":
        import torch

        return None if torch.cuda.is_available() else "torch.cuda.is_available() is False"
      import jax

      jax.devices("gpu")
      return None
    except Exception as e:
      return f"{framework} has no cuda device here: {e}"

  # ---- producer

  def prepare(self, key: str, case: _cases.Case, framework: str) -> list[int]:
    """Builds and keeps the objects of `case`; returns their checksums."""
    values = [make_value(case, framework, i) for i in range(case.objects)]
    self._values[key] = values
    return [_cases.value_checksum(v) for v in values]

  def drop(self, key: str) -> None:
    """Forgets the objects `prepare` kept under `key`."""
    self._values.pop(key, None)

  def send(self, key: str, index: int = 0) -> Any:
    """Returns a kept object; the caller picks the transport with `.options`."""
    return self._values[key][index]

  def put_timed(self, key: str, transport: str) -> tuple[list[Any], float]:
    """`ray.put`s a kept object with a one-sided `transport`, timed here.

    Returns the ref (in a list, so Ray passes it on as a ref) and the seconds
    the put took in this process: the producer's share of a transfer.
    """
    import ray

    value = self._values[key][0]
    t0 = time.perf_counter()
    ref = ray.put(value, _tensor_transport=transport)
    return [ref], time.perf_counter() - t0

  def device_memcpy(self, key: str, copies: int) -> tuple[float, int]:
    """Copies every leaf of the cuda torch objects kept under `key`, `copies`
    times, into tensors allocated before the clock starts.

    Returns:
      the seconds the copies took (synchronized before and after), and the
      checksum of the copies (the sum of the objects' `value_checksum`s,
      modulo 2**64; computed after the clock stops).
    """
    import torch

    values = self._values[key]
    sources = [x for v in values for x in _cases.value_leaves(v)]
    targets = [torch.empty_like(x) for x in sources]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(copies):
      for s, d in zip(sources, targets):
        d.copy_(s)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    copies_by_value, start = [], 0
    for v in values:  # the copies regrouped as the objects they came from
      n = len(_cases.value_leaves(v))
      copies_by_value.append(dict(enumerate(targets[start:start + n])))
      start += n
    checksum = sum(_cases.value_checksum(c) for c in copies_by_value) % (1 << 64)
    return seconds, checksum

  # ---- consumer

  def consume(self, value: Any) -> tuple[int, float]:
    """Reads every byte of `value`: (checksum, seconds the reading took)."""
    t0 = time.perf_counter()
    checksum = _cases.value_checksum(value)
    return checksum, time.perf_counter() - t0

  def consume_as_jax(self, value: Any) -> tuple[int, float]:
    """Makes every NumPy leaf of `value` a `jax.Array` (`_cases.numpy_to_jax`),
    then reads every byte: (checksum, seconds both took)."""
    t0 = time.perf_counter()
    checksum = _cases.value_checksum(_cases.numpy_to_jax(value))
    return checksum, time.perf_counter() - t0

  def consume_nothing(self, value: Any) -> tuple[None, float]:
    """Takes `value` and reads none of it (`ray_rdt_floor`: no bytes arrive)."""
    return None, 0.0

  def get_timed(self, refs: list[Any]) -> tuple[int, float, float, float]:
    """Gets `refs[0]` here and reads it: (checksum, seconds the `ray.get`
    took, seconds the reading took, seconds jax's own share of them took:
    `_cases.jax_cost_s`, measured after). The get is the consumer's share."""
    import ray

    t0 = time.perf_counter()
    value = ray.get(refs[0])
    t1 = time.perf_counter()
    checksum = _cases.value_checksum(value)
    t2 = time.perf_counter()
    return checksum, t1 - t0, t2 - t1, _cases.jax_cost_s(value)

  def call_and_get(
      self, producer: Any, key: str, count: int, transport: str | None, batch: bool
  ) -> tuple[list[int], float]:
    """Plays the driver: calls `producer.send` `count` times, gets and reads the refs.

    The refs are created here, so this process owns them as the driver owns
    its own (Ray cannot lend an RDT ref whose metadata is not known yet).
    `batch` gets them in one `ray.get`, else one by one.

    Returns the checksums and the seconds spent reading.
    """
    import ray

    send = producer.send.options(tensor_transport=transport) if transport else producer.send
    refs = [send.remote(key, i) for i in range(count)]
    values = ray.get(refs) if batch else [ray.get(r) for r in refs]
    t0 = time.perf_counter()
    sums = [_cases.value_checksum(v) for v in values]
    return sums, time.perf_counter() - t0

  # ---- memory

  def reset_peak(self) -> int:
    """Resets the peak-RSS counter; returns the RSS it starts from (-1: unsupported)."""
    return reset_peak_rss()

  def peak(self) -> int:
    """Peak RSS in bytes since `reset_peak`."""
    return peak_rss()
