"""The definitions of a converted NNX model's submodules, derived from the root's.

Conversion keeps the root's `GraphDef`; the definition of each called submodule is
worked out from it when first needed. Each test compares with what NNX itself gives
for the user's submodule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import nnx_modules, raw_value

import flaxlens as fl
from flaxlens._compat import nnx_graph, nnx_variables
from flaxlens.nnx._definition import _Layout, equal

from .corpus import NAMES


class Shared(nnx.Module):
  """A submodule holding a variable another submodule also holds, and static settings."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(10, 4, rngs=rngs)
    self.block = nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.Dropout(0.3, rngs=rngs))
    self.block.tied = self.embed.embedding  # The same Param, reached from two modules.
    self.norm = nnx.LayerNorm(4, epsilon=1e-3, rngs=rngs)

  def __call__(self, tokens):
    return self.norm(self.block(self.embed(tokens)) + self.block.tied[...].sum())


def _tree_and_model():
  model = Shared(nnx.Rngs(0, dropout=1))
  tokens = jnp.array([[1, 2, 3]])
  return fl.unflaxify(model, tokens), model, tokens


@pytest.mark.parametrize("path", ["embed", "block", "block/layers/0", "norm"])
def test_a_derived_definition_is_what_nnx_flattens(path):
  tree, model, _ = _tree_and_model()
  node = tree.select().at_path(path).get()
  module = model
  for key in path.split("/"):
    module = module[int(key)] if key.isdigit() else getattr(module, key)
  graphdef, state = nnx.split(module)
  assert equal(node.definition.graphdef, graphdef)
  flat = nnx.to_flat_state(state)
  assert node.definition.leaf_paths == tuple(tuple(p) for p, _ in flat)
  shapes = tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for _, v in flat)
  assert node.definition.abstract_leaves == shapes


def test_derived_definitions_of_two_conversions_are_equal_and_hash_alike():
  first, _, _ = _tree_and_model()
  second, _, _ = _tree_and_model()
  a = first.select().at_path("block").get().definition
  b = second.select().at_path("block").get().definition
  assert a == b and hash(a) == hash(b)
  assert a != first.select().at_path("norm").get().definition


def test_a_subtree_runs_on_its_own_from_its_derived_definition():
  tree, model, tokens = _tree_and_model()
  hidden = model.embed(tokens)
  node = tree.select().at_path("norm").get()
  assert_trees_equal(node(fl.ArgsAndKwargs.capture(hidden)), model.norm(hidden))
  exported = tree.select().at_path("block").get().export()
  assert equal(nnx.graphdef(exported), nnx.graphdef(model.block))


class Appends(nnx.Module):
  """A call that adds a variable to a plain data list in place (no attribute changes)."""

  def __init__(self):
    self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.log = nnx.data([])

  def __call__(self, x):
    y = self.linear(x)
    self.log.append(nnx.BatchStat(y.sum()))
    return y


def test_a_variable_a_call_adds_to_a_plain_list_is_refused_at_conversion():
  model = Appends()
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="'log/0' inside a new container"):
    fl.unflaxify(model, jnp.ones((1, 2)))
  assert model.log == []


@pytest.mark.parametrize("name", NAMES)
def test_compat_readers_walk_modules_and_read_variables_as_the_installed_flax_does(cases, name):
  model = cases[name].model
  modules = [(tuple(p), id(m)) for p, m in nnx_graph.iter_modules(model)]
  assert modules == [(tuple(p), id(m)) for p, m in nnx_modules(model)]
  for _, variable in nnx.to_flat_state(nnx.state(model)):
    assert nnx_variables.raw_value(variable) is raw_value(variable)


@pytest.mark.parametrize("name", NAMES)
def test_modules_and_variables_read_from_the_graphdef_are_those_nnx_walks_find(cases, name):
  graphdef, variables = nnx_graph.flatten(cases[name].model)
  model, made = nnx_graph.merge_indexed(graphdef, [raw_value(v) for _, v in variables])
  read = _Layout.of(graphdef, model, made)
  assert read.indexed
  modules = [(tuple(p), id(m)) for p, m in nnx_modules(model)]
  assert sorted((p, id(m)) for p, m in read.modules_of(model, made)) == sorted(modules)
  state = [(tuple(p), id(v)) for p, v in nnx.to_flat_state(nnx.state(model))]
  assert [(p, id(made[i])) for i, p in read.variables] == state


class Counting(nnx.Module):
  """A call that counts itself in a static attribute."""

  def __init__(self):
    self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.calls = 0

  def __call__(self, x):
    self.calls += 1
    return self.linear(x)


def test_a_call_that_changes_a_static_attribute_is_refused_at_conversion():
  model = Counting()
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="static attribute 'calls'"):
    fl.unflaxify(model, jnp.ones((1, 2)))
  assert model.calls == 0


class Reshaping(nnx.Module):
  """A call that sets a static attribute again, to a new but equal value."""

  def __init__(self):
    self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.shape = (1, 2)

  def __call__(self, x):
    self.shape = tuple(int(n) for n in x.shape)
    return self.linear(x).reshape(self.shape)


def test_a_call_that_sets_a_static_attribute_to_an_equal_value_converts():
  model, x = Reshaping(), jnp.ones((1, 2))
  tree = fl.unflaxify(model, x)
  assert_trees_equal(tree(fl.ArgsAndKwargs.capture(x)), model(x))
