"""Isolating one call of a Linen tree and replaying it on its own, bit for bit."""

from __future__ import annotations

import dataclasses
import enum

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl

from .conftest import assert_trees_equal, convert

# (case, path of the isolated call); None isolates the root call.
SINGLE = [
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
]


def _argument(case):
  return fl.ArgsAndKwargs.capture(*case.args, **case.kwargs)


def _isolate(case, path):
  tree = convert(case)
  selection = tree.select() if path is None else tree.select().at_path(path)
  return fl.isolate_submodel(selection, _argument(case), random_streams=case.rngs)


@pytest.mark.parametrize("name, path", SINGLE)
def test_stateless_call_of_the_isolated_call_reproduces_output_and_state(cases, name, path):
  isolated = _isolate(cases[name], path)
  output, state = isolated.submodel.stateless_call(
    isolated.initial_var_values, isolated.saved_arg, **isolated.saved_side_inputs
  )
  assert_trees_equal(output, isolated.saved_output)
  assert [v.label for v in state] == [v.label for v in isolated.final_var_values]
  assert_trees_equal([v.value for v in state], [v.value for v in isolated.final_var_values])
  assert isolated.replay()


def test_the_saved_output_is_what_the_call_returned_in_the_model(cases):
  case = cases["dropout"]
  seen = {}

  def grab(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.module.name == "Dropout_1" and context.method_name == "__call__":
      seen["in"], seen["out"] = args[0], out
    return out

  with nn.intercept_methods(grab):
    case.apply()
  isolated = _isolate(case, "Dropout_1")
  assert_trees_equal(isolated.saved_arg.args[0], seen["in"])
  assert_trees_equal(isolated.saved_output, seen["out"])


def test_batchnorm_state_before_and_after_are_saved(cases):
  case = cases["batchnorm_train"]
  isolated = _isolate(case, "BatchNorm_0")
  _, updates = case.apply()
  final = {v.label: v.value for v in isolated.final_var_values}
  initial = {v.label: v.value for v in isolated.initial_var_values}
  assert_trees_equal(final["batch_stats:mean"], updates["batch_stats"]["BatchNorm_0"]["mean"])
  assert_trees_equal(
    initial["batch_stats:mean"], case.variables["batch_stats"]["BatchNorm_0"]["mean"]
  )


def test_isolating_does_not_modify_the_tree(cases):
  case = cases["batchnorm_train"]
  tree = convert(case)
  before = {v.label: v.value for v in fl.variables_in(tree)}
  fl.isolate_submodel(tree.select().at_path("BatchNorm_0"), _argument(case))
  assert all(v.value is before[v.label] for v in fl.variables_in(tree))


def test_the_second_call_of_a_shared_module_replays_exactly(cases):
  case = cases["shared_child_called_twice"]
  tree = convert(case)
  second = tree.select().at(lambda t: t.submodule_calls[(1, "shared.__call__")])
  isolated = fl.isolate_submodel(second, _argument(case))
  assert isolated.replay()
  assert_trees_equal(
    isolated.submodel.scope_data.parameters["kernel"].value,
    case.variables["params"]["shared"]["kernel"],
  )


class DropoutTwice(nn.Module):
  @nn.compact
  def __call__(self, x):
    block = nn.Dropout(0.5, deterministic=False)
    return block(x) + block(x)


def test_each_call_of_a_dropout_called_twice_draws_its_own_mask():
  module, x = DropoutTwice(), jnp.ones((4, 8))
  rngs = {"dropout": jax.random.key(3)}
  tree = fl.unflaxify(module, {}, x, rngs=rngs)
  masks = []
  for key in tree.submodule_calls:
    selection = tree.select().at(lambda t, k=key: t.submodule_calls[k])
    isolated = fl.isolate_submodel(selection, fl.ArgsAndKwargs.capture(x), random_streams=rngs)
    assert isolated.replay()
    masks.append(isolated.saved_output)
  assert not np.array_equal(masks[0], masks[1])
  assert_trees_equal(masks[0] + masks[1], module.apply({}, x, rngs=rngs))


def test_a_call_inside_scan_gives_one_exact_submodel_per_iteration(cases):
  case = cases["scan"]
  tree = convert(case)
  found = fl.isolate_calls(tree.select().at_path("layers/Dense_0"), _argument(case))
  assert [i.call_number for i in found] == [0, 1, 2]
  assert all(i.replay() for i in found)
  stacked = case.variables["params"]["layers"]["Dense_0"]["kernel"]
  for i, isolated in enumerate(found):
    kernel = isolated.submodel.scope_data.parameters["kernel"].value
    assert_trees_equal(kernel, stacked[i])


def test_a_call_inside_vmap_gives_one_submodel_per_member_equal_up_to_rounding(cases):
  case = cases["vmap"]
  tree = convert(case)
  found = fl.isolate_calls(tree.select().at_path("ensemble"), _argument(case))
  assert len(found) == 3
  for isolated in found:
    report = isolated.replay()
    assert max(report.max_abs_diff.values()) < 1e-5


def test_several_executions_need_isolate_calls(cases):
  case = cases["scan"]
  with pytest.raises(fl.FlaxlensError, match="ran 3 times.*isolate_calls"):
    _isolate(case, "layers/Dense_0")


def test_a_selection_of_several_calls_is_refused(cases):
  case = cases["mlp"]
  with pytest.raises(fl.FlaxlensError, match="exactly one call; this one selects 2"):
    fl.isolate_submodel(convert(case).select().at_path("Dense_*"), _argument(case))


def test_a_selection_of_no_call_is_refused(cases):
  case = cases["mlp"]
  selection = convert(case).select().at_path("Dense_0").where(lambda _: False)
  with pytest.raises(fl.FlaxlensError, match="selects 0"):
    fl.isolate_submodel(selection, _argument(case))


def test_a_call_not_made_in_this_run_is_reported(cases):
  case = cases["branch"]
  tree = convert(case)
  with pytest.raises(fl.FlaxlensError, match="never called"):
    fl.isolate_submodel(tree.select().at_path("a"), fl.ArgsAndKwargs.capture(*case.args, mode="b"))


class Mode(enum.Enum):
  FAST = "fast"
  SLOW = "slow"


class Configurable(nn.Module):
  @nn.compact
  def __call__(self, x, *, train: bool, name_tag: str, mode: Mode, extra=None):
    y = nn.Dense(3)(x)
    if train and mode is Mode.FAST and name_tag == "a" and extra is None:
      y = y * 2.0
    return y


class Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Configurable(name="inner")(x, train=True, name_tag="a", mode=Mode.FAST)


def test_python_valued_arguments_stay_python_values_and_replay_under_jit():
  module, x = Outer(), jnp.ones((2, 4))
  variables = module.init(jax.random.key(0), x)
  tree = fl.unflaxify(module, variables, x)
  isolated = fl.isolate_submodel(tree.select().at_path("inner"), fl.ArgsAndKwargs.capture(x))
  kwargs = isolated.saved_arg.kwargs
  assert kwargs["train"] is True and kwargs["name_tag"] == "a" and kwargs["mode"] is Mode.FAST
  report = isolated.replay(jit=True)
  assert max(report.max_abs_diff.values()) < 1e-6


class JittedOuter(nn.Module):
  @nn.jit
  @nn.compact
  def __call__(self, x):
    return Configurable(name="inner")(x, train=True, name_tag="a", mode=Mode.FAST)


def test_python_valued_arguments_stay_python_values_under_the_default_compiled_replay():
  module, x = JittedOuter(), jnp.ones((2, 4))
  isolated = fl.isolate(module, module.init(jax.random.key(0), x), x, at="inner")
  kwargs = isolated.saved_arg.kwargs
  assert isolated.recorded_compiled
  assert kwargs["train"] is True and kwargs["name_tag"] == "a" and kwargs["mode"] is Mode.FAST
  assert isolated.replay()


def test_isolate_from_a_plain_linen_module_in_one_call(cases):
  case = cases["dropout"]
  isolated = fl.isolate(
    case.module, case.variables, *case.args, at="Dropout_0", rngs=case.rngs, **case.kwargs
  )
  assert isolated.replay()
  assert str(isolated.replay()).endswith("exact replay")


def test_a_replay_report_names_the_leaf_that_differs(cases):
  isolated = _isolate(cases["mlp"], "Dense_1")
  tampered = isolated.select().at(lambda i: i.saved_output).apply(lambda y: y + 0.5)
  report = tampered.replay()
  assert not report
  assert report.max_abs_diff["['output']"] == pytest.approx(0.5)
  assert "MISMATCH" in str(report)


def test_an_isolated_call_with_an_edited_setting_replays_with_it(cases):
  case = cases["mlp"]
  tree = (
    convert(case)
    .select()
    .at_path("Dense_1")
    .apply(lambda n: dataclasses.replace(n, module=n.module.clone(dtype=jnp.bfloat16)))
  )
  isolated = fl.isolate_submodel(tree.select().at_path("Dense_1"), _argument(case))
  assert isolated.submodel.module.dtype == jnp.bfloat16
  assert isolated.saved_output.dtype == jnp.bfloat16
  assert isolated.replay()
