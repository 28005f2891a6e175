"""A run that updates state the tree holds frozen is refused, never silently dropped."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import LINEN, NNX

import flaxlens as fl

X = jnp.arange(12.0).reshape(4, 3)


def _linen_tree():
  model = nn.BatchNorm(use_running_average=False)
  variables = model.init(jax.random.key(0), X)
  return fl.unflaxify(model, variables, X, mutable=["batch_stats"])


def _nnx_tree():
  return fl.unflaxify(nnx.BatchNorm(3, rngs=nnx.Rngs(0)), X)


@pytest.mark.parametrize("make", [_linen_tree, _nnx_tree], ids=["linen", "nnx"])
def test_updating_frozen_state_is_refused_and_leaves_the_tree_as_it_was(make):
  frozen = fl.freeze_variables(make())
  before = jax.tree_util.tree_leaves(frozen)
  with pytest.raises(fl.VariableError, match="frozen"):
    frozen(fl.ArgsAndKwargs.capture(X))
  assert all(a is b for a, b in zip(before, jax.tree_util.tree_leaves(frozen), strict=True))


@pytest.mark.parametrize(
  "fw, name", [(LINEN, "mlp"), (LINEN, "sequential"), (NNX, "mlp"), (NNX, "sequential")]
)
def test_a_frozen_tree_through_a_plain_jax_jit_function_matches_the_native_call(corpora, fw, name):
  case = corpora[fw][name]
  frozen = fl.freeze_variables(fw.convert(case))
  expected_out, _ = fw.native(case, jit=True)
  out = jax.jit(lambda tree, argument: tree(argument))(frozen, fw.argument(case))
  assert_trees_equal(out, expected_out)
