"""Variables only NNX has: rng state in modules, exported `nnx.Module`s, `nnx.capture` deltas.

Variable behaviours both frameworks share are in tests/shared/test_variables_and_jax.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import NNX, model_state

import flaxlens as fl


def test_dropout_masks_follow_the_trees_rng_state(cases):
  case = cases["convnet_train"]
  tree = NNX.convert(case)
  first, second = NNX.call(tree, case), NNX.call(tree, case)
  assert not jnp.array_equal(first, second)
  count = NNX.state(tree.select().at_path("drop").get())["rngs/count"]
  assert int(count.value) == 2
  count.value = jnp.zeros_like(count.value)
  norm = NNX.state(tree.select().at_path("norm").get())
  reference = case
  for name in ("mean", "var"):
    reference = NNX.with_variable(reference, norm[name].label, norm[name].value)
  assert_trees_equal(NNX.call(tree, case), NNX.native(reference)[0])


def test_the_exported_module_has_the_models_module_classes(cases):
  case = cases["convnet_train"]
  exported = NNX.export(NNX.convert(case))
  assert [type(m) for _, m in nnx.iter_modules(exported)] == [
    type(m) for _, m in nnx.iter_modules(case.model)
  ]


def test_an_exported_module_includes_variables_the_call_created(cases):
  case = cases["sow_outside_capture"]
  tree = NNX.convert(case)
  assert not hasattr(NNX.export(tree), "hidden")
  NNX.call(tree, case)
  assert_trees_equal(model_state(NNX.export(tree)), NNX.tree_state(tree))


def test_export_refuses_a_tree_whose_variables_left_with_a_replaced_call(cases):
  case = cases["mlp"]
  patched = NNX.convert(case).select().at_path("hidden").apply(lambda _: fl.ArgsAndKwargs)
  with pytest.raises(fl.FlaxlensError, match=r"MLP.__call__: .*'hidden/bias'"):
    NNX.export(patched)


def test_perturbation_gradients_match_nnx(cases):
  """The `nnx.capture(init=perturbations)` + grad workflow, through the tree."""
  case = cases["capture_sow_perturb"]
  x = case.args[0]

  def forward(model, x, perturbations):
    out, _ = nnx.capture(model, nnx.Intermediate, init=perturbations)(x)
    return out

  _, perturbations = nnx.capture(nnx.clone(case.model), nnx.Perturbation)(x)
  tree = fl.unflaxify(case.model, x, perturbations, method=forward)

  def loss_tree(perturbations):
    return tree(fl.ArgsAndKwargs.capture(x, perturbations)).sum()

  def loss_nnx(perturbations):
    return forward(nnx.clone(case.model), x, perturbations).sum()

  assert_trees_equal(jax.grad(loss_tree)(perturbations), jax.grad(loss_nnx)(perturbations))
