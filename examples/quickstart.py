"""Quickstart: a JAX actor returns a pytree over `jax_nixl`; a consumer gets it.

Run: python examples/quickstart.py   (starts a local Ray; CPU is enough)
"""

import jax
import jax.numpy as jnp
import ray

import rdt_jax

# Before any class that names the transport: @ray.method(tensor_transport=...)
# checks the name when the class is defined.
rdt_jax.register()


@ray.remote
class Learner:
  @ray.method(tensor_transport="jax_nixl")
  def params(self):
    # Stays in this actor; only shapes, dtypes and NIXL descriptors travel.
    return {"w": jnp.ones((1024, 1024)), "b": jnp.zeros(1024), "step": 3}


# A consumer-only actor: enable_tensor_transport=True lets it receive RDT objects.
@ray.remote(enable_tensor_transport=True)
class Worker:
  def summarize(self, params):
    # `params` arrived over jax_nixl: the same pytree, jax.Array leaves.
    w = params["w"]
    return (
        f"jax.Array: {isinstance(w, jax.Array)}, {w.dtype}{w.shape}, "
        f"sum {float(w.sum())}, step {params['step']}"
    )


if __name__ == "__main__":
  ray.init()
  learner, worker = Learner.remote(), Worker.remote()
  ref = learner.params.remote()  # an ObjectRef; the arrays stay in the learner

  # Passing the ref to another actor: the worker reads the bytes with NIXL.
  print("worker:", ray.get(worker.summarize.remote(ref)))

  # ray.get in the driver works too (jax_nixl is one-sided).
  params = ray.get(ref)
  print("driver:", {k: getattr(v, "shape", v) for k, v in sorted(params.items())})
  ray.shutdown()
