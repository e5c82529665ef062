"""The newest version of a named stream (`WeightPublisher(announce=True)`,
`rdt_jax.latest_handle`, `WeightSubscriber.pull_latest`): between real actors,
a generator that fell behind pulls the newest version with no handle routed
to it, never goes backwards, skips versions no longer kept, hears None
before anything is announced and after the publisher closed or its process
died; the board's rules alone (no Ray); the errors each call documents.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

import rdt_jax
from rdt_jax.weights import _latest
from rdt_jax.weights._handle import StaleWeightsError, WeightsHandle
from rdt_jax.weights._parts import ShardedPart

rdt_jax.register()

N = 1024


def values(version: int) -> np.ndarray:
  return (np.arange(N, dtype=np.float32) % 31) + version


@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self, name: str, keep: int = 2):
    self.pub = rdt_jax.WeightPublisher(keep=keep, name=name, announce=True)

  def publish(self, version: int) -> int:
    import jax.numpy as jnp

    self.pub.publish({"w": jnp.asarray(values(version))}, version=version)
    return version

  def close(self) -> None:
    self.pub.close()


@ray.remote(enable_tensor_transport=True)
class Generator:
  def __init__(self):
    self.sub = rdt_jax.WeightSubscriber({"w": np.zeros(N, np.float32)})

  def pull_latest(self, stream: str) -> tuple[int | None, int | None, bool]:
    """(version pulled or None, the subscriber's version, whether the template holds it)."""
    handle = self.sub.pull_latest(stream, timeout=60)
    held = self.sub.version
    ok = held is None or bool(np.array_equal(self.sub.template["w"], values(held)))
    return None if handle is None else handle.version, held, ok

  def latest_version(self, stream: str) -> int | None:
    handle = rdt_jax.latest_handle(stream)
    return None if handle is None else handle.version


def _wait_for(generator, stream: str, version: int | None) -> None:
  """Until the board answers `version` (announcements are not waited for)."""
  for _ in range(200):
    if ray.get(generator.latest_version.remote(stream)) == version:
      return
    time.sleep(0.05)
  raise AssertionError(f"the board never announced version {version} of {stream}")


def _a_new_publisher_is_found(generator, stream: str, version: int) -> None:
  """Once `stream`'s publisher is gone (the board answers None), a new one
  publishing `version` is found and pulled."""
  _wait_for(generator, stream, None)
  again = Trainer.remote(stream)
  try:
    ray.get(again.publish.remote(version))
    _wait_for(generator, stream, version)
    assert ray.get(generator.pull_latest.remote(stream)) == (version, version, True)
  finally:
    ray.kill(again)


@pytest.fixture(scope="module")
def cluster(ray_session):
  trainer, generator = Trainer.remote("policy"), Generator.remote()
  yield trainer, generator
  for actor in (trainer, generator):
    ray.kill(actor)


# ---- between actors


def test_a_dead_board_is_none_until_the_next_announcement(ray_session):
  """The board lives as long as the process that made it."""
  trainer, generator = Trainer.remote("dying"), Generator.remote()
  try:
    ray.get(trainer.publish.remote(1))
    _wait_for(generator, "dying", 1)
    ray.kill(trainer)
    _a_new_publisher_is_found(generator, "dying", 2)
  finally:
    ray.kill(generator)


def test_nothing_announced_is_none(cluster):
  _, generator = cluster
  assert ray.get(generator.pull_latest.remote("never-published")) == (None, None, True)


def test_a_generator_that_fell_behind_pulls_the_newest_version(cluster):
  trainer, generator = cluster
  ray.get(trainer.publish.remote(1))
  _wait_for(generator, "policy", 1)
  assert ray.get(generator.pull_latest.remote("policy")) == (1, 1, True)
  ray.get([trainer.publish.remote(v) for v in (2, 3, 4)])
  _wait_for(generator, "policy", 4)
  assert ray.get(generator.pull_latest.remote("policy")) == (4, 4, True)  # 2 and 3 skipped
  assert ray.get(generator.pull_latest.remote("policy")) == (None, 4, True)  # nothing newer
  handle = rdt_jax.latest_handle("policy")  # the driver asks too
  assert isinstance(handle, WeightsHandle) and (handle.stream, handle.version) == ("policy", 4)


def test_a_closed_stream_answers_none_and_a_new_publisher_is_found(ray_session):
  trainer, generator = Trainer.remote("closing"), Generator.remote()
  try:
    ray.get(trainer.publish.remote(5))
    _wait_for(generator, "closing", 5)
    ray.get(trainer.close.remote())
    _wait_for(generator, "closing", None)
    assert ray.get(generator.pull_latest.remote("closing")) == (None, None, True)
    _a_new_publisher_is_found(generator, "closing", 6)
  finally:
    ray.kill(trainer)
    ray.kill(generator)


# ---- the board's rules and pull_latest's retries, without Ray


def _handle(version: int, stream: str = "s", publisher: str = "p", shards: ShardedPart | None = None,
            parts: tuple = ()) -> WeightsHandle:
  return WeightsHandle(version, None, publisher, None, "digest", None, stream, shards, parts)


def test_the_board_never_goes_backwards():
  board = _latest._Board()
  board.announce(_handle(5))
  board.announce(_handle(3))
  board.announce(_handle(5, publisher="q"))
  assert board.latest("s").version == 5 and board.latest("s").publisher == "p"
  assert board.latest("other") is None


def test_the_board_combines_every_process_s_part_of_a_version(monkeypatch):
  combined: list[list[WeightsHandle]] = []

  def combine(parts):
    combined.append(list(parts))
    return _handle(parts[0].version, publisher="combined", parts=tuple(parts))

  monkeypatch.setattr(WeightsHandle, "combine", staticmethod(combine))
  board = _latest._Board()
  part = lambda v, p: _handle(v, publisher=f"p{p}", shards=ShardedPart(p, 2, "g"))  # noqa: E731
  board.announce(part(1, 0))
  board.announce(part(2, 1))
  assert board.latest("s") is None  # no version has both parts yet
  board.announce(part(2, 0))
  assert board.latest("s").version == 2 and len(combined) == 1
  board.announce(part(1, 1))  # older than the newest combined: dropped
  assert board.latest("s").version == 2 and len(combined) == 1 and board._parts["s"] == {}
  board.withdraw("s", "p1")  # a part's publisher closed: the combined handle goes
  assert board.latest("s") is None


def test_withdrawing_another_publisher_s_stream_changes_nothing():
  board = _latest._Board()
  board.announce(_handle(2))
  board.withdraw("s", "someone-else")
  assert board.latest("s").version == 2


class _FakeSubscriber(rdt_jax.WeightSubscriber):
  """pull_latest's retry rule, with the board's answers and pulls given."""

  def __init__(self, answers: list[WeightsHandle | None], stale: set[int]):
    super().__init__({"w": np.zeros(4, np.float32)})
    self.answers, self.stale, self.pulled = answers, stale, []

  def pull(self, handle, timeout=None):
    if handle.version in self.stale:
      raise StaleWeightsError(f"version {handle.version} is no longer kept")
    self.pulled.append(handle.version)
    self._reached = handle.version


def test_a_version_no_longer_kept_is_skipped_for_the_newer_one(monkeypatch):
  sub = _FakeSubscriber([_handle(3), _handle(5)], stale={3})
  monkeypatch.setattr(_latest, "latest_handle", lambda stream, timeout=None: sub.answers.pop(0))
  assert sub.pull_latest("s").version == 5 and sub.pulled == [5]


def test_three_stale_answers_in_a_row_raise(monkeypatch):
  sub = _FakeSubscriber([_handle(3), _handle(4), _handle(5)], stale={3, 4, 5})
  monkeypatch.setattr(_latest, "latest_handle", lambda stream, timeout=None: sub.answers.pop(0))
  with pytest.raises(StaleWeightsError, match="version 5"):
    sub.pull_latest("s")


def test_an_answer_not_newer_pulls_nothing(monkeypatch):
  sub = _FakeSubscriber([_handle(2)], stale=set())
  sub._reached = 2
  monkeypatch.setattr(_latest, "latest_handle", lambda stream, timeout=None: sub.answers.pop(0))
  assert sub.pull_latest("s") is None and sub.pulled == []


# ---- errors


def test_a_subscriber_without_a_template_is_sent_to_pull_named():
  with pytest.raises(ValueError, match=r"pull_named\(rdt_jax.latest_handle"):
    rdt_jax.WeightSubscriber(None).pull_latest("s")


def test_a_stream_that_is_not_a_str_is_refused():
  with pytest.raises(ValueError, match="stream=3"):
    rdt_jax.latest_handle(3)  # type: ignore[arg-type]


def test_announce_takes_a_bool_only():
  with pytest.raises(TypeError, match="announce='yes'"):
    rdt_jax.WeightPublisher(announce="yes")  # type: ignore[arg-type]
