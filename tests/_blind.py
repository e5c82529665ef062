"""An actor class whose module needs no RDT transport registered to import.

Used where a test hides NIXL from an actor: `rdt_jax.register()` then skips
`jax_nixl` there, so a module defining `jax_nixl` methods could not load.
"""

import ray


@ray.remote(enable_tensor_transport=True)
class BlindConsumer:
  def leaf_types(self, value):
    return {k: type(v).__name__ for k, v in value.items()}
