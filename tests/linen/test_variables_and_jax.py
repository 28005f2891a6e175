"""Editing a converted tree's variables, and running it under jit, grad and vmap."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl

from .conftest import assert_trees_equal, call, convert, flat_collections, tree_state


def test_tree_parameters_share_the_callers_buffers(cases):
  case = cases["transformer"]
  tree = convert(case)
  given = {id(leaf) for leaf in jax.tree_util.tree_leaves(case.variables)}
  params = [v for v in fl.variables_in(tree) if isinstance(v, fl.Parameter)]
  assert params and all(id(p.value) in given for p in params)
  assert len(params) == len(jax.tree_util.tree_leaves(case.variables["params"]))


def test_editing_a_parameter_changes_the_next_call(cases):
  case = cases["mlp"]
  tree = convert(case)
  kernel = tree.submodule_calls[(1, "Dense_1.__call__")].scope_data.parameters["kernel"]
  kernel.value = kernel.value * 2.0
  edited = jax.tree_util.tree_map(lambda x: x, case.variables)
  edited["params"]["Dense_1"]["kernel"] = kernel.value
  assert_trees_equal(call(tree, case), case.module.apply(edited, *case.args))


def test_calls_of_one_module_share_its_parameter_objects(cases):
  tree = convert(cases["shared_child_called_twice"])
  first, second = tree.submodule_calls.values()
  assert first.scope_data.parameters["kernel"] is second.scope_data.parameters["kernel"]


def test_a_module_passed_to_two_parents_has_one_set_of_parameters(cases):
  tree = convert(cases["passed_attribute"])
  kernels = {
    id(v) for v in fl.variables_in(tree) if isinstance(v, fl.Parameter) and "kernel" in v.label
  }
  assert len(kernels) == 1


def test_variables_created_during_the_call_start_uninitialized_and_are_filled(cases):
  case = cases["sow_new_collection"]
  tree = convert(case)
  (sown,) = [v for v in fl.variables_in(tree) if v.label.startswith("intermediates:")]
  assert isinstance(sown.value, fl.Uninitialized)
  call(tree, case)
  _, state = case.apply()
  assert_trees_equal(sown.value, flat_collections(state)[sown.label])


def test_variable_jit_matches_and_writes_state_back(cases):
  case = cases["batchnorm_train"]
  tree = convert(case)
  run = fl.variable_jit(lambda t, x: t(fl.ArgsAndKwargs.capture(x, train=True)))
  out = run(tree, *case.args)
  expected_out, expected_state = case.apply()
  np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
  jitted_state = tree_state(tree)
  for label, value in flat_collections(expected_state).items():
    np.testing.assert_allclose(jitted_state[label], value, rtol=1e-6, atol=1e-6)


def test_jit_does_not_recompile_when_only_parameter_values_change(cases):
  case = cases["transformer"]
  tree = convert(case)
  traces = []

  def forward(t, x):
    traces.append(1)
    return t(fl.ArgsAndKwargs.capture(x))

  run = fl.variable_jit(forward)
  run(tree, *case.args)
  for scale in (2.0, 3.0, 4.0):
    for p in fl.variables_in(tree):
      p.value = jax.tree_util.tree_map(lambda a, s=scale: a * s, p.value)
    run(tree, *case.args)
  assert len(traces) == 1


def test_jax_jit_of_unbound_values_matches_apply(cases):
  case = cases["dropout"]
  tree, values = fl.unbind_variables(convert(case), freeze=True)

  @jax.jit
  def forward(values, x, key):
    out, _ = tree.stateless_call(
      values, fl.ArgsAndKwargs.capture(x), random_streams={"dropout": key}
    )
    return out

  out = forward(values, *case.args, case.rngs["dropout"])
  np.testing.assert_allclose(out, case.apply(), rtol=1e-6, atol=1e-6)


def test_grad_with_respect_to_parameters_matches_flax(cases):
  case = cases["mlp"]
  tree, values = fl.unbind_variables(convert(case), freeze=True)

  def loss_tree(values):
    out, _ = tree.stateless_call(values, fl.ArgsAndKwargs.capture(*case.args))
    return (out**2).sum()

  def loss_flax(params):
    return (case.module.apply({"params": params}, *case.args) ** 2).sum()

  grads = {v.label: v.value for v in jax.grad(loss_tree)(values)}
  expected = flat_collections({"params": jax.grad(loss_flax)(case.variables["params"])})
  assert_trees_equal(grads, expected)


def test_perturbation_gradients_match_flax(cases):
  case = cases["perturb"]
  tree = convert(case, mutable=False)
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


def test_vmap_over_inputs_matches_vmapped_apply(cases):
  case = cases["mlp"]
  tree = convert(case)
  xs = jnp.stack([case.args[0], case.args[0] * 2.0])
  out = jax.vmap(lambda x: tree(fl.ArgsAndKwargs.capture(x)))(xs)
  expected = jax.vmap(lambda x: case.module.apply(case.variables, x))(xs)
  assert_trees_equal(out, expected)


@pytest.mark.parametrize("batch", [2, 4096])
def test_conversion_is_abstract_and_accepts_shape_only_inputs(cases, batch):
  case = cases["transformer"]
  tokens = jax.ShapeDtypeStruct((batch, case.args[0].shape[1]), jnp.int32)
  tree = fl.unflaxify(case.module, case.variables, tokens)
  assert list(tree.submodule_calls) == list(convert(case).submodule_calls)


@pytest.mark.parametrize("name", ["batchnorm_train", "transformer", "scan", "passed_attribute"])
def test_edited_variables_export_back_to_flax(cases, name):
  case = cases[name]
  tree = convert(case)
  for p in fl.variables_in(tree):
    if isinstance(p, fl.Parameter):
      p.value = jax.tree_util.tree_map(lambda a: a * 1.5, p.value)
  exported = tree.export()
  result = case.module.apply(
    exported, *case.args, rngs=case.rngs, mutable=case.mutable, **case.kwargs
  )
  expected = result[0] if case.mutable else result
  assert_trees_equal(call(tree, case), expected)


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
