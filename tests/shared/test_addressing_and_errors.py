"""Finding calls by readable path, calling a subtree on its own, and clear errors."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import LINEN, NNX
from replacements import Zeros

import flaxlens as fl


@pytest.mark.parametrize(
  "fw, name, path, module_class",
  [
    (
      LINEN,
      "transformer",
      "TransformerBlock_1/MultiHeadDotProductAttention_0",
      nn.MultiHeadDotProductAttention,
    ),
    (NNX, "scan", "blocks/linear", nnx.Linear),
  ],
)
def test_a_call_is_found_by_its_module_path(corpora, fw, name, path, module_class):
  node = fw.convert(corpora[fw][name]).select().at_path(path).get()
  assert node.path == tuple(path.split("/"))
  assert fw.module_class(node) is module_class
  assert node.readable_path() == (path, "__call__")


@pytest.mark.parametrize(
  "fw, name, pattern, found",
  [
    # In call order: each block calls Dense_1 (created second) before Dense_0.
    (
      LINEN,
      "transformer",
      "TransformerBlock_*/Dense_*",
      [
        "TransformerBlock_0/Dense_1",
        "TransformerBlock_0/Dense_0",
        "TransformerBlock_1/Dense_1",
        "TransformerBlock_1/Dense_0",
      ],
    ),
    (NNX, "list", "layers/*", ["layers/0", "layers/1", "layers/2"]),
  ],
)
def test_path_globs_select_several_calls_in_call_order(corpora, fw, name, pattern, found):
  tree = fw.convert(corpora[fw][name])
  assert [n.readable_path()[0] for n in tree.select().at_path(pattern).get_sequence()] == found


@pytest.mark.parametrize(
  "fw, name, pattern, count",
  [(LINEN, "transformer", "**/query.__call__", 2), (NNX, "remat", "**/linear.__call__", 1)],
)
def test_a_double_star_matches_calls_at_any_depth(corpora, fw, name, pattern, count):
  assert fw.convert(corpora[fw][name]).select().at_path(pattern).count() == count


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_self_method_calls_are_named_self(corpora, fw):
  tree = fw.convert(corpora[fw]["self_method_calls"])
  assert list(tree.submodule_calls) == [(0, "self.encode"), (1, "self.decode")]
  decode = tree.submodule_calls[(1, "self.decode")]
  assert list(decode.submodule_calls) == [(0, "embed.attend")]


@pytest.mark.parametrize(
  "fw, unknown, known", [(LINEN, "Dense_7", "Dense_0"), (NNX, "nowhere", "hidden")]
)
def test_an_unknown_path_lists_known_ones(corpora, fw, unknown, known):
  tree = fw.convert(corpora[fw]["mlp"])
  with pytest.raises(KeyError, match=known):
    tree.select().at_path(unknown)


@pytest.mark.parametrize(
  "fw, name, path, x",
  [
    (LINEN, "transformer", "TransformerBlock_0", jnp.ones((2, 4, 8))),
    (NNX, "remat", "block", NNX.corpus.X),
  ],
)
def test_a_child_called_on_its_own_runs_its_module(corpora, fw, name, path, x):
  case = corpora[fw][name]
  block = fw.convert(case).select().at_path(path).get()
  expected_out, expected_state = fw.native_of_node(case, block, x)
  assert_trees_equal(block(fl.ArgsAndKwargs.capture(x)), expected_out)
  state = fw.tree_state(block)
  assert_trees_equal(state, {label: expected_state[label] for label in state})


@pytest.mark.parametrize(
  "fw, path, shape, message",
  [
    (LINEN, "layers/Dense_0", (2, 8), "layers/Dense_0.*nn.scan"),
    (NNX, "blocks/linear", (2, 4), r"blocks/linear\.__call__.*nnx\.scan"),
  ],
)
def test_a_call_inside_scan_refuses_to_run_on_its_own(corpora, fw, path, shape, message):
  node = fw.convert(corpora[fw]["scan"]).select().at_path(path).get()
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match=message):
    node(fl.ArgsAndKwargs.capture(jnp.ones(shape)))


@pytest.mark.parametrize("fw, method", [(LINEN, "encode"), (NNX, "forward")])
def test_an_unknown_method_name_is_refused(corpora, fw, method):
  with pytest.raises(fl.FlaxlensError, match=f"MLP: the module has no method '{method}'"):
    fw.convert(corpora[fw]["mlp"], method=method)


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_call_needs_args_and_kwargs(corpora, fw):
  case = corpora[fw]["mlp"]
  with pytest.raises(TypeError, match="ArgsAndKwargs"):
    fw.convert(case)(case.args[0])


@pytest.mark.parametrize("fw, label", [(LINEN, "params:Dense_0/"), (NNX, "Param:hidden/")])
def test_unbound_slots_are_reported_by_label(corpora, fw, label):
  case = corpora[fw]["mlp"]
  tree, _ = fl.unbind_variables(fw.convert(case))
  with pytest.raises(fl.FlaxlensError, match=label):
    fw.call(tree, case)


@pytest.mark.parametrize(
  "fw, path, features, message",
  [
    (LINEN, "Scale_0", 8, "b.__call__"),
    (NNX, "a", 4, r"Branchy\.__call__: call \(0, 'b.__call__'\)"),
  ],
)
def test_a_call_structure_diverging_with_patches_present_is_an_error(
  corpora, fw, path, features, message
):
  case = corpora[fw]["branch"]
  patched = fw.convert(case).select().at_path(path).apply(lambda _: Zeros(features))
  with pytest.raises(fl.CallStructureError, match=message):
    fw.call(patched, case, mode="b")
