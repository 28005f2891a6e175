"""Every corpus model: the converted tree's call equals `module.apply`, bit for bit."""

from __future__ import annotations

import pytest

from . import corpus
from .conftest import assert_trees_equal, call, convert, flat_collections, tree_state

CASE_NAMES = corpus.NAMES


def _native(case, **kwargs):
  result = case.apply(**kwargs)
  if case.mutable or case.capture_intermediates:
    return result
  return result, {}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_output_and_state_match_apply(cases, name):
  case = cases[name]
  tree = convert(case)
  expected_out, expected_state = _native(case)
  out = call(tree, case)
  assert_trees_equal(out, expected_out)
  assert tree_state(tree) == tree_state(tree) and set(tree_state(tree)) == set(
    flat_collections(expected_state)
  )
  assert_trees_equal(tree_state(tree), flat_collections(expected_state))


@pytest.mark.parametrize("name", [n for n in CASE_NAMES if corpus.CALL_KWARGS.get(n)])
def test_call_time_arguments_other_than_at_conversion_match_apply(cases, name):
  case = cases[name]
  for kwargs in corpus.CALL_KWARGS[name]:
    tree = convert(case)
    expected_out, expected_state = _native(case, **kwargs)
    out = call(tree, case, **kwargs)
    assert_trees_equal(out, expected_out)
    assert_trees_equal(tree_state(tree), flat_collections(expected_state))


@pytest.mark.parametrize(
  "name",
  [
    "batchnorm_train",
    "created_during_apply",
    "sow_new_collection",
    "collections",
    "spectral_norm_train",
  ],
)
def test_second_call_continues_from_updated_state(cases, name):
  case = cases[name]
  tree = convert(case)
  call(tree, case)
  out = call(tree, case)
  _, state1 = case.apply()
  expected_out, state2 = case.apply(variables={**case.variables, **state1})
  assert_trees_equal(out, expected_out)
  assert_trees_equal(tree_state(tree), flat_collections(state2))
