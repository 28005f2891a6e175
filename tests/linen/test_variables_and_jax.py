"""Variables only Linen has: the `perturbations` collection, immutable collections.

Variable behaviours both frameworks share are in tests/shared/test_variables_and_jax.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN

import flaxlens as fl


def test_perturbation_gradients_match_flax(cases):
  case = cases["perturb"]
  tree = LINEN.convert(case, mutable=False)
  perturbation = case.variables["perturbations"]["hidden"]

  def loss_tree(delta):
    patched = (
      tree.select()
      .at(lambda t: t.scope_data.immutable_variables["perturbations"]["hidden"])
      .set(delta)
    )
    return patched(fl.ArgsAndKwargs.capture(*case.args)).sum()

  def loss_flax(delta):
    variables = {**case.variables, "perturbations": {"hidden": delta}}
    return case.module.apply(variables, *case.args).sum()

  assert_trees_equal(jax.grad(loss_tree)(perturbation), jax.grad(loss_flax)(perturbation))


class ScaledTwice(nn.Module):
  @nn.compact
  def __call__(self, x):
    scaled = Scaler(name="scaler")
    return scaled(scaled(x))


class Scaler(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x * self.variable("constants", "scale", lambda: jnp.full((), 3.0)).value


def test_an_immutable_value_shared_by_two_calls_works_under_jit():
  module, x = ScaledTwice(), jnp.ones((2,))
  variables = module.init(jax.random.key(0), x)
  tree = fl.unflaxify(module, variables, x)
  out = fl.variable_jit(lambda t, x: t(fl.ArgsAndKwargs.capture(x)))(tree, x)
  assert_trees_equal(out, module.apply(variables, x))


def test_replacing_an_immutable_value_in_one_of_two_calls_is_an_error():
  module, x = ScaledTwice(), jnp.ones((2,))
  tree = fl.unflaxify(module, module.init(jax.random.key(0), x), x)
  edited = (
    tree.select()
    .at(
      lambda t: t.submodule_calls[(0, "scaler.__call__")].scope_data.immutable_variables[
        "constants"
      ]["scale"]
    )
    .set(jnp.full((), 5.0))
  )
  with pytest.raises(fl.FlaxlensError, match="constants:scaler/scale"):
    edited(fl.ArgsAndKwargs.capture(x))


class _Sowing(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Dense(3)(x)
    self.sow("intermediates", "y", y)
    return nn.relu(y)


def test_sown_values_pile_up_over_tree_calls_as_apply_given_back_its_variables():
  """The tree's state is what the call before left (README, "What a tree is"): three tree
  calls sow what three `apply` calls chained on their returned variables sow."""
  model, x = _Sowing(), jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  params = model.init(jax.random.key(0), x)["params"]
  tree = fl.unflaxify(model, {"params": params}, x, mutable=["intermediates"])
  variables = {"params": params}
  for call in range(3):
    ours = fl.run(tree, x)
    out, updated = model.apply(variables, x, mutable=["intermediates"])
    variables = {"params": params, **updated}
    assert_trees_equal(ours, out)
    sown = tree.scope_data.variables["intermediates"]["y"].value
    assert len(sown) == call + 1
    assert_trees_equal(sown, updated["intermediates"]["y"])
