"""A converted tree's variables: shared with the model, editable, exported; under jit, grad, vmap.

Edits are checked against the native call with the same edit made to the model's own
variables (`Framework.with_variable`); jitted runs against the natively jitted model.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX, Wrap
from replacements import PlusOne, plus_one

import flaxlens as fl


@pytest.mark.parametrize("fw, name", [(LINEN, "transformer"), (NNX, "scan")])
def test_tree_variables_hold_the_models_own_buffers_before_and_after_a_call(corpora, fw, name):
  case = corpora[fw][name]
  buffers = {label: id(value) for label, value in fw.model_state(case).items()}
  tree = fw.convert(case)
  assert {v.label: id(v.value) for v in fl.variables_in(tree)} == buffers
  fw.call(tree, case)
  parameters = [v for v in fl.variables_in(tree) if isinstance(v, fl.Parameter)]
  assert parameters and all(id(p.value) == buffers[p.label] for p in parameters)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_editing_a_parameter_changes_the_next_call(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  kernel = fw.parameters(tree.select().at_path(path).get())["kernel"]
  kernel.value = kernel.value * 2.0
  expected, _ = fw.native(fw.with_variable(case, kernel.label, kernel.value))
  assert_trees_equal(fw.call(tree, case), expected)


@pytest.mark.parametrize("fw, path", [(LINEN, "layers/Dense_0"), (NNX, "blocks/linear")])
def test_editing_a_stacked_parameter_inside_scan_changes_every_iteration(corpora, fw, path):
  case = corpora[fw]["scan"]
  tree = fw.convert(case)
  bias = fw.parameters(tree.select().at_path(path).get())["bias"]
  bias.value = bias.value + jnp.arange(bias.value.shape[0], dtype=bias.value.dtype)[:, None]
  expected, _ = fw.native(fw.with_variable(case, bias.label, bias.value))
  assert_trees_equal(fw.call(tree, case), expected)


@pytest.mark.parametrize("fw, name", [(LINEN, "shared_child_called_twice"), (NNX, "called_twice")])
def test_calls_of_one_module_share_its_parameter_objects(corpora, fw, name):
  tree = fw.convert(corpora[fw][name])
  first, second = tree.submodule_calls.values()
  assert fw.parameters(first)["kernel"] is fw.parameters(second)["kernel"]


@pytest.mark.parametrize(
  "fw, name, path",
  [(LINEN, "passed_attribute", "shared"), (NNX, "shared_submodule", "first/inner")],
)
def test_a_module_held_by_two_parents_has_one_set_of_parameters(corpora, fw, name, path):
  tree = fw.convert(corpora[fw][name])
  kernels = {
    id(v)
    for v in fl.variables_in(tree)
    if isinstance(v, fl.Parameter) and v.label.endswith("kernel")
  }
  assert len(kernels) == 1
  assert tree.select().at_path(path).count() == 2


@pytest.mark.parametrize(
  "fw, name, created",
  [
    (LINEN, "sow_new_collection", {"intermediates:hidden"}),
    (NNX, "attention_init_cache", {"Cache:cache_index", "Cache:cached_key", "Cache:cached_value"}),
  ],
)
def test_variables_created_by_the_call_start_uninitialized_and_are_filled(
  corpora, fw, name, created
):
  case = corpora[fw][name]
  tree = fw.convert(case)
  uninitialized = {v.label for v in fl.variables_in(tree) if isinstance(v.value, fl.Uninitialized)}
  assert uninitialized == created
  fw.call(tree, case)
  _, expected_state = fw.native(case)
  assert_trees_equal(fw.tree_state(tree), expected_state)


def _jitted_call(fw, case):
  """`fl.variable_jit` of a call of the tree; the case's keywords are Python values."""
  return fl.variable_jit(
    lambda tree, *args: tree(fl.ArgsAndKwargs.capture(*args, **case.kwargs), **fw.side_inputs(case))
  )


@pytest.mark.parametrize(
  "fw, name",
  [(LINEN, "batchnorm_train"), (NNX, "convnet_train"), (NNX, "unhashable_static_attributes")],
)
def test_variable_jit_matches_native_jit_and_writes_state_back(corpora, fw, name):
  case = corpora[fw][name]
  tree = fw.convert(case)
  run = _jitted_call(fw, case)
  for times in (1, 2):
    expected_out, expected_state = fw.native(case, times=times, jit=True)
    assert_trees_equal(run(tree, *case.args), expected_out)
  assert_trees_equal(fw.tree_state(tree), expected_state)


@pytest.mark.parametrize(
  "fw, name, scales", [(LINEN, "transformer", (2.0, 3.0, 4.0)), (NNX, "scan", (2.0, 3.0))]
)
def test_jit_does_not_recompile_when_only_parameter_values_change(corpora, fw, name, scales):
  case = corpora[fw][name]
  tree = fw.convert(case)
  traces = []

  def forward(t, x):
    traces.append(1)
    return t(fl.ArgsAndKwargs.capture(x))

  run = fl.variable_jit(forward)
  run(tree, *case.args)
  for scale in scales:
    for p in fl.variables_in(tree):
      if isinstance(p, fl.Parameter):
        p.value = p.value * scale
    run(tree, *case.args)
  assert len(traces) == 1


@pytest.mark.parametrize("fw, name", [(LINEN, "dropout"), (NNX, "vmap_ensemble")])
def test_jax_jit_of_a_stateless_call_matches_native_jit(corpora, fw, name):
  case = corpora[fw][name]
  tree, values = fl.unbind_variables(fw.convert(case), freeze=True)

  @jax.jit
  def forward(values, argument, side_inputs):
    out, _ = tree.stateless_call(values, argument, **side_inputs)
    return out

  expected, _ = fw.native(case, jit=True)
  assert_trees_equal(forward(values, fw.argument(case), fw.side_inputs(case)), expected)


@pytest.mark.parametrize("fw, name", [(LINEN, "mlp"), (NNX, "remat")])
def test_grad_with_respect_to_parameters_matches_native_grad(corpora, fw, name):
  case = corpora[fw][name]
  tree, values = fl.unbind_variables(fw.convert(case), freeze=True)
  params = [v for v in values if isinstance(v, fl.ParameterValue)]
  states = [v for v in values if not isinstance(v, fl.ParameterValue)]

  def loss(out):
    return (out**2).sum()

  def loss_tree(params):
    out, _ = tree.stateless_call([*params, *states], fw.argument(case))
    return loss(out)

  grads = {v.label: v.value for v in jax.grad(loss_tree)(params)}
  assert_trees_equal(grads, fw.native_parameter_grads(case, loss))


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_vmap_over_inputs_matches_the_vmapped_native_call(corpora, fw):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  xs = jnp.stack([case.args[0], case.args[0] * 2.0])
  out = jax.vmap(lambda x: tree(fl.ArgsAndKwargs.capture(x)))(xs)
  assert_trees_equal(out, jax.vmap(fw.native_function(case))(xs))


@pytest.mark.parametrize("batch", [2, 4096])
@pytest.mark.parametrize("fw, name", [(LINEN, "transformer"), (NNX, "scan")])
def test_conversion_is_abstract_and_accepts_shape_only_inputs(corpora, fw, name, batch):
  case = corpora[fw][name]
  shapes = tuple(jax.ShapeDtypeStruct((batch, *a.shape[1:]), a.dtype) for a in case.args)
  tree = fw.convert(dataclasses.replace(case, args=shapes))
  assert list(tree.submodule_calls) == list(fw.convert(case).submodule_calls)
  assert_trees_equal(fw.call(tree, case), fw.native(case)[0])


EXPORTED = [
  (LINEN, name) for name in ("batchnorm_train", "transformer", "scan", "passed_attribute")
] + [(NNX, "convnet_train")]


@pytest.mark.parametrize("fw, name", EXPORTED)
def test_edited_variables_export_back_to_the_framework(corpora, fw, name):
  case = corpora[fw][name]
  tree = fw.convert(case)
  fw.call(tree, case)
  for p in fl.variables_in(tree):
    if isinstance(p, fl.Parameter):
      p.value = jax.tree_util.tree_map(lambda a: a * 1.5, p.value)
  exported = fw.with_exported(case, fw.export(tree))
  assert_trees_equal(fw.model_state(exported), {v.label: v.value for v in fl.variables_in(tree)})
  expected_out, expected_state = fw.native(exported)
  assert_trees_equal(fw.call(tree, case), expected_out)
  assert_trees_equal(fw.tree_state(tree), expected_state)


def _counting_jit(traces: list) -> object:
  def forward(t, x):
    traces.append(1)
    return t(fl.ArgsAndKwargs.capture(x))

  return fl.variable_jit(forward)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_variable_jit_reads_a_parameter_edited_after_a_call_without_retracing(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree, traces = fw.convert(case), []
  run = _counting_jit(traces)
  run(tree, *case.args)
  kernel = fw.parameters(tree.select().at_path(path).get())["kernel"]
  kernel.value = kernel.value * 2.0
  expected, _ = fw.native(fw.with_variable(case, kernel.label, kernel.value))
  assert_trees_equal(run(tree, *case.args), expected)
  assert len(traces) == 1


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_variable_jit_runs_a_node_replaced_by_selection_after_a_call(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  run = _counting_jit([])
  run(tree, *case.args)
  wrapped = tree.select().at_path(path).apply(PlusOne)
  expected, _ = fw.native(case, wrap=Wrap(path, plus_one))
  assert_trees_equal(run(wrapped, *case.args), expected)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_variable_jit_uses_a_parameter_object_swapped_in_by_a_selection(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  run = _counting_jit([])
  run(tree, *case.args)
  old = fw.parameters(tree.select().at_path(path).get())["kernel"]
  swapped = (
    tree.select()
    .at_path(path)
    .at(lambda node: fw.parameters(node)["kernel"])
    .set(fl.Parameter(old.value * 2.0, label=old.label))
  )
  expected, _ = fw.native(fw.with_variable(case, old.label, old.value * 2.0))
  assert_trees_equal(run(swapped, *case.args), expected)
  assert_trees_equal(run(tree, *case.args), fw.native(case)[0])


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_deep_copy_of_a_converted_tree_runs_as_the_model(corpora, fw):
  case = corpora[fw]["mlp"]
  copied = copy.deepcopy(fw.convert(case))
  assert_trees_equal(fw.call(copied, case), fw.native(case)[0])


_IN_PLACE_EDITS = {
  "assign": lambda d, k: d.__setitem__(k, d[k]),
  "delete": lambda d, k: d.__delitem__(k),
  "pop": lambda d, k: d.pop(k),
  "popitem": lambda d, k: d.popitem(),
  "setdefault": lambda d, k: d.setdefault("new", 1),
  "update": lambda d, k: d.update({k: d[k]}),
  "merge in place": lambda d, k: d.__ior__({k: d[k]}),
  "clear": lambda d, k: d.clear(),
}


@pytest.mark.parametrize("edit", sorted(_IN_PLACE_EDITS))
@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_a_converted_trees_dicts_refuse_in_place_edits_and_stay_whole(corpora, fw, path, edit):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  node = tree.select().at_path(path).get()
  for held, key in (
    (fw.parameters(node), "kernel"),
    (tree.submodule_calls, next(iter(tree.submodule_calls))),
  ):
    with pytest.raises(fl.ArgumentError, match=r"read-only.*select\(\)\.at"):
      _IN_PLACE_EDITS[edit](held, key)
  assert "kernel" in fw.parameters(node)
  assert_trees_equal(_counting_jit([])(tree, *case.args), fw.native(case)[0])
