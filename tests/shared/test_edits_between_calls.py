"""Edits made to a tree after it has run are seen by its next eager call.

A tree call reuses what it worked out at earlier calls (NNX: where the modules and
variables of the rebuilt model are); each test calls the tree once, edits it, and
compares the next call with the native call on the same edit.
"""

from __future__ import annotations

import dataclasses

import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX, Wrap
from replacements import PlusOne, plus_one

import flaxlens as fl


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_a_parameter_edited_after_a_call_changes_the_next_call(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  fw.call(tree, case)
  kernel = fw.parameters(tree.select().at_path(path).get())["kernel"]
  kernel.value = kernel.value * 2.0
  expected, _ = fw.native(fw.with_variable(case, kernel.label, kernel.value))
  assert_trees_equal(fw.call(tree, case), expected)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_a_parameter_object_swapped_in_after_a_call_is_used_by_the_next_call(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  fw.call(tree, case)
  old = fw.parameters(tree.select().at_path(path).get())["kernel"]
  swapped = (
    tree.select()
    .at_path(path)
    .at(lambda node: fw.parameters(node)["kernel"])
    .set(fl.Parameter(old.value * 2.0, label=old.label))
  )
  expected, _ = fw.native(fw.with_variable(case, old.label, old.value * 2.0))
  assert_trees_equal(fw.call(swapped, case), expected)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_a_call_replaced_after_a_call_is_replaced_in_the_next_call(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  fw.call(tree, case)
  wrapped = tree.select().at_path(path).apply(PlusOne)
  expected, _ = fw.native(case, wrap=Wrap(path, plus_one))
  assert_trees_equal(fw.call(wrapped, case), expected)
  assert_trees_equal(fw.call(tree, case), fw.native(case)[0])


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_a_subtree_swapped_in_after_a_call_runs_in_the_next_call(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  fw.call(tree, case)
  other = fw.convert(case).select().at_path(path).get()
  kernel = fw.parameters(other)["kernel"]
  kernel.value = kernel.value * 2.0
  swapped = tree.select().at_path(path).set(other)
  expected, _ = fw.native(fw.with_variable(case, kernel.label, kernel.value))
  assert_trees_equal(fw.call(swapped, case), expected)


@pytest.mark.parametrize(
  "fw, name",
  [(LINEN, "batchnorm_train"), (NNX, "convnet_train"), (NNX, "variable_replaced_by_the_call")],
)
def test_state_a_call_updates_is_what_the_next_call_starts_from(corpora, fw, name):
  case = corpora[fw][name]
  tree = fw.convert(case)
  for _ in range(3):
    output = fw.call(tree, case)
  expected, state = fw.native(case, times=3)
  assert_trees_equal(output, expected)
  assert_trees_equal(fw.tree_state(tree), state)


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_1"), (NNX, "out")])
def test_a_hand_built_plain_dict_edited_in_place_after_a_call_is_seen(corpora, fw, path):
  """A run works out once which variables it gathers, but only for read-only dicts: a
  node rebuilt by hand with plain dicts is gathered afresh at every call."""
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  node = tree.select().at_path(path).get()
  plain = dict(node.scope_data.parameters)
  hand_built = dataclasses.replace(
    node, scope_data=dataclasses.replace(node.scope_data, parameters=plain)
  )
  tree = tree.select().at_path(path).set(hand_built)
  fw.call(tree, case)
  old = plain["kernel"]
  plain["kernel"] = fl.Parameter(old.value * 2.0, label=old.label)
  expected, _ = fw.native(fw.with_variable(case, old.label, old.value * 2.0))
  assert_trees_equal(fw.call(tree, case), expected)
