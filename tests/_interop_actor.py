"""An actor that imports torch and rdt_jax in the order it is told to.

Kept out of the test module (which imports both at the top) so that the
worker's import order is the one under test: this module imports neither.
"""

from __future__ import annotations

import importlib

import ray


@ray.remote(enable_tensor_transport=True)
class Mixer:
  """Returns torch tensors over Ray's own `nixl` and pytrees over `jax_nixl`."""

  def __init__(self, order: tuple[str, ...]):
    """Imports the modules in `order`; "ray-nixl" stands for a first use of
    Ray's NIXL (which installs Ray's torch serializer) at that point."""
    for name in order:
      if name == "ray-nixl":
        import torch

        ray.put(torch.zeros(1), _tensor_transport="nixl")
      else:
        importlib.import_module(name)
    importlib.import_module("rdt_jax").register()
    self.kept = None

  @ray.method(tensor_transport="nixl")
  def torch_nixl(self, n: int):
    import torch

    self.kept = torch.arange(n, dtype=torch.float32)
    return self.kept

  @ray.method(tensor_transport="jax_nixl")
  def mixed_jax_nixl(self, n: int):
    import jax.numpy as jnp
    import torch

    self.kept = torch.arange(n, dtype=torch.float32)
    return {"jax": jnp.arange(n, dtype=jnp.float32), "torch": self.kept}

  def overwrite_kept(self, value: float) -> None:
    """Writes the last returned torch tensor in place. A consumer that fetches
    it afterwards sees the new values only if the tensor stayed out of band."""
    self.kept.fill_(value)

  def sums(self, value) -> dict:
    """The sum of each leaf of `value` (a tensor, or a dict of arrays)."""
    import rdt_jax

    tree = value if isinstance(value, dict) else {"": value}
    return {k: float(rdt_jax.to_numpy(x).sum()) for k, x in tree.items()}
