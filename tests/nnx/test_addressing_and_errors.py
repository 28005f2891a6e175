"""Addressing and errors only NNX has: list indices, shared modules, rendering, mutation.

Addressing and errors both frameworks share are in tests/shared/test_addressing_and_errors.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import treescope
from flax import nnx
from frameworks import NNX

import flaxlens as fl


def test_list_items_are_addressed_by_index(cases):
  tree = NNX.convert(cases["list"])
  assert tree.select().at_path("layers/1").get().path == ("layers", 1)


def test_a_child_called_on_its_own_advances_its_own_rng_state(cases):
  case = cases["remat"]
  block = NNX.convert(case).select().at_path("block").get()
  block(NNX.argument(case))
  assert int(NNX.tree_state(block)["RngCount:block/drop/rngs/count"]) == 1


def test_a_shared_module_is_named_by_its_first_path_from_the_other_parent(cases):
  tree = NNX.convert(cases["shared_submodule"])
  second = tree.submodule_calls[(1, "second.__call__")]
  assert list(second.submodule_calls) == [(0, "/first/inner.__call__")]


def test_a_tree_renders_with_treescope_in_one_line_per_module(cases):
  text = treescope.render_to_text(NNX.convert(cases["scan"]))
  assert "InterceptedNNXModuleMethod" in text and "NNXModuleDef(<GraphDef>, 4 variables)" in text
  assert "Param:blocks/linear/kernel" in text


def test_a_non_module_is_refused():
  with pytest.raises(TypeError, match="flax.nnx.Module"):
    fl.unflaxify(object(), jnp.ones(2))


def test_random_streams_are_refused_with_the_nnx_way(cases):
  case = cases["convnet_train"]
  with pytest.raises(fl.FlaxlensError, match="ConvNet.__call__: random_streams is for Linen"):
    NNX.convert(case)(
      fl.ArgsAndKwargs.capture(*case.args), random_streams={"dropout": None, "x": 1}
    )


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
