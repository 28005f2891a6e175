"""Variables only NNX has: rng state in modules, exported `nnx.Module`s, `nnx.capture` deltas.

Variable behaviours both frameworks share are in tests/shared/test_variables_and_jax.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import NNX, model_state, nnx_modules

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
  assert [type(m) for _, m in nnx_modules(exported)] == [
    type(m) for _, m in nnx_modules(case.model)
  ]


def test_an_exported_module_includes_variables_the_call_created(cases):
  case = cases["sow_outside_capture"]
  tree = NNX.convert(case)
  assert not hasattr(NNX.export(tree), "hidden")
  NNX.call(tree, case)
  assert_trees_equal(model_state(NNX.export(tree)), NNX.tree_state(tree))


def test_export_into_updates_the_given_models_variables_in_place(cases):
  case = cases["convnet_train"]
  model = nnx.clone(case.model)
  kernel = model.conv.kernel
  tree = NNX.convert(case)
  NNX.call(tree, case)
  tree.select().at_path("conv").get().scope_data.parameters["kernel"].value *= 2.0
  assert tree.export(into=model) is model
  assert model.conv.kernel is kernel
  assert_trees_equal(model_state(model), model_state(NNX.export(tree)))


def test_export_into_carries_a_mode_the_tree_changed(cases):
  case = cases["convnet_train"]
  model = nnx.clone(case.model)
  NNX.convert(case).eval().export(into=model)
  reference = nnx.clone(case.model)
  reference.eval()
  assert_trees_equal(model(*case.args), reference(*case.args))


def test_export_into_adds_variables_the_call_created(cases):
  case = cases["sow_outside_capture"]
  model = nnx.clone(case.model)
  tree = NNX.convert(case)
  NNX.call(tree, case)
  tree.export(into=model)
  assert_trees_equal(model_state(model), NNX.tree_state(tree))


def test_export_into_refuses_a_model_of_another_architecture(cases):
  tree = NNX.convert(cases["mlp"])
  other = type(cases["mlp"].model)(nnx.Rngs(0))
  other.hidden = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  before = model_state(other)
  with pytest.raises(fl.ExportError, match=r"'hidden/bias', 'hidden/kernel'"):
    tree.export(into=other)
  assert_trees_equal(model_state(other), before)


def test_export_into_refuses_a_model_of_another_class(cases):
  tree = NNX.convert(cases["mlp"])
  with pytest.raises(fl.ExportError, match="needs a MLP to update, got a Linear"):
    tree.export(into=nnx.Linear(4, 2, rngs=nnx.Rngs(0)))


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
