"""Asyncio and rdt_jax refs: `get_async`, the awaitable that fetches them.

Ray runs the deserialization of an awaited ref (`await ref`,
`asyncio.wrap_future(ref.future())`) in a callback on its core worker's io
thread. For an rdt_jax object that callback would have to move the bytes,
and it cannot: that thread also delivers the object's transport metadata to
its owner (which arrives after the object itself is ready) and every reply
to this process, so a fetch there waits for itself, and Ray's own wait ends
in a callback error that leaves the awaiting coroutine waiting forever. The
seam (`rdt_jax._ray.aio`) makes that callback return `AwaitNotSupportedError`
(`rdt_jax._aio_errors`) instead, which Ray's future raises at once;
`get_async` is the awaitable that works, in the driver and in async actors.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rdt_jax import _ray

__all__ = ["get_async"]


def _get(refs: Any, timeout: float | None) -> Any:
  import ray

  with _ray.aio.quiet_blocking_get_warning():
    return ray.get(refs, timeout=timeout)


async def get_async(refs: Any, *, timeout: float | None = None) -> Any:
  """Awaitable `ray.get`: fetches one ref or a list of refs without blocking the event loop.

  Use it where ``await ref`` would be written: ``await ref`` of an rdt_jax
  ref raises `AwaitNotSupportedError` (Ray cannot run a transfer where it
  runs an awaited ref's deserialization). Works in the driver and in async
  actors, for refs of any transport and for ordinary refs.

  It runs ``ray.get(refs, timeout=timeout)`` in a worker thread of the
  running event loop (`asyncio.to_thread`), so it returns what `ray.get`
  returns and raises what `ray.get` raises (`GetTimeoutError` after
  `timeout` seconds, the producer's error, `ActorDiedError`, ...), honours
  receive targets (`rdt_jax.set_target_for_ref`, Ray's `set_target_for_ref`)
  and `receive_as`, and overlaps the transfers of a list of refs as one
  `ray.get` does. Cancelling the awaiting task does not stop the `ray.get`
  already running; its result is dropped.

  Args:
    refs: an `ObjectRef` or a list of them, as for `ray.get`.
    timeout: seconds to wait at most, as for `ray.get` (None: no limit).

  Returns:
    The value, or the list of values, that `ray.get(refs)` returns.
  """
  return await asyncio.to_thread(_get, refs, timeout)
