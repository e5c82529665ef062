"""The DLPack layer: describe, allocate, rebuild and convert any framework's arrays.

Data flows one way through rdt_jax::

  producer leaf -> describe() -> LeafSpec + raw buffers -> (a backend moves bytes)
  -> receive buffers (host_pool / allocate_device_buffer) -> rebuild_*() -> consumer leaf

This subpackage imports no Ray (its tests run where Ray cannot be imported)
and imports no framework eagerly. Modules:

* `_dispatch`: the one dispatch point on array types (`framework_of`); every
  other module of rdt_jax asks it for pointers, devices, dtypes, conversions;
* `_numpy`, `_jax`, `_torch`: one module per framework (describe, export,
  rebuild, convert); `_sharding`: sharded `jax.Array` layouts;
* `_dtypes`, `_devices`, `_memory`: dtypes, the one device parser, host
  pool / layout / byte views; `_pool`: the device region pool (packed,
  registered once, never reused while a transfer may write it);
* `_cuda`: every CUDA-specific step (stream ordering), no-ops on host memory;
  `_cupy`: cupy arrays (described and converted; not a receive type);
* `_specs`, `_errors`: the framework-neutral leaf descriptions and the error.

`README.md` beside this file has the design rules.
"""

from rdt_jax._dlpack._cuda import copy_bytes as copy_bytes
from rdt_jax._dlpack._cuda import copy_from_host as copy_from_host
from rdt_jax._dlpack._cuda import cuda_available as cuda_available
from rdt_jax._dlpack._cuda import wait_for_copies as wait_for_copies
from rdt_jax._dlpack._cuda import wait_for_producers as wait_for_producers
from rdt_jax._dlpack._cuda import wait_received as wait_received
from rdt_jax._dlpack._devices import Device as Device
from rdt_jax._dlpack._devices import check_device as check_device
from rdt_jax._dlpack._devices import jax_device as jax_device
from rdt_jax._dlpack._devices import parse_device as parse_device
from rdt_jax._dlpack._dispatch import block_until_ready as block_until_ready
from rdt_jax._dlpack._dispatch import buffer_pointer as buffer_pointer
from rdt_jax._dlpack._dispatch import check_x64 as check_x64
from rdt_jax._dlpack._dispatch import convert_leaf as convert_leaf
from rdt_jax._dlpack._dispatch import copy_into as copy_into
from rdt_jax._dlpack._dispatch import describe as describe
from rdt_jax._dlpack._dispatch import device_of as device_of
from rdt_jax._dlpack._dispatch import dtype_of as dtype_of
from rdt_jax._dlpack._dispatch import framework_of as framework_of
from rdt_jax._dlpack._dispatch import hold_buffer as hold_buffer
from rdt_jax._dlpack._dispatch import host_to_jax_many as host_to_jax_many
from rdt_jax._dlpack._dispatch import is_array as is_array
from rdt_jax._dlpack._dispatch import is_c_contiguous as is_c_contiguous
from rdt_jax._dlpack._dispatch import is_writable as is_writable
from rdt_jax._dlpack._dispatch import rebuild_device as rebuild_device
from rdt_jax._dlpack._dispatch import rebuild_host as rebuild_host
from rdt_jax._dlpack._dispatch import rebuild_view as rebuild_view
from rdt_jax._dlpack._dispatch import to_jax_exact as to_jax_exact
from rdt_jax._dlpack._dtypes import SUB_BYTE_DTYPE_NAMES as SUB_BYTE_DTYPE_NAMES
from rdt_jax._dlpack._dtypes import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from rdt_jax._dlpack._dtypes import np_dtype_from_name as np_dtype_from_name
from rdt_jax._dlpack._errors import UnsupportedLeafError as UnsupportedLeafError
from rdt_jax._dlpack._gc import GC_PAUSE_MIN_LEAVES as GC_PAUSE_MIN_LEAVES
from rdt_jax._dlpack._gc import gc_paused as gc_paused
from rdt_jax._dlpack._lazy import importable as importable
from rdt_jax._dlpack._memory import ALIGNMENT as ALIGNMENT
from rdt_jax._dlpack._memory import HostBufferPool as HostBufferPool
from rdt_jax._dlpack._memory import aligned as aligned
from rdt_jax._dlpack._memory import aligned_host_buffer as aligned_host_buffer
from rdt_jax._dlpack._memory import host_bytes as host_bytes
from rdt_jax._dlpack._memory import host_chunk as host_chunk
from rdt_jax._dlpack._memory import host_layout as host_layout
from rdt_jax._dlpack._memory import host_pointer as host_pointer
from rdt_jax._dlpack._memory import host_pool as host_pool
from rdt_jax._dlpack._memory import pack_host_chunks as pack_host_chunks
from rdt_jax._dlpack._pool import DEVICE_ALIGNMENT as DEVICE_ALIGNMENT
from rdt_jax._dlpack._pool import Region as Region
from rdt_jax._dlpack._pool import RegionPool as RegionPool
from rdt_jax._dlpack._pool import device_pool as device_pool
from rdt_jax._dlpack._pool import pack_layout as pack_layout
from rdt_jax._dlpack._pool import region_source as region_source
from rdt_jax._dlpack._sharding import Box as Box
from rdt_jax._dlpack._sharding import Slice as Slice
from rdt_jax._dlpack._sharding import TargetLayout as TargetLayout
from rdt_jax._dlpack._sharding import box_shape as box_shape
from rdt_jax._dlpack._sharding import build_sharded as build_sharded
from rdt_jax._dlpack._sharding import copy_runs as copy_runs
from rdt_jax._dlpack._sharding import cut as cut
from rdt_jax._dlpack._sharding import full_box as full_box
from rdt_jax._dlpack._sharding import intersect as intersect
from rdt_jax._dlpack._sharding import is_sharding as is_sharding
from rdt_jax._dlpack._sharding import receive_sharding as receive_sharding
from rdt_jax._dlpack._sharding import source_boxes as source_boxes
from rdt_jax._dlpack._sharding import target_layout as target_layout
from rdt_jax._dlpack._specs import ChunkSpec as ChunkSpec
from rdt_jax._dlpack._specs import DescribedLeaf as DescribedLeaf
from rdt_jax._dlpack._specs import DeviceKind as DeviceKind
from rdt_jax._dlpack._specs import Framework as Framework
from rdt_jax._dlpack._specs import LeafSpec as LeafSpec
from rdt_jax._dlpack._specs import ShardingLayout as ShardingLayout
from rdt_jax._dlpack._torch import bytes_tensor as torch_bytes

__all__ = [
    "ALIGNMENT",
    "DEVICE_ALIGNMENT",
    "GC_PAUSE_MIN_LEAVES",
    "SUB_BYTE_DTYPE_NAMES",
    "SUPPORTED_DTYPES",
    "Box",
    "ChunkSpec",
    "DescribedLeaf",
    "Device",
    "DeviceKind",
    "Framework",
    "HostBufferPool",
    "LeafSpec",
    "Region",
    "RegionPool",
    "ShardingLayout",
    "Slice",
    "TargetLayout",
    "UnsupportedLeafError",
    "aligned",
    "aligned_host_buffer",
    "block_until_ready",
    "box_shape",
    "buffer_pointer",
    "build_sharded",
    "check_device",
    "check_x64",
    "convert_leaf",
    "copy_bytes",
    "copy_from_host",
    "copy_into",
    "copy_runs",
    "cuda_available",
    "cut",
    "describe",
    "device_of",
    "device_pool",
    "dtype_of",
    "framework_of",
    "full_box",
    "gc_paused",
    "hold_buffer",
    "host_bytes",
    "host_chunk",
    "host_layout",
    "host_pointer",
    "host_pool",
    "host_to_jax_many",
    "importable",
    "intersect",
    "is_array",
    "is_c_contiguous",
    "is_sharding",
    "is_writable",
    "jax_device",
    "np_dtype_from_name",
    "pack_host_chunks",
    "pack_layout",
    "parse_device",
    "rebuild_device",
    "rebuild_host",
    "rebuild_view",
    "receive_sharding",
    "region_source",
    "source_boxes",
    "target_layout",
    "to_jax_exact",
    "torch_bytes",
    "wait_for_copies",
    "wait_for_producers",
    "wait_received",
]
