"""Bring your own transport: same-host shared memory on `rdt_jax.DlpackTransport`.

The base class describes any jax/torch/numpy leaf as raw buffers, plans the
receive buffers and rebuilds each leaf as its source type; a backend only
moves bytes. Here the producer copies an object's chunks into a memfd (shared
memory the kernel frees when the producer closes it or dies), consumers read
them through /proc straight into the planned buffers, and Ray's free closes it.
Host memory, one Linux host. `python examples/shm_transport.py` runs a demo.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import rdt_jax


def _memory(pointer: int, nbytes: int) -> ctypes.Array:
  """`nbytes` at `pointer`, as a writable buffer (no copy)."""
  return (ctypes.c_char * nbytes).from_address(pointer)


@dataclass
class ShmMetadata(rdt_jax.DlpackTransportMetadata):
  path: str = ""  # the producer's memfd, as other processes open it

  __eq__ = object.__eq__  # Ray compares metadata by identity
  __hash__ = object.__hash__


class ShmTransport(rdt_jax.DlpackTransport):
  """`shm_example`: one-sided copies through a shared-memory file."""

  name = "shm_example"
  devices = ("cpu",)
  metadata_class = ShmMetadata

  def __init__(self):
    super().__init__()
    self.files: dict[str, int] = {}  # obj_id -> memfd, until Ray frees it

  @staticmethod
  def is_one_sided() -> bool:
    return True  # consumers read on their own, ray.get included

  @staticmethod
  def can_abort_transport() -> bool:
    return False  # a copy finishes quickly; there is nothing to stop

  def export_buffers(self, obj_id, leaves, meta):
    fd = self.files[obj_id] = os.memfd_create(f"rdt-jax-{obj_id}")
    with open(fd, "wb", closefd=False) as f:
      for leaf in leaves:
        for pointer, chunk in zip(leaf.pointers, leaf.spec.chunks, strict=True):
          f.write(_memory(pointer, chunk.nbytes))
    meta.path = f"/proc/{os.getpid()}/fd/{fd}"

  def start_receive(self, obj_id, meta, communicator_metadata, destinations):
    with open(meta.path, "rb") as f:
      for d in destinations:
        if f.readinto(_memory(d.pointer, d.nbytes)) != d.nbytes:
          raise RuntimeError(f"{meta.path} ended early: was object {obj_id} freed?")

  def release(self, obj_id):
    if (fd := self.files.pop(obj_id, None)) is not None:
      os.close(fd)


def main() -> None:
  import jax.numpy as jnp
  import numpy as np
  import ray

  rdt_jax.register_transport(ShmTransport)  # before the actor classes below

  @ray.remote(enable_tensor_transport=True)
  class Producer:
    @ray.method(tensor_transport="shm_example")
    def params(self):
      return {"w": jnp.full((256, 256), 0.5), "b": np.arange(8.0), "step": 3}

  @ray.remote(enable_tensor_transport=True)
  class Consumer:
    def sums(self, params):
      return {k: (type(v).__name__, float(v.sum())) for k, v in params.items() if k != "step"}

  ray.init(include_dashboard=False, logging_level="warning")  # or $RAY_ADDRESS
  ref = Producer.remote().params.remote()
  got = ray.get(Consumer.remote().sums.remote(ref))
  assert got == {"w": ("ArrayImpl", 32768.0), "b": ("ndarray", 28.0)}, got
  print("consumer got:", got, "driver got:", {k: type(v).__name__ for k, v in ray.get(ref).items()})
  ray.shutdown()


if __name__ == "__main__":
  main()
