"""A tracer never ends up in a variable that outlives its trace: such writes are refused
before anything is written, and the tree keeps working, as natively."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl

from .models import X, scanned_tree


class LinenNormed(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))


class NNXNormed(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.linear(x))


class Linen:
  def __init__(self):
    self.module = LinenNormed()
    self.variables = self.module.init(jax.random.key(0), X)

  def convert(self):
    return fl.unflaxify(self.module, self.variables, X, mutable=["batch_stats"])

  def native_twice(self, x):
    """Two native calls, the second from the state the first left; the second output."""
    _, state = self.module.apply(self.variables, x, mutable=["batch_stats"])
    out, _ = self.module.apply({**self.variables, **state}, x, mutable=["batch_stats"])
    return out


class NNX:
  def __init__(self):
    self.model = NNXNormed(nnx.Rngs(0))

  def convert(self):
    return fl.unflaxify(self.model, X)

  def native_twice(self, x):
    model = nnx.clone(self.model)
    model(x)
    return model(x)


@pytest.fixture(params=[Linen, NNX], ids=["linen", "nnx"])
def fw(request):
  return request.param()


def state_of(tree):
  return {v.label: v.value for v in fl.variables_in(tree) if isinstance(v, fl.StateVariable)}


def test_a_variable_made_outside_a_trace_refuses_a_tracer():
  total = fl.StateVariable(jnp.zeros(()), label="total")

  def add(x):
    total.value = total.value + x.sum()
    return x

  with pytest.raises(fl.VariableError, match="'total'.*fl.variable_jit"):
    jax.jit(add)(X)
  assert_trees_equal(total.value, jnp.zeros(()))


def test_a_variable_made_inside_a_trace_takes_tracers():
  def add(x):
    total = fl.StateVariable(jnp.zeros(()), label="total")
    total.value = total.value + x.sum()
    return total.value

  assert_trees_equal(jax.jit(add)(X), X.sum())


def test_jax_jit_of_a_stateful_tree_is_refused_and_leaves_its_state(fw):
  tree = fw.convert()
  before = state_of(tree)
  with pytest.raises(fl.VariableError, match=r"__call__: storing a traced value.*variable_jit"):
    jax.jit(lambda x: tree(fl.ArgsAndKwargs.capture(x)))(X)
  after = state_of(tree)
  assert before.keys() == after.keys()
  assert all(after[k] is before[k] for k in before)


def test_a_stateful_tree_keeps_working_after_a_refused_jit(fw):
  tree = fw.convert()
  with pytest.raises(fl.VariableError):
    jax.jit(lambda x: tree(fl.ArgsAndKwargs.capture(x)))(X)
  tree(fl.ArgsAndKwargs.capture(X))
  assert_trees_equal(tree(fl.ArgsAndKwargs.capture(X)), fw.native_twice(X))


class Summing(fl.Layer):
  """Continues the call and adds the sum of its output to a state variable."""

  inner: object
  total: object

  def __call__(self, argument, /, **side_inputs):
    out = self.inner(argument)
    self.total.value = self.total.value + out.sum()
    return out


@pytest.mark.parametrize("name", ["linen", "nnx"])
def test_a_stateful_replacement_inside_a_scan_body_is_refused(name):
  tree, path = scanned_tree(name)
  total = fl.StateVariable(jnp.zeros(()), label="total")
  patched = tree.select().at_path(path).apply(lambda node: Summing(node, total))
  with pytest.raises(fl.VariableError, match="'total'"):
    patched(fl.ArgsAndKwargs.capture(X))
  assert_trees_equal(total.value, jnp.zeros(()))
