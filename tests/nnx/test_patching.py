"""Replacing or wrapping one call changes exactly that call, as patching NNX would."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx
from replacements import PlusOne, Recorder

import flaxlens as fl

from .conftest import assert_trees_equal, call, convert, model_state, tree_state
from .native import PlusOneDropout, PlusOneLinear, ZeroLinear, swap


class Zeros(fl.Layer):
  """Replacement returning zeros with `features` in the last axis of its input's shape."""

  features: int = fl.static_field()

  def __call__(self, argument, /, **side_inputs):
    x = argument.args[0]
    return jnp.zeros(x.shape[:-1] + (self.features,), x.dtype)


def _patch(tree, path, fn):
  return tree.select().at_path(path).apply(fn)


def _native_with(case, path, cls):
  reference = nnx.clone(case.model)
  module = reference
  for key in path:
    module = module[key] if isinstance(key, int) else getattr(module, key)
  swap(module, cls)
  return case.native(reference), reference


def test_replacing_a_call_changes_exactly_that_call(cases):
  case = cases["mlp"]
  patched = _patch(convert(case), "hidden", lambda _: Zeros(8))
  expected, _ = _native_with(case, ("hidden",), ZeroLinear)
  assert_trees_equal(call(patched, case), expected)


def test_replacement_receives_the_calls_arguments_and_side_inputs(cases):
  case = cases["mlp"]
  seen = []
  patched = _patch(convert(case), "out", lambda node: Recorder(seen, node))
  patched(fl.ArgsAndKwargs.capture(*case.args), flag="on")
  ((argument, side_inputs),) = seen
  assert isinstance(argument, fl.ArgsAndKwargs)
  assert argument.args[0].shape == (2, 8)
  assert side_inputs == {"flag": "on"}


def test_wrapping_a_call_keeps_the_wrapped_call_exact(cases):
  case = cases["mlp"]
  wrapped = _patch(convert(case), "hidden", PlusOne)
  expected, _ = _native_with(case, ("hidden",), PlusOneLinear)
  assert_trees_equal(call(wrapped, case), expected)


def test_wrapping_dropout_keeps_its_mask_and_rng_state_exact(cases):
  case = cases["convnet_train"]
  tree = _patch(convert(case), "drop", PlusOne)
  expected, reference = _native_with(case, ("drop",), PlusOneDropout)
  assert_trees_equal(call(tree, case), expected)
  assert_trees_equal(tree_state(tree), model_state(reference))


@pytest.mark.parametrize(
  "name, path, features", [("scan", ("blocks", "linear"), 4), ("vmap_ensemble", ("members",), 2)]
)
def test_replacing_a_call_inside_a_transform_applies_at_every_iteration(
  cases, name, path, features
):
  case = cases[name]
  patched = _patch(convert(case), "/".join(path), lambda _: Zeros(features))
  expected, _ = _native_with(case, path, ZeroLinear)
  assert_trees_equal(call(patched, case), expected)


@pytest.mark.parametrize("name", ["scan", "vmap_ensemble", "remat", "nnx_jit_inside"])
def test_wrapping_a_call_inside_a_transform_keeps_it_exact(cases, name):
  case = cases[name]
  path = {"scan": "blocks/linear", "vmap_ensemble": "members"}.get(name, "block/linear")
  expected, reference = _native_with(case, tuple(path.split("/")), PlusOneLinear)
  tree = _patch(convert(case), path, PlusOne)
  assert_trees_equal(call(tree, case), expected)
  assert_trees_equal(tree_state(tree), model_state(reference))


def test_nnx_jit_inside_the_model_sees_each_calls_patches(cases):
  """A module-level `nnx.jit` caches traces; every tree call must still be intercepted."""
  case = cases["nnx_jit_inside"]
  zeroed = _patch(convert(case), "block/linear", lambda _: Zeros(4))
  plus_one = _patch(convert(case), "block/linear", PlusOne)
  assert_trees_equal(call(zeroed, case), _native_with(case, ("block", "linear"), ZeroLinear)[0])
  assert_trees_equal(
    call(plus_one, case), _native_with(case, ("block", "linear"), PlusOneLinear)[0]
  )
  assert_trees_equal(call(convert(case), case), case.native(nnx.clone(case.model)))


def test_an_inherited_only_call_is_intercepted_and_patchable(cases):
  case = cases["inherited_call"]
  tree = convert(case)
  assert list(tree.submodule_calls) == [(0, "first.__call__"), (1, "second.__call__")]
  patched = _patch(tree, "first", lambda _: Zeros(8))

  class ZeroMyLinear(type(case.model.first)):
    def __call__(self, x):
      return jnp.zeros(x.shape[:-1] + (self.out_features,), x.dtype)

  expected, _ = _native_with(case, ("first",), ZeroMyLinear)
  assert_trees_equal(call(patched, case), expected)


def test_patching_one_call_of_a_module_called_twice_leaves_the_other(cases):
  case = cases["called_twice"]
  tree = convert(case)
  first = (0, "linear.__call__")
  patched = tree.select().at(lambda t: t.submodule_calls[first]).apply(PlusOne)
  model = nnx.clone(case.model)
  x = case.args[0]
  expected = model.linear(nnx.tanh(model.linear(x) + 1.0))
  assert_trees_equal(call(patched, case), expected)


def test_patching_does_not_modify_the_original_tree(cases):
  case = cases["mlp"]
  tree = convert(case)
  _patch(tree, "hidden", lambda _: Zeros(8))
  assert all(isinstance(n, fl.InterceptedNNXModuleMethod) for n in tree.submodule_calls.values())
  assert_trees_equal(call(tree, case), case.native(nnx.clone(case.model)))


def test_wrapping_every_call_with_an_identity_changes_nothing(cases):
  class Identity(fl.Layer):
    inner: object

    def __call__(self, argument, /, **side_inputs):
      return self.inner(argument, **side_inputs)

  for name in ("scan", "convnet_train", "attention_decode", "capture_sow_perturb", "remat"):
    case = cases[name]
    wrapped = (
      convert(case)
      .select()
      .at(lambda t: t.submodule_calls)
      .at_instances_of(fl.InterceptedNNXModuleMethod)
      .apply(Identity)
    )
    reference = nnx.clone(case.model)
    assert_trees_equal(call(wrapped, case), case.native(reference))
    assert_trees_equal(tree_state(wrapped), model_state(reference))


def test_nnx_capture_method_outputs_sows_the_same_methods_as_on_the_model(cases):
  """`nnx.capture` skips inherited-only methods; the tree must not add them."""
  case = cases["inherited_call"]

  def capture_all(model, x):
    return nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)

  tree = fl.unflaxify(case.model, *case.args, method=capture_all)
  expected = capture_all(nnx.clone(case.model), *case.args)
  assert_trees_equal(call(tree, case), expected)
