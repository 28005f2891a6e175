"""Training and evaluation modes: taken from the model, switched on the tree as in NNX."""

from __future__ import annotations

import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import NNX, model_state

import flaxlens as fl

from .corpus import FLAX_RELEASE


@pytest.mark.parametrize(
  "name, on_tree, on_model",
  [
    ("convnet_train", lambda t: t.eval(), lambda m: m.eval()),
    ("convnet_eval", lambda t: t.train(), lambda m: m.train()),
    ("convnet_eval", lambda t: t.train().eval(), lambda m: (m.train(), m.eval())),
    (
      "convnet_train",
      lambda t: t.set_attributes(nnx.Dropout, deterministic=True),
      lambda m: m.set_attributes(nnx.Dropout, deterministic=True),
    ),
    pytest.param(
      "convnet_train",
      lambda t: t.view(use_running_average=True),
      lambda m: nnx.view(m, use_running_average=True),
      marks=pytest.mark.skipif(FLAX_RELEASE < (0, 12, 4), reason="nnx.view: flax >= 0.12.4"),
    ),
    ("scan", lambda t: t.eval(), lambda m: m.eval()),
    ("unhashable_static_attributes", lambda t: t.eval(), lambda m: m.eval()),
  ],
)
def test_switching_mode_on_the_tree_matches_switching_it_on_the_model(
  cases, name, on_tree, on_model
):
  case = cases[name]
  tree = on_tree(NNX.convert(case))
  reference = nnx.clone(case.model)
  switched = on_model(reference)
  model = switched if isinstance(switched, nnx.Module) else reference
  assert_trees_equal(NNX.call(tree, case), case.native(model))
  assert_trees_equal(NNX.tree_state(tree), model_state(model))


def test_switching_mode_returns_a_new_tree_and_keeps_the_old_one(cases):
  case = cases["convnet_train"]
  tree = NNX.convert(case)
  evaluated = tree.eval()
  assert evaluated is not tree
  assert (
    tree.select().at_path("drop").get().definition.graphdef
    != evaluated.select().at_path("drop").get().definition.graphdef
  )
  assert_trees_equal(NNX.call(tree, case), NNX.native(case)[0])


def test_switching_mode_keeps_patches_and_shared_variables(cases):
  case = cases["convnet_train"]

  class Double(fl.Layer):
    inner: object

    def __call__(self, argument, /, **side_inputs):
      return self.inner(argument, **side_inputs) * 2.0

  tree = NNX.convert(case).select().at_path("head").apply(Double)
  evaluated = tree.eval()
  assert isinstance(evaluated.submodule_calls[(3, "head.__call__")], Double)
  assert set(map(id, fl.variables_in(evaluated))) == set(map(id, fl.variables_in(tree)))
  reference = nnx.clone(case.model)
  reference.eval()
  x = case.args[0]
  expected = reference.head(
    reference.drop(nnx.relu(reference.norm(reference.conv(x)))).mean((1, 2))
  )
  assert_trees_equal(NNX.call(evaluated, case), expected * 2.0)


def test_an_unknown_attribute_is_refused_as_nnx_refuses_it(cases):
  tree = NNX.convert(cases["mlp"])
  with pytest.raises(ValueError, match="no_such_flag"):
    tree.set_attributes(no_such_flag=True)


@pytest.mark.parametrize(
  "path, on_node, on_model",
  [
    ("drop", lambda n: n.eval(), lambda m: m.drop.eval()),
    (
      "drop",
      lambda n: n.set_attributes(deterministic=True),
      lambda m: m.drop.set_attributes(deterministic=True),
    ),
    ("norm", lambda n: n.eval(), lambda m: m.norm.eval()),
  ],
)
def test_switching_mode_of_one_call_grafted_into_the_tree_matches_switching_that_module(
  cases, path, on_node, on_model
):
  case = cases["convnet_train"]
  tree = NNX.convert(case).select().at_path(path).apply(on_node)
  reference = nnx.clone(case.model)
  on_model(reference)
  for _ in range(2):
    assert_trees_equal(NNX.call(tree, case), case.native(reference))
  assert_trees_equal(NNX.tree_state(tree), model_state(reference))
  assert_trees_equal(NNX.export(tree)(*case.args), case.native(reference))
