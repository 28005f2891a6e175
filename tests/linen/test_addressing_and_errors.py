"""Errors only Linen has: bound modules, variables dicts, interceptors left behind.

Addressing and errors both frameworks share are in tests/shared/test_addressing_and_errors.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax.linen import module as linen_module
from frameworks import LINEN

import flaxlens as fl


def test_a_bound_module_is_refused(cases):
  case = cases["mlp"]
  bound = case.module.bind(case.variables)
  with pytest.raises(fl.FlaxlensError, match="unbound"):
    fl.unflaxify(bound, case.variables, *case.args)


def test_variables_must_be_a_dict(cases):
  case = cases["mlp"]
  with pytest.raises(TypeError, match="variables must be a dict"):
    fl.unflaxify(case.module, [case.variables], *case.args)


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


class Boom(fl.Layer):
  def __call__(self, argument, /, **side_inputs):
    raise RuntimeError("boom")


def test_no_interceptor_is_left_behind_when_a_replacement_raises(cases):
  case = cases["mlp"]
  patched = LINEN.convert(case).select().at_path("Dense_1").apply(lambda _: Boom())
  with pytest.raises(RuntimeError, match="boom"):
    LINEN.call(patched, case)
  assert len(linen_module._global_interceptor_stack) == 0
  assert_trees_equal(LINEN.call(LINEN.convert(case), case), case.apply())


class DoublesItsParameter(nn.Module):
  """A call that puts a new value into the 'params' collection."""

  @nn.compact
  def __call__(self, x):
    p = self.param("p", nn.initializers.ones, (3,))
    self.put_variable("params", "p", p * 2)
    return x * p


def test_a_call_that_updates_params_is_refused_at_conversion():
  module, x = DoublesItsParameter(), jnp.ones((2, 3))
  variables = module.init(jax.random.key(0), x)
  before = variables["params"]["p"]
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="updates the parameter 'p'"):
    fl.unflaxify(module, variables, x, mutable=["params"])
  assert variables["params"]["p"] is before
  assert_trees_equal(before, jnp.full(3, 2.0))


class Normalizes(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.BatchNorm(use_running_average=False)(nn.Dense(3)(x))


@pytest.mark.parametrize("mutable", [True, ["params", "batch_stats"]])
def test_params_listed_as_mutable_but_left_unchanged_convert(mutable):
  module, x = Normalizes(), jnp.arange(6.0).reshape(2, 3)
  variables = module.init(jax.random.key(0), x)
  tree = fl.unflaxify(module, variables, x, mutable=mutable)
  native, updates = module.apply(variables, x, mutable=mutable)
  assert_trees_equal(tree(fl.ArgsAndKwargs.capture(x)), native)
  assert_trees_equal(tree.export()["batch_stats"], updates["batch_stats"])
