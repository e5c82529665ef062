"""Memory: the host buffer pool, device regions, CUDA stream order and IPC, the GC pause.

This room of the array layer knows where a transfer's memory comes from and
when it may be written or reused, not what an array is (`rdt_jax._dlpack`,
whose framework modules allocate device regions and make the views) nor where
each byte lies in it (`rdt_jax._layout`). It imports `rdt_jax._dlpack` and no
Ray. The names below are what the rest of rdt_jax uses; tests of the room's
internals import its private modules directly. `README.md` beside this file
lists the modules and the rules.
"""

from rdt_jax._memory._cuda import copy_bytes as copy_bytes
from rdt_jax._memory._cuda import copy_from_host as copy_from_host
from rdt_jax._memory._cuda import copy_into as copy_into
from rdt_jax._memory._cuda import copy_into_many as copy_into_many
from rdt_jax._memory._cuda import cuda_available as cuda_available
from rdt_jax._memory._cuda import ipc_capable as ipc_capable
from rdt_jax._memory._cuda import settle_targets as settle_targets
from rdt_jax._memory._cuda import wait_for_copies as wait_for_copies
from rdt_jax._memory._cuda import wait_for_producers as wait_for_producers
from rdt_jax._memory._cuda import wait_received as wait_received
from rdt_jax._memory._gc import gc_paused as gc_paused
from rdt_jax._memory._host import HostBufferPool as HostBufferPool
from rdt_jax._memory._host import aligned as aligned
from rdt_jax._memory._host import host_pointer as host_pointer
from rdt_jax._memory._host import host_pool as host_pool
from rdt_jax._memory._ipc import IpcError as IpcError
from rdt_jax._memory._ipc import allocate as ipc_allocate
from rdt_jax._memory._ipc import copy_runs as ipc_copy
from rdt_jax._memory._ipc import export as ipc_export
from rdt_jax._memory._ipc import free as ipc_free
from rdt_jax._memory._ipc import mapped as ipc_mapped
from rdt_jax._memory._ipc import usable as ipc_usable
from rdt_jax._memory._regions import Region as Region
from rdt_jax._memory._regions import device_pool as device_pool
from rdt_jax._memory._regions import region_source as region_source

# Grouped by purpose, one comment per group (not sorted as a whole).
__all__ = [  # noqa: RUF022
    # Host memory: the buffer pool and its alignment.
    "HostBufferPool",
    "aligned",
    "host_pointer",
    "host_pool",
    # Device memory: the region pool and where a region's memory comes from.
    "Region",
    "device_pool",
    "region_source",
    # CUDA: stream ordering, copies on a device and into caller arrays, what the devices can do.
    "copy_bytes",
    "copy_from_host",
    "copy_into",
    "copy_into_many",
    "cuda_available",
    "ipc_capable",
    "settle_targets",
    "wait_for_copies",
    "wait_for_producers",
    "wait_received",
    # CUDA IPC: allocations another process maps, mappings of them, copies between them.
    "IpcError",
    "ipc_allocate",
    "ipc_copy",
    "ipc_export",
    "ipc_free",
    "ipc_mapped",
    "ipc_usable",
    # The GC pause around one object's per-leaf work.
    "gc_paused",
]
