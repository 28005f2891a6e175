"""Isolating one call of a tree and replaying it on its own, bit for bit."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX, Wrap

import flaxlens as fl

# (framework, case, path of the isolated call); None isolates the root call.
SINGLE = [
  (LINEN, name, path)
  for name, path in [
    ("mlp", "Dense_1"),
    ("batchnorm_train", "BatchNorm_0"),
    ("batchnorm_eval", "BatchNorm_0"),
    ("dropout", "Dropout_1"),
    ("single_key_rngs", "Dropout_0"),
    ("transformer", "TransformerBlock_1"),
    ("jit", "mlp"),
    ("remat", "mlp/Dense_1"),
    ("sow_new_collection", "Dense_0"),
    ("capture_intermediates", "Dense_1"),
    ("created_during_apply", None),
    ("collections", None),
    ("partitioned", None),
    ("self_method_calls", "embed.attend"),
    ("weight_norm", "Dense_1.__call__"),
    ("spectral_norm_train", "Dense_1.__call__"),
    ("weight_norm", "WeightNorm_1.__call__"),
    ("spectral_norm_train", "SpectralNorm_1.__call__"),
    ("handed_modules", "second"),
  ]
] + [
  (NNX, name, path)
  for name, path in [
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
    ("handed_modules", "second"),
  ]
]


@pytest.mark.parametrize("fw, name, path", SINGLE)
def test_stateless_call_of_the_isolated_call_reproduces_output_and_state(corpora, fw, name, path):
  isolated = fw.isolate(corpora[fw][name], path)
  saved_arg = jax.tree_util.tree_map(lambda x: x, isolated.saved_arg)  # may hold an nnx.Rngs
  output, state = isolated.submodel.stateless_call(
    isolated.initial_var_values, saved_arg, **isolated.saved_side_inputs
  )
  assert_trees_equal(output, isolated.saved_output)
  assert [v.label for v in state] == [v.label for v in isolated.final_var_values]
  assert_trees_equal([v.value for v in state], [v.value for v in isolated.final_var_values])
  assert isolated.replay()


@pytest.mark.parametrize(
  "fw, name, path",
  [
    (LINEN, "dropout", "Dropout_1"),
    (NNX, "convnet_train", "drop"),
    (LINEN, "handed_modules", "second"),
    (NNX, "handed_modules", "second"),
  ],
)
def test_the_saved_argument_and_output_are_what_the_call_had_in_the_model(corpora, fw, name, path):
  case = corpora[fw][name]
  seen = []

  def record(output, x, *args):
    seen.append((x, output))
    return output

  fw.native(case, wrap=Wrap(path, record))
  ((x, output),) = seen
  isolated = fw.isolate(case, path)
  assert_trees_equal(isolated.saved_arg.args[0], x)
  assert_trees_equal(isolated.saved_output, output)


@pytest.mark.parametrize(
  "fw, name, path", [(LINEN, "batchnorm_train", "BatchNorm_0"), (NNX, "convnet_train", "norm")]
)
def test_isolating_does_not_modify_the_tree_or_the_model(corpora, fw, name, path):
  case = corpora[fw][name]
  before = fw.model_state(case)
  tree = fw.convert(case)
  values = {v.label: v.value for v in fl.variables_in(tree)}
  fl.isolate(tree, fw.argument(case), path, **fw.side_inputs(case))
  assert all(v.value is values[v.label] for v in fl.variables_in(tree))
  assert_trees_equal(fw.model_state(case), before)


@pytest.mark.parametrize(
  "fw, path, iterations, stacked_kernel",
  [
    (LINEN, "layers/Dense_0", 3, "params:layers/Dense_0/kernel"),
    (NNX, "blocks/linear", 4, "Param:blocks/linear/kernel"),
  ],
)
def test_a_call_inside_scan_gives_one_exact_submodel_per_iteration(
  corpora, fw, path, iterations, stacked_kernel
):
  case = corpora[fw]["scan"]
  found = fw.isolate(case, path, every=True)
  assert [i.call_number for i in found] == list(range(iterations))
  assert all(i.replay() for i in found)
  kernels = [fw.parameters(i.submodel)["kernel"].value for i in found]
  stacked = fw.model_state(case)[stacked_kernel]
  for i, kernel in enumerate(kernels):
    assert_trees_equal(kernel, stacked[i])
  assert not all(np.array_equal(a, b) for a, b in zip(kernels, kernels[1:], strict=False))


@pytest.mark.parametrize(
  "fw, name, path", [(LINEN, "vmap", "ensemble"), (NNX, "vmap_ensemble", "members")]
)
def test_a_call_inside_vmap_gives_one_submodel_per_member_equal_up_to_rounding(
  corpora, fw, name, path
):
  found = fw.isolate(corpora[fw][name], path, every=True)
  assert len(found) == 3
  assert all(i.replay().max_abs < 1e-5 for i in found)


@pytest.mark.parametrize(
  "fw, path, message",
  [
    (LINEN, "layers/Dense_0", "ran 3 times.*pass every=True"),
    (NNX, "blocks/linear", "ran 4 times.*pass every=True"),
  ],
)
def test_a_call_run_several_times_is_refused_without_every(corpora, fw, path, message):
  with pytest.raises(fl.FlaxlensError, match=message):
    fw.isolate(corpora[fw]["scan"], path)


@pytest.mark.parametrize(
  "fw, name, pattern, named",
  [
    (LINEN, "mlp", "Dense_*", "selects 2: Dense_0.__call__, Dense_1.__call__"),
    (NNX, "list", "layers/*", "selects 3: layers/0.__call__, layers/1.__call__, layers/2"),
  ],
)
def test_a_pattern_matching_several_calls_is_refused_naming_them(corpora, fw, name, pattern, named):
  case = corpora[fw][name]
  with pytest.raises(
    fl.SelectionError, match=f"the path '{re.escape(pattern)}' {re.escape(named)}"
  ):
    fl.isolate(fw.convert(case), fw.argument(case), pattern)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_0"), (NNX, "hidden")])
def test_a_selection_of_no_call_is_refused(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  selection = tree.select().at_path(path).where(lambda _: False)
  with pytest.raises(fl.SelectionError, match="the selection selects 0"):
    fl.isolate(tree, fw.argument(case), selection)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_0"), (NNX, "hidden")])
def test_a_selection_of_another_tree_is_refused(corpora, fw, path):
  case = corpora[fw]["mlp"]
  other = fw.convert(case).select().at_path(path)
  with pytest.raises(fl.ArgumentError, match="fl.isolate: at is a selection of another tree"):
    fl.isolate(fw.convert(case), fw.argument(case), other)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_0"), (NNX, "hidden")])
def test_a_call_node_of_another_tree_is_refused(corpora, fw, path):
  case = corpora[fw]["mlp"]
  node = fw.convert(case).select().at_path(path).get()
  with pytest.raises(fl.SelectionError, match="is not a call of"):
    fl.isolate(fw.convert(case), fw.argument(case), node)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_0"), (NNX, "hidden")])
def test_a_plain_flax_model_is_refused_showing_how_to_convert_it(corpora, fw, path):
  case = corpora[fw]["mlp"]
  model = fw.unflaxify_arguments(case)[0][0]
  with pytest.raises(fl.ArgumentError, match=r"tree must be a converted tree") as refused:
    fl.isolate(model, fw.argument(case), path)
  assert "fl.isolate(fl.unflaxify(model, variables, x), x, " in str(refused.value)


def test_the_old_call_with_the_model_arguments_spread_is_refused_showing_the_new_one():
  module, x = nn.Dense(2), jnp.ones((1, 3))
  variables = module.init(jax.random.key(0), x)
  with pytest.raises(fl.ArgumentError, match="multiple values for argument 'at'") as refused:
    fl.isolate(module, variables, x, at="")
  assert str(refused.value).endswith(
    'For example: fl.isolate(fl.unflaxify(model, variables, x), x, "Block_0/Dense_1").'
  )


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_call_not_made_in_this_run_is_reported(corpora, fw):
  case = corpora[fw]["branch"]
  tree = fw.convert(case)
  with pytest.raises(fl.FlaxlensError, match="never called"):
    fl.isolate(tree, fw.argument(case, mode="b"), "a")
  assert fl.isolate(tree, fw.argument(case, mode="b"), "a", every=True) == ()


@pytest.mark.parametrize(
  "fw, name, key, kernel",
  [
    (LINEN, "shared_child_called_twice", (1, "shared.__call__"), "params:shared/kernel"),
    (NNX, "called_twice", (1, "linear.__call__"), "Param:linear/kernel"),
  ],
)
def test_the_second_call_of_a_shared_module_replays_exactly(corpora, fw, name, key, kernel):
  case = corpora[fw][name]
  tree = fw.convert(case)
  second = tree.submodule_calls[key]
  isolated = fl.isolate(tree, fw.argument(case), second, **fw.side_inputs(case))
  assert isolated.replay()
  assert_trees_equal(fw.parameters(isolated.submodel)["kernel"].value, fw.model_state(case)[kernel])


@pytest.mark.parametrize(
  "fw, name, path", [(LINEN, "dropout", "Dropout_0"), (NNX, "convnet_train", "drop")]
)
def test_the_call_can_be_named_by_path_selection_or_node_alike(corpora, fw, name, path):
  case = corpora[fw][name]
  tree = fw.convert(case)
  selection = tree.select().at_path(path)
  found = [
    fl.isolate(tree, fw.argument(case), at, **fw.side_inputs(case))
    for at in (path, selection, selection.get())
  ]
  for isolated in found:
    assert isolated.replay()
    assert_trees_equal(isolated.saved_output, found[0].saved_output)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_a_replay_report_names_the_leaf_that_differs(corpora, fw, path):
  isolated = fw.isolate(corpora[fw]["mlp"], path)
  tampered = isolated.select().at(lambda i: i.saved_output).apply(lambda y: y + 0.5)
  report = tampered.replay()
  assert not report
  (row,) = [r for r in report.rows if not r.bitwise]
  assert row.name == "output" and row.max_abs == pytest.approx(0.5)
  assert "output  " in str(report) and "NOT bitwise equal: 1 of" in str(report)


@pytest.mark.parametrize(
  "fw, mean, native_mean",
  [
    (LINEN, "batch_stats:norm/mean", "batch_stats:norm/mean"),
    (NNX, "BatchStat:norm/mean", "BatchStat:first/norm/mean"),
  ],
)
def test_a_call_of_modules_its_parent_shares_leaves_their_state_as_the_model_does(
  corpora, fw, mean, native_mean
):
  case = corpora[fw]["handed_modules"]
  _, native_state = fw.native(case)  # `second` makes the last update of the shared BatchNorm.
  isolated = fw.isolate(case, "second")
  final = {v.label: v.value for v in isolated.final_var_values}
  assert_trees_equal(final[mean], native_state[native_mean])
  assert isolated.replay()


@pytest.mark.parametrize(
  "fw, drop", [(LINEN, ("drop", "__call__")), (NNX, ("first", "drop", "__call__"))]
)
def test_a_shared_dropout_called_from_its_second_parent_replays_its_second_mask(corpora, fw, drop):
  case = corpora[fw]["handed_modules"]
  _, captured = fw.native_captures(case)
  tree = fw.convert(case)
  second = next(k for k in tree.submodule_calls if k[1].startswith("second."))
  call = next(k for k in tree.submodule_calls[second].submodule_calls if "drop." in k[1])
  selection = tree.select().at(lambda t: t.submodule_calls[second].submodule_calls[call])
  isolated = fl.isolate(tree, fw.argument(case), selection, **fw.side_inputs(case))
  assert_trees_equal(isolated.saved_output, captured[drop][1])
  assert not np.array_equal(captured[drop][0], captured[drop][1])
  assert isolated.replay()
