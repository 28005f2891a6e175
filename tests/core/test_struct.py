"""Specification of `fl.Struct`: frozen dataclass pytrees with static fields."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import treescope

import flaxlens as fl
from flaxlens.core._cache import Derived
from flaxlens.core._readonly import read_only


class Pair(fl.Struct):
  left: Any
  right: Any


class Scaled(fl.Struct):
  value: Any
  name: str = fl.static_field(default="scaled")


class Validated(fl.Struct):
  value: Any

  def __post_init__(self):
    if self.value < 0:
      raise ValueError("value must be non-negative")


class CustomInit(fl.Struct):
  value: Any

  def __init__(self, raw):
    object.__setattr__(self, "value", raw * 10)


class Colored(fl.Struct):
  value: Any

  def treescope_color(self):
    return "#abcdef"


def test_subclass_is_a_dataclass():
  assert dataclasses.is_dataclass(Pair)
  assert [f.name for f in dataclasses.fields(Pair)] == ["left", "right"]


def test_assigning_a_field_raises_frozen_instance_error():
  pair = Pair(1, 2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    pair.left = 3


def test_equality_is_identity():
  assert Pair(1, 2) != Pair(1, 2)
  pair = Pair(1, 2)
  assert pair == pair


def test_attributes_dict_lists_all_fields_in_declaration_order():
  scaled = Scaled(5, name="s")
  assert list(scaled.attributes_dict().items()) == [("value", 5), ("name", "s")]


def test_from_attributes_skips_post_init():
  obj = Validated.from_attributes(value=-1)
  assert obj.value == -1
  with pytest.raises(ValueError, match="non-negative"):
    Validated(-1)


def test_from_attributes_skips_a_custom_init():
  assert CustomInit(2).value == 20
  assert CustomInit.from_attributes(value=2).value == 2


def test_from_attributes_returns_an_instance_of_the_class():
  assert type(Pair.from_attributes(left=1, right=2)) is Pair


def test_from_attributes_with_a_missing_field_raises_value_error_naming_it():
  with pytest.raises(ValueError, match=r"missing \['right'\]"):
    Pair.from_attributes(left=1)


def test_from_attributes_with_an_unknown_field_raises_value_error_naming_it():
  with pytest.raises(ValueError, match=r"unexpected \['middle'\]"):
    Pair.from_attributes(left=1, right=2, middle=3)


def test_key_for_field_is_a_get_attr_key():
  key = Pair.key_for_field("left")
  assert isinstance(key, jax.tree_util.GetAttrKey)
  assert key.name == "left"


def test_tree_flatten_gives_children_and_static_values():
  children, aux = Scaled(5, name="s").tree_flatten()
  assert children == [5]
  assert aux == ("s",)


def test_tree_unflatten_inverts_tree_flatten():
  original = Scaled(5, name="s")
  children, aux = original.tree_flatten()
  rebuilt = Scaled.tree_unflatten(aux, children)
  assert type(rebuilt) is Scaled
  assert rebuilt.attributes_dict() == {"value": 5, "name": "s"}


def test_tree_flatten_with_keys_pairs_each_child_with_its_field_key():
  keyed, aux = Pair(1, 2).tree_flatten_with_keys()
  assert keyed == [
    (jax.tree_util.GetAttrKey("left"), 1),
    (jax.tree_util.GetAttrKey("right"), 2),
  ]
  assert aux == ()


def test_jax_round_trip_rebuilds_an_equal_struct():
  original = Pair(Scaled(1, name="a"), [2, 3])
  leaves, treedef = jax.tree_util.tree_flatten(original)
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert leaves == [1, 2, 3]
  assert rebuilt.left.name == "a"
  assert rebuilt.left.value == 1
  assert rebuilt.right == [2, 3]


def test_jax_paths_name_fields_with_dot_notation():
  pairs, _ = jax.tree_util.tree_flatten_with_path(Pair(Scaled(1), {"k": 2}))
  assert [jax.tree_util.keystr(path) for path, _ in pairs] == [".left.value", ".right['k']"]


def test_static_fields_are_not_leaves():
  assert jax.tree_util.tree_leaves(Scaled(5, name="s")) == [5]


def test_static_fields_are_part_of_the_treedef():
  first = jax.tree_util.tree_structure(Scaled(5, name="a"))
  second = jax.tree_util.tree_structure(Scaled(5, name="b"))
  assert first != second
  assert first == jax.tree_util.tree_structure(Scaled(6, name="a"))


def test_tree_map_keeps_static_fields():
  mapped = jax.tree_util.tree_map(lambda x: x + 1, Scaled(5, name="s"))
  assert (mapped.value, mapped.name) == (6, "s")


def test_a_struct_rebuilt_by_jax_keeps_its_none_and_empty_dict_fields():
  empty = read_only({})
  original = Pair(Pair(None, empty), Pair(read_only({"k": 1}), None))
  leaves, treedef = jax.tree_util.tree_flatten(original)
  rebuilt = jax.tree_util.tree_unflatten(treedef, [x + 1 for x in leaves])
  assert leaves == [1]
  assert rebuilt.left.left is None
  assert type(rebuilt.left.right) is type(empty) and rebuilt.left.right == {}
  assert dict(rebuilt.right.left) == {"k": 2} and rebuilt.right.right is None


def test_none_and_empty_dict_fields_tell_treedefs_apart():
  def structure(left, right):
    return jax.tree_util.tree_structure(Pair(left, right))

  assert structure(None, 1) != structure(read_only({}), 1)
  assert structure(None, 1) != structure(1, None)
  assert structure(None, 1) == structure(None, 2)


def test_a_selection_reaches_an_empty_dict_field_and_replaces_it():
  tree = Pair(read_only({}), 1)
  edited = tree.select().at(lambda p: p.left).set(read_only({"k": 2}))
  assert dict(edited.left) == {"k": 2} and edited.right == 1
  assert jax.tree_util.tree_leaves(edited) == [2, 1]


def test_jit_accepts_a_struct_argument():
  out = jax.jit(lambda s: s.left + s.right)(Pair(jnp.ones(2), jnp.ones(2)))
  np.testing.assert_array_equal(out, [2.0, 2.0])


def test_jit_does_not_retrace_when_only_array_values_change():
  traces = []

  @jax.jit
  def double(s):
    traces.append(s.name)
    return s.value * 2

  double(Scaled(jnp.ones(2), name="a"))
  out = double(Scaled(jnp.ones(2) * 3, name="a"))
  np.testing.assert_array_equal(out, [6.0, 6.0])
  assert traces == ["a"]


def test_jit_retraces_when_only_a_static_field_changes():
  traces = []

  @jax.jit
  def double(s):
    traces.append(s.name)
    return s.value * 2

  double(Scaled(jnp.ones(2), name="a"))
  double(Scaled(jnp.ones(2), name="b"))
  assert traces == ["a", "b"]


def test_treescope_color_defaults_to_none():
  assert Pair(1, 2).treescope_color() is None


def test_treescope_color_can_be_overridden():
  assert Colored(1).treescope_color() == "#abcdef"


def test_treescope_renders_a_struct_tree_to_html_naming_the_class():
  html = treescope.render_to_html(Pair(Scaled(jnp.ones(2)), [1, None]), compressed=False)
  assert "Pair" in html
  assert "Scaled" in html


def test_treescope_renders_a_colored_struct_to_html():
  html = treescope.render_to_html(Colored(1), compressed=False)
  assert "Colored" in html
  assert "#abcdef" in html


def test_select_starts_a_selection_at_the_struct_itself():
  pair = Pair(1, 2)
  selection = pair.select()
  assert isinstance(selection, fl.Selection)
  assert selection.get() is pair


# --- values kept on a struct (core/_cache.py) ----------------------------------------------

_worked_out: list[Any] = []


def _total(pair: Pair) -> Any:
  _worked_out.append(pair)
  return pair.left + pair.right


TOTAL = Derived("test_total", _total)
TOTAL_WHILE_SMALL = Derived("test_total_while_small", _total, lambda pair, total: total < 10)


@pytest.mark.parametrize(
  "make_copy",
  [copy.copy, copy.deepcopy, lambda p: pickle.loads(pickle.dumps(p))],
  ids=["copy", "deepcopy", "pickle"],
)
def test_a_copy_of_a_struct_works_out_derived_values_afresh(make_copy):
  pair = Pair(1, 2)
  assert TOTAL(pair) == 3
  other = make_copy(pair)
  _worked_out.clear()
  assert (TOTAL(other), TOTAL(other)) == (3, 3)
  assert _worked_out == [other]
  assert TOTAL(pair) == 3 and _worked_out == [other]


def test_a_derived_value_that_does_not_last_is_worked_out_at_every_use():
  small, large = Pair(1, 2), Pair(10, 20)
  _worked_out.clear()
  assert [TOTAL_WHILE_SMALL(p) for p in (small, small, large, large)] == [3, 3, 30, 30]
  assert _worked_out == [small, large, large]
