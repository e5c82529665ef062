"""Weight sync: a trainer publishes versions of its parameters; generators pull
them into live parameters.

`WeightPublisher` (in the trainer's actor) keeps each version readable and
hands out a `WeightsHandle`: the version, the publisher's actor, a digest of
the value's structure and, for a version sent as a pytree, the ref of its RDT
object.
`WeightSubscriber` (in a generator) pulls a handle's version into its
template: torch and numpy leaves are written in place, jax leaves arrive
with the template's sharding, `rdt_jax.Slice` leaves receive one index range.

Two ways a version travels, chosen by the publisher per structure:

* packed (`jax_nixl`, every array leaf in host memory): the leaves are
  copied into one pooled buffer per version, and subscribers copy their
  leaves out of it, node-locally straight from the publisher's memory or
  through NIXL READs of the buffer as RDT objects of at most the
  publisher's `bucket_bytes` each, which the publisher makes when the
  first subscriber elsewhere asks for them (`rdt_jax.weights._packed`); per
  step each side pays a copy per leaf and no per-leaf registration,
  metadata or plan;
* packed in device memory (`jax_nixl`, every array leaf on one CUDA
  device): one CUDA allocation of the publisher's own per version, copied
  through CUDA IPC by subscribers on its host whose templates are CUDA
  tensors written in place, and sent to the others as one RDT object of the
  tree made at the first request (`rdt_jax.weights._device`);
* as a pytree (leaves on several devices, or `jax_transfer`): one RDT
  object of the tree, pulled with `rdt_jax.set_target_for_ref` and
  `ray.get`.

The rules of the stream, in one place:

* versions published by one publisher strictly increase;
* the publisher keeps at most `keep` versions readable and frees older ones at
  once (`rdt_jax._ray.state.free_now`), whatever handles to them remain;
* a pull asks the publisher which versions it keeps before it starts and again
  after its bytes arrived: a version that is not newer than the subscriber's,
  or that is not kept, is refused with `StaleWeightsError` before any byte
  moves; one freed while it was read is refused after (its bytes may be
  another version's);
* `sub.version` names a version only while the template holds exactly its
  bytes (`atomic=False`: `None` from the moment a pull may write into the
  template until it succeeds; `atomic=True`: the pull lands in staging
  buffers and is copied into the template only once it succeeded).

The wing's rooms, each readable alone (no cycles; a pull moves down them):

* `_handle`: `WeightsHandle`, `StaleWeightsError`, a value's structure and
  its digest, the template check;
* `_packed`: packed versions' overview; their layouts, the kept-versions
  table and the publisher's stream;
* `_packed_checks`: the checks of what a publisher sends about a packed
  version (nothing trusted before them);
* `_device`: versions packed in device memory: the publisher's CUDA
  allocations, the tree made for pulls through Ray, the subscriber's
  `DevicePlan`;
* `_packed_plan`: the subscriber's plan of a packed structure, the pulled
  value, buckets;
* `_plans`: a subscriber's plans, one entry each, keyed by structure and
  route;
* `_protocol`: the subscriber's questions to the publisher and their typed
  answers;
* `_latest`: the board of each announced stream's newest handle
  (`latest_handle`);
* `_kept`: a publisher's kept versions and its end, by one rule;
* `_publisher`: `WeightPublisher` and its kept versions;
* `_routes`: the read routes (node-local, buckets through Ray, pytree,
  colocated);
* `_device_route`: the CUDA IPC route of a version in device memory;
* `_staging`: a template's staging arrays (`atomic=True`);
* `_mapping`: `From`, `Fuse`: a template of the engine's names and layouts
  (`source=`), its plan and its pull;
* `_named`: `pull_named`'s reads, a version's `(name, array)` pairs a bucket
  at a time;
* `_stats`: `PullStats`, what a pull did (`WeightSubscriber.last_pull`), and
  `PublishStats`, what a publisher did (`WeightPublisher.stats`);
* `_subscriber`: `WeightSubscriber`: pull, pull_async, commit.
"""

from rdt_jax.weights import _combine  # noqa: F401  (installs WeightsHandle.combine)
from rdt_jax.weights._handle import MappingError as MappingError
from rdt_jax.weights._handle import StaleWeightsError as StaleWeightsError
from rdt_jax.weights._handle import TemplateError as TemplateError
from rdt_jax.weights._handle import WeightsHandle as WeightsHandle
from rdt_jax.weights._latest import latest_handle as latest_handle
from rdt_jax.weights._mapping import From as From
from rdt_jax.weights._mapping import Fuse as Fuse
from rdt_jax.weights._publisher import WeightPublisher as WeightPublisher
from rdt_jax.weights._stats import PublishStats as PublishStats
from rdt_jax.weights._stats import PullStats as PullStats
from rdt_jax.weights._subscriber import WeightSubscriber as WeightSubscriber

__all__ = [
    "From", "Fuse", "MappingError", "PublishStats", "PullStats", "StaleWeightsError", "TemplateError",
    "WeightPublisher", "WeightSubscriber", "WeightsHandle", "latest_handle",
]
