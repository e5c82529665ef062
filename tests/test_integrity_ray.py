"""A torch conjugate view returned over Ray is refused by name on the producer,
never delivered as its unconjugated bytes."""

from __future__ import annotations

import pytest
import ray

torch = pytest.importorskip("torch")

import rdt_jax

rdt_jax.register()

RAY_NUM_CPUS = 2
pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(enable_tensor_transport=True)
class Producer:

  @ray.method(tensor_transport="jax_nixl")
  def weights(self, resolved: bool):
    w = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    return {"w": w.resolve_conj() if resolved else w}


def test_conjugate_view_is_refused_over_ray():
  producer = Producer.remote()
  got = ray.get(producer.weights.remote(True))["w"]
  assert torch.equal(got, torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
  with pytest.raises(Exception, match=r"\['w'\] is a torch conjugate view.*resolve_conj"):
    ray.get(producer.weights.remote(False))
