"""Finding calls by readable path, rendering, calling a subtree on its own, and clear errors."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import treescope
from flax import nnx

import flaxlens as fl

from .conftest import assert_trees_equal, call, convert, model_state, tree_state
from .test_patching import Zeros


def test_a_call_is_found_by_its_module_path(cases):
  tree = convert(cases["scan"])
  node = tree.select().at_path("blocks/linear").get()
  assert node.path == ("blocks", "linear")
  assert node.module_type is nnx.Linear
  assert node.readable_path() == ("blocks/linear", "__call__")


def test_list_items_are_addressed_by_index_and_globs_select_several_calls(cases):
  tree = convert(cases["list"])
  assert tree.select().at_path("layers/1").get().path == ("layers", 1)
  found = tree.select().at_path("layers/*").get_sequence()
  assert [n.readable_path()[0] for n in found] == ["layers/0", "layers/1", "layers/2"]
  assert convert(cases["remat"]).select().at_path("**/linear.__call__").count() == 1


def test_self_method_calls_are_named_self(cases):
  tree = convert(cases["self_method_calls"])
  assert list(tree.submodule_calls) == [(0, "self.encode"), (1, "self.decode")]
  decode = tree.submodule_calls[(1, "self.decode")]
  assert list(decode.submodule_calls) == [(0, "embed.attend")]


def test_a_shared_module_is_named_by_its_first_path_from_the_other_parent(cases):
  tree = convert(cases["shared_submodule"])
  second = tree.submodule_calls[(1, "second.__call__")]
  assert list(second.submodule_calls) == [(0, "/first/inner.__call__")]


def test_a_tree_renders_with_treescope_in_one_line_per_module(cases):
  text = treescope.render_to_text(convert(cases["scan"]))
  assert "InterceptedNNXModuleMethod" in text and "NNXModuleDef(<GraphDef>, 4 variables)" in text
  assert "Param:blocks/linear/kernel" in text


def test_an_unknown_path_lists_known_ones(cases):
  with pytest.raises(KeyError, match="hidden"):
    convert(cases["mlp"]).select().at_path("nowhere")


def test_a_child_called_on_its_own_runs_its_module(cases):
  case = cases["remat"]
  tree = convert(case)
  block = tree.select().at_path("block").get()
  reference = nnx.clone(case.model)
  expected = reference.block(case.args[0])
  assert_trees_equal(block(fl.ArgsAndKwargs.capture(case.args[0])), expected)
  state = model_state(reference)
  assert_trees_equal(tree_state(block), {label: state[label] for label in tree_state(block)})
  assert int(state["RngCount:block/drop/rngs/count"]) == 1


def test_a_call_inside_scan_refuses_to_run_on_its_own(cases):
  node = convert(cases["scan"]).select().at_path("blocks/linear").get()
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match=r"blocks/linear\.__call__.*nnx\.scan"):
    node(fl.ArgsAndKwargs.capture(jnp.ones((2, 4))))


def test_a_non_module_is_refused():
  with pytest.raises(TypeError, match="flax.nnx.Module"):
    fl.unflaxify(object(), jnp.ones(2))


def test_an_unknown_method_name_is_refused(cases):
  case = cases["mlp"]
  with pytest.raises(fl.FlaxlensError, match="MLP: the module has no method 'forward'"):
    fl.unflaxify(case.model, *case.args, method="forward")


def test_random_streams_are_refused_with_the_nnx_way(cases):
  case = cases["convnet_train"]
  with pytest.raises(fl.FlaxlensError, match="ConvNet.__call__: random_streams is for Linen"):
    convert(case)(fl.ArgsAndKwargs.capture(*case.args), random_streams={"dropout": None, "x": 1})


def test_another_branch_without_patches_runs_natively(cases):
  case = cases["branch"]
  tree = convert(case)
  assert_trees_equal(call(tree, case, mode="b"), case.native(nnx.clone(case.model), mode="b"))


def test_a_call_structure_diverging_with_patches_present_is_an_error(cases):
  case = cases["branch"]
  patched = convert(case).select().at_path("a").apply(lambda _: Zeros(4))
  with pytest.raises(fl.CallStructureError, match=r"Branchy\.__call__: call \(0, 'b.__call__'\)"):
    call(patched, case, mode="b")


class LazyScale(nnx.Module):
  def __call__(self, x):
    if not hasattr(self, "scale"):
      self.scale = nnx.Param(jnp.ones(x.shape[-1]))
    return x * self.scale


def test_a_call_that_creates_parameters_is_refused_with_the_path():
  model = nnx.Sequential(LazyScale())
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="parameter Param 'layers/0/scale'"):
    fl.unflaxify(model, jnp.ones((2, 3)))


class Counting(nnx.Module):
  def __init__(self):
    self.calls = 0

  def __call__(self, x):
    self.calls += 1
    return x * self.calls


def test_a_call_that_changes_static_attributes_is_refused_with_the_path():
  model = nnx.Sequential(Counting())
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="'calls' of the module at 'layers/0'"):
    fl.unflaxify(model, jnp.ones(2))
  assert model.layers[0].calls == 0
