"""Isolating one call of an NNX tree and replaying it on its own, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl

from .conftest import assert_trees_equal, convert

# (case, path of the isolated call); None isolates the root call.
SINGLE = [
  ("mlp", "hidden"),
  ("convnet_train", "norm"),
  ("convnet_train", "drop"),
  ("convnet_eval", "norm"),
  ("called_twice", None),
  ("shared_submodule", None),
  ("self_method_calls", None),
  ("inherited_call", None),
  ("attention_decode", None),
  ("remat", None),
  ("linen_bridge", None),
  ("rngs_argument", None),
  ("unhashable_static_attributes", None),
  ("linen_bridge_batch_stats", "net"),
  ("linen_bridge_weight_norm", None),
]


def _argument(case):
  args, kwargs = case.fresh_arguments()
  return fl.ArgsAndKwargs.capture(*args, **kwargs)


def _isolate(case, path):
  tree = convert(case)
  selection = tree.select() if path is None else tree.select().at_path(path)
  return fl.isolate_submodel(selection, _argument(case))


@pytest.mark.parametrize("name, path", SINGLE)
def test_stateless_call_of_the_isolated_call_reproduces_output_and_state(cases, name, path):
  isolated = _isolate(cases[name], path)
  saved_arg = jax.tree_util.tree_map(lambda x: x, isolated.saved_arg)  # may hold an nnx.Rngs
  output, state = isolated.submodel.stateless_call(
    isolated.initial_var_values, saved_arg, **isolated.saved_side_inputs
  )
  assert_trees_equal(output, isolated.saved_output)
  assert [v.label for v in state] == [v.label for v in isolated.final_var_values]
  assert_trees_equal([v.value for v in state], [v.value for v in isolated.final_var_values])
  assert isolated.replay()


def test_dropout_state_is_saved_so_the_mask_replays(cases):
  isolated = _isolate(cases["convnet_train"], "drop")
  labels = [v.label for v in isolated.initial_var_values]
  assert any(label.startswith("RngCount:") for label in labels)
  assert not np.array_equal(isolated.saved_output, isolated.saved_arg.args[0])
  assert isolated.replay()


def test_isolating_does_not_modify_the_tree_or_the_model(cases):
  case = cases["convnet_train"]
  before = nnx.to_flat_state(nnx.state(case.model))
  tree = convert(case)
  values = {v.label: v.value for v in fl.variables_in(tree)}
  fl.isolate_submodel(tree.select().at_path("norm"), _argument(case))
  assert all(v.value is values[v.label] for v in fl.variables_in(tree))
  after = nnx.to_flat_state(nnx.state(case.model))
  assert_trees_equal([v.get_raw_value() for _, v in after], [v.get_raw_value() for _, v in before])


def test_a_call_inside_nnx_scan_gives_one_exact_submodel_per_iteration(cases):
  case = cases["scan"]
  tree = convert(case)
  found = fl.isolate_calls(tree.select().at_path("blocks/linear"), _argument(case))
  assert len(found) == 4
  assert [i.call_number for i in found] == [0, 1, 2, 3]
  assert all(i.replay() for i in found)
  kernels = [i.submodel.scope_data.parameters for i in found]
  assert not all(
    np.array_equal(a[k].value, b[k].value)
    for a, b in zip(kernels, kernels[1:], strict=False)
    for k in a
  )


def test_a_call_inside_nnx_vmap_replays_per_member_up_to_rounding(cases):
  case = cases["vmap_ensemble"]
  tree = convert(case)
  found = fl.isolate_calls(tree.select().at_path("members"), _argument(case))
  assert len(found) == 3
  assert all(max(i.replay().max_abs_diff.values()) < 1e-5 for i in found)


def test_a_call_receiving_nnx_objects_is_refused_with_the_reason(cases):
  case = cases["rngs_argument"]
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="drop.__call__: the call receives NNX"):
    _isolate(case, "drop")


def test_isolate_from_a_plain_nnx_model_in_one_call():
  rngs = nnx.Rngs(0, dropout=1)
  model = nnx.Sequential(nnx.Linear(3, 8, rngs=rngs), nnx.Dropout(0.5, rngs=rngs))
  x = jnp.ones((2, 3))
  isolated = fl.isolate(model, x, at="layers/1")
  assert isolated.replay()
  assert_trees_equal(isolated.saved_arg.args[0], model.layers[0](x))


@pytest.mark.parametrize(
  "name, path",
  [
    ("convnet_train", "drop"),
    ("convnet_train", "norm"),
    ("attention_decode", None),
    ("linen_bridge", None),
    ("sow_outside_capture", None),
  ],
)
def test_a_saved_nnx_call_loads_and_replays_exactly(cases, tmp_path, name, path):
  isolated = _isolate(cases[name], path)
  fl.save_isolated(isolated, tmp_path / "call")
  loaded = fl.load_isolated(tmp_path / "call", allow=["nnx"])
  assert loaded.replay()
  assert_trees_equal(loaded.saved_output, isolated.saved_output)


def test_a_saved_scan_iteration_loads_and_replays_exactly(cases, tmp_path):
  case = cases["scan"]
  found = fl.isolate_calls(convert(case).select().at_path("blocks/linear"), _argument(case))
  fl.save_isolated(found[2], tmp_path / "iteration")
  loaded = fl.load_isolated(tmp_path / "iteration", allow=["nnx"])
  assert loaded.call_number == 2
  assert loaded.replay()
