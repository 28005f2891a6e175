"""Every corpus model: the converted tree's call equals the NNX model's, bit for bit."""

from __future__ import annotations

import pytest
from flax import nnx

from . import corpus
from .conftest import assert_trees_equal, call, convert, model_state, tree_state


@pytest.mark.parametrize("name", corpus.NAMES)
def test_output_and_updated_state_match_the_model(cases, name):
  case = cases[name]
  tree = convert(case)
  reference = nnx.clone(case.model)
  expected = case.native(reference)
  assert_trees_equal(call(tree, case), expected)
  assert_trees_equal(tree_state(tree), model_state(reference))


@pytest.mark.parametrize("name", corpus.NAMES)
def test_a_second_call_continues_from_the_updated_state(cases, name):
  case = cases[name]
  tree = convert(case)
  reference = nnx.clone(case.model)
  case.native(reference)
  expected = case.native(reference)
  call(tree, case)
  assert_trees_equal(call(tree, case), expected)
  assert_trees_equal(tree_state(tree), model_state(reference))


@pytest.mark.parametrize("name", list(corpus.CALL_KWARGS))
def test_call_time_arguments_other_than_at_conversion_match_the_model(cases, name):
  case = cases[name]
  for kwargs in corpus.CALL_KWARGS[name]:
    tree = convert(case)
    reference = nnx.clone(case.model)
    expected = case.native(reference, **kwargs)
    assert_trees_equal(call(tree, case, **kwargs), expected)
    assert_trees_equal(tree_state(tree), model_state(reference))
