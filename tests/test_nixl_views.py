"""A consumer's view of a producer's NIXL agent (`nixl.views.RemoteViews`):
when it is extended, rebuilt, or refused.

The agent here records the calls the views make; what NIXL itself does with
device memory registered again at a known address (it refuses the metadata,
then the producer for good) only happens with CUDA memory, and
tests/gpu/test_gpu_backends.py exercises it on a GPU host.
"""

from __future__ import annotations

import pytest

from rdt_jax.transports.nixl import views as views_module
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata
from rdt_jax.transports.nixl.views import DeviceViewBusy, RemoteViews


class _RecordingAgent:
  def __init__(self) -> None:
    self.calls: list[tuple[str, object]] = []

  def add_remote_agent(self, metadata: bytes) -> None:
    self.calls.append(("add", metadata))

  def remove_remote_agent(self, name: str) -> None:
    self.calls.append(("remove", name))


def _meta(version: int, dereg: int = 0, device: int = 0) -> NixlTransportMetadata:
  return NixlTransportMetadata(
      tensor_meta=[], agent_name="producer", agent_meta=f"v{version}".encode(), agent_version=version,
      dereg_epoch=dereg, device_dereg_epoch=device,
  )


@pytest.fixture
def views(monkeypatch):
  monkeypatch.setattr(views_module, "view_rebuild_interval_s", lambda: 3600.0)
  agent = _RecordingAgent()
  return RemoteViews(lambda: agent, lambda: None), agent


def _read(views: RemoteViews, meta: NixlTransportMetadata) -> None:
  views.close_read(views.open_read(meta))


def test_freed_device_memory_rebuilds_the_view_at_the_next_read(views):
  views, agent = views
  _read(views, _meta(1))
  _read(views, _meta(2))  # new regions: the view is extended
  _read(views, _meta(3, dereg=1))  # host memory freed: extended (rebuilt at most once an hour here)
  _read(views, _meta(4, dereg=2, device=1))  # device memory freed: rebuilt now
  _read(views, _meta(4, dereg=2, device=1))  # nothing new
  assert agent.calls == [
      ("add", b"v1"), ("add", b"v2"), ("add", b"v3"), ("remove", "producer"), ("add", b"v4"),
  ]
  assert views.rebuilds == 1  # counters()["view_rebuilds"]


def test_a_view_with_reads_in_flight_is_not_extended_after_device_memory_was_freed(views):
  views, agent = views
  held = views.open_read(_meta(1))
  with pytest.raises(DeviceViewBusy, match=r"producer deregistered device memory .* 1 READ\(s\) from it"):
    views.open_read(_meta(2, device=1))
  assert agent.calls == [("add", b"v1")]  # nothing loaded over the old view
  assert views.inflight("producer") == 1
  views.close_read(held)
  _read(views, _meta(2, device=1))  # none in flight: rebuilt
  assert agent.calls[1:] == [("remove", "producer"), ("add", b"v2")]
  assert views.inflight() == 0


def test_a_view_loaded_for_host_memory_is_rebuilt_once_before_its_first_device_read(views):
  """UCX sets a connection's lanes up when the view is loaded; loaded with
  no CUDA context, the connection reads device memory by emulation."""
  views, agent = views
  _read(views, _meta(1))  # host memory: no CUDA context needed, maybe none yet
  views.close_read(views.open_read(_meta(1), device=True))  # rebuilt, in this device READ's thread
  views.close_read(views.open_read(_meta(1), device=True))
  _read(views, _meta(1))
  assert agent.calls == [("add", b"v1"), ("remove", "producer"), ("add", b"v1")]
  assert views.rebuilds == 1


def test_a_view_loaded_for_a_device_read_is_kept_for_host_reads(views):
  views, agent = views
  views.close_read(views.open_read(_meta(1), device=True))
  _read(views, _meta(1))
  views.close_read(views.open_read(_meta(1), device=True))
  assert agent.calls == [("add", b"v1")] and views.rebuilds == 0


def test_the_rebuild_for_device_memory_waits_for_reads_in_flight(views):
  views, agent = views
  held = views.open_read(_meta(1))
  views.close_read(views.open_read(_meta(1), device=True))  # goes ahead on the old view
  assert agent.calls == [("add", b"v1")]
  views.close_read(held)
  views.close_read(views.open_read(_meta(1), device=True))  # none in flight: rebuilt now
  assert agent.calls == [("add", b"v1"), ("remove", "producer"), ("add", b"v1")]
