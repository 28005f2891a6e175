"""Editing a converted tree's variables, and running it under jit, grad and vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import flaxlens as fl

from .conftest import assert_trees_equal, call, convert, model_state, tree_state


def test_editing_a_parameter_changes_the_next_call(cases):
  case = cases["mlp"]
  tree = convert(case)
  kernel = tree.select().at_path("out").get().scope_data.parameters["kernel"]
  kernel.value = kernel.value * 2.0
  reference = nnx.clone(case.model)
  reference.out.kernel.set_value(kernel.value)
  assert_trees_equal(call(tree, case), case.native(reference))


def test_editing_a_stacked_parameter_inside_scan_changes_every_iteration(cases):
  case = cases["scan"]
  tree = convert(case)
  bias = tree.select().at_path("blocks/linear").get().scope_data.parameters["bias"]
  bias.value = bias.value + jnp.arange(4.0)[:, None]
  reference = nnx.clone(case.model)
  reference.blocks.linear.bias.set_value(bias.value)
  assert_trees_equal(call(tree, case), case.native(reference))


def test_calls_of_one_module_share_its_parameter_objects(cases):
  tree = convert(cases["called_twice"])
  first, second = tree.submodule_calls.values()
  assert first.scope_data.parameters["kernel"] is second.scope_data.parameters["kernel"]


def test_a_module_held_by_two_parents_has_one_set_of_parameters(cases):
  tree = convert(cases["shared_submodule"])
  kernels = {id(v) for v in fl.variables_in(tree) if v.label.endswith("kernel")}
  assert len(kernels) == 1
  assert tree.select().at_path("first/inner").count() == 2


def test_variables_created_by_the_call_start_uninitialized_and_are_filled(cases):
  case = cases["attention_init_cache"]
  tree = convert(case)
  created = {v.label: v for v in fl.variables_in(tree) if v.label.startswith("Cache:")}
  assert set(created) == {"Cache:cache_index", "Cache:cached_key", "Cache:cached_value"}
  assert all(isinstance(v.value, fl.Uninitialized) for v in created.values())
  call(tree, case)
  reference = nnx.clone(case.model)
  case.native(reference)
  assert_trees_equal(tree_state(tree), model_state(reference))


def test_dropout_masks_follow_the_trees_rng_state(cases):
  case = cases["convnet_train"]
  tree = convert(case)
  first, second = call(tree, case), call(tree, case)
  assert not jnp.array_equal(first, second)
  count = tree.select().at_path("drop").get().scope_data.variables["RngCount"]["rngs/count"]
  assert int(count.value) == 2
  count.value = jnp.zeros_like(count.value)
  mean = tree.select().at_path("norm").get().scope_data.variables["batch_stats"]["mean"]
  var = tree.select().at_path("norm").get().scope_data.variables["batch_stats"]["var"]
  reference = nnx.clone(case.model)
  reference.norm.mean.set_value(mean.value)
  reference.norm.var.set_value(var.value)
  assert_trees_equal(call(tree, case), case.native(reference))


@pytest.mark.parametrize("name", ["convnet_train", "unhashable_static_attributes"])
def test_variable_jit_matches_nnx_jit_and_writes_state_back(cases, name):
  case = cases[name]
  tree = convert(case)
  run = fl.variable_jit(lambda t, x: t(fl.ArgsAndKwargs.capture(x)))
  reference = nnx.clone(case.model)
  native = nnx.jit(lambda m, x: m(x))
  for _ in range(2):
    assert_trees_equal(run(tree, *case.args), native(reference, *case.args))
  assert_trees_equal(tree_state(tree), model_state(reference))


def test_jit_does_not_recompile_when_only_parameter_values_change(cases):
  case = cases["scan"]
  tree = convert(case)
  traces = []

  def forward(t, x):
    traces.append(1)
    return t(fl.ArgsAndKwargs.capture(x))

  run = fl.variable_jit(forward)
  run(tree, *case.args)
  for scale in (2.0, 3.0):
    for p in fl.variables_in(tree):
      if isinstance(p, fl.Parameter):
        p.value = p.value * scale
    run(tree, *case.args)
  assert len(traces) == 1


def test_jax_jit_of_a_stateless_call_matches_nnx_jit(cases):
  case = cases["vmap_ensemble"]
  tree, values = fl.unbind_variables(convert(case), freeze=True)

  @jax.jit
  def forward(values, x):
    out, _ = tree.stateless_call(values, fl.ArgsAndKwargs.capture(x))
    return out

  expected = nnx.jit(lambda m, x: m(x))(nnx.clone(case.model), *case.args)
  assert_trees_equal(forward(values, *case.args), expected)


def test_grad_with_respect_to_parameters_matches_nnx_grad(cases):
  case = cases["remat"]
  tree, values = fl.unbind_variables(convert(case), freeze=True)
  params = [v for v in values if isinstance(v, fl.ParameterValue)]
  states = [v for v in values if not isinstance(v, fl.ParameterValue)]

  def loss_tree(params):
    out, _ = tree.stateless_call([*params, *states], fl.ArgsAndKwargs.capture(*case.args))
    return (out**2).sum()

  def loss_nnx(model):
    return (model(*case.args) ** 2).sum()

  grads = {v.label: v.value for v in jax.grad(loss_tree)(params)}
  expected = nnx.grad(loss_nnx)(nnx.clone(case.model))
  assert_trees_equal(grads, model_state(expected))


def test_vmap_over_inputs_matches_vmapped_model(cases):
  case = cases["mlp"]
  tree = convert(case)
  xs = jnp.stack([case.args[0], case.args[0] * 2.0])
  out = jax.vmap(lambda x: tree(fl.ArgsAndKwargs.capture(x)))(xs)
  expected = jax.vmap(nnx.clone(case.model))(xs)
  assert_trees_equal(out, expected)


@pytest.mark.parametrize("batch", [2, 4096])
def test_conversion_is_abstract_and_accepts_shape_only_inputs(cases, batch):
  case = cases["scan"]
  x = jax.ShapeDtypeStruct((batch, 4), jnp.float32)
  tree = fl.unflaxify(case.model, x)
  assert [n.readable_path() for n in tree.select().at_path("**").get_sequence()] == [
    n.readable_path() for n in convert(case).select().at_path("**").get_sequence()
  ]
  assert_trees_equal(call(tree, case), case.native(nnx.clone(case.model)))


def test_the_tree_exports_a_plain_nnx_module_with_its_current_variables(cases):
  case = cases["convnet_train"]
  tree = convert(case)
  call(tree, case)
  tree.select().at_path("head").get().scope_data.parameters["bias"].value += 1.0
  exported = tree.export()
  assert [type(m) for _, m in nnx.iter_modules(exported)] == [
    type(m) for _, m in nnx.iter_modules(case.model)
  ]
  assert_trees_equal(model_state(exported), tree_state(tree))
  assert_trees_equal(case.native(exported), call(tree, case))
  assert_trees_equal(model_state(exported), tree_state(tree))


def test_an_exported_module_includes_variables_the_call_created(cases):
  case = cases["sow_outside_capture"]
  tree = convert(case)
  assert not hasattr(tree.export(), "hidden")
  call(tree, case)
  assert_trees_equal(model_state(tree.export()), tree_state(tree))


def test_export_refuses_a_tree_whose_variables_left_with_a_replaced_call(cases):
  case = cases["mlp"]
  patched = convert(case).select().at_path("hidden").apply(lambda _: fl.ArgsAndKwargs)
  with pytest.raises(fl.FlaxlensError, match=r"MLP.__call__: .*'hidden/bias'"):
    patched.export()


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
