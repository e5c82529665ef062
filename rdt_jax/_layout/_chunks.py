"""One object's chunks in one buffer: where each lies, and typed views of them.

A receive packs every chunk of an object into one host buffer
(`host_layout`, chunks on the 64-byte boundary jax aliases) or one device
region per device (`pack_layout`, on cudaMalloc's 256-byte boundary), so a
backend registers and reads one buffer per object instead of one per leaf.
The memory itself comes from `rdt_jax._memory`'s pools.
"""

from __future__ import annotations

import numpy as np

from rdt_jax import _limits
from rdt_jax._dlpack._bytes import host_bytes
from rdt_jax._dlpack._specs import ChunkSpec, DescribedLeaf, LeafSpec
from rdt_jax._memory._host import aligned


def host_layout(specs: list[LeafSpec]) -> tuple[list[list[int]], int]:
  """Packs every chunk of `specs` into one host buffer.

  Returns:
    per leaf, the byte offset of each chunk; and the total buffer size. Every
    chunk starts on an `_limits.HOST_ALIGNMENT` boundary so jax can alias it.
  """
  offsets: list[list[int]] = []
  total = 0
  for spec in specs:
    leaf_offsets = []
    for chunk in spec.chunks:
      leaf_offsets.append(total)
      total += aligned(chunk.nbytes)
    offsets.append(leaf_offsets)
  return offsets, total


def host_chunk(buffer: np.ndarray, offset: int, dtype: np.dtype, chunk: ChunkSpec) -> np.ndarray:
  """A zero-copy typed view of one chunk inside a host receive buffer."""
  return buffer[offset : offset + chunk.nbytes].view(dtype).reshape(chunk.shape)


def pack_host_chunks(leaves: list[DescribedLeaf]) -> bytes:
  """Every byte of host `leaves`, chunk after chunk in leaf order, as one
  `bytes` object (one copy): what a transport sends in band."""
  return b"".join([
      host_bytes(pointer, chunk.nbytes).data
      for leaf in leaves
      for pointer, chunk in zip(leaf.pointers, leaf.spec.chunks)
      if chunk.nbytes
  ])


def copy_packed_into(buffer: np.ndarray, addresses: list[int], starts: list[int], sizes: list[int]) -> None:
  """Copies packed host leaves into `buffer`: `sizes[i]` bytes from
  `addresses[i]` to offset `starts[i]` (as `host_layout` lays them out); the
  leaves' buffers hold their final values.

  Raises:
    ValueError: if a leaf would land outside `buffer` (nothing is copied).
  """
  import ctypes

  if len(addresses) != len(starts) or len(starts) != len(sizes):
    raise ValueError(f"{len(addresses)} addresses for {len(starts)} packed leaves")
  if starts and starts[-1] + sizes[-1] > buffer.nbytes:
    raise ValueError(f"packed leaves end at byte {starts[-1] + sizes[-1]} of a buffer of {buffer.nbytes}")
  base = int(buffer.__array_interface__["data"][0])
  move = ctypes.memmove
  for address, start, nbytes in zip(addresses, starts, sizes):
    if nbytes:
      move(base + start, address, nbytes)


def pack_layout(specs: list[LeafSpec], alignment: int = _limits.DEVICE_ALIGNMENT) -> tuple[list[list[int]], int]:
  """Packs every chunk of `specs` into one region.

  Returns:
    per leaf, the byte offset of each chunk; and the region's size (at least
    1, so an object of empty leaves still has an address). Every chunk
    starts on an `alignment` boundary.
  """
  offsets: list[list[int]] = []
  total = 0
  for spec in specs:
    leaf_offsets = []
    for chunk in spec.chunks:
      leaf_offsets.append(total)
      total += -(-chunk.nbytes // alignment) * alignment
    offsets.append(leaf_offsets)
  return offsets, max(total, 1)
