"""Every corpus model: the converted tree's call equals the native call, bit for bit.

Output and the state the call leaves are compared with `module.apply` (Linen) or a call
of a copy of the model (NNX).
"""

from __future__ import annotations

import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX

EVERY_CASE = [(fw, name) for fw in (LINEN, NNX) for name in fw.corpus.NAMES]
OTHER_CALL_KWARGS = [
  (fw, name, kwargs)
  for fw in (LINEN, NNX)
  for name, calls in fw.corpus.CALL_KWARGS.items()
  for kwargs in calls
]
# Linen cases that carry state from one call to the next; every NNX model does.
SECOND_CALL = [
  (LINEN, name)
  for name in (
    "batchnorm_train",
    "created_during_apply",
    "sow_new_collection",
    "collections",
    "spectral_norm_train",
  )
] + [(NNX, name) for name in NNX.corpus.NAMES]


@pytest.mark.parametrize("fw, name", EVERY_CASE)
def test_output_and_updated_state_match_the_native_call(corpora, fw, name):
  case = corpora[fw][name]
  tree = fw.convert(case)
  expected_out, expected_state = fw.native(case)
  assert_trees_equal(fw.call(tree, case), expected_out)
  assert_trees_equal(fw.tree_state(tree), expected_state)


@pytest.mark.parametrize("fw, name", SECOND_CALL)
def test_a_second_call_continues_from_the_updated_state(corpora, fw, name):
  case = corpora[fw][name]
  tree = fw.convert(case)
  expected_out, expected_state = fw.native(case, times=2)
  fw.call(tree, case)
  assert_trees_equal(fw.call(tree, case), expected_out)
  assert_trees_equal(fw.tree_state(tree), expected_state)


@pytest.mark.parametrize("fw, name, kwargs", OTHER_CALL_KWARGS)
def test_call_time_arguments_other_than_at_conversion_match_the_native_call(
  corpora, fw, name, kwargs
):
  case = corpora[fw][name]
  tree = fw.convert(case)
  expected_out, expected_state = fw.native(case, **kwargs)
  assert_trees_equal(fw.call(tree, case, **kwargs), expected_out)
  assert_trees_equal(fw.tree_state(tree), expected_state)
