"""Specification of variables: Parameter, StateVariable, their values and slots."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import flaxlens as fl


def is_state(var):
  return isinstance(var, fl.StateVariable)


# --- variables -----------------------------------------------------------------


@pytest.mark.parametrize("kind", [fl.Parameter, fl.StateVariable])
def test_a_variable_is_a_single_leaf_not_a_pytree(kind):
  var = kind(jnp.ones(3), label="v")
  leaves = jax.tree_util.tree_leaves({"a": var})
  assert len(leaves) == 1
  assert leaves[0] is var


@pytest.mark.parametrize("kind", [fl.Parameter, fl.StateVariable])
def test_a_variable_value_is_mutable(kind):
  var = kind(1, label="v")
  var.value = 2
  assert var.value == 2


def test_omitted_labels_are_generated_and_unique():
  labels = [fl.Parameter(0).label, fl.Parameter(0).label, fl.StateVariable(0).label]
  assert all(isinstance(label, str) for label in labels)
  assert len(set(labels)) == 3


def test_a_given_label_is_kept():
  assert fl.StateVariable(0, label="mean").label == "mean"


def test_a_non_string_label_raises_type_error():
  with pytest.raises(TypeError, match="label must be a string"):
    fl.Parameter(0, label=3)


@pytest.mark.parametrize(
  ("kind", "value_kind"),
  [(fl.Parameter, fl.ParameterValue), (fl.StateVariable, fl.StateVariableValue)],
)
def test_freeze_gives_the_matching_frozen_value(kind, value_kind):
  var = kind(5, label="v")
  frozen = var.freeze()
  assert type(frozen) is value_kind
  assert (frozen.value, frozen.label) == (5, "v")


def test_a_frozen_value_is_a_pytree_with_value_as_its_only_child():
  frozen = fl.Parameter(jnp.ones(2), label="w").freeze()
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(frozen)[0]]
  assert paths == [".value"]


def test_a_frozen_value_is_immutable():
  frozen = fl.Parameter(1, label="w").freeze()
  with pytest.raises(dataclasses.FrozenInstanceError):
    frozen.value = 2


def test_a_frozen_value_does_not_follow_later_assignments():
  var = fl.StateVariable(1, label="s")
  frozen = var.freeze()
  var.value = 2
  assert frozen.value == 1


@pytest.mark.parametrize(
  ("kind", "slot_kind"),
  [(fl.Parameter, fl.ParameterSlot), (fl.StateVariable, fl.StateVariableSlot)],
)
def test_slot_gives_the_matching_slot_with_the_label(kind, slot_kind):
  slot = kind(0, label="v").slot()
  assert type(slot) is slot_kind
  assert slot.label == "v"


def test_a_slot_has_no_leaves():
  assert jax.tree_util.tree_leaves(fl.ParameterSlot(label="w")) == []


def test_unfreeze_as_copy_makes_a_new_variable_of_the_matching_kind():
  copy = fl.StateVariableValue(value=3, label="s").unfreeze_as_copy()
  assert type(copy) is fl.StateVariable
  assert (copy.value, copy.label) == (3, "s")


# --- variables_in ----------------------------------------------------------------


def test_variables_in_lists_distinct_variables_in_traversal_order():
  a, b = fl.Parameter(0, label="a"), fl.StateVariable(0, label="b")
  found = fl.variables_in({"x": [b, a], "y": b})
  assert len(found) == 2
  assert found[0] is b and found[1] is a


def test_variables_in_rejects_two_variables_with_one_label():
  with pytest.raises(fl.VariableError, match="'w'"):
    fl.variables_in([fl.Parameter(0, label="w"), fl.Parameter(0, label="w")])


# --- unbind / bind -------------------------------------------------------------------


def test_unbind_replaces_variables_by_slots():
  w, s = fl.Parameter(1.0, label="w"), fl.StateVariable(0, label="s")
  tree, variables = fl.unbind_variables({"w": w, "s": s, "other": 3})
  assert type(tree["w"]) is fl.ParameterSlot and tree["w"].label == "w"
  assert type(tree["s"]) is fl.StateVariableSlot and tree["s"].label == "s"
  assert tree["other"] == 3
  assert len(variables) == 2
  assert variables[0] is s and variables[1] is w  # traversal order: dict keys sorted


def test_unbind_does_not_modify_the_original_tree():
  w = fl.Parameter(1.0, label="w")
  original = {"w": w}
  fl.unbind_variables(original)
  assert original["w"] is w


def test_unbind_then_bind_restores_the_same_variable_objects():
  w, s = fl.Parameter(1.0, label="w"), fl.StateVariable(0, label="s")
  tree, variables = fl.unbind_variables([w, (s, 4)])
  rebound = fl.bind_variables(tree, variables)
  assert rebound[0] is w
  assert rebound[1][0] is s
  assert rebound[1][1] == 4


def test_a_variable_reachable_twice_becomes_two_slots_with_one_label():
  w = fl.Parameter(1.0, label="shared")
  tree, variables = fl.unbind_variables({"a": w, "b": w})
  assert variables == (w,)
  assert tree["a"].label == tree["b"].label == "shared"


def test_binding_frozen_values_shares_one_new_variable_between_slots_with_one_label():
  w = fl.Parameter(1.0, label="shared")
  tree, values = fl.unbind_variables({"a": w, "b": w}, freeze=True)
  rebound = fl.bind_variables(tree, values)
  assert rebound["a"] is rebound["b"]
  assert rebound["a"] is not w
  assert type(rebound["a"]) is fl.Parameter
  assert rebound["a"].value == 1.0


def test_binding_frozen_values_leaves_the_original_variable_alone():
  w = fl.Parameter(1.0, label="w")
  tree, values = fl.unbind_variables([w], freeze=True)
  rebound = fl.bind_variables(tree, values)
  rebound[0].value = 2.0
  assert w.value == 1.0


def test_unbind_with_freeze_returns_frozen_values():
  w, s = fl.Parameter(1.0, label="w"), fl.StateVariable(0, label="s")
  _, values = fl.unbind_variables([w, s], freeze=True)
  assert [type(v) for v in values] == [fl.ParameterValue, fl.StateVariableValue]
  assert [(v.label, v.value) for v in values] == [("w", 1.0), ("s", 0)]


def test_unbind_with_a_predicate_unbinds_only_matching_variables():
  w, s = fl.Parameter(1.0, label="w"), fl.StateVariable(0, label="s")
  tree, variables = fl.unbind_variables({"w": w, "s": s}, predicate=is_state)
  assert variables == (s,)
  assert tree["w"] is w
  assert type(tree["s"]) is fl.StateVariableSlot


def test_unbind_with_a_non_callable_predicate_raises_type_error():
  with pytest.raises(TypeError, match="predicate must be callable"):
    fl.unbind_variables([fl.Parameter(0)], predicate="state")


def test_unbind_rejects_two_distinct_variables_with_one_label():
  tree = [fl.Parameter(0, label="w"), fl.Parameter(1, label="w")]
  with pytest.raises(fl.VariableError, match="'w'"):
    fl.unbind_variables(tree)


def test_bind_fills_only_slots_whose_label_is_given():
  tree = [fl.ParameterSlot(label="a"), fl.ParameterSlot(label="b")]
  rebound = fl.bind_variables(tree, [fl.ParameterValue(value=1, label="a")])
  assert rebound[0].value == 1
  assert type(rebound[1]) is fl.ParameterSlot


def test_bind_with_an_unknown_label_raises_variable_error_naming_it():
  tree = [fl.ParameterSlot(label="a")]
  values = [fl.ParameterValue(value=1, label="a"), fl.ParameterValue(value=2, label="zzz")]
  with pytest.raises(fl.VariableError, match="zzz"):
    fl.bind_variables(tree, values)


def test_bind_with_an_unknown_label_and_allow_unused_ignores_it():
  tree = [fl.ParameterSlot(label="a")]
  values = [fl.ParameterValue(value=1, label="a"), fl.ParameterValue(value=2, label="zzz")]
  rebound = fl.bind_variables(tree, values, allow_unused=True)
  assert len(rebound) == 1
  assert rebound[0].value == 1


def test_bind_a_parameter_value_into_a_state_slot_raises_variable_error():
  with pytest.raises(fl.VariableError, match="StateVariable"):
    fl.bind_variables([fl.StateVariableSlot(label="s")], [fl.ParameterValue(value=1, label="s")])


def test_bind_a_state_variable_into_a_parameter_slot_raises_variable_error():
  with pytest.raises(fl.VariableError, match="Parameter"):
    fl.bind_variables([fl.ParameterSlot(label="w")], [fl.StateVariable(1, label="w")])


def test_bind_with_duplicate_labels_raises_variable_error():
  values = [fl.ParameterValue(value=1, label="w"), fl.ParameterValue(value=2, label="w")]
  with pytest.raises(fl.VariableError, match="two variables labelled 'w'"):
    fl.bind_variables([fl.ParameterSlot(label="w")], values)


def test_bind_with_something_that_is_not_a_variable_raises_type_error():
  with pytest.raises(TypeError, match="int"):
    fl.bind_variables([fl.ParameterSlot(label="w")], [3])


# --- freeze_variables --------------------------------------------------------------


def test_freeze_variables_replaces_every_variable_by_its_frozen_value():
  tree = {"w": fl.Parameter(1.0, label="w"), "s": [fl.StateVariable(2, label="s")], "n": 3}
  frozen = fl.freeze_variables(tree)
  assert type(frozen["w"]) is fl.ParameterValue and frozen["w"].value == 1.0
  assert type(frozen["s"][0]) is fl.StateVariableValue and frozen["s"][0].value == 2
  assert frozen["n"] == 3


def test_freeze_variables_gives_a_tree_whose_leaves_are_the_values():
  frozen = fl.freeze_variables([fl.Parameter(1.0, label="w"), fl.StateVariable(2, label="s")])
  assert jax.tree_util.tree_leaves(frozen) == [1.0, 2]


def test_variable_errors_are_flaxlens_errors():
  tree = {"w": fl.ParameterSlot(label="w")}
  with pytest.raises(fl.FlaxlensError, match="No slot in the tree"):
    fl.bind_variables(tree, [fl.ParameterValue(value=1.0, label="other")])


def test_variable_errors_stay_value_errors():
  w1, w2 = fl.Parameter(1.0, label="w"), fl.Parameter(2.0, label="w")
  with pytest.raises(ValueError, match="share the label 'w'"):
    fl.variables_in([w1, w2])


def test_variables_survive_pickling():
  import pickle

  w = fl.Parameter(jnp.arange(3.0), label="w")
  copy = pickle.loads(pickle.dumps(w))
  assert copy.label == "w" and (copy.value == w.value).all()
