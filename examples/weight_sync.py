"""RL-style weight sync: a JAX learner pushes its parameters to generators.

Each step the learner updates its parameters (a pytree of jax arrays), puts
them once with `ray.put(params, _tensor_transport="jax_nixl")`, and hands the
ref to every generator. Each generator holds PyTorch copies of the weights
(an inference engine's parameters) and receives straight into them with
`rdt_jax.set_target_for_ref`: no new allocation per step, the tensors other
code holds see the new values. The bytes go learner -> generator directly.

Run:  python examples/weight_sync.py [--generators 3] [--steps 5] [--mb 16]
"""

from __future__ import annotations

import argparse
import sys
import time

import ray

import rdt_jax

rdt_jax.register()


@ray.remote(enable_tensor_transport=True)
class Learner:
  def __init__(self, mb: int, layers: int = 8):
    import jax.numpy as jnp

    width = int((mb * (1 << 20) / 4 / layers) ** 0.5)
    self.params = {
        f"layer{i}": {"w": jnp.zeros((width, width)), "b": jnp.zeros(width)}
        for i in range(layers)
    }

  def shapes(self) -> dict:
    import jax

    return jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), self.params)

  def step(self) -> list:
    """One (pretend) training step; returns [ref] to the new parameters."""
    import jax

    self.params = jax.tree_util.tree_map(lambda x: x + 1.0, self.params)
    # A list keeps Ray from resolving the ref before the generators see it.
    return [ray.put(self.params, _tensor_transport="jax_nixl")]


@ray.remote(enable_tensor_transport=True)
class Generator:
  def __init__(self, shapes: dict):
    import torch

    self.params = {
        name: {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, (shape, dt) in layer.items()}
        for name, layer in shapes.items()
    }
    self.addresses = self._addresses()

  def _addresses(self) -> list[int]:
    return [t.data_ptr() for layer in self.params.values() for t in layer.values()]

  def sync(self, refs: list) -> tuple[float, bool]:
    """Receives the learner's parameters into this generator's tensors."""
    rdt_jax.set_target_for_ref(refs[0], self.params)
    new = ray.get(refs[0])
    w = self.params["layer0"]["w"]
    in_place = new["layer0"]["w"] is w and self._addresses() == self.addresses
    return float(self.params["layer0"]["w"][0, 0]), in_place


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--generators", type=int, default=3)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--mb", type=int, default=16, help="parameter size in MiB")
  args = parser.parse_args(argv)

  ray.init(num_cpus=args.generators + 2, include_dashboard=False, logging_level="warning")
  # docs: begin sync-loop
  learner = Learner.remote(args.mb)
  shapes = ray.get(learner.shapes.remote())
  generators = [Generator.remote(shapes) for _ in range(args.generators)]
  for step in range(1, args.steps + 1):
    t0 = time.perf_counter()
    refs = ray.get(learner.step.remote())
    results = ray.get([g.sync.remote(refs) for g in generators])
    elapsed = time.perf_counter() - t0
    assert all(value == float(step) and in_place for value, in_place in results), results
    print(
        f"step {step}: {args.generators} generators synced {args.mb} MiB in place "
        f"in {elapsed:.3f} s"
    )
  # docs: end sync-loop
  ray.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
