"""Ray metrics of rdt_jax: counted in each process, flushed to `ray.util.metrics`.

A transfer or a pull appends one tuple to a queue (a fraction of a
microsecond, measured by `scripts/metrics_cost.py`); a daemon thread started
at the first count adds them up and hands the sums to Ray's metric objects
every `RDT_JAX_METRICS_FLUSH_S` seconds, and once more at exit. Ray exports them from its metrics endpoint
(`ray start --metrics-export-port`, `ray.init(_metrics_export_port=)`; the
endpoint needs `ray[default]`) with the prefix `ray_` and, for counters, the
suffix `_total`: `ray_rdt_jax_transfer_bytes_total`. `RDT_JAX_METRICS=0` counts
nothing.

The metrics, each with its tags:

| metric | kind | tags | what |
| --- | --- | --- | --- |
| `rdt_jax_transfers` | counter | transport, outcome | fetches over an rdt_jax transport (`ok`, `failed`) |
| `rdt_jax_transfer_bytes` | counter | transport | bytes those fetches received |
| `rdt_jax_transfer_seconds` | counter | transport | their seconds, from Ray's call to the leaves built |
| `rdt_jax_weight_pulls` | counter | stream, route, outcome | weight pulls (`ok`, `stale`, `failed`) |
| `rdt_jax_weight_pull_bytes` | counter | stream, route | bytes of the successful pulls |
| `rdt_jax_weight_pull_seconds` | counter | stream, route | their seconds |
| `rdt_jax_weight_pull_lag` | gauge | stream | versions the last pull was behind the newest kept |
| `rdt_jax_weight_publishes` | counter | stream, kind | versions published (`packed`, `packed_device`, `pytree`) |
| `rdt_jax_weight_publish_bytes` | counter | stream, kind | their bytes |
| `rdt_jax_weight_publish_seconds` | counter | stream, kind | seconds their `publish` took |

Latencies are sums: a mean is `rate(..._seconds_total) / rate(..._total)` of
the matching count.
"""

from __future__ import annotations

import atexit
import collections
import threading
from typing import Any, Final

from rdt_jax import _limits, _settings

__all__ = ["METRICS", "count_publish", "count_pull", "count_transfer", "flush", "pending"]

#: name -> (kind, tag keys, description).
METRICS: Final[dict[str, tuple[str, tuple[str, ...], str]]] = {
    "rdt_jax_transfers": ("counter", ("transport", "outcome"), "Fetches of RDT objects over an rdt_jax transport."),
    "rdt_jax_transfer_bytes": ("counter", ("transport",), "Bytes received by rdt_jax fetches."),
    "rdt_jax_transfer_seconds": ("counter", ("transport",), "Seconds of rdt_jax fetches, summed."),
    "rdt_jax_weight_pulls": ("counter", ("stream", "route", "outcome"), "Weight pulls."),
    "rdt_jax_weight_pull_bytes": ("counter", ("stream", "route"), "Bytes of successful weight pulls."),
    "rdt_jax_weight_pull_seconds": ("counter", ("stream", "route"), "Seconds of successful weight pulls, summed."),
    "rdt_jax_weight_pull_lag": ("gauge", ("stream",), "Versions the last pull was behind the newest kept one."),
    "rdt_jax_weight_publishes": ("counter", ("stream", "kind"), "Weight versions published."),
    "rdt_jax_weight_publish_bytes": ("counter", ("stream", "kind"), "Bytes of weight versions published."),
    "rdt_jax_weight_publish_seconds": ("counter", ("stream", "kind"), "Seconds of publish calls, summed."),
}

_lock = threading.Lock()
_events: collections.deque[tuple[Any, ...]] = collections.deque()  # counted, not yet added up (thread-safe)
_counts: dict[tuple[str, tuple[str, ...]], float] = {}  # (metric, tag values) -> sum since the last flush
_gauges: dict[tuple[str, tuple[str, ...]], float] = {}  # (metric, tag values) -> last value
_state: dict[str, Any] = {"on": None, "thread": None, "objects": {}}


def _on() -> bool:
  on = _state["on"]
  if on is None:
    on = _state["on"] = bool(_settings.value("RDT_JAX_METRICS"))
    if on:
      _start()
  return bool(on)


def _append(event: tuple[Any, ...]) -> None:
  _events.append(event)
  if len(_events) > _limits.METRICS_EVENTS_QUEUED:  # the flushing thread fell behind: add up here
    _add_up()


def count_transfer(transport: str, nbytes: int, seconds: float, ok: bool) -> None:
  """One fetch over an rdt_jax transport ended (`ok`: its leaves were built)."""
  if _state["on"] is False or not _on():
    return
  _append(("transfer", transport, nbytes, seconds, ok))


def count_pull(stream: str, route: str, outcome: str, nbytes: int = 0, seconds: float = 0.0,
               lag: int | None = None) -> None:
  """One weight pull ended: `outcome` "ok" (with its bytes, seconds and
  lag), "stale" or "failed"."""
  if _state["on"] is False or not _on():
    return
  _append(("pull", stream, route, outcome, nbytes, seconds, lag))


def count_publish(stream: str, kind: str, nbytes: int, seconds: float) -> None:
  """One version published."""
  if _state["on"] is False or not _on():
    return
  _append(("publish", stream, kind, nbytes, seconds))


def _add_up() -> None:
  """Moves the events counted so far into the sums (the flushing thread's
  work, so that counting costs a caller one append)."""
  with _lock:
    while True:
      try:
        event = _events.popleft()
      except IndexError:
        return
      for key, amount in _amounts(event):
        if key[0] in _GAUGES:
          _gauges[key] = amount
        else:
          _counts[key] = _counts.get(key, 0.0) + amount


Amounts = list[tuple[tuple[str, tuple[str, ...]], float]]


def _amounts(event: tuple[Any, ...]) -> Amounts:
  """The (metric, tag values) sums one counted event adds to."""
  kind = event[0]
  if kind == "transfer":
    _, transport, nbytes, seconds, ok = event
    if not ok:
      return [(("rdt_jax_transfers", (transport, "failed")), 1.0)]
    return [(("rdt_jax_transfers", (transport, "ok")), 1.0), (("rdt_jax_transfer_bytes", (transport,)), nbytes),
            (("rdt_jax_transfer_seconds", (transport,)), seconds)]
  if kind == "pull":
    _, stream, route, outcome, nbytes, seconds, lag = event
    out: Amounts = [(("rdt_jax_weight_pulls", (stream, route, outcome)), 1.0)]
    if outcome == "ok":
      out += [(("rdt_jax_weight_pull_bytes", (stream, route)), nbytes),
              (("rdt_jax_weight_pull_seconds", (stream, route)), seconds)]
      if lag is not None:
        out.append((("rdt_jax_weight_pull_lag", (stream,)), lag))
    return out
  _, stream, what, nbytes, seconds = event
  return [(("rdt_jax_weight_publishes", (stream, what)), 1.0),
          (("rdt_jax_weight_publish_bytes", (stream, what)), nbytes),
          (("rdt_jax_weight_publish_seconds", (stream, what)), seconds)]


_GAUGES: Final = frozenset(name for name, (kind, _, _) in METRICS.items() if kind == "gauge")


def pending() -> dict[str, float]:
  """What this process counted since its last flush, by metric and tags
  (`name{tag=value,...}`), gauges' last values included."""
  _add_up()
  with _lock:
    items = list(_counts.items()) + list(_gauges.items())
  return {f"{name}{{{','.join(f'{k}={v}' for k, v in zip(METRICS[name][1], tags))}}}": float(amount)
          for (name, tags), amount in items}


def flush() -> bool:
  """Hands what was counted to Ray's metric objects now (the background
  thread does so every `RDT_JAX_METRICS_FLUSH_S`). Returns False, keeping
  the counts, where this process is not connected to Ray: a process that
  left a Ray session with counts not yet flushed flushes them into the next
  one it joins."""
  import ray

  _add_up()
  if not ray.is_initialized():
    return False
  with _lock:
    counts, gauges = dict(_counts), dict(_gauges)
    _counts.clear()
    _gauges.clear()
  for (name, tags), amount in counts.items():
    if amount:
      _metric(name).inc(float(amount), tags=dict(zip(METRICS[name][1], tags)))
  for (name, tags), amount in gauges.items():
    _metric(name).set(float(amount), tags=dict(zip(METRICS[name][1], tags)))
  return True


def _metric(name: str) -> Any:
  """Ray's metric object of `name`, made once per process."""
  objects = _state["objects"]
  found = objects.get(name)
  if found is None:
    from ray.util import metrics

    kind, keys, description = METRICS[name]
    make = metrics.Counter if kind == "counter" else metrics.Gauge
    found = objects[name] = make(name, description=description, tag_keys=keys)
  return found


def _start() -> None:
  """Starts the flushing thread (once per process, at the first count)."""
  with _lock:
    if _state["thread"] is not None:
      return
    every = float(_settings.value("RDT_JAX_METRICS_FLUSH_S"))
    stop = threading.Event()
    thread = threading.Thread(target=_loop, args=(every, stop), name="rdt-jax-metrics", daemon=True)
    _state["thread"] = thread
  thread.start()
  atexit.register(_at_exit, stop)


def _loop(every: float, stop: threading.Event) -> None:
  while not stop.wait(every):
    try:
      flush()
    except Exception:  # a metrics failure must never reach a transfer; the next flush tries again
      import logging

      logging.getLogger(__name__).debug("rdt_jax metrics flush failed", exc_info=True)


def _at_exit(stop: threading.Event) -> None:
  stop.set()
  try:
    flush()
  except Exception:
    pass
