"""Linen and NNX nodes have one shape: CallNode, scope_data, sliced, export(), at_calls_of."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl

X = jnp.ones((2, 3))


class WideDense(nn.Dense):
  """A user subclass of a Flax module."""


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    h = WideDense(4)(nn.relu(h))
    return nn.BatchNorm(use_running_average=False)(nn.LayerNorm()(h))


class WideLinear(nnx.Linear):
  """A user subclass of an NNX module."""


class Count(nnx.Variable):
  """A variable type NNX's registry does not know."""


class NNXNet(nnx.Module):
  def __init__(self):
    rngs = nnx.Rngs(0, dropout=1)
    self.first = nnx.Linear(3, 4, rngs=rngs)
    self.second = WideLinear(4, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.count = Count(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    self.count[...] += 1
    return self.drop(self.norm(self.second(nnx.relu(self.first(x)))))


def linen_tree():
  model = LinenNet()
  variables = model.init(jax.random.key(0), X)
  return model, variables, fl.unflaxify(model, variables, X, mutable=["batch_stats"])


def test_every_converted_call_of_either_framework_is_a_call_node():
  _, _, linen = linen_tree()
  trees = [linen, fl.unflaxify(NNXNet(), X)]
  for tree in trees:
    nodes = tree.select().at_subtrees_where(lambda n: hasattr(n, "submodule_calls"))
    assert all(isinstance(n, fl.CallNode) for n in nodes.get_sequence())
    assert isinstance(tree, fl.CallNode)


@pytest.mark.parametrize(
  "make, module_class, paths",
  [
    (lambda: linen_tree()[2], nn.Dense, ["Dense_0", "WideDense_0"]),
    (lambda: linen_tree()[2], WideDense, ["WideDense_0"]),
    (lambda: fl.unflaxify(NNXNet(), X), nnx.Linear, ["first", "second"]),
    (lambda: fl.unflaxify(NNXNet(), X), WideLinear, ["second"]),
  ],
  ids=["linen-base", "linen-subclass", "nnx-base", "nnx-subclass"],
)
def test_at_calls_of_selects_the_calls_of_a_module_class_and_its_subclasses(
  make, module_class, paths
):
  tree = make()
  selected = tree.select().at_calls_of(module_class).get_sequence()
  assert ["/".join(map(str, n.path)) for n in selected] == paths


def test_nnx_variables_are_grouped_by_the_collection_nnx_names_their_type():
  model = NNXNet()
  tree = fl.unflaxify(model, X)
  norm = tree.select().at_path("norm").get().scope_data
  drop = tree.select().at_path("drop").get().scope_data
  assert sorted(norm.parameters) == ["bias", "scale"]
  assert sorted(norm.variables) == ["batch_stats"]
  assert sorted(norm.variables["batch_stats"]) == ["mean", "var"]
  assert sorted(drop.variables) == ["RngCount", "RngKey"]
  assert tree.scope_data.variables["Count"]["count"].value == model.count[...]
  assert tree.scope_data.immutable_variables == {} and tree.scope_data.rngs is None


def test_linen_and_nnx_scope_data_have_the_same_fields():
  _, _, linen = linen_tree()
  nnx_tree = fl.unflaxify(NNXNet(), X)
  assert type(linen.scope_data) is type(nnx_tree.scope_data) is fl.InterceptedFlaxScopeData


def test_linen_export_is_the_variables_dict_module_apply_takes():
  model, variables, tree = linen_tree()
  exported = tree.export()
  expected, _ = model.apply(variables, X, mutable=["batch_stats"])
  actual, _ = model.apply(exported, X, mutable=["batch_stats"])
  assert_trees_equal(actual, expected)


def test_nnx_export_is_a_new_model_that_computes_as_the_original():
  model = NNXNet()
  tree = fl.unflaxify(model, X)
  exported = tree.export()
  assert exported is not model and type(exported) is NNXNet
  assert_trees_equal(exported(X), model(X))


def test_a_call_inside_a_slicing_transform_is_sliced_in_both_frameworks():
  class LinenScan(nn.Module):
    @nn.compact
    def __call__(self, x):
      body = nn.scan(
        lambda m, c, _: (m(c), None),
        variable_broadcast=False,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=2,
      )
      return body(nn.Dense(3), x, None)[0]

  linen_model = LinenScan()
  linen = fl.unflaxify(linen_model, linen_model.init(jax.random.key(0), X), X)

  class NNXScan(nnx.Module):
    def __init__(self):
      self.layers = nnx.vmap(lambda key: nnx.Linear(3, 3, rngs=nnx.Rngs(key)))(
        jax.random.split(jax.random.key(0), 2)
      )

    def __call__(self, x):
      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      def step(layer, h):
        return layer(h)

      return step(self.layers, x)

  nnx_tree = fl.unflaxify(NNXScan(), X)
  for tree in (linen, nnx_tree):
    (inner,) = tree.select().at_calls_of((nn.Dense, nnx.Linear)).get_sequence()
    assert inner.sliced and not tree.sliced
    with pytest.raises(fl.UnsupportedFlaxFeatureError, match="slices its variables"):
      inner(fl.ArgsAndKwargs.capture(X))
