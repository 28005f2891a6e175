"""Replacing or wrapping one call changes exactly that call, as patching the model would.

The native side wraps the same call of the real model: a Flax interceptor (Linen) or a
subclass swapped into a copy of the model (NNX); see `frameworks.Wrap`.
"""

from __future__ import annotations

import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX, Wrap
from replacements import Identity, PlusOne, Recorder, Zeros, plus_one, zeros

import flaxlens as fl


def _patch(tree, path, fn):
  return tree.select().at_path(path).apply(fn)


def _assert_matches_native(fw, tree, case, **native):
  """The tree's output and state equal the native call's (wrapped as `native` says)."""
  expected_out, expected_state = fw.native(case, **native)
  assert_trees_equal(fw.call(tree, case), expected_out)
  assert_trees_equal(fw.tree_state(tree), expected_state)


def _assert_output_matches_native(fw, tree, case, **native):
  """As above, for output only: a replaced call takes its node's variables with it."""
  expected_out, _ = fw.native(case, **native)
  assert_trees_equal(fw.call(tree, case), expected_out)


REPLACED = [
  (LINEN, "mlp", "Dense_0", 16),
  (NNX, "mlp", "hidden", 8),
  # Inside transforms: the replacement applies at every iteration.
  (LINEN, "scan", "layers/Dense_0", 8),
  (LINEN, "vmap", "ensemble", 4),
  (NNX, "scan", "blocks/linear", 4),
  (NNX, "vmap_ensemble", "members", 2),
]


@pytest.mark.parametrize("fw, name, path, features", REPLACED)
def test_replacing_a_call_changes_exactly_that_call(corpora, fw, name, path, features):
  case = corpora[fw][name]
  patched = _patch(fw.convert(case), path, lambda _: Zeros(features))
  _assert_output_matches_native(fw, patched, case, wrap=Wrap(path, zeros))


@pytest.mark.parametrize("fw, path, shape", [(LINEN, "Dense_1", (2, 16)), (NNX, "out", (2, 8))])
def test_replacement_receives_the_calls_arguments_and_side_inputs(corpora, fw, path, shape):
  case = corpora[fw]["mlp"]
  seen = []
  patched = _patch(fw.convert(case), path, lambda node: Recorder(seen, node))
  patched(fw.argument(case), flag="on")
  ((argument, side_inputs),) = seen
  assert isinstance(argument, fl.ArgsAndKwargs)
  assert argument.args[0].shape == shape
  assert side_inputs == {"flag": "on"}


WRAPPED = [
  (LINEN, "mlp", "Dense_0"),
  (NNX, "mlp", "hidden"),
  # Dropout: the mask, and NNX's rng count, stay those of the model.
  (LINEN, "dropout", "Dropout_0"),
  (NNX, "convnet_train", "drop"),
  # Inside transforms.
  (LINEN, "scan", "layers/Dense_0"),
  (NNX, "scan", "blocks/linear"),
  (NNX, "vmap_ensemble", "members"),
  (NNX, "remat", "block/linear"),
  (NNX, "nnx_jit_inside", "block/linear"),
  # Variable names holding "/" (`nn.WeightNorm`'s "Dense_0/kernel/scale").
  (LINEN, "weight_norm", "WeightNorm_1"),
  (LINEN, "spectral_norm_train", "Dense_1"),
  (NNX, "linen_bridge_weight_norm", "norm"),
]


@pytest.mark.parametrize("fw, name, path", WRAPPED)
def test_wrapping_a_call_keeps_the_wrapped_call_exact(corpora, fw, name, path):
  case = corpora[fw][name]
  wrapped = _patch(fw.convert(case), path, PlusOne)
  _assert_matches_native(fw, wrapped, case, wrap=Wrap(path, plus_one))


@pytest.mark.parametrize(
  "fw, name, path",
  [(LINEN, "shared_child_called_twice", "shared"), (NNX, "called_twice", "linear")],
)
def test_patching_one_call_of_a_module_called_twice_leaves_the_other(corpora, fw, name, path):
  case = corpora[fw][name]
  first = (0, f"{path}.__call__")
  patched = fw.convert(case).select().at(lambda t: t.submodule_calls[first]).apply(PlusOne)
  _assert_matches_native(fw, patched, case, wrap=Wrap(path, plus_one, calls=frozenset({0})))


@pytest.mark.parametrize("fw, path", [(LINEN, "Dense_0"), (NNX, "hidden")])
def test_patching_does_not_modify_the_original_tree(corpora, fw, path):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  _patch(tree, path, PlusOne)
  assert all(isinstance(n, fw.node_type) for n in tree.submodule_calls.values())
  _assert_matches_native(fw, tree, case)


IDENTITY_CASES = [
  (LINEN, name)
  for name in (
    "transformer",
    "scan",
    "rnn_lstm",
    "batchnorm_train",
    "dropout",
    "spectral_norm_train",
    "weight_norm",
  )
] + [
  (NNX, name)
  for name in ("scan", "convnet_train", "attention_decode", "capture_sow_perturb", "remat")
]


@pytest.mark.parametrize("fw, name", IDENTITY_CASES)
def test_wrapping_every_call_with_an_identity_changes_nothing(corpora, fw, name):
  case = corpora[fw][name]
  wrapped = (
    fw.convert(case)
    .select()
    .at(lambda t: t.submodule_calls)
    .at_instances_of(fw.node_type)
    .apply(Identity)
  )
  _assert_matches_native(fw, wrapped, case)
