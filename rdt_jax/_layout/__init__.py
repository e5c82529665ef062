"""Where bytes lie: one object's chunks in its receive buffer, resharding on
receive, and many host leaves packed into one buffer.

This room of the array layer knows where each byte of a leaf goes, not how
it is described or converted (`rdt_jax._dlpack`) nor where the memory comes
from (`rdt_jax._memory`); it imports those two rooms and no Ray. The names
below are what the rest of rdt_jax uses; tests of the room's internals
import its private modules directly. `README.md` beside this file lists the
modules and the rules.
"""

from rdt_jax._layout._chunks import copy_packed_into as copy_packed_into
from rdt_jax._layout._chunks import host_chunk as host_chunk
from rdt_jax._layout._chunks import host_layout as host_layout
from rdt_jax._layout._chunks import pack_host_chunks as pack_host_chunks
from rdt_jax._layout._chunks import pack_layout as pack_layout
from rdt_jax._layout._packing import DevicePacker as DevicePacker
from rdt_jax._layout._packing import NotHostMemory as NotHostMemory
from rdt_jax._layout._packing import NotOnDevice as NotOnDevice
from rdt_jax._layout._packing import PackedLayout as PackedLayout
from rdt_jax._layout._packing import Packer as Packer
from rdt_jax._layout._packing import cuda_device_of as cuda_device_of
from rdt_jax._layout._packing import is_cpu_sharding as is_cpu_sharding
from rdt_jax._layout._packing import jax_placement as jax_placement
from rdt_jax._layout._reshard import Slice as Slice
from rdt_jax._layout._reshard import TargetLayout as TargetLayout
from rdt_jax._layout._reshard import build_sharded as build_sharded
from rdt_jax._layout._reshard import copy_runs as copy_runs
from rdt_jax._layout._reshard import cut as cut
from rdt_jax._layout._reshard import sharded_builder as sharded_builder
from rdt_jax._layout._reshard import target_layout as target_layout

# Grouped by purpose, one comment per group (not sorted as a whole).
__all__ = [  # noqa: RUF022
    # One object's chunks in one host buffer or device region, and typed views of them.
    "copy_packed_into",
    "host_chunk",
    "host_layout",
    "pack_host_chunks",
    "pack_layout",
    # Resharding on receive: slices, target layouts, byte runs between boxes, the arriving array.
    "Slice",
    "TargetLayout",
    "build_sharded",
    "copy_runs",
    "cut",
    "sharded_builder",
    "target_layout",
    # Many leaves packed into one host or device buffer at fixed offsets (weight streams).
    "NotHostMemory",
    "NotOnDevice",
    "PackedLayout",
    "Packer",
    "DevicePacker",
    "cuda_device_of",
    "is_cpu_sharding",
    "jax_placement",
]
