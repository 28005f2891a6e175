"""Specification of selections: `fl.select(tree)` / `struct.select()` and `fl.Selection`."""

from __future__ import annotations

from typing import Any

import jax
import pytest
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

import flaxlens as fl


class Node(fl.Struct):
  child: Any
  name: str = fl.static_field(default="node")


class Call(fl.Struct):
  """Stands in for a converted Flax call: it answers to a readable module path."""

  body: Any
  path: str = fl.static_field()
  method: str = fl.static_field(default="__call__")

  def readable_path(self):
    return self.path, self.method


class Box:
  """An arbitrary pytree, registered without keys."""

  def __init__(self, items):
    self.items = list(items)


jax.tree_util.register_pytree_node(
  Box, lambda box: (tuple(box.items), None), lambda _, items: Box(items)
)


@pytest.fixture
def tree():
  return {"a": [1, 2, 3], "b": Node(child=(4, "x")), "c": None}


@pytest.fixture
def calls():
  return {
    "blocks": [
      Call(body=Call(body=1, path="Block_0/Dense_0"), path="Block_0"),
      Call(
        body=(
          Call(body=2, path="Block_1/Dense_0"),
          Call(body=3, path="Block_1/Attention_0", method="attend"),
        ),
        path="Block_1",
      ),
    ],
    "head": Call(body=4, path="Head"),
  }


def paths_of(selection):
  return [jax.tree_util.keystr(p) for p in selection.keypaths]


def call_paths(selection):
  return [node.path for node in selection.get_sequence()]


# --- starting ------------------------------------------------------------------


def test_select_selects_the_root(tree):
  selection = fl.select(tree)
  assert selection.keypaths == ((),)
  assert selection.get() is tree


def test_struct_select_selects_the_struct(tree):
  node = tree["b"]
  assert node.select().get() is node


def test_deselect_returns_the_whole_tree(tree):
  assert fl.select(tree).at(lambda t: t["a"]).deselect() is tree


# --- at ------------------------------------------------------------------------


def test_at_follows_dict_keys_and_list_indices(tree):
  selection = fl.select(tree).at(lambda t: t["a"][1])
  assert selection.keypaths == ((DictKey("a"), SequenceKey(1)),)
  assert selection.get() == 2


def test_at_follows_struct_attributes(tree):
  selection = fl.select(tree).at(lambda t: t["b"].child[1])
  assert selection.keypaths == ((DictKey("b"), GetAttrKey("child"), SequenceKey(1)),)
  assert selection.get() == "x"


def test_at_can_select_a_container(tree):
  assert fl.select(tree).at(lambda t: t["a"]).get() is tree["a"]


def test_at_can_select_none(tree):
  selection = fl.select(tree).at(lambda t: t["c"])
  assert paths_of(selection) == ["['c']"]
  assert selection.get() is None


def test_at_distinguishes_equal_leaves_by_position():
  assert paths_of(fl.select([7, 7]).at(lambda t: t[1])) == ["[1]"]


def test_at_with_multiple_selects_every_returned_part(tree):
  selection = fl.select(tree).at(lambda t: (t["a"][0], t["b"].child), multiple=True)
  assert paths_of(selection) == ["['a'][0]", "['b'].child"]


def test_at_of_a_new_object_raises_value_error(tree):
  with pytest.raises(ValueError, match="not a node of the tree"):
    fl.select(tree).at(lambda t: [t["a"][0]])


def test_at_of_several_parts_without_multiple_raises_value_error(tree):
  with pytest.raises(ValueError, match="multiple=True"):
    fl.select(tree).at(lambda t: (t["a"][0], t["a"][1]))


def test_at_of_a_static_field_raises_value_error(tree):
  with pytest.raises(ValueError, match="not a node of the tree"):
    fl.select(tree).at(lambda t: t["b"].name)


def test_at_with_a_failing_attribute_access_raises_value_error(tree):
  with pytest.raises(ValueError, match="accessor failed"):
    fl.select(tree).at(lambda t: t["b"].missing)


def test_at_with_a_non_callable_raises_type_error(tree):
  with pytest.raises(TypeError, match="callable"):
    fl.select(tree).at("a")


# --- searching -----------------------------------------------------------------


def test_at_instances_of_selects_the_outermost_matches_by_default():
  tree = {"outer": Node(child=Node(child=1)), "other": 2}
  assert paths_of(fl.select(tree).at_instances_of(Node)) == ["['outer']"]


def test_at_instances_of_with_innermost_selects_the_deepest_matches():
  tree = {"outer": Node(child=Node(child=1)), "other": 2}
  assert paths_of(fl.select(tree).at_instances_of(Node, innermost=True)) == ["['outer'].child"]


def test_at_instances_of_accepts_a_tuple_of_types(tree):
  found = fl.select(tree).at_instances_of((int, str)).get_sequence()
  assert found == (1, 2, 3, 4, "x")


def test_at_subtrees_where_selects_nodes_matching_the_predicate(tree):
  selection = fl.select(tree).at_subtrees_where(lambda x: isinstance(x, int) and x % 2 == 0)
  assert paths_of(selection) == ["['a'][1]", "['b'].child[0]"]


def test_at_subtrees_where_with_keypath_passes_the_path_from_the_root(tree):
  seen = []

  def under_child(path, node):
    seen.append(path)
    return GetAttrKey("child") in path and isinstance(node, int)

  selection = fl.select(tree).at(lambda t: t["b"]).at_subtrees_where(under_child, with_keypath=True)
  assert selection.get() == 4
  assert seen[0] == (DictKey("b"),)


def test_at_subtrees_where_with_innermost_prefers_deeper_matches():
  tree = [[1, [2]], 3]
  is_list = lambda x: isinstance(x, list)
  assert paths_of(fl.select(tree).at_subtrees_where(is_list)) == [""]
  assert paths_of(fl.select(tree).at_subtrees_where(is_list, innermost=True)) == ["[0][1]"]


def test_at_subtrees_where_with_a_non_callable_raises_type_error(tree):
  with pytest.raises(TypeError, match="callable"):
    fl.select(tree).at_subtrees_where(True)


def test_at_subtrees_where_with_no_match_selects_nothing(tree):
  assert fl.select(tree).at_subtrees_where(lambda x: False).count() == 0


def test_where_keeps_only_selected_nodes_matching_the_predicate(tree):
  selection = fl.select(tree).at_instances_of(int).where(lambda x: x > 2)
  assert selection.get_sequence() == (3, 4)


def test_where_with_keypath_passes_the_path_and_the_node(tree):
  selection = (
    fl.select(tree)
    .at_instances_of(int)
    .where(lambda path, x: path[0] == DictKey("a") and x != 2, with_keypath=True)
  )
  assert selection.get_sequence() == (1, 3)


def test_where_with_a_non_callable_raises_type_error(tree):
  with pytest.raises(TypeError, match="callable"):
    fl.select(tree).where(3)


def test_at_keypaths_selects_nodes_at_jax_key_paths(tree):
  keypaths = [(DictKey("a"), SequenceKey(2)), (DictKey("b"), GetAttrKey("child"))]
  selection = fl.select(tree).at_keypaths(keypaths)
  assert selection.get_sequence() == (3, (4, "x"))


def test_at_keypaths_is_relative_to_each_selected_node(tree):
  selection = fl.select(tree).at(lambda t: t["b"]).at_keypaths([(GetAttrKey("child"),)])
  assert selection.keypaths == ((DictKey("b"), GetAttrKey("child")),)


def test_at_keypaths_with_overlapping_paths_raises_value_error(tree):
  with pytest.raises(ValueError, match="overlap"):
    fl.select(tree).at_keypaths([(DictKey("a"),), (DictKey("a"), SequenceKey(0))])


def test_at_keypaths_with_a_missing_path_raises_key_error(tree):
  with pytest.raises(KeyError, match="no node at"):
    fl.select(tree).at_keypaths([(DictKey("zzz"),)])


def test_selections_compose_by_narrowing_each_selected_node(tree):
  selection = (
    fl.select(tree)
    .at(lambda t: (t["a"], t["b"]), multiple=True)
    .at_instances_of(int)
    .where(lambda x: x != 2)
  )
  assert paths_of(selection) == ["['a'][0]", "['a'][2]", "['b'].child[0]"]


# --- traversal -------------------------------------------------------------------


def test_traversal_reaches_dicts_lists_tuples_structs_none_and_registered_pytrees():
  tree = {"d": {"k": 1}, "l": [2], "t": (3,), "s": Node(child=4), "n": None, "box": Box([5])}
  assert fl.select(tree).at_instances_of(int).get_sequence() == (5, 1, 2, 4, 3)
  assert fl.select(tree).at_instances_of(type(None)).count() == 1


def test_editing_rebuilds_a_registered_pytree():
  new = fl.select({"box": Box([1, 2])}).at_instances_of(int).apply(lambda x: x * 10)
  assert type(new["box"]) is Box
  assert new["box"].items == [10, 20]


def test_at_navigates_into_a_registered_pytree():
  selection = fl.select({"box": Box([1, 2])}).at(lambda t: t["box"].items[1])
  assert selection.get() == 2


# --- reading ---------------------------------------------------------------------


def test_count_is_the_number_of_selected_nodes(tree):
  assert fl.select(tree).at_instances_of(int).count() == 4


def test_get_sequence_is_in_tree_order(tree):
  selection = fl.select(tree).at(lambda t: (t["b"].child[0], t["a"][0]), multiple=True)
  assert selection.get_sequence() == (4, 1)
  assert fl.select(tree).at_instances_of(int).get_sequence() == (1, 2, 3, 4)


def test_get_by_path_maps_key_paths_to_nodes(tree):
  by_path = fl.select(tree).at(lambda t: t["a"][0]).get_by_path()
  assert by_path == {(DictKey("a"), SequenceKey(0)): 1}


def test_get_returns_the_single_selected_node(tree):
  assert fl.select(tree).at_instances_of(str).get() == "x"


def test_get_with_nothing_selected_raises_value_error(tree):
  with pytest.raises(ValueError, match="exactly one.*0 are"):
    fl.select(tree).at_instances_of(float).get()


def test_get_with_several_selected_raises_value_error(tree):
  with pytest.raises(ValueError, match="exactly one.*4 are"):
    fl.select(tree).at_instances_of(int).get()


# --- editing ---------------------------------------------------------------------


def test_apply_replaces_each_selected_node_by_the_function_result(tree):
  new = fl.select(tree).at_instances_of(int).apply(lambda x: x * 10)
  assert new["a"] == [10, 20, 30]
  assert new["b"].child == (40, "x")


def test_apply_does_not_mutate_the_original_tree(tree):
  a, b = tree["a"], tree["b"]
  fl.select(tree).at_instances_of(int).apply(lambda x: x * 10)
  assert tree["a"] is a and a == [1, 2, 3]
  assert tree["b"] is b and b.child == (4, "x")


def test_apply_keeps_unselected_subtrees_as_the_same_objects(tree):
  new = fl.select(tree).at(lambda t: t["a"][0]).apply(lambda x: -x)
  assert new is not tree
  assert new["a"] is not tree["a"]
  assert new["b"] is tree["b"]


def test_apply_keeps_struct_static_fields(tree):
  new = fl.select(tree).at(lambda t: t["b"].child).set(0)
  assert type(new["b"]) is Node
  assert new["b"].name == "node"


def test_apply_with_keypath_passes_the_path_and_the_node(tree):
  new = (
    fl.select(tree)
    .at(lambda t: t["a"][2])
    .apply(lambda path, x: (jax.tree_util.keystr(path), x), with_keypath=True)
  )
  assert new["a"][2] == ("['a'][2]", 3)


def test_apply_with_a_non_callable_raises_type_error(tree):
  with pytest.raises(TypeError, match="callable"):
    fl.select(tree).apply(None)


def test_apply_on_the_root_returns_the_function_result(tree):
  assert fl.select(tree).apply(lambda t: "replaced") == "replaced"


def test_apply_with_nothing_selected_returns_the_tree(tree):
  assert fl.select(tree).at_instances_of(float).apply(lambda x: 0) is tree


def test_set_replaces_every_selected_node_by_the_value(tree):
  new = fl.select(tree).at_instances_of(int).where(lambda x: x < 3).set(0)
  assert new["a"] == [0, 0, 3]


def test_set_can_replace_none(tree):
  assert fl.select(tree).at(lambda t: t["c"]).set(5)["c"] == 5


def test_insert_before_inserts_into_a_list(tree):
  new = fl.select(tree).at(lambda t: t["a"][1]).insert_before(9)
  assert new["a"] == [1, 9, 2, 3]
  assert tree["a"] == [1, 2, 3]


def test_insert_after_inserts_into_a_list(tree):
  assert fl.select(tree).at(lambda t: t["a"][1]).insert_after(9)["a"] == [1, 2, 9, 3]


def test_insert_into_a_tuple_keeps_it_a_tuple(tree):
  before = fl.select(tree).at(lambda t: t["b"].child[1]).insert_before("y")
  after = fl.select(tree).at(lambda t: t["b"].child[1]).insert_after("y")
  assert before["b"].child == (4, "y", "x")
  assert after["b"].child == (4, "x", "y")


def test_insert_next_to_several_nodes_of_one_list():
  new = fl.select([1, "x", 2, "y"]).at_instances_of(str).insert_after("!")
  assert new == [1, "x", "!", 2, "y", "!"]


def test_insert_next_to_a_dict_value_raises_type_error(tree):
  with pytest.raises(TypeError, match="dict"):
    fl.select(tree).at(lambda t: t["c"]).insert_before(0)


def test_insert_next_to_a_struct_field_raises_type_error(tree):
  with pytest.raises(TypeError, match="Node"):
    fl.select(tree).at(lambda t: t["b"].child).insert_after(0)


def test_remove_from_parent_removes_from_a_list(tree):
  new = fl.select(tree).at_instances_of(int).where(lambda x: x != 2).remove_from_parent()
  assert new["a"] == [2]
  assert new["b"].child == ("x",)


def test_remove_from_parent_removes_from_a_dict(tree):
  new = fl.select(tree).at(lambda t: t["c"]).remove_from_parent()
  assert set(new) == {"a", "b"}
  assert set(tree) == {"a", "b", "c"}


def test_remove_from_parent_of_the_root_raises_value_error(tree):
  with pytest.raises(ValueError, match="root"):
    fl.select(tree).remove_from_parent()


# --- at_path ---------------------------------------------------------------------


def test_at_path_selects_a_call_by_its_module_path(calls):
  assert call_paths(fl.select(calls).at_path("Block_0/Dense_0")) == ["Block_0/Dense_0"]


def test_at_path_selects_a_call_by_its_path_and_method(calls):
  selection = fl.select(calls).at_path("Block_1/Attention_0.attend")
  assert call_paths(selection) == ["Block_1/Attention_0"]


def test_at_path_selects_the_outermost_matching_calls(calls):
  assert call_paths(fl.select(calls).at_path("Block_*")) == ["Block_0", "Block_1"]


def test_at_path_single_star_matches_within_one_segment(calls):
  assert call_paths(fl.select(calls).at_path("*")) == ["Block_0", "Block_1", "Head"]
  selection = fl.select(calls).at_path("Block_1/*")
  assert call_paths(selection) == ["Block_1/Dense_0", "Block_1/Attention_0"]


def test_at_path_double_star_matches_across_segments(calls):
  selection = fl.select(calls).at_path("**/Dense_0")
  assert call_paths(selection) == ["Block_0/Dense_0", "Block_1/Dense_0"]
  assert call_paths(fl.select(calls).at_path("**.attend")) == ["Block_1/Attention_0"]


def test_at_path_double_star_slash_also_matches_no_segment():
  tree = [Call(body=1, path="Dense_0"), Call(body=2, path="Block/Dense_0")]
  assert call_paths(fl.select(tree).at_path("**/Dense_0")) == ["Dense_0", "Block/Dense_0"]


def test_at_path_single_star_stays_within_a_segment_next_to_a_double_star():
  tree = [Call(body=Call(body=1, path="Outer/Dense_0/Inner"), path="Outer")]
  with pytest.raises(KeyError):
    fl.select(tree).at_path("**/Dense_*")


def test_at_path_without_a_match_raises_key_error_listing_known_paths(calls):
  with pytest.raises(KeyError, match="Known calls include") as info:
    fl.select(calls).at_path("Block_9/Dense_0")
  assert "Block_0/Dense_0.__call__" in str(info.value)
  assert "Block_1/Attention_0.attend" in str(info.value)


def test_at_path_searches_only_inside_the_selected_nodes(calls):
  selection = fl.select(calls).at(lambda t: t["blocks"][1]).at_path("**/Dense_0")
  assert call_paths(selection) == ["Block_1/Dense_0"]


def test_at_path_selection_can_be_edited(calls):
  new = fl.select(calls).at_path("Head").apply(lambda call: call.body)
  assert new["head"] == 4
  assert type(calls["head"]) is Call


def test_at_with_multiple_refuses_overlapping_parts():
  tree = {"a": [1, 2]}
  with pytest.raises(ValueError, match="overlap"):
    fl.select(tree).at(lambda t: (t["a"], t["a"][0]), multiple=True)


def test_expect_passes_a_nonempty_selection_through():
  tree = {"a": 1.0, "b": 2}
  assert fl.select(tree).at_instances_of(float).expect().set(0.0) == {"a": 0.0, "b": 2}


def test_expect_refuses_an_empty_selection_before_an_edit():
  with pytest.raises(fl.SelectionError, match="is empty, but at least one node was expected"):
    fl.select({"a": 1}).at_instances_of(float).expect().apply(lambda x: x + 1)


def test_expect_with_a_count_refuses_another_number_of_nodes():
  with pytest.raises(fl.SelectionError, match="holds 2 nodes, but exactly 1 node"):
    fl.select({"a": 1.0, "b": 2.0}).at_instances_of(float).expect(1)


def test_an_unmatched_path_is_a_flaxlens_selection_error_and_a_key_error(calls):
  with pytest.raises(fl.SelectionError) as info:
    fl.select(calls).at_path("Nowhere")
  assert isinstance(info.value, fl.FlaxlensError) and isinstance(info.value, KeyError)


def test_selection_misuse_is_a_flaxlens_error():
  with pytest.raises(fl.FlaxlensError, match="exactly one selected node"):
    fl.select([1, 2]).at_instances_of(int).get()
