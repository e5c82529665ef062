"""The actors of the multi-process weight tests (tests/test_weights_multihost.py,
and the two-host check in tests/_twohost_driver.py): a process of a
multi-controller JAX trainer, and generators of each kind.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time

import numpy as np
import ray

import rdt_jax

TWO = "--xla_force_host_platform_device_count=2"
THREE = "--xla_force_host_platform_device_count=3"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def sha(x) -> str:
  a = np.ascontiguousarray(np.asarray(x))
  return hashlib.sha256(a.view(np.uint8).tobytes()).hexdigest()[:16]


def leaf_sha(x) -> str:
  """The digest of a leaf's bytes, whatever its framework."""
  import torch

  if isinstance(x, torch.Tensor):
    t = x.detach().contiguous()
    return sha(t.view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy())
  return sha(np.asarray(x))


@ray.remote(enable_tensor_transport=True)
class Trainer:
  """One process of a multi-controller trainer."""

  def __init__(self, process: int, processes: int, coordinator: str, keep: int = 2, pack: bool = True):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process)
    self.pub = rdt_jax.WeightPublisher(keep=keep, pack=pack)
    self.params = None

  def pid(self) -> int:
    return os.getpid()

  def recreate(self, pack: bool) -> None:
    """A new publisher with another `pack` setting replaces this one: this
    process's part of the same structure travels the other way."""
    self.pub.close()
    self.pub = rdt_jax.WeightPublisher(keep=2, pack=pack)

  def devices(self) -> tuple[int, int]:
    import jax

    return jax.local_device_count(), jax.device_count()

  def step(self, version: int):
    """The version's parameters: global arrays made from the version number,
    then one jitted step over all processes' devices; published."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    rows = Mesh(devices, ("x",))
    grid = Mesh(devices.reshape(2, 2), ("dp", "tp"))
    shapes = {
        "w": ((8, 6), np.float32, NamedSharding(rows, P("x", None))),
        "b": ((6,), np.float32, NamedSharding(rows, P())),  # replicated on all four devices
        "emb": ((6, 8), jnp.bfloat16, NamedSharding(grid, P(None, "tp"))),  # replicated over dp
    }
    arrays = {}
    for name, (shape, dtype, sharding) in shapes.items():
      whole = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * 0.5 + version).astype(dtype)
      arrays[name] = jax.make_array_from_callback(shape, sharding, lambda index, w=whole: w[index])
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x * 2 + 1, p))
    self.params = {**step(arrays), "step": version}
    return self.pub.publish(self.params, version=version)

  def publish_key(self) -> str:
    """A publish of the tree with a typed PRNG key beside the global arrays: the error."""
    import jax

    try:
      self.pub.publish({**self.params, "rng": jax.random.key(0)}, version=10**6)
    except rdt_jax.UnsupportedLeafError as e:
      return str(e)
    return "published"

  def expected(self) -> dict:
    """Each leaf's global bytes (gathered from every process: a collective)."""
    from jax.experimental import multihost_utils

    out = {}
    for name in ("w", "b", "emb"):
      whole = np.asarray(multihost_utils.process_allgather(self.params[name], tiled=True))
      out[name] = whole
    return out


@ray.remote(enable_tensor_transport=True)
class Generator:
  def __init__(self, kind: str, atomic: bool = False, rank: int = 0):
    import jax
    import torch

    self.kind = kind
    if kind == "torch":
      template = {"w": torch.zeros(8, 6), "b": torch.zeros(6), "emb": torch.zeros((6, 8), dtype=torch.bfloat16),
                  "step": 0}
    elif kind == "jax":
      from jax.sharding import Mesh, NamedSharding
      from jax.sharding import PartitionSpec as P

      mesh = Mesh(np.array(jax.devices()[:3]), ("y",))
      template = {"w": NamedSharding(mesh, P(None, "y")), "b": NamedSharding(mesh, P("y")),
                  "emb": NamedSharding(mesh, P("y", None)), "step": 0}
    elif kind == "engine":  # its own names and layouts: w transposed, b under another name, emb not read
      template = {"dense.weight": torch.zeros(6, 8), "dense.bias": torch.zeros(6)}
    else:  # a tensor-parallel rank of two: its rows of w and emb, all of b
      template = {"w": rdt_jax.Slice[4 * rank:4 * rank + 4, :], "b": torch.zeros(6),
                  "emb": rdt_jax.Slice[3 * rank:3 * rank + 3], "step": 0}
    self.template = template
    source = {"dense.weight": rdt_jax.From("w", transpose=(1, 0)), "dense.bias": "b"} if kind == "engine" else None
    self.sub = rdt_jax.WeightSubscriber(template, atomic=atomic, source=source)

  def pull(self, handle, timeout: float | None = None) -> dict:
    t0 = time.monotonic()
    error = None
    try:
      params = self.sub.pull(handle, timeout=timeout)
    except Exception as e:
      error, params = " | ".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])]), None
    out = {"error": error, "version": self.sub.version, "elapsed": time.monotonic() - t0,
           "last": self.sub.last_pull}
    if params is not None and self.kind == "engine":
      out["shas"] = {k: leaf_sha(t) for k, t in params.items()}
    elif params is not None:
      out["shas"] = {k: leaf_sha(params[k]) for k in ("w", "b", "emb")}
      out["step"] = params["step"]
      out["in_place"] = self.kind != "torch" or all(params[k] is self.template[k] for k in ("w", "b", "emb"))
      if self.kind == "jax":
        out["devices"] = {k: len(params[k].sharding.device_set) for k in ("w", "b", "emb")}
    return out
