"""`rdt-jax doctor`: what this host will do with rdt_jax, checked before the first transfer.

It reports, for this host and this environment:

* versions: Python, Ray, jax/jaxlib, numpy, torch, cupy, NIXL (the distribution
  `rdt_jax._compat.nixl_api` imports), and the CUDA build of each;
* transports: what `rdt_jax.register()` returns here, and Ray's built-in ones;
* whether the Ray minor is inside the tested range (`rdt_jax._ray.version`);
* GPUs: count, names, peer access between each pair, and `nvidia-smi`'s
  NVLink status and topology where it exists;
* UCX: which protocol and transport a NIXL READ uses for host memory and, where
  a GPU is visible, for device memory, and at what rate. The NIXL wheels ship no
  `ucx_info`, so this is found the way a user can: a loopback READ of
  `--mb` MiB between two NIXL agents in two child processes, run with the
  environment a jax_nixl process has (`rdt_jax.transports.nixl.ucx.apply_defaults`
  applied) plus `UCX_LOG_LEVEL=info UCX_PROTO_INFO=used UCX_LOG_FILE=...`, then
  the protocol tables UCX logs are parsed (`parse_proto_tables`). Beside it, the
  node-local host read rdt_jax makes itself (`process_vm_readv`) is tried on the
  same buffer;
* on a GPU host, whether XLA's preallocation leaves room for the other jax
  processes on a GPU (docs/gpu.md, "The memory rule").

Each check ends in a `Finding`: `ok`, `warn` or `fail`, with why and the fix.
`run` returns 0 if no finding is `fail`, 1 otherwise. What is a fail (the
configuration is broken, or slow enough to lose to Ray's object store):

* Ray, jax or numpy missing; `register()` raising (an untested Ray minor
  without `RDT_JAX_ALLOW_UNTESTED_RAY=1`, or Ray internals changed); an
  invalid `RDT_JAX_*` setting;
* the loopback READ failing, timing out, or delivering wrong bytes;
* host memory that moves between two processes on this host only through
  TCP: UCX's host READ emulated over TCP *and* no node-local read;
* on a GPU host: `device_read_problem()` (CUDA IPC READs turned off), a device
  READ that UCX emulates or sends over TCP, or one slower than
  `_limits.DOCTOR_DEVICE_READ_MIN_GBPS`;
* on a GPU host shared by `--jax-processes-per-gpu` N > 1 jax processes:
  preallocation on with N x fraction >= 1 (the second process runs out of memory).

What is a warning (it works, with less or with a caveat): NIXL missing
(`jax_nixl` unavailable, the other transports work); torch missing (no
`jax_gloo`/`jax_nccl`, no Ray built-ins); an untested Ray allowed by
`RDT_JAX_ALLOW_UNTESTED_RAY=1`; node-local reads refused or off while UCX reads
host memory by CMA; UCX's host READ over TCP while node-local reads work (only
reads between hosts or after a refusal use it); a protocol UCX's log did not
show; GPUs no framework sees, or pairs without peer access; jax on the CPU of
a GPU host; a NIXL CUDA build other than torch's. On a host without a GPU the
device checks do not apply (`device_read_problem()` is still shown).

It needs no running Ray and starts none; it runs on hosts without a GPU.

Rooms, each readable alone, bottom up: `records` (`Finding` and the exit
status; `ReadResult` and `Loopback`, what the loopback measured), `ucx_log`
(UCX's protocol tables, errors and version, read from its log),
`judge_reads` and `judge_setup` (the decisions: pure functions of what was
measured or collected), `installed` (versions, transports, the Ray range),
`gpus` (GPUs, peer access, `nvidia-smi`), `children` (the loopback's two
processes), `loopback` (running them; the node-local read), `progress` (each
check's name and result as it runs, on stderr), `checks` (the whole check,
`collect`), `render` (the text report) and `command` (the command line). Their
names are re-exported here.

While it runs, `run` writes each check's name to stderr as it starts, then its
result and time on the same line; stdout holds the report alone (text, or JSON
with `--json`).
"""

from rdt_jax._doctor.checks import CHECKS as CHECKS
from rdt_jax._doctor.checks import collect as collect
from rdt_jax._doctor.checks import jax_nixl_ucx_env as jax_nixl_ucx_env
from rdt_jax._doctor.command import add_arguments as add_arguments
from rdt_jax._doctor.command import run as run
from rdt_jax._doctor.gpus import active_nvlinks as active_nvlinks
from rdt_jax._doctor.gpus import collect_gpus as collect_gpus
from rdt_jax._doctor.installed import RAY_BUILTIN as RAY_BUILTIN
from rdt_jax._doctor.installed import collect_ray as collect_ray
from rdt_jax._doctor.installed import collect_transports as collect_transports
from rdt_jax._doctor.installed import collect_versions as collect_versions
from rdt_jax._doctor.installed import ray_builtin_usable as ray_builtin_usable
from rdt_jax._doctor.judge_reads import judge_device_read as judge_device_read
from rdt_jax._doctor.judge_reads import judge_device_read_settings as judge_device_read_settings
from rdt_jax._doctor.judge_reads import judge_host_read as judge_host_read
from rdt_jax._doctor.judge_reads import judge_node_local as judge_node_local
from rdt_jax._doctor.judge_setup import GPU_DOC as GPU_DOC
from rdt_jax._doctor.judge_setup import XLA_DEFAULT_FRACTION as XLA_DEFAULT_FRACTION
from rdt_jax._doctor.judge_setup import XLA_PREALLOCATE_OFF as XLA_PREALLOCATE_OFF
from rdt_jax._doctor.judge_setup import judge_gpus as judge_gpus
from rdt_jax._doctor.judge_setup import judge_packages as judge_packages
from rdt_jax._doctor.judge_setup import judge_ray as judge_ray
from rdt_jax._doctor.judge_setup import judge_xla_memory as judge_xla_memory
from rdt_jax._doctor.loopback import run_loopback as run_loopback
from rdt_jax._doctor.progress import Progress as Progress
from rdt_jax._doctor.progress import Step as Step
from rdt_jax._doctor.records import Finding as Finding
from rdt_jax._doctor.records import Loopback as Loopback
from rdt_jax._doctor.records import ReadResult as ReadResult
from rdt_jax._doctor.records import Severity as Severity
from rdt_jax._doctor.records import exit_status as exit_status
from rdt_jax._doctor.render import render_text as render_text
from rdt_jax._doctor.ucx_log import UCX_LOG_ENV as UCX_LOG_ENV
from rdt_jax._doctor.ucx_log import ProtoRow as ProtoRow
from rdt_jax._doctor.ucx_log import ProtoTable as ProtoTable
from rdt_jax._doctor.ucx_log import ReadPath as ReadPath
from rdt_jax._doctor.ucx_log import parse_proto_tables as parse_proto_tables
from rdt_jax._doctor.ucx_log import read_path as read_path
from rdt_jax._doctor.ucx_log import ucx_errors as ucx_errors
from rdt_jax._doctor.ucx_log import ucx_version as ucx_version

__all__ = [
  "CHECKS",
  "Finding",
  "Progress",
  "ProtoRow",
  "ProtoTable",
  "ReadPath",
  "ReadResult",
  "Step",
  "active_nvlinks",
  "add_arguments",
  "collect",
  "exit_status",
  "jax_nixl_ucx_env",
  "judge_device_read",
  "judge_device_read_settings",
  "judge_gpus",
  "judge_host_read",
  "judge_node_local",
  "judge_packages",
  "judge_ray",
  "judge_xla_memory",
  "parse_proto_tables",
  "ray_builtin_usable",
  "read_path",
  "render_text",
  "run",
  "ucx_errors",
  "ucx_version",
]
