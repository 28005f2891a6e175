"""Finding calls by readable path, calling a subtree on its own, and clear errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.linen import module as linen_module

import flaxlens as fl

from .conftest import assert_trees_equal, call, convert


def test_a_call_is_found_by_its_module_path(cases):
  tree = convert(cases["transformer"])
  node = tree.select().at_path("TransformerBlock_1/MultiHeadDotProductAttention_0").get()
  assert node.path == ("TransformerBlock_1", "MultiHeadDotProductAttention_0")
  assert isinstance(node.module, nn.MultiHeadDotProductAttention)


def test_path_globs_select_several_calls(cases):
  tree = convert(cases["transformer"])
  found = tree.select().at_path("TransformerBlock_*/Dense_*").get_sequence()
  # In call order: each block calls Dense_1 (created second) before Dense_0.
  assert [n.readable_path()[0] for n in found] == [
    "TransformerBlock_0/Dense_1",
    "TransformerBlock_0/Dense_0",
    "TransformerBlock_1/Dense_1",
    "TransformerBlock_1/Dense_0",
  ]
  assert tree.select().at_path("**/query.__call__").count() == 2


def test_an_unknown_path_lists_known_ones(cases):
  tree = convert(cases["mlp"])
  with pytest.raises(KeyError, match="Dense_0"):
    tree.select().at_path("Dense_7")


def test_a_child_called_on_its_own_applies_its_module(cases):
  case = cases["transformer"]
  tree = convert(case)
  block = tree.select().at_path("TransformerBlock_0").get()
  x = jnp.ones((2, 4, 8))
  expected = block.module.apply({"params": case.variables["params"]["TransformerBlock_0"]}, x)
  assert_trees_equal(block(fl.ArgsAndKwargs.capture(x)), expected)


def test_a_call_inside_scan_refuses_to_run_on_its_own(cases):
  tree = convert(cases["scan"])
  dense = tree.select().at_path("layers/Dense_0").get()
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="layers/Dense_0.*nn.scan"):
    dense(fl.ArgsAndKwargs.capture(jnp.ones((2, 8))))


def test_a_bound_module_is_refused(cases):
  case = cases["mlp"]
  bound = case.module.bind(case.variables)
  with pytest.raises(fl.FlaxlensError, match="unbound"):
    fl.unflaxify(bound, case.variables, *case.args)


def test_variables_must_be_a_dict(cases):
  case = cases["mlp"]
  with pytest.raises(TypeError, match="variables must be a dict"):
    fl.unflaxify(case.module, [case.variables], *case.args)


def test_an_unknown_method_is_refused(cases):
  case = cases["mlp"]
  with pytest.raises(fl.FlaxlensError, match="no method 'encode'"):
    fl.unflaxify(case.module, case.variables, *case.args, method="encode")


def test_a_call_needs_args_and_kwargs(cases):
  tree = convert(cases["mlp"])
  with pytest.raises(TypeError, match="ArgsAndKwargs"):
    tree(jnp.ones((2, 8)))


def test_unbound_slots_are_reported_by_label(cases):
  tree, _ = fl.unbind_variables(convert(cases["mlp"]))
  with pytest.raises(fl.FlaxlensError, match="params:Dense_0/"):
    tree(fl.ArgsAndKwargs.capture(jnp.ones((2, 8))))


class LazyCache(nn.Module):
  @nn.compact
  def __call__(self, x, remember: bool = False):
    if remember:
      self.variable("cache", "last", lambda: x)
    return nn.Dense(2)(x)


def test_a_variable_created_only_at_call_time_is_an_error_not_lost():
  module = LazyCache()
  x = jnp.ones((1, 3))
  variables = module.init(jax.random.key(0), x)
  tree = fl.unflaxify(module, variables, x, mutable=["cache"])
  with pytest.raises(fl.CallStructureError, match="cache:last"):
    tree(fl.ArgsAndKwargs.capture(x, remember=True))


class Zeros(fl.Layer):
  def __call__(self, argument, /, **side_inputs):
    return jnp.zeros((2, 8))


def test_another_branch_with_patches_present_is_an_error(cases):
  case = cases["branch"]
  patched = convert(case).select().at_path("Scale_0").apply(lambda _: Zeros())
  with pytest.raises(fl.CallStructureError, match="b.__call__"):
    call(patched, case, mode="b")


class Boom(fl.Layer):
  def __call__(self, argument, /, **side_inputs):
    raise RuntimeError("boom")


def test_no_interceptor_is_left_behind_when_a_replacement_raises(cases):
  case = cases["mlp"]
  patched = convert(case).select().at_path("Dense_1").apply(lambda _: Boom())
  with pytest.raises(RuntimeError, match="boom"):
    call(patched, case)
  assert len(linen_module._global_interceptor_stack) == 0
  assert_trees_equal(call(convert(case), case), case.apply())
