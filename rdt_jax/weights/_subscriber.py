"""The generator's side of weight sync: `WeightSubscriber`.

A pull checks its version against the newest one reached, picks the read
route (`rdt_jax.weights._routes`) for the handle, and commits: with
`atomic=True` the bytes land in staging arrays and are copied into the
template only once everything the pull returns is built. Pulls of one
subscriber run one at a time, whoever calls them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray

from rdt_jax import _memory, _ray, _targets
from rdt_jax.weights import _latest, _routes
from rdt_jax.weights._device import DevicePlan
from rdt_jax.weights._device_route import pull_device_local
from rdt_jax.weights._handle import (
  MappingError,
  TemplateError,
  WeightsHandle,
  check_handle,
  check_newer,
  check_template,
  flatten,
  label,
)
from rdt_jax.weights._mapping import Source, check_source_mapping, mapped_plan, pull_mapped
from rdt_jax.weights._named import named_leaves, renamed
from rdt_jax.weights._packed_checks import check_layout, check_source
from rdt_jax.weights._packed_plan import PackedPlan, unflatten
from rdt_jax.weights._plans import PlanKey, Plans
from rdt_jax.weights._protocol import ask_object, publishers
from rdt_jax.weights._publisher import WeightPublisher, bucket_size
from rdt_jax.weights._pull import Pull, PullCancelled, PullLock, committing, locked_pull, pull_threads
from rdt_jax.weights._sharded_route import MappedShardedPlan, pull_sharded, pull_sharded_mapped, sharded_plan
from rdt_jax.weights._staging import commit_staged, staged_tree
from rdt_jax.weights._stats import PullStats, count_pulled, lag_of, version_bytes

__all__ = ["WeightSubscriber"]

class WeightSubscriber:
  """Pulls published versions into a generator's parameters.

  Args:
    template: a pytree of the published value's structure whose leaves say
      where each leaf lands, as for `rdt_jax.set_target_for_ref`: numpy or
      torch arrays are written in place (the pulled tree holds those very
      objects), jax arrays and `jax.sharding.Sharding`s are placements (the
      leaf arrives as a new jax array with that sharding), `rdt_jax.Slice`
      receives one index range, a typed PRNG key receives a typed key of its
      implementation. Checked at a structure's first pull (errors name the
      leaf path). None: no template, for a subscriber that only pulls by
      name (`pull_named`). With `source`: the engine's own tree of numpy or
      torch tensors (`dict(model.named_parameters())`), written in place.
    atomic: False (default): pulls write into the template's arrays in
      place, with no extra memory; a pull that fails once its fetch started
      raises and leaves `version` None (the template is torn: some leaves may
      hold the new bytes) until the next successful pull. True: pulls land in
      staging arrays of the template's in-place leaves (one more copy of
      them, allocated at the first pull and reused), then one memcpy into
      the template; a failed pull leaves the template's arrays bit for bit as
      they were and `version` unchanged, unless that last copy fails (a
      device error; a host copy does not fail): then `version` is None.
    source: where each template leaf's bytes come from in the published
      tree, for a template of the engine's names and layouts: a mapping
      from each template path (`"['fc.weight']"` as `jax.tree_util.keystr`
      prints it, or its dotted name `"fc.weight"`, `"layers.0.qkv"`) to a
      published path (str), `rdt_jax.From` (a transpose, reshape or index
      range), `rdt_jax.Fuse` (published leaves concatenated), or None (left
      alone); or a function of the leaf's dotted name returning one (a path
      with a key neither str nor int, a tuple say, is given in `keystr`
      form). Checked at a structure's first pull (errors name the template
      leaf); unmapped published leaves are not read node-locally, and
      through Ray only buckets holding a mapped leaf are fetched. A pull
      reads a bucket at a time (a larger leaf in parts of its rows, unless
      a reshape needs it whole) and writes each leaf's transform into the
      engine tensors as it arrives: extra memory is about one bucket.
    bucket_bytes: the most bytes a `pull_named` or `source=` pull on the
      publisher's host copies at a time (a larger leaf alone, or in parts
      of its rows): an int from 4 KiB to 1 TiB, rounded down to a multiple
      of 64; through Ray the publisher's `bucket_bytes` sizes the buckets.
      None (default): `RDT_JAX_WEIGHT_BUCKET_BYTES` (256 MiB unless set),
      read here. The value in use is the attribute `bucket_bytes`.

  A pull refused before its fetch started (`StaleWeightsError`, a template
  that does not match, a publisher that is gone) changes nothing in either
  mode.

  Raises:
    TemplateError: a template that holds no array, `Slice` or sharding leaf.
    MappingError: a `source=` without a template.
    ArgumentTypeError: (a `TypeError`) a `source=` that is neither a
      mapping nor a function, or maps a leaf to a value of another type.
    TypeError: a `bucket_bytes` that is not an int.
    ValueError: a `bucket_bytes` outside its range (named in the message).
    SettingError: `bucket_bytes` left out and its setting holds a bad value.
  """

  def __init__(self, template: Any, atomic: bool = False, source: Source | None = None,
               bucket_bytes: int | None = None):
    self.template = template
    self.atomic = bool(atomic)
    self.bucket_bytes = bucket_size(bucket_bytes)
    if source is not None:
      check_source_mapping(source)
      if template is None:
        raise MappingError("source= maps published leaves into a template's tensors: give the template too.")
    self.source = source
    self._flat = [] if template is None else flatten(template)
    if template is not None and not self._flat:
      raise TemplateError("The template holds no jax, torch or numpy arrays, rdt_jax.Slice or sharding leaves.")
    self._version: int | None = None
    self._reached: int | None = None  # the newest version a pull reached (see `pull`)
    self._lock = PullLock()  # one pull at a time, whoever calls
    self._checked: set[str] = set()  # structures the template was checked against
    self._fits: set[str] = set()  # structures a pull of which succeeded with this target
    self._flat_target: dict[str, Any] = {}
    self._staging: Any = None
    # Every plan of a structure and route pulled (`rdt_jax.weights._plans`): packed, in device
    # memory, mapped, combined; one entry each.
    self._plans = Plans()
    self._sizes: dict[str, int] = {}  # array bytes of each structure pulled as a pytree, by digest
    self._last_pull: PullStats | None = None

  @property
  def version(self) -> int | None:
    """The version the template holds, or None (none pulled yet, or torn)."""
    return self._version

  @property
  def last_pull(self) -> PullStats | None:
    """What the last successful pull did (`rdt_jax.PullStats`: version,
    bytes, seconds, route, RDT objects fetched, lag behind the newest kept
    version), or None before the first. A failed pull leaves it as it was."""
    return self._last_pull

  def pull(self, handle: WeightsHandle, timeout: float | None = None) -> Any:
    """Pulls `handle`'s version into the template.

    Pulls of one subscriber run one at a time, whoever calls them (threads,
    `pull_async`, Ray's concurrency groups): a pull waits for the one
    running, then checks its version against the newest version a pull
    reached. `version` never decreases, except to None for a torn
    `atomic=False` pull.

    A publisher in this very process (a colocated trainer and generator)
    is pulled from like any other: the template receives the bytes in place
    (in device memory, a copy on the device), and the pulled tree never
    holds the publisher's kept arrays.

    A combined handle (`WeightsHandle.combine`: a version published by
    every process of a multi-controller trainer) is pulled the same way:
    each box the template needs is read from the process holding it, from
    every process at once; an error of one process's part fails the pull
    and names that process.

    Args:
      handle: a `WeightsHandle` from `WeightPublisher.publish`, or from
        `WeightsHandle.combine`.
      timeout: seconds the whole pull may take, waiting for a pull running
        in another thread included (None: no limit).

    Returns:
      The pulled tree: the template's in-place arrays themselves holding the
      new bytes, new jax arrays for jax leaves. `version` is then
      `handle.version`.

    Raises:
      ArgumentTypeError: (a `TypeError`) if `handle` is not a `WeightsHandle`.
      StaleWeightsError: for a version not newer than the newest version a
        pull of this subscriber reached (`version`, or the one before a torn
        pull), or not kept by the publisher (before anything moves), or
        freed while it was read; for a handle of a publisher that was
        closed or replaced since.
      TemplateError, UnsupportedLeafError: at the first pull of a structure,
        naming the leaf path where template and published value differ.
      MetadataError: for a handle or layout that does not hold together
        (naming the field); nothing is read.
      ray.exceptions.GetTimeoutError: the pull (or the wait for the pull
        running) ran out of time; `version` is then as the class docstring
        says for a failed pull.
      ray.exceptions.RayError: the publisher's actor died.
    """
    check_handle(handle)
    deadline = None if timeout is None else time.monotonic() + timeout
    return self._serialized(handle, deadline, None)

  def pull_latest(self, stream: str = "weights", timeout: float | None = None) -> WeightsHandle | None:
    """`pull` of the newest version announced on `stream` (by a
    `WeightPublisher(name=stream, announce=True)` in this Ray namespace),
    if newer than the newest this subscriber reached: one question to
    rdt_jax's board (`rdt_jax.latest_handle`); a version no longer kept is
    skipped (three questions in all). `timeout`: seconds for it all.

    Returns:
      The handle pulled, or None where nothing newer was announced.

    Raises:
      ValueError: no template (pull by name:
        `pull_named(rdt_jax.latest_handle(stream))`), or `stream` not a str.
      StaleWeightsError: three versions in a row no longer kept.
      TemplateError, MetadataError, ray.exceptions.RayError: as `pull`.
    """
    return _latest.pull_latest(self, stream, timeout)

  async def pull_async(self, handle: WeightsHandle, timeout: float | None = None) -> Any:
    """`pull`, awaitable: for async actors and drivers, whose event loop it
    does not block (the pull runs in a worker thread). Same arguments,
    result, errors and serialization as `pull`.

    Cancelling the awaiting task ends the pull like a failed one: the
    template is unchanged with `atomic=True`, and with `atomic=False`
    `version` is None if bytes may have reached the template. The
    cancellation returns only once the pull has stopped: nothing writes into
    the template after it.
    """
    import asyncio

    check_handle(handle)
    deadline = None if timeout is None else time.monotonic() + timeout
    cancel = threading.Event()
    future = asyncio.get_running_loop().run_in_executor(pull_threads(), self._in_thread, handle, deadline, cancel)
    try:
      return await asyncio.shield(future)
    except asyncio.CancelledError:
      cancel.set()
      while not future.done():  # the pull stops at its next step; wait for it, whatever cancels us again
        try:
          await asyncio.shield(future)
        except asyncio.CancelledError:
          continue
        except BaseException:
          break
      if not future.cancelled():
        future.exception()  # retrieved: the pull's own error is superseded by the cancellation
      raise

  def pull_named(self, handle: WeightsHandle, timeout: float | None = None,
                 rename: Callable[[str], str | None] | None = None,
                 framework: str = "torch") -> Iterator[tuple[str, Any]]:
    """The version's array leaves as `(name, array)` pairs, a bucket at a
    time, for an engine that loads weights by name (vLLM's `load_weights`).
    For a subscriber made with `template=None` (its `version` is what the
    engine holds; a subscriber with a template pulls into it with `pull`).

    Nothing happens until the first pair is asked for. From then the
    iteration holds this subscriber's pulls (another `pull` waits, so do
    not call one while iterating), and `version` is None (the engine holds
    part of a version) until the last pair has been taken: then it is
    `handle.version` and `last_pull` describes the pull. Stopping early
    (`close()`, or dropping the iterator) leaves `version` None.

    Memory: a packed version comes in buckets (consecutive leaves; a larger
    leaf alone) of this subscriber's `bucket_bytes` on the publisher's host,
    of the publisher's `bucket_bytes` through Ray, each pair's array a view of
    its bucket's host buffer, valid while referenced: extra memory stays at
    about one bucket while the caller copies each array and drops it before
    asking for the next bucket's. A version sent as a pytree, or packed in
    device memory, arrives whole, its arrays as they arrived (then
    converted to `framework`). A typed PRNG key comes as its key data.

    Every pair yielded holds the version's bytes: a bucket's pairs come only
    once the publisher still kept the version after the bucket arrived.

    Args:
      handle: a `WeightsHandle` from `WeightPublisher.publish`.
      timeout: seconds the whole iteration may take to fetch, waiting for a
        pull running in another thread included (None: no limit).
      rename: the engine's name for a published path (as
        `jax.tree_util.keystr` prints it); a leaf it maps to None is
        skipped. None: the published paths.
      framework: "torch" (default) or "numpy": the arrays' type.

    Returns:
      An iterator of `(name, array)`.

    Raises:
      ArgumentTypeError: (a `TypeError`) if `handle` is not a `WeightsHandle`.
      ValueError: for another `framework`, a subscriber with a template,
        or a combined handle (`WeightsHandle.combine`).
      StaleWeightsError: (from the iteration) as `pull`: not newer, not
        kept, or freed while it was read; pairs already yielded hold the
        version's bytes, and `version` stays None.
      ray.exceptions.GetTimeoutError, ray.exceptions.RayError: as `pull`.
    """
    check_handle(handle)
    if framework not in ("torch", "numpy"):
      raise ValueError(f"framework={framework!r}: pull_named gives 'torch' or 'numpy' arrays.")
    if handle.parts:
      raise ValueError("pull_named takes the handle of one publisher; a version of a multi-process trainer (a "
                       "combined handle) is pulled into a template with pull().")
    if self.template is not None:
      raise ValueError("pull_named is for a WeightSubscriber(None), whose version is what the engine loaded; "
                       "this subscriber has a template: pull into it with pull(), or make one with template=None.")
    deadline = None if timeout is None else time.monotonic() + timeout
    return self._named(handle, deadline, rename, framework)

  def _named(self, handle: WeightsHandle, deadline: float | None, rename: Callable[[str], str | None] | None,
             framework: str) -> Iterator[tuple[str, Any]]:
    with locked_pull(self._lock, handle, deadline):
      check_newer(handle, self._version, self._reached)
      started = time.perf_counter()
      pull = Pull(handle, label(handle), deadline, self._version, None, self._set_version, self.bucket_bytes)
      structure = pull.ask(want_structure=True)
      if structure is None:
        raise RuntimeError(f"The publisher no longer knows the structure of version {handle.version}.")
      pull.layout = None if structure.packed is None else structure.packed.layout
      counted = [0]
      for name, out in renamed(named_leaves(pull, structure), rename, framework, counted, pull):
        self._version = None  # the engine holds part of the version from here until the last pair
        yield name, out
        del out  # the caller's copy is the only reference to a bucket's view
      nbytes = counted[0]
      self._version = handle.version
      self._reach(handle.version)
      stats = self._last_pull = PullStats(handle.version, nbytes, time.perf_counter() - started, pull.route,
                                          pull.objects, lag_of(handle.version, pull.kept))
    count_pulled(handle, stats)

  def _reach(self, version: int) -> None:
    """Records that a pull reached `version` (see `pull`)."""
    self._reached = version if self._reached is None else max(self._reached, version)

  def _in_thread(self, handle: WeightsHandle, deadline: float | None, cancel: threading.Event) -> Any:
    """`pull_async`'s pull, in a thread of rdt_jax's: its `ray.get`s block
    that thread, not the event loop, so Ray's advice against a blocking
    `ray.get` in an async actor is not logged for them."""
    with _ray.aio.quiet_blocking_get_warning():
      return self._serialized(handle, deadline, cancel)

  def _serialized(self, handle: WeightsHandle, deadline: float | None, cancel: threading.Event | None) -> Any:
    """Runs one pull once no other pull of this subscriber runs."""
    with locked_pull(self._lock, handle, deadline, cancel):
      if cancel is not None and cancel.is_set():
        raise PullCancelled(f"The pull of version {handle.version} was cancelled.")
      value = self._pull(handle, deadline, cancel)
      self._reach(handle.version)
      stats = self._last_pull  # this pull's, before another thread's pull may replace it
    count_pulled(handle, stats)
    return value

  def _pull(self, handle: WeightsHandle, deadline: float | None, cancel: threading.Event | None) -> Any:
    """One pull (`pull`), the subscriber's lock held: refuses a version not
    newer than the newest reached, then takes the handle's route."""
    if self.template is None:
      raise ValueError("This WeightSubscriber has no template (template=None): pull with pull_named, or give a "
                       "template to pull into.")
    check_newer(handle, self._version, self._reached)
    current = self._version
    started = time.perf_counter()
    pull = Pull(handle, label(handle), deadline, current, cancel, self._set_version, self.bucket_bytes)
    nbytes = None
    key = PlanKey.of(handle)
    source = self.source
    if handle.parts and source is not None:
      combined = self._plans.get(key, lambda: MappedShardedPlan.make(pull, self._flat, source, self.atomic))
      nbytes = pull_sharded_mapped(pull, combined, self.atomic)
      value = self.template
    elif handle.parts:
      value, nbytes = pull_sharded(pull, self._plans.get(key, lambda: sharded_plan(pull, self._flat, self.atomic)),
                                   self.atomic)
    elif source is not None:
      nbytes = pull_mapped(pull, self._plans.get(key, lambda: mapped_plan(pull, self._flat, source, self.atomic)),
                           self.atomic)
      value = self.template
    elif handle.packed is not None and getattr(handle.packed, "device", -1) != -1:
      value = self._pull_device(pull)
    elif handle.packed is not None:
      value = self._pull_packed(pull)
    else:
      local = publishers.get(handle.publisher)
      if isinstance(local, WeightPublisher):
        value = _routes.pull_colocated(pull, local, self._flat, self._checked, self._target(), self.atomic)
      else:
        value = self._pull_pytree(pull)
      if self.atomic:
        value = self._commit(pull, value)
    self._version = handle.version
    if nbytes is None:
      nbytes = version_bytes(self._sizes, handle.structure, value, pull.layout)
    self._last_pull = PullStats(handle.version, nbytes, time.perf_counter() - started, pull.route, pull.objects,
                                lag_of(handle.version, pull.kept))
    return value

  def _set_version(self, version: int | None) -> None:
    self._version = version

  def _pull_pytree(self, pull: Pull) -> Any:
    """A pull of a version sent as a pytree from another process: the
    template is checked at its structure's first pull."""
    handle = pull.handle
    structure = pull.ask(want_structure=handle.structure not in self._checked)
    _routes.check_structure_once(handle, structure, self._flat, self._checked)
    target = self._target()
    fits = handle.structure in self._fits
    value = _routes.pull_pytree(pull, target, self._flat_target if fits else None, self.atomic)
    if not fits:
      self._fits.add(handle.structure)  # later versions of it skip set_target_for_ref's checks
      self._flat_target = _targets.flatten_target(target)
    return value

  # ---- packed versions (rdt_jax.weights._packed)

  def _plan(self, pull: Pull) -> PackedPlan:
    """The plan of the pulled structure: made at its first pull, after the
    publisher says the version is kept and sends the structure's layout, and
    the template is checked against it."""
    plan: PackedPlan = self._planned(pull, PackedPlan)
    return plan

  def _planned(self, pull: Pull, make: Callable[..., Any]) -> Any:
    """The plan of the pulled packed structure and route, made at its
    first pull by `make(layout, entries, template, atomic)` once the
    publisher sent the layout and the template and layout are checked
    against it."""
    handle = pull.handle

    def new() -> Any:
      answer = pull.ask(want_structure=True)
      if answer is None or answer.packed is None:
        raise RuntimeError(f"The publisher no longer knows the packed structure of version {handle.version}.")
      check_template(self._flat, answer.entries)
      check_layout(answer.packed, answer.entries, pull.label)
      self._checked.add(handle.structure)
      return make(answer.packed, answer.entries, dict(self._flat), self.atomic)

    return self._plans.get(PlanKey.of(handle), new)

  def _pull_packed(self, pull: Pull) -> Any:
    """A pull of a packed version: node-local where the kernel allows it,
    else through Ray; then the plan commits the leaves."""
    handle = pull.handle
    plan = self._plan(pull)
    source = check_source(handle.packed, pull.label, plan, handle.version)
    pull.layout = plan.info.layout
    plan.check_targets()
    staging = _memory.host_pool.acquire(plan.staging_bytes) if plan.staging_bytes else None
    if pull.deadline is not None and time.monotonic() > pull.deadline:
      raise ray.exceptions.GetTimeoutError(f"The pull of version {handle.version} ran out of time before it began.")
    pull.check_cancelled()
    if not (_routes.can_read_directly(source) and _routes.pull_node_local(pull, plan, staging, self.atomic)):
      _routes.pull_buckets(pull, plan, staging, self.atomic)
    pull.check_cancelled()
    with committing(pull, plan.commits_into_template):
      return unflatten(plan.info, plan.commit(staging), source.rest)

  # ---- versions packed in device memory (rdt_jax.weights._device)

  def _device_plan(self, pull: Pull) -> DevicePlan | None:
    """The plan of the pulled structure if the template takes its bytes
    directly (None: it does not, and versions of it come through Ray):
    made at the structure's first pull, after the template is checked."""
    plan: DevicePlan | None = self._planned(pull, DevicePlan.make)
    return plan

  def _pull_device(self, pull: Pull) -> Any:
    """A pull of a version packed in device memory: copied through CUDA
    IPC into the template's tensors where the template and the host allow
    it, else the version's tree through Ray (made by the publisher at the
    first such request)."""
    handle = pull.handle
    source = check_source(handle.packed, pull.label)
    plan = self._device_plan(pull)
    pull.layout = None if plan is None else plan.info.layout
    if plan is not None:
      check_source(source, pull.label, plan, handle.version)  # type: ignore[arg-type]
      plan.check_targets()
      if pull.deadline is not None and time.monotonic() > pull.deadline:
        raise ray.exceptions.GetTimeoutError(f"The pull of version {handle.version} ran out of time before it began.")
      pull.check_cancelled()
      if _routes.can_read_directly(source) and pull_device_local(pull, plan, source):
        pull.check_cancelled()
        return unflatten(plan.info, plan.written(), source.rest)
    ref = ask_object(handle, pull.label, pull.left(), pull.current)
    through_ray = dataclasses.replace(pull, handle=dataclasses.replace(handle, ref=ref))
    value = self._pull_pytree(through_ray)
    pull.route, pull.objects, pull.kept = through_ray.route, through_ray.objects, through_ray.kept
    return self._commit(pull, value) if self.atomic else value

  def _target(self) -> Any:
    if not self.atomic:
      return self.template
    if self._staging is None:
      self._staging = staged_tree(self.template)
    return self._staging

  def _commit(self, pull: Pull, value: Any) -> Any:
    """An atomic pull's last step: its staging arrays copied into the
    template (`commit_staged`); a copy that fails leaves `version` None."""
    with committing(pull):
      return commit_staged(self._flat, value)

