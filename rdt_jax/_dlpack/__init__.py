"""The DLPack layer: describe, rebuild and convert any framework's arrays.

Data flows one way through rdt_jax::

  producer leaf -> describe() -> LeafSpec + raw buffers -> (a backend moves bytes)
  -> receive memory (`rdt_jax._memory`, laid out by `rdt_jax._layout`)
  -> rebuild_host() / rebuild_device() -> consumer leaf

This subpackage is the bottom room of the array layer (with `rdt_jax._memory`
and `rdt_jax._layout`, which are built on it). It imports no Ray and no
framework eagerly, and nothing of rdt_jax above it (only `rdt_jax._compat`
and `rdt_jax._error_base`). The names below are what the rest of rdt_jax
uses; tests of the layer's internals import its private modules directly.
`README.md` beside this file lists the modules and the design rules.
"""

from rdt_jax._dlpack._bytes import host_bytes as host_bytes
from rdt_jax._dlpack._devices import Device as Device
from rdt_jax._dlpack._devices import check_device as check_device
from rdt_jax._dlpack._devices import jax_device as jax_device
from rdt_jax._dlpack._devices import parse_device as parse_device
from rdt_jax._dlpack._dispatch import block_until_ready as block_until_ready
from rdt_jax._dlpack._dispatch import buffer_pointer as buffer_pointer
from rdt_jax._dlpack._dispatch import buffer_pointers as buffer_pointers
from rdt_jax._dlpack._dispatch import check_x64 as check_x64
from rdt_jax._dlpack._dispatch import chunkable as chunkable
from rdt_jax._dlpack._dispatch import convert_leaf as convert_leaf
from rdt_jax._dlpack._dispatch import describe as describe
from rdt_jax._dlpack._dispatch import device_of as device_of
from rdt_jax._dlpack._dispatch import dtype_of as dtype_of
from rdt_jax._dlpack._dispatch import framework_of as framework_of
from rdt_jax._dlpack._dispatch import hold_buffer as hold_buffer
from rdt_jax._dlpack._dispatch import host_to_jax_many as host_to_jax_many
from rdt_jax._dlpack._dispatch import is_array as is_array
from rdt_jax._dlpack._dispatch import is_c_contiguous as is_c_contiguous
from rdt_jax._dlpack._dispatch import is_writable as is_writable
from rdt_jax._dlpack._dispatch import mark_written as mark_written
from rdt_jax._dlpack._dispatch import mark_written_many as mark_written_many
from rdt_jax._dlpack._dispatch import rebuild_device as rebuild_device
from rdt_jax._dlpack._dispatch import rebuild_host as rebuild_host
from rdt_jax._dlpack._dispatch import rebuild_view as rebuild_view
from rdt_jax._dlpack._dispatch import region_writer as region_writer
from rdt_jax._dlpack._dispatch import to_jax_exact as to_jax_exact
from rdt_jax._dlpack._dtypes import np_dtype_from_name as np_dtype_from_name
from rdt_jax._dlpack._errors import UnsupportedLeafError as UnsupportedLeafError
from rdt_jax._dlpack._jax import PackKind as PackKind
from rdt_jax._dlpack._jax import is_prng_key as is_prng_key
from rdt_jax._dlpack._jax import packable as packable
from rdt_jax._dlpack._jax import packed_spec as packed_spec
from rdt_jax._dlpack._jax import prng_key_parts as prng_key_parts
from rdt_jax._dlpack._jax import wrap_prng_key as wrap_prng_key
from rdt_jax._dlpack._lazy import importable as importable
from rdt_jax._dlpack._sharding import Box as Box
from rdt_jax._dlpack._sharding import box_shape as box_shape
from rdt_jax._dlpack._sharding import full_box as full_box
from rdt_jax._dlpack._sharding import intersect as intersect
from rdt_jax._dlpack._sharding import is_sharding as is_sharding
from rdt_jax._dlpack._sharding import owned_shards as owned_shards
from rdt_jax._dlpack._sharding import receive_sharding as receive_sharding
from rdt_jax._dlpack._sharding import shard_arrays as shard_arrays
from rdt_jax._dlpack._sharding import source_boxes as source_boxes
from rdt_jax._dlpack._sharding import spans_processes as spans_processes
from rdt_jax._dlpack._sharding import spec_problem as spec_problem
from rdt_jax._dlpack._specs import RECEIVE_MODES as RECEIVE_MODES
from rdt_jax._dlpack._specs import ChunkSpec as ChunkSpec
from rdt_jax._dlpack._specs import DescribedLeaf as DescribedLeaf
from rdt_jax._dlpack._specs import Framework as Framework
from rdt_jax._dlpack._specs import LeafSpec as LeafSpec
from rdt_jax._dlpack._specs import ShardingLayout as ShardingLayout
from rdt_jax._dlpack._torch import bytes_tensor as torch_bytes
from rdt_jax._dlpack._torch import from_device_bytes as torch_from_device_bytes

# Grouped by purpose, one comment per group (not sorted as a whole).
__all__ = [  # noqa: RUF022
    # Leaf descriptions (framework-neutral, cross the wire in metadata) and the error.
    "RECEIVE_MODES",
    "ChunkSpec",
    "DescribedLeaf",
    "Framework",
    "LeafSpec",
    "ShardingLayout",
    "UnsupportedLeafError",
    "np_dtype_from_name",
    # Devices: the one parser, and lookups that never pick another device.
    "Device",
    "check_device",
    "jax_device",
    "parse_device",
    # Questions about one array, answered by its framework (the one dispatch point).
    "block_until_ready",
    "buffer_pointer",
    "buffer_pointers",
    "check_x64",
    "describe",
    "PackKind",
    "packable",
    "packed_spec",
    "device_of",
    "dtype_of",
    "framework_of",
    "hold_buffer",
    "is_array",
    "is_c_contiguous",
    "is_writable",
    "mark_written",
    "mark_written_many",
    # Conversions between frameworks.
    "convert_leaf",
    "region_writer",
    "chunkable",
    "to_jax_exact",
    # Typed PRNG keys: raw key data and implementation name, and back.
    "is_prng_key",
    "prng_key_parts",
    "wrap_prng_key",
    # Rebuilding received leaves from host views or device byte views.
    "host_to_jax_many",
    "rebuild_device",
    "rebuild_host",
    "rebuild_view",
    "receive_sharding",
    # Sharded leaves: the box each chunk covers, checks of a spec from another process.
    "Box",
    "box_shape",
    "full_box",
    "intersect",
    "is_sharding",
    "source_boxes",
    "spec_problem",
    # Global arrays of a multi-controller program: the shards this process owns.
    "owned_shards",
    "shard_arrays",
    "spans_processes",
    # Raw memory as arrays: uint8 views and torch byte tensors over a pointer.
    "host_bytes",
    "torch_bytes",
    "torch_from_device_bytes",
    # Whether a framework can be imported here (checked without importing it).
    "importable",
]
