"""State held in NumPy arrays: tree calls update the tree's state, never the user's buffers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import raw_value

import flaxlens as fl

X = jax.random.normal(jax.random.key(0), (2, 4))


class LinenCounter(nn.Module):
  """Counts its calls in a variable that `+=` updates in place when it holds NumPy."""

  @nn.compact
  def __call__(self, x):
    count = self.variable("counter", "count", lambda: jnp.zeros((), jnp.float32))
    count.value += 1.0
    return nn.Dense(4)(x) + count.value


class Count(nnx.Variable):
  pass


class NNXCounter(nnx.Module):
  """Counts its calls with `v[...] = ...`, which writes into a NumPy array in place."""

  def __init__(self):
    self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    self.count = Count(np.zeros((), np.float32))

  def __call__(self, x):
    self.count[...] = self.count[...] + 1.0
    return self.linear(x) + self.count[...]


def _linen():
  """(tree, native calls on an independent copy, the user's buffers, param buffers)."""
  params = LinenCounter().init(jax.random.key(1), X)["params"]
  variables = {"params": params, "counter": {"count": np.zeros((), np.float32)}}
  tree = fl.unflaxify(LinenCounter(), variables, X, mutable=["counter"])
  native = {"params": params, "counter": {"count": np.zeros((), np.float32)}}

  def native_call():
    out, updated = LinenCounter().apply(native, X, mutable=["counter"])
    native.update(updated)
    return out

  buffers = jax.tree_util.tree_leaves(params)
  return tree, native_call, variables["counter"]["count"], buffers


def _nnx():
  model, native = NNXCounter(), NNXCounter()
  tree = fl.unflaxify(model, X)
  buffers = [raw_value(v) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
  return tree, lambda: native(X), raw_value(model.count), buffers


@pytest.mark.parametrize("framework", [_linen, _nnx], ids=["linen", "nnx"])
def test_tree_calls_update_numpy_state_without_writing_into_the_users_buffer(framework):
  tree, native_call, user_buffer, parameter_buffers = framework()
  for _ in range(3):
    assert_trees_equal(tree(fl.ArgsAndKwargs.capture(X)), native_call())
  assert user_buffer == 0.0
  (state,) = [v for v in fl.variables_in(tree) if isinstance(v, fl.StateVariable)]
  assert state.value == 3.0 and state.value is not user_buffer
  parameters = [v.value for v in fl.variables_in(tree) if isinstance(v, fl.Parameter)]
  assert {id(b) for b in parameters} == {id(b) for b in parameter_buffers}
