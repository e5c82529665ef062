"""From a JAX trainer to a torch engine: weights arrive under the engine's
names and layouts, checked by the model's own outputs.

One small GPT-style transformer is written twice: in Flax NNX for the
trainer (separate q/k/v and gate/up projections, `(in, out)` kernels, an
embedding used again as the output projection) and in torch for the engine
(`nn.Linear`'s `(out, in)` weights, one fused qkv and one fused gate/up
tensor per layer, the output projection tied to the embedding). The trainer
takes real optimizer steps (optax's Adam) and publishes each version with
`rdt_jax.WeightPublisher`; two torch engines pull every version into
`dict(model.named_parameters())` through one `source=` mapping: one in
float32, one in bfloat16 (the cast happens in the pull).

After each version:
* the float32 engine's logits on a fixed batch match the JAX model's to
  float32 tolerance;
* every bfloat16 weight is bit for bit jax's own cast of the trainer's.

Random init, nothing downloaded. Needs flax and optax (`pip install flax optax`).

Run:  python examples/jax_to_torch.py [--steps 3]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import ray

import rdt_jax

rdt_jax.register()

VOCAB, WIDTH, HEADS, LAYERS, SEQ, FFN = 101, 64, 4, 2, 16, 128


def flax_model(seed: int):
  """The trainer's model, in Flax NNX."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.ln1 = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)
      self.q, self.k, self.v, self.o = (nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(4))
      self.ln2 = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)
      self.gate, self.up = nnx.Linear(WIDTH, FFN, rngs=rngs), nnx.Linear(WIDTH, FFN, rngs=rngs)
      self.down = nnx.Linear(FFN, WIDTH, rngs=rngs)

    def __call__(self, x):
      b, t, _ = x.shape
      h = self.ln1(x)
      q, k, v = (p(h).reshape(b, t, HEADS, -1).transpose(0, 2, 1, 3) for p in (self.q, self.k, self.v))
      att = q @ k.swapaxes(-1, -2) / np.sqrt(WIDTH // HEADS)
      att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
      y = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, WIDTH)
      x = x + self.o(y)
      h = self.ln2(x)
      return x + self.down(nnx.silu(self.gate(h)) * self.up(h))

  class GPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
      self.pos = nnx.Param(jax.random.normal(rngs.params(), (SEQ, WIDTH)) * 0.02)
      self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
      self.ln_f = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
      for block in self.blocks:
        x = block(x)
      return self.embed.attend(self.ln_f(x))  # tied output projection

  return GPT(nnx.Rngs(seed))


def torch_model(dtype: str):
  """The engine's model, in torch: fused projections, tied output."""
  import torch
  from torch import nn
  from torch.nn import functional as F

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
      self.qkv, self.o = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
      self.gate_up, self.down = nn.Linear(WIDTH, 2 * FFN), nn.Linear(FFN, WIDTH)

    def forward(self, x):
      b, t, _ = x.shape
      q, k, v = (p.reshape(b, t, HEADS, -1).transpose(1, 2) for p in self.qkv(self.ln1(x)).split(WIDTH, -1))
      att = q @ k.transpose(-1, -2) / np.sqrt(WIDTH // HEADS)
      att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
      x = x + self.o((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, WIDTH))
      gate, up = self.gate_up(self.ln2(x)).split(FFN, -1)
      return x + self.down(F.silu(gate) * up)

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(VOCAB, WIDTH)
      self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
      self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
      self.ln_f = nn.LayerNorm(WIDTH)

    def forward(self, tokens):
      x = self.embed(tokens) + self.pos[: tokens.shape[1]]
      for block in self.blocks:
        x = block(x)
      return self.ln_f(x) @ self.embed.weight.T  # tied output projection

  return GPT().to(getattr(torch, dtype))


def torch_source(name: str):
  """Where each torch parameter comes from in the Flax tree: the one place
  the two models' names and layouts meet. `name` is the torch parameter's
  name (`blocks.0.qkv.weight`); published paths are written with dots."""
  if name in ("embed.weight", "pos"):
    return {"embed.weight": "embed.embedding", "pos": "pos"}[name]
  if name.startswith("ln_f."):
    return "ln_f." + {"weight": "scale", "bias": "bias"}[name.split(".")[-1]]
  _, layer, module, kind = name.split(".")
  at = f"blocks.{layer}"
  if module.startswith("ln"):
    return f"{at}.{module}." + {"weight": "scale", "bias": "bias"}[kind]
  parts = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up"), "o": ("o",), "down": ("down",)}[module]
  if kind == "weight":  # Flax kernels are (in, out); torch weights (out, in)
    return rdt_jax.Fuse(*(rdt_jax.From(f"{at}.{p}.kernel", transpose=(1, 0)) for p in parts))
  return rdt_jax.Fuse(*(f"{at}.{p}.bias" for p in parts))


def batch() -> np.ndarray:
  return np.random.default_rng(7).integers(0, VOCAB, (4, SEQ)).astype(np.int32)


@ray.remote(enable_tensor_transport=True)
class Trainer:
  """Takes optimizer steps on next-token prediction (one fixed batch: the
  loss falls) and publishes each version."""

  def __init__(self):
    import optax
    from flax import nnx

    self.model = flax_model(seed=0)
    self.optimizer = nnx.Optimizer(self.model, optax.adam(1e-2), wrt=nnx.Param)
    self.pub = rdt_jax.WeightPublisher(keep=2)
    self.tokens = np.random.default_rng(1).integers(0, VOCAB, (8, SEQ + 1)).astype(np.int32)

  def step(self, version: int):
    """One optimizer step; publishes the new parameters. Returns the handle,
    the model's logits on the fixed batch and the parameters (to check)."""
    import jax
    import optax
    from flax import nnx

    tokens = self.tokens

    def loss(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    value, grads = nnx.value_and_grad(loss)(self.model)
    self.optimizer.update(self.model, grads)
    params = nnx.state(self.model, nnx.Param).to_pure_dict()
    handle = self.pub.publish(params, version=version)
    logits = np.asarray(self.model(batch()))
    return handle, float(value), logits, jax.tree_util.tree_map(np.asarray, params)


@ray.remote(enable_tensor_transport=True)
class Engine:
  """A torch inference engine: pulls each version into its own parameters."""

  def __init__(self, dtype: str):
    self.model = torch_model(dtype)
    self.params = dict(self.model.named_parameters())  # the tied output shares embed.weight
    self.sub = rdt_jax.WeightSubscriber(self.params, source=torch_source)

  def load(self, handle):
    import torch

    self.sub.pull(handle)
    with torch.no_grad():
      logits = self.model(torch.from_numpy(batch()).long()).float().numpy()
    bits = {n: p.detach().view(torch.int16).numpy().copy() for n, p in self.params.items() if p.dtype == torch.bfloat16}
    return logits, bits, self.sub.version, self.sub.last_pull


def expected_bits(params: dict) -> dict:
  """Each torch parameter of a bfloat16 engine, as jax casts the trainer's
  float32 values, as raw bits."""
  import jax.numpy as jnp

  def at(path: str) -> np.ndarray:
    x = params
    for key in path.split("."):
      x = x[int(key)] if key.isdigit() else x[key]
    return x

  out = {}
  for name in dict(torch_model("float32").named_parameters()):
    spec = torch_source(name)
    parts = spec.parts if isinstance(spec, rdt_jax.Fuse) else (rdt_jax.From(spec),)
    value = np.concatenate([at(p.path).transpose(p.transpose) if p.transpose else at(p.path) for p in parts])
    out[name] = np.asarray(jnp.asarray(value).astype(jnp.bfloat16)).view(np.int16)
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
  trainer, f32, bf16 = Trainer.remote(), Engine.remote("float32"), Engine.remote("bfloat16")
  ok = True
  for version in range(1, args.steps + 1):
    handle, loss, want, params = ray.get(trainer.step.remote(version))
    logits, _, held, last = ray.get(f32.load.remote(handle))
    _, bits, held16, _ = ray.get(bf16.load.remote(handle))
    err = float(np.max(np.abs(logits - want)))
    same = np.allclose(logits, want, rtol=1e-4, atol=1e-4)
    want_bits = expected_bits(params)
    exact = bits.keys() == want_bits.keys() and all(np.array_equal(bits[n], b) for n, b in want_bits.items())
    ok = ok and same and exact and held == held16 == version
    print(f"version {version}: loss {loss:.3f}, float32 logits within {err:.1e} of jax: {same}, "
          f"bfloat16 weights bit for bit: {exact}, pulled {last.nbytes} bytes by {last.route}")
  ray.shutdown()
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
