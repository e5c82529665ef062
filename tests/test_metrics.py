"""rdt_jax's Ray metrics (`rdt_jax._metrics`) on Ray's own metrics endpoint.

A local Ray with a metrics export port (Ray's metrics agent comes with
`ray[default]`, in the test extra) and a short report interval; a trainer
publishes versions of a stream named "policy", a generator pulls them (one
pull refused as stale), and another actor fetches a plain jax_nixl return. The
Prometheus text Ray serves must show each count under its documented name.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import ray

import rdt_jax
from conftest import start_ray, worker_env

rdt_jax.register()

FLUSH = {"RDT_JAX_METRICS_FLUSH_S": "0.2"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def metrics_port() -> int:
  """A port free when the module's Ray starts (picked then, not at import:
  collecting the module must not hold one, and a port free at collection
  may be taken by the time the module runs)."""
  return _free_port()


@pytest.fixture(scope="module", autouse=True)
def ray_with_metrics(metrics_port):
  start_ray(env=FLUSH, num_cpus=4, _metrics_export_port=metrics_port,
            _system_config={"metrics_report_interval_ms": 500})
  yield
  ray.shutdown()


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self):
    self.pub = rdt_jax.WeightPublisher(keep=1, name="policy")

  def publish(self, version: int):
    import jax.numpy as jnp

    return self.pub.publish({"w": jnp.full((256, 16), version, jnp.float32)}, version=version)

  @ray.method(tensor_transport="jax_nixl")
  def plain(self):
    import jax.numpy as jnp

    return {"x": jnp.arange(1 << 16, dtype=jnp.float32)}


@ray.remote(enable_tensor_transport=True)
class Generator:
  def __init__(self):
    self.sub = rdt_jax.WeightSubscriber({"w": np.zeros((256, 16), np.float32)})

  def pull(self, handle) -> str:
    try:
      self.sub.pull(handle)
    except rdt_jax.StaleWeightsError:
      return "stale"
    return "ok"


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def fetch(self, trainer) -> tuple[float, str]:
    """Fetches a plain jax_nixl return; (its last value, this worker's id:
    the driver's own counts, from every earlier test in its process, carry
    another)."""
    x = ray.get(trainer.plain.remote())["x"]
    return float(x[-1]), ray.get_runtime_context().get_worker_id()


def _scrape(port: int) -> str:
  return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _value(text: str, name: str, **tags: str) -> float:
  """The sum of `name`'s samples whose tags include `tags`."""
  total = 0.0
  for line in text.splitlines():
    m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
    if m and all(f'{k}="{v}"' in m.group(1) for k, v in tags.items()):
      total += float(m.group(2))
  return total


def test_pulls_publishes_and_transfers_reach_rays_metrics_endpoint(metrics_port):
  t = Trainer.options(runtime_env=worker_env(**FLUSH)).remote()
  g = Generator.options(runtime_env=worker_env(**FLUSH)).remote()
  old = ray.get(t.publish.remote(1))
  assert old.stream == "policy"
  assert ray.get(g.pull.remote(old)) == "ok"
  assert ray.get(g.pull.remote(ray.get(t.publish.remote(2)))) == "ok"
  assert ray.get(g.pull.remote(old)) == "stale"
  last, worker = ray.get(Consumer.options(runtime_env=worker_env(**FLUSH)).remote().fetch.remote(t))
  assert last == (1 << 16) - 1
  want = {
      ("ray_rdt_jax_weight_pulls_total", (("stream", "policy"), ("route", "node_local"), ("outcome", "ok"))): 2.0,
      ("ray_rdt_jax_weight_pulls_total", (("stream", "policy"), ("outcome", "stale"))): 1.0,
      ("ray_rdt_jax_weight_pull_bytes_total", (("stream", "policy"),)): 2 * 256 * 16 * 4,
      ("ray_rdt_jax_weight_publishes_total", (("stream", "policy"), ("kind", "packed"))): 2.0,
      ("ray_rdt_jax_weight_publish_bytes_total", (("stream", "policy"),)): 2 * 256 * 16 * 4,
      ("ray_rdt_jax_transfers_total", (("transport", "jax_nixl"), ("outcome", "ok"), ("WorkerId", worker))): 1.0,
      ("ray_rdt_jax_transfer_bytes_total", (("transport", "jax_nixl"), ("WorkerId", worker))): 4 << 16,
  }
  deadline, got = time.monotonic() + 60, {}
  while time.monotonic() < deadline:
    text = _scrape(metrics_port)
    got = {key: _value(text, key[0], **dict(key[1])) for key in want}
    if got == want:
      break
    time.sleep(1)
  assert got == want, f"{got}\n--- scraped:\n" + "\n".join(x for x in text.splitlines() if "rdt_jax" in x)
  assert _value(text, "ray_rdt_jax_weight_pull_seconds_total", stream="policy") > 0
  assert _value(text, "ray_rdt_jax_transfer_seconds_total", transport="jax_nixl") > 0
  assert "ray_rdt_jax_weight_pull_lag" in text
  for a in (t, g):
    ray.kill(a)


def test_a_stream_name_is_checked():
  @ray.remote(enable_tensor_transport=True)
  class Bad:
    def make(self, name) -> str:
      try:
        rdt_jax.WeightPublisher(name=name)
      except ValueError as e:
        return str(e)
      return "made"

  b = Bad.remote()
  assert "1 to 64 letters" in ray.get(b.make.remote("a b"))
  assert "1 to 64 letters" in ray.get(b.make.remote("x" * 65))
  assert ray.get(b.make.remote("lora-v2.0_a")) == "made"
  ray.kill(b)


def test_metrics_off_counts_nothing():
  code = (
      "from rdt_jax import _metrics\n"
      "_metrics.count_pull('s', 'node_local', 'ok', 1, 0.1, 0)\n"
      "_metrics.count_transfer('jax_nixl', 1, 0.1, True)\n"
      "print(_metrics.pending(), _metrics._state['thread'])\n"
  )
  off = subprocess.run([sys.executable, "-c", code], env={**_env(), "RDT_JAX_METRICS": "0"}, capture_output=True,
                       text=True, check=True)
  assert off.stdout.strip() == "{} None", off.stdout
  on = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
  assert "rdt_jax_weight_pulls{stream=s,route=node_local,outcome=ok}': 1.0" in on.stdout, on.stdout


def test_a_flush_outside_ray_keeps_the_counts():
  code = (
      "from rdt_jax import _metrics\n"
      "_metrics.count_publish('s', 'packed', 8, 0.1)\n"
      "assert _metrics.flush() is False\n"
      "print(_metrics.pending())\n"
  )
  out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
  assert "rdt_jax_weight_publishes{stream=s,kind=packed}': 1.0" in out.stdout, out.stdout


def _env() -> dict[str, str]:
  import os

  return {k: v for k, v in os.environ.items() if not k.startswith("RDT_JAX_")}
