"""The backend suite on CUDA devices (skipped without CUDA; see conftest.py).

Covers jax_nixl VRAM -> VRAM, VRAM -> host and host -> VRAM, jax_nccl over a
backend="nccl" group, jax_transfer on GPU; jax, torch and cupy leaves mixed;
bfloat16 and float8; empty and 0-d leaves; receive_as; targets and target
devices (`cuda:N` honoured or refused by name); `Slice(into=...)` in CUDA
memory refused by name; the device region pool
(registered once, reused); producer stream order; sharded arrays across the
local GPUs where there are two or more.

Every actor takes a share of one GPU, so XLA's preallocation is off in the
actors (docs/gpu.md: the memory rule).
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

import rdt_jax
from gpu.conftest import SHARE, gpu_count
from rdt_jax import _dlpack, _layout, _memory

#: Registered before the actor classes: `ray.method` checks transport names.
REGISTERED = rdt_jax.register()
NCCL = "jax_nccl" if "jax_nccl" in REGISTERED else "jax_nixl"
TRANSFER = "jax_transfer" if "jax_transfer" in REGISTERED else "jax_nixl"


def _has(module: str) -> bool:
  return _dlpack.importable(module)


def _kill(*actors: object) -> None:
  """Ends a test's own actors, so their GPU shares go back for later tests."""
  for actor in actors:
    ray.kill(actor)


def _ready(*refs: ray.ObjectRef) -> list[ray.ObjectRef]:
  """`refs`, once their objects exist: a ref sent inside a list must be
  (rdt_jax.RefNotReadyError otherwise)."""
  ray.wait(list(refs), num_returns=len(refs), timeout=120)
  return list(refs)


def make_tree(device: str = "cuda", cupy_leaf: bool = True) -> dict:
  """The mixed tree every test sends, on `device` ("cuda" or "cpu")."""
  import jax
  import jax.numpy as jnp
  import ml_dtypes
  import torch

  platform = "gpu" if device == "cuda" else "cpu"
  jd = jax.devices(platform)[0]
  ref = reference()
  tree = {
      "jax_f32": jax.device_put(ref["jax_f32"], jd),
      "jax_bf16": jax.device_put(ref["jax_bf16"], jd),
      "jax_f8": jax.device_put(ref["jax_f8"], jd),
      "jax_f8_e3m4": jax.device_put(ref["jax_f8_e3m4"], jd),
      "jax_empty": jnp.zeros((0, 3), jnp.float32, device=jd),
      "jax_scalar": jax.device_put(ref["jax_scalar"], jd),
      "jax_big": jax.device_put(ref["jax_big"], jd),
      "torch_f32": torch.from_numpy(ref["torch_f32"]).to(device),
      "torch_bf16": torch.from_numpy(ref["torch_bf16"].view(np.uint16)).view(torch.bfloat16).to(device),
      "torch_empty": torch.zeros((2, 0), device=device),
      "step": 3,
  }
  assert tree["jax_f8"].dtype == ml_dtypes.float8_e4m3fn
  if cupy_leaf and device == "cuda" and _has("cupy"):
    import cupy

    tree["cupy_i32"] = cupy.asarray(ref["cupy_i32"])
  return tree


def reference() -> dict:
  """Host values of `make_tree`'s leaves."""
  import ml_dtypes

  rng = np.random.default_rng(12)
  return {
      "jax_f32": rng.standard_normal((64, 33)).astype(np.float32),
      "jax_bf16": rng.standard_normal((17,)).astype(ml_dtypes.bfloat16),
      "jax_f8": rng.standard_normal((5, 5)).astype(ml_dtypes.float8_e4m3fn),
      "jax_f8_e3m4": rng.standard_normal((9,)).astype(ml_dtypes.float8_e3m4),
      "jax_empty": np.zeros((0, 3), np.float32),
      "jax_scalar": np.float32(2.5),
      "jax_big": rng.standard_normal((1 << 20,)).astype(np.float32),  # 4 MiB: read in place
      "torch_f32": rng.standard_normal((8, 8)).astype(np.float32),
      "torch_bf16": rng.standard_normal((6,)).astype(ml_dtypes.bfloat16),
      "torch_empty": np.zeros((2, 0), np.float32),
      "cupy_i32": np.arange(100, dtype=np.int32),
  }


def describe_leaves(tree: dict) -> dict:
  """(framework, device kind, device index, dtype name) of each array leaf."""
  out = {}
  for k, v in tree.items():
    fw = _dlpack.framework_of(v)
    if fw is not None:
      d = _dlpack.device_of(v)
      out[k] = (fw, d.kind, d.index, _dlpack.dtype_of(v).name)
  return out


def check_values(tree: dict) -> list[str]:
  """Leaves whose values differ from `reference()` (empty list: all equal)."""
  ref = reference()
  bad = []
  for k, v in tree.items():
    if _dlpack.framework_of(v) is None:
      continue
    host = _dlpack.convert_leaf(v, "numpy")
    if host.shape != ref[k].shape or host.tobytes() != np.asarray(ref[k]).tobytes():
      bad.append(k)
  return bad


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class GpuActor:
  def __init__(self):
    rdt_jax.register()

  def devices(self) -> int:
    return gpu_count()

  @ray.method(tensor_transport="jax_nixl")
  def nixl(self, device: str = "cuda", cupy_leaf: bool = True):
    return make_tree(device, cupy_leaf)

  @ray.method(tensor_transport=NCCL)
  def nccl(self):
    return make_tree("cuda")

  @ray.method(tensor_transport=TRANSFER)
  def transfer(self):
    return make_tree("cuda", cupy_leaf=False)

  @ray.method(tensor_transport="jax_nixl")
  def after_queued_work(self):
    """A torch result whose kernels are still queued when it is returned."""
    import torch

    x = torch.ones((2048, 2048), device="cuda")
    for _ in range(20):
      x = (x @ x) / 2048.0
    return {"x": x}

  def receive_as(self, mode: str) -> None:
    rdt_jax.receive_as(mode)

  def take(self, tree: dict) -> tuple[dict, list[str]]:
    return describe_leaves(tree), check_values(tree)

  def take_value(self, tree: dict) -> float:
    return float(_dlpack.convert_leaf(tree["x"], "numpy").astype(np.float64).sum())

  def get(self, refs: list, device: str | None = None) -> tuple[dict, list[str]]:
    ref = refs[0]
    if device is not None:
      rdt_jax.set_target_device_for_ref(ref, device)
    tree = ray.get(ref)
    return describe_leaves(tree), check_values(tree)

  def get_error(self, refs: list, device: str) -> str:
    rdt_jax.set_target_device_for_ref(refs[0], device)
    try:
      ray.get(refs[0])
    except Exception as e:
      return str(e)
    return ""

  @ray.method(tensor_transport="jax_nixl")
  def weights(self, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"w": torch.randn((1024, 1024), device="cuda", generator=g), "b": torch.randn(64, device="cuda")}

  def into_busy_cuda_target(self, refs: list) -> tuple[float, bool]:
    """Receives into a cuda parameter while a kernel queued on a side stream
    still reads it: the read must see the old values (the transfer waits for
    queued work before writing caller memory), the target the new ones."""
    import torch

    target = {"w": torch.zeros((1024, 1024), device="cuda"), "b": torch.zeros(64, device="cuda")}
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
      torch.cuda._sleep(200_000_000)  # about 0.1 s of queued work first
      seen = target["w"].sum()
    rdt_jax.set_target_for_ref(refs[0], target)
    out = ray.get(refs[0])
    side.synchronize()
    return float(seen), out["w"] is target["w"] and bool(out["w"].abs().sum() > 0)

  def mixed_memory_targets(self, refs: list) -> str:
    """A cuda object with a host target for one leaf: one READ cannot mix
    host and device memory, so it is refused by name (never a wrong read)."""
    import torch

    rdt_jax.set_target_for_ref(refs[0], {"w": torch.zeros((1024, 1024)), "b": torch.zeros(64, device="cuda")})
    try:
      ray.get(refs[0])
    except Exception as e:
      return str(e)
    return ""

  @ray.method(tensor_transport="jax_nixl")
  def big(self, seed: int):
    """32 MiB of jax and 32 MiB of torch device memory, each leaf `seed` everywhere."""
    import jax
    import torch

    return {
        "j": jax.device_put(np.full(1 << 23, seed, np.float32), jax.devices("gpu")[0]),
        "t": torch.full((1 << 23,), float(seed), device="cuda"),
    }

  def take_big(self, tree: dict) -> list[float]:
    """Each leaf's (min, max), read on the host."""
    out = []
    for k in ("j", "t"):
      host = _dlpack.convert_leaf(tree[k], "numpy")
      out += [float(host.min()), float(host.max())]
    return out

  def view_rebuilds(self) -> int:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return get_tensor_transport_manager("JAX_NIXL").counters()["view_rebuilds"]

  def pool_state(self) -> tuple[int, int]:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    t = get_tensor_transport_manager("JAX_NIXL")
    return t.counters()["pooled_registrations"], _memory.device_pool.pooled_bytes()



@pytest.fixture(scope="module")
def pair(gpu_ray):
  return GpuActor.remote(), GpuActor.remote()


def expected_kinds(tree_keys: list[str], mode: str, kind: str) -> dict:
  out = {}
  for k in tree_keys:
    src = k.split("_")[0]
    fw = src if mode == "source" else mode
    if src == "cupy" and kind == "cpu" and mode == "source":
      fw = "numpy"
    out[k] = (fw, "cpu" if fw == "numpy" else kind)
  return out


def assert_arrived(described: dict, bad: list[str], mode: str, kind: str) -> None:
  assert bad == [], f"wrong values in {bad}"
  want = expected_kinds(list(described), mode, kind)
  got = {k: (v[0], v[1]) for k, v in described.items()}
  assert got == want


# --------------------------------------------------------------------------
# jax_nixl


def test_nixl_vram_to_vram(pair):
  producer, consumer = pair
  described, bad = ray.get(consumer.take.remote(producer.nixl.remote()))
  assert_arrived(described, bad, "source", "cuda")
  assert described["jax_f8_e3m4"][3] == "float8_e3m4"


def test_nixl_vram_to_host(pair):
  producer, consumer = pair
  ref = producer.nixl.remote()
  described, bad = ray.get(consumer.get.remote(_ready(ref), "cpu"))
  assert_arrived(described, bad, "source", "cpu")


def test_nixl_host_to_vram(pair):
  producer, consumer = pair
  ref = producer.nixl.remote("cpu")
  described, bad = ray.get(consumer.get.remote(_ready(ref), "cuda:0"))
  assert_arrived(described, bad, "source", "cuda")


def test_nixl_driver_get(pair):
  producer, _ = pair
  tree = ray.get(producer.nixl.remote(cupy_leaf=False))
  assert check_values(tree) == []


@pytest.mark.parametrize("mode", ["jax", "torch", "numpy"])
def test_receive_as(pair, mode):
  producer, consumer = pair
  ray.get(consumer.receive_as.remote(mode))
  try:
    ref = producer.nixl.remote(cupy_leaf=False)
    if mode == "torch":
      # torch has no float8_e3m4: refused by name, never sent another way.
      assert "float8_e3m4" in ray.get(consumer.get_error.remote(_ready(ref), "cuda:0"))
      return
    described, bad = ray.get(consumer.get.remote(_ready(ref), None))
    assert_arrived(described, bad, mode, "cuda")
  finally:
    ray.get(consumer.receive_as.remote("source"))


def test_target_device_that_does_not_exist_is_refused_by_name(pair):
  producer, consumer = pair
  n = ray.get(consumer.devices.remote())
  message = ray.get(consumer.get_error.remote(_ready(producer.nixl.remote()), f"cuda:{n}"))
  assert f"cuda:{n}" in message and "this process has cuda:0" in message


def test_device_regions_registered_once(pair):
  producer, consumer = pair
  for _ in range(2):
    ray.get(consumer.take.remote(producer.nixl.remote(cupy_leaf=False)))
  before = ray.get(consumer.pool_state.remote())
  for _ in range(3):
    ray.get(consumer.take.remote(producer.nixl.remote(cupy_leaf=False)))
  assert ray.get(consumer.pool_state.remote()) == before


def test_repeated_device_objects_cost_no_reconnect(pair):
  """Objects of device memory made and freed one after the other: the
  producer copies them into pooled regions registered once, so freeing one
  deregisters nothing and the consumer never rebuilds its view (reconnects)."""
  producer, consumer = pair
  for seed in (1, 2):
    assert ray.get(consumer.take_big.remote(producer.big.remote(seed))) == [seed] * 4
  before = ray.get(consumer.view_rebuilds.remote())
  for seed in range(3, 8):
    assert ray.get(consumer.take_big.remote(producer.big.remote(seed))) == [seed] * 4
  assert ray.get(consumer.view_rebuilds.remote()) == before


def test_torch_memory_is_ipc_capable_and_jax_memory_is_told_apart():
  """`ipc_capable` asks the driver about the allocation: torch's caching
  allocator (cudaMalloc) can be mapped by CUDA IPC; the answer for XLA's
  memory is printed (the export copies jax leaves either way)."""
  import jax
  import torch

  assert _memory.ipc_capable(torch.zeros(1 << 20, device="cuda").data_ptr()) is True
  x = jax.device_put(np.zeros(1 << 20, np.float32), jax.devices("gpu")[0])
  print("jax memory ipc_capable:", _memory.ipc_capable(x.unsafe_buffer_pointer()))


def test_producer_queued_work_completes_before_the_read(pair):
  producer, consumer = pair
  value = ray.get(consumer.take_value.remote(producer.after_queued_work.remote()))
  assert value == pytest.approx(2048.0 * 2048.0, rel=1e-3)


def test_transfer_into_a_cuda_target_waits_for_queued_work(pair):
  producer, consumer = pair
  seen, landed = ray.get(consumer.into_busy_cuda_target.remote(_ready(producer.weights.remote(1))))
  assert seen == 0.0 and landed


def test_one_read_into_host_and_device_memory_is_refused(pair):
  producer, consumer = pair
  message = ray.get(consumer.mixed_memory_targets.remote(_ready(producer.weights.remote(2))))
  assert "host and device memory at once" in message


def test_region_reuse_waits_for_kernels_queued_on_its_last_leaf():
  import torch

  from rdt_jax._dlpack._devices import Device
  from rdt_jax._memory._regions import FrameworkAllocator, RegionPool

  pool = RegionPool(FrameworkAllocator(), max_bytes=1 << 30)
  cuda = Device("cuda", 0)
  region = pool.acquire(1 << 20, cuda, "torch")
  leaf = region.view(0, 1 << 20).view(torch.float32)
  region.release()
  side = torch.cuda.Stream()
  with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000)
    _ = leaf.sum()
    done = torch.cuda.Event()
    done.record(side)
  del leaf, _  # the last Python reference goes while the kernel is queued
  again = pool.acquire(1 << 20, cuda, "torch")
  assert again is region and done.query()  # handed out only after the queued work ran


# --------------------------------------------------------------------------
# jax_nccl, jax_transfer


@pytest.mark.skipif(
    gpu_count() < 2, reason="NCCL runs one rank per GPU (two ranks on one GPU: NCCL_ERROR_INVALID_USAGE)"
)
def test_nccl_group(gpu_ray):
  if not _has("cupy") or NCCL != "jax_nccl":
    pytest.skip("jax_nccl is not registered or Ray's NCCL group lacks cupy here")
  from ray.experimental.collective import create_collective_group, destroy_collective_group

  producer, consumer = GpuActor.remote(), GpuActor.remote()
  group = create_collective_group([producer, consumer], backend="nccl")
  try:
    described, bad = ray.get(consumer.take.remote(producer.nccl.remote()))
    assert_arrived(described, bad, "source", "cuda")
  finally:
    destroy_collective_group(group)
    _kill(producer, consumer)


def test_transfer_on_gpu(gpu_ray):
  if TRANSFER != "jax_transfer":
    pytest.skip("this jax has no jax.experimental.transfer")
  producer, consumer = GpuActor.remote(), GpuActor.remote()
  try:
    described, bad = ray.get(consumer.take.remote(producer.transfer.remote()))
    assert_arrived(described, bad, "source", "cuda")
  finally:
    _kill(producer, consumer)


# --------------------------------------------------------------------------
# Sharded arrays across local GPUs


@ray.remote(num_gpus=2, enable_tensor_transport=True)
class TwoGpuActor:
  def __init__(self):
    rdt_jax.register()

  @ray.method(tensor_transport="jax_nixl")
  def sharded(self):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices("gpu")[:2]), ("x",))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    return {"s": jax.device_put(x, NamedSharding(mesh, PartitionSpec("x")))}

  def get(self, refs: list, device: str | None) -> str:
    if device is not None:
      rdt_jax.set_target_device_for_ref(refs[0], device)
    try:
      tree = ray.get(refs[0])
    except Exception as e:
      return f"error: {e}"
    host = _dlpack.convert_leaf(tree["s"], "numpy")
    ok = np.array_equal(host, np.arange(64, dtype=np.float32).reshape(8, 8))
    return "ok" if ok else "wrong values"


@pytest.mark.skipif(gpu_count() < 2, reason="needs two or more local GPUs")
def test_sharded_across_local_gpus(gpu_ray):
  producer, consumer = TwoGpuActor.remote(), TwoGpuActor.remote()
  try:
    assert ray.get(consumer.get.remote(_ready(producer.sharded.remote()), "cpu")) == "ok"
    # On cuda: rebuilding shards there is not implemented yet, refused by name.
    message = ray.get(consumer.get.remote(_ready(producer.sharded.remote()), None))
    assert message == "ok" or ("['s']" in message and "sharded" in message)
  finally:
    _kill(producer, consumer)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_slice_into_device_memory_is_refused_by_name(kind):
  """A `Slice(into=...)` array in CUDA memory (a torch tensor or a cupy
  array) is refused naming the leaf and the device: slices are planned and
  copied in host memory, so writing one from the CPU would be wrong."""
  from rdt_jax import _targets

  if kind == "torch":
    torch = pytest.importorskip("torch")
    into = torch.zeros((2, 2), dtype=torch.float32, device="cuda:0")
  else:
    cupy = pytest.importorskip("cupy")
    into = cupy.zeros((2, 2), dtype=cupy.float32)
  leaf = _dlpack.describe(np.zeros((4, 2), np.float32), "['a']").spec
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"\['a'\] has a Slice.into array in cuda:0 memory"):
    _targets.leaf_layout(leaf, _layout.Slice((slice(0, 2),), into=into))


def test_a_copy_from_host_to_a_gpu_has_finished_when_it_returns():
  """jax copies host memory to a gpu asynchronously; the DLPack layer's
  host -> jax entry waits for it, so the host buffer may be written (or a
  pooled one reused) at once without changing the array."""
  import jax

  from rdt_jax._dlpack import _jax

  gpu = jax.devices("gpu")[0]
  for attempt in range(10):
    source = np.zeros(64 << 20, np.uint8)
    out = _jax.from_host(source, "['x']", gpu)
    source[:] = 7
    assert not np.asarray(out).any(), f"attempt {attempt}: the write after the copy reached the gpu array"


# --------------------------------------------------------------------------
# Weight sync with device memory on both sides


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class GpuTrainer:
  """Publishes its GPU parameters, then donates them to its next jitted step."""

  def __init__(self):
    import jax

    rdt_jax.register()
    gpu = jax.devices("gpu")[0]
    self.params = [jax.device_put(np.arange(1 << 20, dtype=np.float32) + i, gpu) for i in range(2)]
    self.step = jax.jit(lambda p: [x + 1.0 for x in p], donate_argnums=0)
    self.publisher = rdt_jax.WeightPublisher(transport="jax_nixl", keep=2)

  def publish_then_step(self, version: int):
    import jax

    handle = self.publisher.publish(self.params, version=version)
    sums = [float(np.asarray(x).astype(np.float64).sum()) for x in self.params]
    self.params = self.step(self.params)  # donates the arrays just published
    jax.block_until_ready(self.params)
    return handle, sums


@ray.remote(num_gpus=SHARE, enable_tensor_transport=True)
class GpuGenerator:
  """Pulls versions into CUDA tensors in place."""

  def __init__(self):
    import torch

    rdt_jax.register()
    self.tensors = [torch.empty(1 << 20, device="cuda") for _ in range(2)]
    self.subscriber = rdt_jax.WeightSubscriber(self.tensors)

  def pull(self, handle):
    import torch

    self.subscriber.pull(handle)
    torch.cuda.synchronize()
    return [float(t.double().sum()) for t in self.tensors], self.subscriber.version


def test_a_trainer_that_donates_its_device_arrays_keeps_its_published_versions(gpu_ray):
  """On a GPU, XLA refuses to donate a buffer another library holds; the
  publisher copies device leaves at publish, so the donating step neither
  fails nor changes the version a generator pulls afterwards."""
  trainer, generator = GpuTrainer.remote(), GpuGenerator.remote()
  try:
    for version in (1, 2, 3):
      handle, sums = ray.get(trainer.publish_then_step.remote(version), timeout=90)
      got, pulled = ray.get(generator.pull.remote(handle), timeout=90)
      assert pulled == version and got == pytest.approx(sums, rel=1e-12)
  finally:
    _kill(trainer, generator)
