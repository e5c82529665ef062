"""`From(index=...)` cuts as `rdt_jax.Slice` does: an int keeps its axis, with
length 1 (docs/jax_to_torch.md, "Stacked layers"). Checked on the plan a mapped
subscriber makes at the first pull of a structure, from the published leaves'
paths, shapes and dtypes; examples/rl_loop.py pulls a stack this way through Ray.
"""

from __future__ import annotations

import pytest
import torch

import rdt_jax
from rdt_jax.weights._mapping import MappedPlan

L, D = 3, 4
#: A published value {"w": an (L, D, D) float32 stack}, as a plan sees it.
STACK = [("['w']", "array", (L, D, D), "float32")]


def plan(tensor: torch.Tensor, source: rdt_jax.From) -> MappedPlan:
  return MappedPlan(STACK, [("['layer2']", tensor)], {"layer2": source}, atomic=False)


def test_an_int_index_keeps_its_axis_with_length_one():
  assert list(plan(torch.zeros(1, D, D), rdt_jax.From("w", index=2)).writes) == ["['w']"]
  with pytest.raises(rdt_jax.MappingError) as refused:
    plan(torch.zeros(D, D), rdt_jax.From("w", index=2))
  assert str(refused.value) == (
      "The template leaf ['layer2'] has shape (4, 4); its source ['w'] gives (1, 4, 4) after index (2,).")
  assert rdt_jax.From("w", index=2) == rdt_jax.From("w", index=rdt_jax.Slice[2])


def test_a_layer_of_the_stack_as_d_by_d_is_a_reshape_then_its_rows():
  source = rdt_jax.From("w", reshape=(L * D, D), index=(slice(2 * D, 3 * D),))
  assert list(plan(torch.zeros(D, D), source).writes) == ["['w']"]
