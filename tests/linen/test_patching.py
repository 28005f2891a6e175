"""Replacing or wrapping one call changes exactly that call, as Flax would."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import pytest
from replacements import PlusOne, Recorder

import flaxlens as fl

from . import corpus
from .conftest import assert_trees_equal, call, convert


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

  for name in ("transformer", "scan", "rnn_lstm", "batchnorm_train", "dropout"):
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
