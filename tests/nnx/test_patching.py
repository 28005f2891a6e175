"""Patching what only NNX has: module-level `nnx.jit` caches, inherited-only methods, capture.

Patching behaviours both frameworks share are in tests/shared/test_patching.py.
"""

from __future__ import annotations

import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import NNX, Wrap
from replacements import PlusOne, Zeros, plus_one, zeros

import flaxlens as fl

from .corpus import FLAX_RELEASE


def test_nnx_jit_inside_the_model_sees_each_calls_patches(cases):
  """A module-level `nnx.jit` caches traces; every tree call must still be intercepted."""
  case = cases["nnx_jit_inside"]
  zeroed = NNX.convert(case).select().at_path("block/linear").apply(lambda _: Zeros(4))
  wrapped = NNX.convert(case).select().at_path("block/linear").apply(PlusOne)
  zeros_native, _ = NNX.native(case, wrap=Wrap("block/linear", zeros))
  plus_one_native, _ = NNX.native(case, wrap=Wrap("block/linear", plus_one))
  assert_trees_equal(NNX.call(zeroed, case), zeros_native)
  assert_trees_equal(NNX.call(wrapped, case), plus_one_native)
  assert_trees_equal(NNX.call(NNX.convert(case), case), NNX.native(case)[0])


def test_an_inherited_only_call_is_intercepted_and_patchable(cases):
  case = cases["inherited_call"]
  tree = NNX.convert(case)
  assert list(tree.submodule_calls) == [(0, "first.__call__"), (1, "second.__call__")]
  patched = tree.select().at_path("first").apply(lambda _: Zeros(8))
  expected, _ = NNX.native(case, wrap=Wrap("first", zeros))
  assert_trees_equal(NNX.call(patched, case), expected)


@pytest.mark.skipif(FLAX_RELEASE < (0, 12, 6), reason="nnx.capture: flax >= 0.12.6")
def test_nnx_capture_method_outputs_sows_the_same_methods_as_on_the_model(cases):
  """`nnx.capture` skips inherited-only methods; the tree must not add them."""
  case = cases["inherited_call"]

  def capture_all(model, x):
    return nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)

  tree = fl.unflaxify(case.model, *case.args, method=capture_all)
  expected = capture_all(nnx.clone(case.model), *case.args)
  assert_trees_equal(NNX.call(tree, case), expected)
