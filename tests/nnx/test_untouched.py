"""The user's model is never modified: not by conversion, not by calls, not by errors."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import NNX, model_state, nnx_modules

import flaxlens as fl

from . import corpus


def _snapshot(model: nnx.Module):
  """Classes, static attributes and variable values of every module of `model`."""
  modules = list(nnx_modules(model))
  types = {path: type(m) for path, m in modules}
  statics = {
    path: sorted((k for k in vars(m) if not nnx.is_data(vars(m)[k])), key=repr)
    for path, m in modules
  }
  return types, statics, model_state(model)


def _class_methods():
  """The methods of the classes the corpus uses, to check none was patched."""
  classes = [nnx.Linear, nnx.Dropout, nnx.BatchNorm, nnx.MultiHeadAttention, corpus.MyLinear]
  return {(c, name): vars(c).get(name) for c in classes for name in ("__call__", "init_cache")}


def _assert_unchanged(model, before, methods):
  types, statics, state = _snapshot(model)
  assert types == before[0]
  assert statics == before[1]
  assert set(state) == set(before[2])
  for label, value in state.items():
    assert value is before[2][label], label
  assert _class_methods() == methods


@pytest.mark.parametrize("name", corpus.NAMES)
def test_conversion_and_calls_leave_the_model_untouched(cases, name):
  case = cases[name]
  before, methods = _snapshot(case.model), _class_methods()
  tree = NNX.convert(case)
  NNX.call(tree, case)
  NNX.call(tree, case)
  _assert_unchanged(case.model, before, methods)


class Boom(fl.Layer):
  def __call__(self, argument, /, **side_inputs):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
  "name, path",
  [
    ("convnet_train", "drop"),
    ("scan", "blocks/linear"),
    ("capture_sow_perturb", "first"),
    ("nnx_jit_inside", "block/linear"),
  ],
)
def test_a_call_that_raises_midway_leaves_model_and_tree_untouched(cases, name, path):
  case = cases[name]
  before, methods = _snapshot(case.model), _class_methods()
  tree = NNX.convert(case).select().at_path(path).apply(lambda _: Boom())
  state = {v.label: v.value for v in fl.variables_in(tree)}
  with pytest.raises(RuntimeError, match="boom"):
    NNX.call(tree, case)
  _assert_unchanged(case.model, before, methods)
  assert {v.label: v.value for v in fl.variables_in(tree)} == state
  assert_trees_equal(NNX.call(NNX.convert(case), case), NNX.native(case)[0])


def test_converted_classes_keep_their_names_and_isinstance(cases):
  """Inside a call, modules are instances of the user's own classes."""
  seen = []

  class Spy(fl.Layer):
    inner: object

    def __call__(self, argument, /, **side_inputs):
      seen.append(argument)
      return self.inner(argument, **side_inputs)

  case = cases["inherited_call"]

  def peek(model, x):
    seen.append((type(model.first).__name__, isinstance(model.first, corpus.MyLinear)))
    return model(x)

  tree = fl.unflaxify(case.model, *case.args, method=peek).select().at_path("first").apply(Spy)
  seen.clear()
  NNX.call(tree, case)
  assert seen[0] == ("MyLinear", True)
  assert jnp.array_equal(seen[1].args[0], case.args[0])
  assert type(case.model.first) is corpus.MyLinear


class _Normed(nnx.Module):
  def __init__(self):
    rngs = nnx.Rngs(0)
    self.linear = nnx.Linear(4, 2, rngs=rngs)
    self.bn = nnx.BatchNorm(2, rngs=rngs)

  def __call__(self, x):
    return self.bn(self.linear(x))


def test_a_method_that_donates_the_model_leaves_the_users_buffers_alone():
  step = nnx.jit(lambda m, x: m(x), donate_argnums=0)
  native, model, x = _Normed(), _Normed(), jnp.ones((2, 4))
  tree = fl.unflaxify(model, x, method=step)
  for _ in range(2):
    assert_trees_equal(tree(fl.ArgsAndKwargs.capture(x)), step(native, x))
  assert not any(v.is_deleted() for v in model_state(model).values())
  assert_trees_equal(model(x), _Normed()(x))
