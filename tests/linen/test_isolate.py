"""Isolation only Linen has: batch statistics, a Dropout called twice, Python-valued arguments.

Isolation behaviours both frameworks share are in tests/shared/test_isolate.py.
"""

from __future__ import annotations

import dataclasses
import enum

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from comparisons import assert_trees_equal
from frameworks import LINEN

import flaxlens as fl


def test_batchnorm_state_before_and_after_are_saved(cases):
  case = cases["batchnorm_train"]
  isolated = LINEN.isolate(case, "BatchNorm_0")
  _, updates = case.apply()
  final = {v.label: v.value for v in isolated.final_var_values}
  initial = {v.label: v.value for v in isolated.initial_var_values}
  assert_trees_equal(final["batch_stats:mean"], updates["batch_stats"]["BatchNorm_0"]["mean"])
  assert_trees_equal(
    initial["batch_stats:mean"], case.variables["batch_stats"]["BatchNorm_0"]["mean"]
  )


class DropoutTwice(nn.Module):
  @nn.compact
  def __call__(self, x):
    block = nn.Dropout(0.5, deterministic=False)
    return block(x) + block(x)


def test_each_call_of_a_dropout_called_twice_draws_its_own_mask():
  module, x = DropoutTwice(), jnp.ones((4, 8))
  rngs = {"dropout": jax.random.key(3)}
  tree = fl.unflaxify(module, {}, x, rngs=rngs)
  masks = []
  for key in tree.submodule_calls:
    selection = tree.select().at(lambda t, k=key: t.submodule_calls[k])
    isolated = fl.isolate_submodel(selection, fl.ArgsAndKwargs.capture(x), random_streams=rngs)
    assert isolated.replay()
    masks.append(isolated.saved_output)
  assert not np.array_equal(masks[0], masks[1])
  assert_trees_equal(masks[0] + masks[1], module.apply({}, x, rngs=rngs))


class Mode(enum.Enum):
  FAST = "fast"
  SLOW = "slow"


class Configurable(nn.Module):
  @nn.compact
  def __call__(self, x, *, train: bool, name_tag: str, mode: Mode, extra=None):
    y = nn.Dense(3)(x)
    if train and mode is Mode.FAST and name_tag == "a" and extra is None:
      y = y * 2.0
    return y


class Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Configurable(name="inner")(x, train=True, name_tag="a", mode=Mode.FAST)


def test_python_valued_arguments_stay_python_values_and_replay_under_jit():
  module, x = Outer(), jnp.ones((2, 4))
  variables = module.init(jax.random.key(0), x)
  tree = fl.unflaxify(module, variables, x)
  isolated = fl.isolate_submodel(tree.select().at_path("inner"), fl.ArgsAndKwargs.capture(x))
  kwargs = isolated.saved_arg.kwargs
  assert kwargs["train"] is True and kwargs["name_tag"] == "a" and kwargs["mode"] is Mode.FAST
  report = isolated.replay(jit=True)
  assert max(report.max_abs_diff.values()) < 1e-6


class JittedOuter(nn.Module):
  @nn.jit
  @nn.compact
  def __call__(self, x):
    return Configurable(name="inner")(x, train=True, name_tag="a", mode=Mode.FAST)


def test_python_valued_arguments_stay_python_values_under_the_default_compiled_replay():
  module, x = JittedOuter(), jnp.ones((2, 4))
  isolated = fl.isolate(module, module.init(jax.random.key(0), x), x, at="inner")
  kwargs = isolated.saved_arg.kwargs
  assert isolated.recorded_compiled
  assert kwargs["train"] is True and kwargs["name_tag"] == "a" and kwargs["mode"] is Mode.FAST
  assert isolated.replay()


def test_an_isolated_call_with_an_edited_setting_replays_with_it(cases):
  case = cases["mlp"]
  tree = (
    LINEN.convert(case)
    .select()
    .at_path("Dense_1")
    .apply(lambda n: dataclasses.replace(n, module=n.module.clone(dtype=jnp.bfloat16)))
  )
  isolated = fl.isolate_submodel(tree.select().at_path("Dense_1"), LINEN.argument(case))
  assert isolated.submodel.module.dtype == jnp.bfloat16
  assert isolated.saved_output.dtype == jnp.bfloat16
  assert isolated.replay()


def test_isolate_takes_capture_intermediates_as_a_conversion_option():
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
  x = jnp.ones((1, 3))
  variables = model.init(jax.random.key(0), x)
  isolated = fl.isolate(model, variables, x, at="layers_2", capture_intermediates=True)
  _, state = model.apply(variables, x, capture_intermediates=True)
  assert (isolated.saved_output == state["intermediates"]["layers_2"]["__call__"][0]).all()
  assert isolated.replay()
