"""RL loop: an optax trainer publishes each step; torch and JAX generators pull it.  Run: python examples/rl_loop.py"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import ray
import torch

import rdt_jax

rdt_jax.register()  # before the actors: the generators may then read over jax_nixl
L, D = 3, 16  # a stack of L tanh layers, scanned: one (L, D, D) kernel
X = np.linspace(-1, 1, 4 * D, dtype=np.float32).reshape(4, D)  # the fixed input
OPT = optax.adam(1e-2)

def forward(w, x):
  return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

@ray.remote(enable_tensor_transport=True)
class Trainer:
  def __init__(self):
    self.w = jax.random.normal(jax.random.key(0), (L, D, D)) / D**0.5
    self.opt_state, self.pub = OPT.init(self.w), rdt_jax.WeightPublisher(keep=2)
  def step(self, version: int) -> tuple[rdt_jax.WeightsHandle, np.ndarray]:
    grads = jax.grad(lambda w: jnp.mean((forward(w, X) - 0.5) ** 2))(self.w)
    updates, self.opt_state = OPT.update(grads, self.opt_state)
    self.w = optax.apply_updates(self.w, updates)
    return self.pub.publish({"w": self.w}, version=version), np.asarray(forward(self.w, X))

@ray.remote(enable_tensor_transport=True)
class TorchGenerator:  # an engine with one (D, D) tensor per layer: rows i*D to (i+1)*D of the stack as (L*D, D)
  def __init__(self):
    self.layers = {f"layer{i}": torch.empty(D, D) for i in range(L)}
    source = {f"layer{i}": rdt_jax.From("w", reshape=(L * D, D), index=(slice(i * D, (i + 1) * D),)) for i in range(L)}
    self.sub = rdt_jax.WeightSubscriber(self.layers, source=source)
  def generate(self, handle: rdt_jax.WeightsHandle) -> tuple[int | None, np.ndarray]:
    self.sub.pull(handle)  # into self.layers, in place
    h = torch.from_numpy(X)
    for w in self.layers.values():
      h = torch.tanh(h @ w)
    return self.sub.version, h.numpy()

@ray.remote(enable_tensor_transport=True)
class JaxGenerator:
  def __init__(self):
    self.sub = rdt_jax.WeightSubscriber({"w": jnp.zeros((L, D, D))})  # pulled as a new jax array
  def generate(self, handle: rdt_jax.WeightsHandle) -> tuple[int | None, np.ndarray]:
    w = self.sub.pull(handle)["w"]
    return self.sub.version, np.asarray(forward(w, X))

if __name__ == "__main__":
  ray.init(num_cpus=3, include_dashboard=False, logging_level="warning")
  trainer, generators = Trainer.remote(), [TorchGenerator.remote(), JaxGenerator.remote()]
  for step in range(1, 6):
    handle, want = ray.get(trainer.step.remote(step))
    for version, out in ray.get([g.generate.remote(handle) for g in generators]):
      assert version == handle.version == step, (version, step)  # versions only go forward, one step at a time
      np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)  # the trainer's forward pass
    print(f"version {step}: the torch and jax generators' outputs match the trainer's")
