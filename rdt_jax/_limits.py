"""Every fixed tuning constant and trust bound of rdt_jax, each with why it has its value.

What a user may change lives in `rdt_jax._settings` (environment variables,
checked when read); what is fixed lives here, one constant per decision. A
module reads a constant as `_limits.NAME` when it uses it, so a test that
narrows a bound patches it here, in one place.

Each constant carries a `Why:` line, which `tests/test_limits.py` requires,
and no other module of the package (the benchmark aside) defines a numeric
constant of its own.

This module imports nothing of rdt_jax: every layer may read it.
"""

from __future__ import annotations

from typing import Final

# -- Arrays and memory --------------------------------------------------------

#: Host receive buffers start on this boundary.
#: Why: `jnp.from_dlpack` and `jax.device_put` alias (do not copy) host memory aligned to 64 bytes.
HOST_ALIGNMENT: Final = 64

#: Device chunks start on this boundary.
#: Why: cudaMalloc's alignment; jax and torch alias DLPack buffers aligned this way without copying.
DEVICE_ALIGNMENT: Final = 256

#: Objects with at least this many leaves pause the cyclic collector while they are built.
#: Why: below it a pause costs more than the collections it saves (scripts/gc_pause_ab.py;
#: docs/development/performance-log.md).
GC_PAUSE_MIN_LEAVES: Final = 64

#: Row-major buffer layouts remembered, per (shape, dtype).
#: Why: a bound on memory; a model has far fewer distinct leaf shapes than this.
JAX_ROW_MAJOR_MAX: Final = 4096

#: Axes a leaf spec from another process may have.
#: Why: a trust bound; a model's leaves have a handful of axes.
SHARDING_MAX_NDIM: Final = 64

#: Elements a leaf spec from another process may have.
#: Why: a trust bound; no buffer of that many bytes exists.
SHARDING_MAX_ELEMENTS: Final = 1 << 56

# -- The serializer's hand-off -------------------------------------------------

#: Structures whose leaf paths are kept (`_handoff.leaf_path`), most recently used last.
#: Why: a weight-sync loop or a benchmark sends a handful of structures; 16 covers them
#: while bounding what a process that sends ever-new structures keeps.
PATHS_KEPT: Final = 16

#: Seconds a published hand-off waits for Ray's extract before it is dropped.
#: Why: Ray extracts right after serializing; an entry this old belongs to a task that failed.
HANDOFF_TTL_S: Final = 120.0

#: Published hand-offs kept at most.
#: Why: a bound on memory if Ray never extracts (each entry holds only weak references).
HANDOFF_MAX: Final = 256

#: Integer lists at least this long pickle as packed int64 bytes in metadata.
#: Why: below it a plain list pickles smaller and faster than a packed one.
METADATA_PACK_INTS_MIN: Final = 16

# -- Processes and the lifetime contract ---------------------------------------

#: Processes watched through a pidfd at most.
#: Why: each holds one file descriptor; a consumer talks to far fewer producers than this.
WATCHED_MAX: Final = 64

#: Producers known dead, most recent last, remembered at most.
#: Why: a forgotten one is asked about again, so the bound costs a lookup, not safety.
MAX_DEAD_REMEMBERED: Final = 4096

#: Producers whose latest lookup found them alive, most recent last, remembered at most.
#: Why: a forgotten one costs the next fetch from it a lookup of its own, not safety.
MAX_ALIVE_REMEMBERED: Final = 4096

#: Seconds a consumer of a two-sided transfer waits, past Ray's RDT fetch timeout, for the
#: kill Ray sends after a failed send.
#: Why: room for Ray's kill to arrive on a loaded host, and a bound on a wait that finds none.
KILL_GRACE_S: Final = 10.0

#: How many aborted objects a process remembers.
#: Why: on a producer no fetch ever consumes Ray's abort mark, so the oldest must be forgotten.
MAX_ABORTED: Final = 4096

#: Actors whose answer to `actor_has_tensor_transport` a process keeps at most.
#: Why: a bound on memory; each answer saves a round trip to the actor.
MAX_ACTORS_KNOWN: Final = 4096

#: Seconds an actor's answer is kept after its last use.
#: Why: a gone actor's answer goes then; a live one is asked again at most every ten minutes.
ACTOR_ANSWER_IDLE_S: Final = 600.0

# -- Node-local reads -----------------------------------------------------------

#: Descriptors per `process_vm_readv` call.
#: Why: Linux's UIO_MAXIOV; more are refused with EINVAL.
IOV_MAX: Final = 1024

#: Objects at least this large are read by several threads.
#: Why: below it the threads' start-up costs more than the parallel copy saves (docs/performance.md).
PARALLEL_MIN_BYTES: Final = 16 << 20

# -- jax_nixl -------------------------------------------------------------------

#: Seconds between two looks for producers to forget (idle or exited).
#: Why: a look costs a lock and a scan; once a second keeps it off every fetch's path.
NIXL_FORGET_CHECK_S: Final = 1.0

#: Chunks up to this size are packed into one staging buffer (per device), and
#: host jax leaves up to this size of a value of many leaves into one buffer.
#: Why: a registration and a descriptor cost more than copying a chunk this small;
#: packing a leaf measured faster up to 256 KiB, level at 512 KiB, slower from 1 MiB.
PACK_MAX_CHUNK: Final = 256 << 10

#: Kinds of packable leaf (device, shape, dtype) whose checks are remembered.
#: Why: a model has a few hundred distinct shapes; past this, kinds are checked per leaf.
PACK_KINDS_MAX: Final = 4096

#: Pack tables (a packed return's leaf table) a process keeps, most recently used last.
#: Why: a loop returns a handful of structures; a table of 10,000 leaves holds about
#: 2 MB of specs, so sixteen bound what a process that meets ever-new structures keeps.
PACK_TABLES_KEPT: Final = 16

#: No buffer of a process ends above this address; a larger address or size is refused.
#: Why: user space is below 2**57 on every 64-bit platform NIXL runs on.
NIXL_ADDRESS_LIMIT: Final = 1 << 57

#: Objects of at most this many chunks have their metadata's chunks checked in a Python
#: loop rather than with numpy arrays.
#: Why: measured here: building the arrays costs about 12 us for one chunk, the loop under 1 us.
NIXL_CHECK_LOOP_MAX: Final = 16

#: Device indices a chunk may name.
#: Why: a trust bound far above any host's device count.
NIXL_MAX_DEVICES: Final = 1 << 16

# -- jax_transfer ---------------------------------------------------------------

#: Seconds a consumer waits for the offer service's answer.
#: Why: an answer takes milliseconds; thirty seconds is a producer that is stuck or gone.
TRANSFER_ANSWER_TIMEOUT_S: Final = 30.0

#: The largest offer-protocol message either side accepts (bytes of JSON).
#: Why: a trust bound; an offer for 10,000 leaves is well under it.
TRANSFER_MAX_MESSAGE: Final = 1 << 20

#: Seconds a consumer tries to connect to a producer's offer service.
#: Why: a connection on a working network takes milliseconds.
TRANSFER_CONNECT_TIMEOUT_S: Final = 10.0

#: Seconds after which unused offer and transfer connections are closed.
#: Why: a weight-sync loop reuses them within seconds; a gone producer's go within a minute.
TRANSFER_IDLE_S: Final = 60.0

#: Idle offer connections kept per producer.
#: Why: a bound on idle sockets; concurrent fetches open more, which close when idle.
TRANSFER_POOL_PER_PRODUCER: Final = 4

#: Bulk-data sockets per transfer server.
#: Why: every server must use the same number (in jaxlib 0.10 a pull by a peer with fewer
#: aborts the puller: "Check failed: bind(cfd, ...)"), and one is as fast as four on 2 cores.
TRANSFER_BULK_SOCKETS: Final = 1

#: Threads making offer requests (each waits for a producer's answer).
#: Why: a consumer rarely pulls from more producers at once; each thread mostly waits.
TRANSFER_REQUEST_THREADS: Final = 16

# -- Weight sync ----------------------------------------------------------------

#: Prepared node-local reads kept per plan (one per publisher buffer seen).
#: Why: a publisher keeps a few versions, each in its own buffer; eight covers `keep` up to 8.
WEIGHTS_PREPARED_KEPT: Final = 8

#: Plans a weight subscriber keeps (one per structure and route it pulled, oldest dropped first).
#: Why: a trainer publishes one structure at a time and changes it rarely (a new adapter, a
#: rollback); four covers a few switches back and forth, and a plan dropped is made again.
WEIGHTS_PLANS_KEPT: Final = 4

#: Seconds between two checks, while a pull waits for the subscriber's lock or for its
#: publisher's answer, that its `pull_async` was cancelled.
#: Why: the wait is a lock or a Ray call that cannot be interrupted; 50 ms bounds how long a
#: cancellation waits at about twenty wake-ups a second, only while a pull waits.
WEIGHTS_CANCEL_POLL_S: Final = 0.05

#: Threads that read the parts of a multi-process version at once (one per trainer process).
#: Why: a part's read is a system call or a Ray fetch that waits, not work on a core; 64 covers
#: a trainer of 64 processes in one round, and more processes queue for a thread.
WEIGHTS_PART_THREADS: Final = 64

#: Seconds `WeightsHandle.combine` waits for the trainer processes' answers (their parts' layouts).
#: Why: the question runs in each publisher's system concurrency group, answered within
#: milliseconds even while a step runs; a process that does not answer in a minute is gone or stuck.
WEIGHTS_COMBINE_ASK_S: Final = 60.0

#: CUDA IPC mappings of other processes' allocations a process keeps open.
#: Why: a weight publisher keeps `keep` device buffers, each its own allocation, and a
#: subscriber maps each once; sixteen covers a few publishers of `keep` up to 8, and an
#: old mapping is closed once more are open than that.
IPC_MAPPINGS_KEPT: Final = 16

#: Questions to the board of newest versions one `WeightSubscriber.pull_latest` makes
#: before a version no longer kept is an error.
#: Why: each new question finds a newer version, unless the trainer publishes faster than
#: the subscriber pulls with a small `keep`; three bound the retries of that case.
LATEST_ATTEMPTS: Final = 3

#: Seconds one question to the board of newest versions waits for its answer.
#: Why: the board answers from memory in about a Ray actor call; thirty seconds tell a
#: busy cluster from a board that cannot answer.
LATEST_ASK_S: Final = 30.0

#: Bytes of a CUDA IPC handle (`sizeof(CUipcMemHandle)`, cuda.h).
#: Why: CUDA's own size; metadata holding a handle of another size is refused.
CUDA_IPC_HANDLE_BYTES: Final = 64

#: Seconds between two checks, while a bucket's fetch runs, that the publisher still keeps
#: the version.
#: Why: a freed version's buckets are deregistered, and their fetch would end only at Ray's
#: fetch timeout; two seconds bound that wait at a small cost to the publisher.
WEIGHTS_STALE_CHECK_S: Final = 2.0

#: Slots a kept-versions table named by a handle may have.
#: Why: a trust bound on what a handle from another process names.
WEIGHTS_MAX_SLOTS: Final = 1 << 16

#: Bytes a packed version named by a handle may have.
#: Why: a trust bound (64 TiB) far above any one process's weights.
WEIGHTS_MAX_NBYTES: Final = 1 << 46

#: Versions a publisher's answer may list.
#: Why: a trust bound on what an answer from another process names.
WEIGHTS_MAX_KEPT: Final = 1 << 16

#: Bytes up to which a mapped weight pull writes a host tensor's part with numpy's copy
#: rather than torch's.
#: Why: measured here for a transposed float32 leaf: numpy 8 us against torch 14 us at
#: 127 KiB, 50 us against 26 us at 256 KiB (torch's copy is multi-threaded and blocked).
MAP_NUMPY_COPY_BYTES: Final = 128 << 10

# -- Metrics --------------------------------------------------------------------

#: Counted metric events a process queues before the caller adds them up itself.
#: Why: the flushing thread adds the queue up every few seconds; a burst of a hundred
#: thousand transfers in between (a few MB of tuples) means it fell behind.
METRICS_EVENTS_QUEUED: Final = 100_000

# -- Diagnosis and the contract kit ---------------------------------------------

#: A READ of device memory slower than this (GB/s, median of the loopback's timed READs)
#: is a fail in `rdt-jax doctor`.
#: Why: UCX's emulated READ ran at 0.4-0.6 GB/s on an H200, a CUDA IPC READ at hundreds of
#: GB/s, a PCIe peer READ at tens.
DOCTOR_DEVICE_READ_MIN_GBPS: Final = 2.0

#: Seconds a fetch that should fail may take before the contract kit calls it a hang.
#: Why: the failures the kit provokes end within seconds; a minute tells a hang from a slow host.
CONTRACT_FAIL_WITHIN_S: Final = 60.0
