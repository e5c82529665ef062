"""The consumer's side of one pull: what it pulls, its handle, and the leaves.

* `plan`: each leaf is pulled onto the device the receive plan chose, with
  the producer's mesh shape, axis names and partition spec for a sharded
  leaf (`_dlpack.receive_sharding`), or onto a single-device jax target; the
  base converts it to the leaf's arriving type afterwards (numpy/torch leaves
  arrive as their source type again). A resharded leaf (a target sharding or
  an `rdt_jax.Slice`) is pulled as its distinct target pieces, each a
  single-device array the producer cuts for it (the offer's `cuts`). Empty
  leaves hold no bytes, are not offered, and are made here.
* `Pull`: a pull in progress, the handle `start_pull` returns.
* `requests`: the threads offer requests run in. Ray starts every fetch of a
  `ray.get` before it waits for any, so the request runs beside the wait,
  and the wait bounds it with the caller's timeout.
* `assemble`: the leaves, from the pulled arrays; a replicated target
  shard crossed once and is copied here.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from rdt_jax import _dlpack, _limits
from rdt_jax.transports._destinations import Placement
from rdt_jax.transports.transfer import boxes


@dataclass
class Pull:
  """A pull in progress: the pulled arrays, how to make the leaves, the
  offer connection it holds until the pull ends, and the request that
  makes the offer and starts the pull (`TransferTransport._begin`, in a
  thread; `stop` ends it, and once set no connection is kept)."""

  pulled: list[Any]
  recipes: list[tuple[Any, ...]]
  sock: socket.socket | None = None
  address: tuple[str, int] = ("", 0)
  uuid: int = 0
  done: bool = field(default=False)
  request: concurrent.futures.Future[None] | None = None
  stop: threading.Event = field(default_factory=threading.Event)
  lock: threading.Lock = field(default_factory=threading.Lock)


_request_pool: list[concurrent.futures.ThreadPoolExecutor] = []
_request_pool_lock = threading.Lock()


def requests() -> concurrent.futures.ThreadPoolExecutor:
  """The threads offer requests run in (created at the first pull)."""
  with _request_pool_lock:
    if not _request_pool:
      _request_pool.append(
          concurrent.futures.ThreadPoolExecutor(_limits.TRANSFER_REQUEST_THREADS, thread_name_prefix="rdt-jax-offer")
      )
    return _request_pool[0]


def plan(
    leaves: list[_dlpack.LeafSpec], placements: list[Placement]
) -> tuple[list[Any], list[Any], list[tuple[Any, ...]]]:
  """What to pull for `leaves` onto their `placements`: `(structs, cuts,
  recipes)`, the `jax.ShapeDtypeStruct`s pulled (in offer order), per offered
  (non-empty) leaf None or the boxes the producer cuts from it, and per leaf
  how `assemble` makes it from the pulled arrays."""
  import jax

  structs: list[Any] = []  # what is pulled, in offer order
  cuts: list[Any] = []  # per offered (non-empty) leaf: None or its boxes
  recipes: list[tuple[Any, ...]] = []  # per leaf: how to make it from `structs`
  for spec, p in zip(leaves, placements):
    if p.layout is None:
      sharding = p.template.sharding if p.template is not None else _dlpack.receive_sharding(spec, p.device)
      struct = jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)
      if spec.nbytes:
        cuts.append(None)
        recipes.append(("whole", len(structs)))
        structs.append(struct)
      else:  # empty leaves hold no bytes (and are not offered): made here
        recipes.append(("empty", struct))
      continue
    # Resharded: each distinct target piece is cut on the producer and
    # pulled as a single-device array onto the first device that holds it
    # (jax's transfer server pairs shards by position, so pulling the whole
    # array with another sharding would move the wrong bytes).
    layout = p.layout
    devices = [
        layout.devices[layout.device_pieces.index(i)] if layout.sharding is not None
        else _dlpack.jax_device(p.device)
        for i in range(len(layout.pieces))
    ]
    indices: list[Any] = []
    for box, device in zip(layout.pieces, devices):
      struct = jax.ShapeDtypeStruct(
          _dlpack.box_shape(box), spec.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
      )
      if boxes.volume(box):
        indices.append(len(structs))
        structs.append(struct)
      else:
        indices.append(struct)
    if spec.nbytes:
      cuts.append(list(layout.pieces))
    recipes.append(("pieces", indices, layout, devices))
  return structs, cuts, recipes


def assemble(pulled: list[Any], recipes: list[tuple[Any, ...]]) -> list[Any]:
  """One array per leaf, made by `recipes` (`plan`) from the `pulled` arrays."""
  import jax
  import jax.numpy as jnp

  def empty(struct: Any) -> Any:
    with jax.enable_x64(True):
      return jnp.zeros(struct.shape, struct.dtype, device=struct.sharding)

  out = []
  for recipe in recipes:
    if recipe[0] == "whole":
      out.append(pulled[recipe[1]])
    elif recipe[0] == "empty":
      out.append(empty(recipe[1]))
    else:
      _, indices, layout, devices = recipe
      pieces = [pulled[i] if isinstance(i, int) else empty(i) for i in indices]
      if layout.sharding is None:
        out.append(pieces[0])
        continue
      # Replicated target shards: the piece crossed once; copies are local.
      shards = [
          pieces[i] if devices[i] == d else jax.device_put(pieces[i], d)
          for d, i in zip(layout.devices, layout.device_pieces)
      ]
      out.append(jax.make_array_from_single_device_arrays(layout.shape, layout.sharding, shards))
  return out
