"""Replacing or wrapping one call changes exactly that call, as Flax would."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from replacements import PlusOne, Recorder

import flaxlens as fl

from . import corpus
from .conftest import assert_trees_equal, call, convert, flat_collections, tree_state


class Zeros(fl.Layer):
  """Replacement that returns zeros of a fixed shape."""

  shape: tuple = fl.static_field()

  def __call__(self, argument, /, **side_inputs):
    return jnp.zeros(self.shape)


def _replace_native(predicate, new_output):
  """A Flax interceptor replacing the output of the calls `predicate` picks."""

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return new_output(out) if predicate(context) else out

  return interceptor


def _patch(tree, path, fn):
  return tree.select().at_path(path).apply(fn)


def test_replacing_a_call_changes_exactly_that_call(cases):
  case = cases["mlp"]
  patched = _patch(convert(case), "Dense_0", lambda _: Zeros((2, 16)))
  with nn.intercept_methods(_replace_native(lambda c: c.module.name == "Dense_0", jnp.zeros_like)):
    expected = case.apply()
  assert_trees_equal(call(patched, case), expected)


def test_replacement_receives_the_calls_arguments_and_side_inputs(cases):
  case = cases["mlp"]
  seen = []
  patched = _patch(convert(case), "Dense_1", lambda node: Recorder(seen, node))
  patched(fl.ArgsAndKwargs.capture(*case.args), flag="on")
  ((argument, side_inputs),) = seen
  assert isinstance(argument, fl.ArgsAndKwargs)
  assert argument.args[0].shape == (2, 16)
  assert side_inputs == {"flag": "on"}


def test_wrapping_a_call_keeps_the_wrapped_call_exact(cases):
  case = cases["mlp"]
  tree = convert(case)
  captured = {}

  def capture_first(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.module.name == "Dense_0":
      captured["h"] = out
      return out + 1.0
    return out

  with nn.intercept_methods(capture_first):
    expected = case.apply()
  wrapped = _patch(tree, "Dense_0", PlusOne)
  assert_trees_equal(call(wrapped, case), expected)


def test_wrapping_keeps_dropout_exact(cases):
  case = cases["dropout"]

  def plus_one(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return out + 1.0 if context.module.name == "Dropout_0" else out

  with nn.intercept_methods(plus_one):
    expected = case.apply()
  wrapped = _patch(convert(case), "Dropout_0", PlusOne)
  assert_trees_equal(call(wrapped, case), expected)


@pytest.mark.parametrize("name, path", [("scan", "layers/Dense_0"), ("vmap", "ensemble")])
def test_replacing_a_call_inside_a_lifted_transform_applies_at_every_iteration(cases, name, path):
  case = cases[name]

  shapes = []

  def zero_dense(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if isinstance(context.module, nn.Dense):
      shapes.append(out.shape)
      return jnp.zeros_like(out)
    return out

  with nn.intercept_methods(zero_dense):
    expected = case.apply()
  patched = _patch(convert(case), path, lambda _: Zeros(shapes[-1]))
  assert_trees_equal(call(patched, case), expected)


def test_wrapping_a_call_inside_scan_keeps_it_exact(cases):
  case = cases["scan"]

  def plus_one(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return out + 1.0 if isinstance(context.module, nn.Dense) else out

  with nn.intercept_methods(plus_one):
    expected = case.apply()
  assert_trees_equal(call(_patch(convert(case), "layers/Dense_0", PlusOne), case), expected)


@pytest.mark.parametrize(
  "name, path, module_name",
  [("weight_norm", "WeightNorm_1", "WeightNorm_1"), ("spectral_norm_train", "Dense_1", "Dense_1")],
)
def test_wrapping_a_call_whose_variable_names_hold_slashes_keeps_it_exact(
  cases, name, path, module_name
):
  case = cases[name]

  def plus_one(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    wanted = context.module.name == module_name and context.method_name == "__call__"
    return out + 1.0 if wanted else out

  with nn.intercept_methods(plus_one):
    expected, _ = case.apply() if case.mutable else (case.apply(), None)
  wrapped = _patch(convert(case), path, PlusOne)
  assert_trees_equal(call(wrapped, case), expected)


def test_capture_intermediates_leaves_out_a_call_whose_replacement_skips_it(cases):
  case = cases["capture_intermediates"]
  patched = _patch(convert(case), "Dense_0", lambda _: Zeros((2, 16)))

  def zeros_instead(next_fun, args, kwargs, context):
    if context.module.name == "Dense_0" and context.method_name == "__call__":
      return jnp.zeros((2, 16))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(zeros_instead):
    expected_out, expected_state = case.apply()
  del expected_state["intermediates"]["Dense_0"]
  assert_trees_equal(call(patched, case), expected_out)
  assert_trees_equal(tree_state(patched), flat_collections(expected_state))


def test_capture_intermediates_captures_what_a_wrapper_returns(cases):
  case = cases["capture_intermediates"]

  def plus_one(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return out + 1.0 if context.module.name == "Dense_0" else out

  with nn.intercept_methods(plus_one):
    expected_out, expected_state = case.apply()
  wrapped = _patch(convert(case), "Dense_0", PlusOne)
  assert_trees_equal(call(wrapped, case), expected_out)
  assert_trees_equal(tree_state(wrapped), flat_collections(expected_state))


def test_patching_one_call_of_a_module_called_twice_leaves_the_other(cases):
  case = cases["shared_child_called_twice"]
  tree = convert(case)
  first = (0, "shared.__call__")
  patched = tree.select().at(lambda t: t.submodule_calls[first]).apply(PlusOne)
  calls = []

  def plus_one_first(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name != "__call__" or context.module.name != "shared":
      return out
    calls.append(context.module.name)
    return out + 1.0 if len(calls) == 1 else out

  with nn.intercept_methods(plus_one_first):
    expected = case.apply()
  assert_trees_equal(call(patched, case), expected)


def test_patching_does_not_modify_the_original_tree(cases):
  case = cases["mlp"]
  tree = convert(case)
  _patch(tree, "Dense_0", lambda _: Zeros((2, 16)))
  assert all(isinstance(n, fl.InterceptedFlaxModuleMethod) for n in tree.submodule_calls.values())
  assert_trees_equal(call(tree, case), case.apply())


def test_every_corpus_tree_survives_wrapping_every_call(cases):
  """Wrapping with an identity wrapper everywhere changes nothing."""

  class Identity(fl.Layer):
    inner: object

    def __call__(self, argument, /, **side_inputs):
      return self.inner(argument, **side_inputs)

  names = ("transformer", "scan", "rnn_lstm", "batchnorm_train", "dropout", "spectral_norm_train")
  for name in names + ("weight_norm",):
    case = cases[name]
    tree = convert(case)
    wrapped = (
      tree.select()
      .at(lambda t: t.submodule_calls)
      .at_instances_of(fl.InterceptedFlaxModuleMethod)
      .apply(Identity)
    )
    result = case.apply()
    expected = result[0] if case.mutable else result
    assert_trees_equal(call(wrapped, case), expected), name


def test_module_names_are_stable_keys(cases):
  assert list(convert(cases["transformer"]).submodule_calls) == [
    (0, "Embed_0.__call__"),
    (1, "TransformerBlock_0.__call__"),
    (2, "TransformerBlock_1.__call__"),
    (3, "LayerNorm_0.__call__"),
    (4, "Dense_0.__call__"),
  ]
  assert corpus.Transformer


class Configured(nn.Module):
  """Two Dense layers; the first one's dtype is a setting of the model."""

  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(8, dtype=self.dtype, name="first")(x))
    return nn.Dense(4, name="second")(h)


def _edit_module(tree, path, **settings):
  return _patch(tree, path, lambda n: dataclasses.replace(n, module=n.module.clone(**settings)))


def test_an_edited_module_setting_takes_effect_in_the_whole_tree():
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = Configured().init(jax.random.key(0), x)
  tree = _edit_module(fl.unflaxify(Configured(), variables, x), "first", dtype=jnp.bfloat16)
  expected = Configured(dtype=jnp.bfloat16).apply(variables, x)
  assert_trees_equal(tree(fl.ArgsAndKwargs.capture(x)), expected)


def test_an_edit_that_changes_the_modules_variables_is_refused():
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = Configured().init(jax.random.key(0), x)
  tree = _edit_module(fl.unflaxify(Configured(), variables, x), "first", features=5)
  with pytest.raises(fl.FlaxlensError, match=r"^first\.__call__: the edited settings \['features"):
    tree(fl.ArgsAndKwargs.capture(x))


class ScaledDense(nn.Module):
  scale: float = 1.0

  def setup(self):
    self.dense = nn.Dense(4)

  def __call__(self, x):
    return self.dense(x) * self.scale


class WithSetupChild(nn.Module):
  @nn.compact
  def __call__(self, x):
    return ScaledDense(name="scaled")(x)


def test_an_edit_of_a_module_with_setup_is_refused():
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = WithSetupChild().init(jax.random.key(0), x)
  tree = _edit_module(fl.unflaxify(WithSetupChild(), variables, x), "scaled", scale=2.0)
  with pytest.raises(fl.FlaxlensError, match=r"^scaled\.__call__: .*setup"):
    tree(fl.ArgsAndKwargs.capture(x))
