"""Exporting a tree back to its framework: exact round trips, edits carried, patches refused.

Linen exports the variables dict for `module.apply`, NNX a new model (or the given one,
updated in place). Round trips are compared in their full static detail (boxes with
their axis names, NNX variable types and metadata) and leaf by leaf as the same arrays.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX
from replacements import Identity, PlusOne

import flaxlens as fl

EVERY_CASE = [(fw, name) for fw in (LINEN, NNX) for name in fw.corpus.NAMES]
BOTH = [LINEN, NNX]
FIRST_CHILD = {LINEN: "Dense_0", NNX: "hidden"}  # the first call of each corpus's "mlp"


def _assert_same_leaves(actual, expected):
  """Same structure (statics included); JAX leaves the same arrays, others equal and typed."""
  leaves_a, def_a = jax.tree_util.tree_flatten(actual)
  leaves_e, def_e = jax.tree_util.tree_flatten(expected)
  assert def_a == def_e, f"structure differs:\n{def_a}\n{def_e}"
  for a, e in zip(leaves_a, leaves_e, strict=True):
    if isinstance(e, jax.Array):
      assert a is e
    else:
      assert type(a) is type(e) and np.asarray(a).dtype == np.asarray(e).dtype
      np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.parametrize("fw, name", EVERY_CASE)
def test_export_without_edits_gives_back_the_model_exactly(corpora, fw, name):
  case = corpora[fw][name]
  exported = fw.export(fw.convert(case))
  _assert_same_leaves(fw.export_form(exported), fw.export_form(fw.unedited_export(case)))


@pytest.mark.parametrize("fw, name", EVERY_CASE)
def test_edited_variables_export_to_a_model_that_computes_as_the_tree(corpora, fw, name):
  case = corpora[fw][name]
  tree = fw.convert(case)
  fw.call(tree, case)
  for p in fl.variables_in(tree):
    if isinstance(p, fl.Parameter):
      p.value = jax.tree_util.tree_map(lambda a: a * 1.5, p.value)
  exported = fw.with_exported(case, fw.export(tree))
  held = {v.label: v.value for v in fl.variables_in(tree)}
  state = fw.model_state(exported)
  assert_trees_equal({label: state[label] for label in held}, held)
  expected_out, expected_state = fw.native(exported)
  assert_trees_equal(fw.call(tree, case), expected_out)
  assert_trees_equal(fw.tree_state(tree), expected_state)


@pytest.mark.parametrize("fw", BOTH)
def test_export_never_writes_into_the_converted_model(corpora, fw):
  case = corpora[fw]["batchnorm_train" if fw is LINEN else "convnet_train"]
  before = fw.model_state(case)
  tree = fw.convert(case)
  fw.call(tree, case)
  for p in fl.variables_in(tree):
    if isinstance(p, fl.Parameter):
      p.value = jax.tree_util.tree_map(lambda a: a + 1.0, p.value)
  fw.export(tree)
  assert_trees_equal(fw.model_state(case), before)


@pytest.mark.parametrize("fw", BOTH)
def test_export_refuses_replaced_calls_listing_every_patched_path(corpora, fw):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  children = [n for n in tree.submodule_calls.values() if isinstance(n, fw.node_type)]
  patched = (
    tree.select()
    .at(lambda t: tuple(t.submodule_calls.values()), multiple=True)
    .apply(lambda node: PlusOne(inner=node))
  )
  with pytest.raises(fl.ExportError, match="replaced calls") as info:
    fw.export(patched)
  for child in children:
    assert repr(child.where()) in str(info.value)


@pytest.mark.parametrize("fw", BOTH)
def test_export_refuses_a_wrapper_that_changes_nothing(corpora, fw):
  case = corpora[fw]["mlp"]
  patched = fw.convert(case).select().at_path(FIRST_CHILD[fw]).apply(lambda n: Identity(inner=n))
  with pytest.raises(fl.ExportError, match=rf"\['{FIRST_CHILD[fw]}.__call__'\]"):
    fw.export(patched)


@pytest.mark.parametrize("fw", BOTH)
def test_export_refuses_a_call_replaced_by_another_trees_node(corpora, fw):
  case = corpora[fw]["mlp"]
  other = fw.convert(case).select().at_path(FIRST_CHILD[fw]).get()
  patched = fw.convert(case).select().at_path(FIRST_CHILD[fw]).set(other)
  with pytest.raises(fl.ExportError, match=FIRST_CHILD[fw]):
    fw.export(patched)


@pytest.mark.parametrize("fw", BOTH)
def test_a_subtree_exports_its_own_module(corpora, fw):
  case = corpora[fw]["mlp"]
  node = fw.convert(case).select().at_path(FIRST_CHILD[fw]).get()
  x = case.args[0]
  expected, _ = fw.native_of_node(case, node, x)
  exported = fw.export(node)
  if fw is LINEN:
    assert_trees_equal(node.module.apply(exported, x), expected)
  else:
    assert_trees_equal(exported(x), expected)


@pytest.mark.parametrize("frozen", ["whole", "params"])
def test_export_keeps_frozen_dicts_where_the_converted_variables_had_them(corpora, frozen):
  from flax.core import freeze

  case = corpora[LINEN]["mlp"]
  variables = case.variables
  given = (
    freeze(variables) if frozen == "whole" else {**variables, "params": freeze(variables["params"])}
  )
  tree = fl.unflaxify(case.module, given, *case.args)
  exported = tree.export()
  assert jax.tree_util.tree_structure(exported) == jax.tree_util.tree_structure(given)
  np.testing.assert_array_equal(
    case.module.apply(exported, *case.args), case.module.apply(given, *case.args)
  )
