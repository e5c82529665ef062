"""Sharded `jax.Array`s: describe their distinct shards, rebuild their layout."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rdt_jax._dlpack import _jax
from rdt_jax._dlpack._devices import PLATFORM_KIND, Device, jax_device, jax_platform, parse_device
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._specs import ChunkSpec, DescribedLeaf, LeafSpec, ShardingLayout


def describe_sharded(x: Any, path: str, dtype: np.dtype) -> DescribedLeaf:
  """A `NamedSharding`-sharded array as one chunk per distinct shard.

  Raises:
    UnsupportedLeafError: for any other kind of sharding.
  """
  import jax

  sharding = x.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise UnsupportedLeafError(
        path,
        f"is sharded with {type(sharding).__name__}; rdt_jax rebuilds "
        "NamedSharding layouts only",
        "Reshard it with jax.device_put(x, NamedSharding(mesh, spec)).",
    )
  mesh = sharding.mesh
  by_device = {s.device: s for s in x.addressable_shards}
  chunk_of_index: dict[tuple, int] = {}
  chunks: list[ChunkSpec] = []
  pointers: list[int] = []
  device_indices: list[int] = []
  arrays: list[Any] = []
  device_chunks: list[int] = []
  for d in mesh.devices.flat:
    shard = by_device[d]
    key = tuple((s.start, s.stop, s.step) for s in shard.index)
    if key not in chunk_of_index:  # replicated shards cross the wire once
      chunk_of_index[key] = len(chunks)
      data = shard.data
      shape = tuple(int(n) for n in data.shape)
      chunks.append(ChunkSpec(shape, math.prod(shape) * dtype.itemsize))
      pointers.append(_jax.pointer(data))
      arrays.append(data)
      device_indices.append(parse_device(d).index)
    device_chunks.append(chunk_of_index[key])
  layout = ShardingLayout(
      mesh_shape=tuple(int(n) for n in mesh.devices.shape),
      axis_names=tuple(mesh.axis_names),
      spec=tuple(sharding.spec),
      device_chunks=tuple(device_chunks),
  )
  spec = LeafSpec(
      path=path,
      shape=tuple(int(n) for n in x.shape),
      dtype=dtype,
      framework="jax",
      device=PLATFORM_KIND[mesh.devices.flat[0].platform],
      chunks=tuple(chunks),
      sharding=layout,
  )
  return DescribedLeaf(spec, tuple(pointers), tuple(device_indices), tuple(arrays))


def chunk_indices(spec: LeafSpec) -> list[tuple[slice, ...]]:
  """The global index each chunk of a sharded leaf covers."""
  from jax.sharding import PartitionSpec

  layout = spec.sharding
  assert layout is not None
  mesh_axes = dict(zip(layout.axis_names, layout.mesh_shape))
  seen: dict[int, tuple[slice, ...]] = {}
  for flat, chunk_id in enumerate(layout.device_chunks):
    if chunk_id in seen:
      continue
    coords = dict(zip(layout.axis_names, np.unravel_index(flat, layout.mesh_shape)))
    index = []
    for dim, entry in enumerate(PartitionSpec(*layout.spec)):
      size = spec.shape[dim]
      names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      parts, pos = 1, 0
      for name in names:
        pos = pos * mesh_axes[name] + int(coords[name])
        parts *= mesh_axes[name]
      step = size // parts
      index.append(slice(pos * step, (pos + 1) * step))
    index += [slice(None)] * (len(spec.shape) - len(index))
    seen[chunk_id] = tuple(index)
  return [seen[i] for i in range(len(spec.chunks))]


def assemble_host(chunk_views: list[np.ndarray], spec: LeafSpec) -> np.ndarray:
  """Gathers a sharded leaf's chunks into one host array (one copy)."""
  out = np.empty(spec.shape, spec.dtype)
  for index, view in zip(chunk_indices(spec), chunk_views):
    out[index] = view
  return out


def mesh_sharding(spec: LeafSpec, platform: str, fix: str) -> Any:
  """The producer's mesh shape, axis names and partition spec, rebuilt on this
  process's first devices of `platform` ("cpu" or "gpu").

  Raises:
    UnsupportedLeafError: if there are fewer such devices than the mesh has,
      naming both counts; `fix` says what to do.
  """
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  layout = spec.sharding
  assert layout is not None
  available = jax.local_devices(backend=platform)
  if len(available) < layout.num_devices:
    raise UnsupportedLeafError(
        spec.path,
        f"is sharded over {layout.num_devices} devices (mesh "
        f"{dict(zip(layout.axis_names, layout.mesh_shape))}) but this process "
        f"has only {len(available)} {platform} device(s)",
        fix,
    )
  devices = np.array(available[: layout.num_devices], dtype=object).reshape(layout.mesh_shape)
  return NamedSharding(Mesh(devices, layout.axis_names), PartitionSpec(*layout.spec))


def rebuild_sharded(chunk_views: list[np.ndarray], spec: LeafSpec) -> Any:
  """Rebuilds a sharded jax.Array from host chunks with the producer's mesh
  shape, axis names and partition spec, on this process's first cpu devices."""
  import jax

  layout = spec.sharding
  assert layout is not None
  sharding = mesh_sharding(
      spec,
      "cpu",
      "Give the consumer at least as many devices (e.g. XLA_FLAGS="
      f"--xla_force_host_platform_device_count={layout.num_devices} in "
      "its runtime_env), or receive it as numpy (rdt_jax.receive_as('numpy')), "
      "which assembles the global array.",
  )
  arrays = [
      _jax.from_host(chunk_views[chunk_id], spec.path, device)
      for device, chunk_id in zip(sharding.mesh.devices.flat, layout.device_chunks)
  ]
  return jax.make_array_from_single_device_arrays(spec.shape, sharding, arrays)


def receive_sharding(spec: LeafSpec, device: Device) -> Any:
  """The `jax.sharding.Sharding` a leaf gets when a backend receives it as a
  whole `jax.Array` (as `jax_transfer` pulls it).

  A sharded leaf gets the producer's mesh shape, axis names and partition spec
  on this process's first devices of `device`'s platform; any other leaf
  lives on `device`.

  Raises:
    UnsupportedLeafError: if this process has fewer devices than the
      producer's mesh, naming both counts, or no jax backend for `device`.
  """
  import jax

  if spec.sharding is None:
    return jax.sharding.SingleDeviceSharding(jax_device(device))
  n = spec.sharding.num_devices
  fix = (
      "A whole-array backend moves each shard to its own device: give the "
      "consumer at least as many devices (e.g. XLA_FLAGS="
      f"--xla_force_host_platform_device_count={n} on cpu), or send it with "
      "jax_nixl, which can assemble it for a numpy receiver."
  )
  return mesh_sharding(spec, jax_platform(device.kind), fix)
