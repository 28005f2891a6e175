"""Folding interventions into weights: the folded tree's export runs the edit natively.

Each test folds interventions into a copy of a small transformer's tree (the Linen
corpus's `Transformer`, its NNX counterpart), checks which parameters changed and how,
and runs the export with Flax itself: its output must be close to the native model with
the same edit made by wrapping the call (or, where an input is edited, to the tree run
with the intervention). Unfoldable interventions are refused with one reason each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX, Wrap
from nnx import corpus as nnx_corpus

import flaxlens as fl

BOTH = [LINEN, NNX]
SITES = {
  LINEN: {
    "down": "TransformerBlock_0/Dense_0",
    "up": "TransformerBlock_0/Dense_1",
    "mlp_norm": "TransformerBlock_0/LayerNorm_1",
    "attention_out": "TransformerBlock_1/MultiHeadDotProductAttention_0/out",
    "block": "TransformerBlock_0",
    "embed": "Embed_0",
  },
  NNX: {
    "down": "blocks/0/down",
    "up": "blocks/0/up",
    "mlp_norm": "blocks/0/mlp_norm",
    "attention_out": "blocks/1/attention/out",
    "block": "blocks/0",
    "embed": "embed",
  },
}
TIED = {LINEN: ("shared_child_called_twice", "shared"), NNX: ("called_twice", "linear")}
DROPOUT = {LINEN: ("dropout", "Dense_1"), NNX: ("convnet_train", "head")}  # a biased call
STATEFUL = {LINEN: ("batchnorm_train", "Conv_0"), NNX: ("convnet_train", "head")}
VECTOR = jax.random.normal(jax.random.key(11), (8,))
CLOSE = {"atol": 1e-5, "rtol": 1e-5}


def _transformer(corpora, fw):
  if fw is LINEN:
    return corpora[LINEN]["transformer"]
  model = nnx_corpus.Transformer(nnx_corpus.RNGS())
  return nnx_corpus.Case("transformer", model, (nnx_corpus.TOKENS,))


def _parameter(tree, path, name):
  return tree.select().at_path(path).get_sequence()[0].scope_data.parameters[name]


def _fold(fw, case, interventions):
  """The case's tree, and the case with its model replaced by the folded tree's export."""
  tree = fw.convert(case)
  folded = fl.fold(tree, case.args, interventions)
  return tree, fw.with_exported(case, fw.export(folded))


def _changed(fw, case, exported) -> dict[str, tuple]:
  """`{label: (before, after)}` of the parameters whose values differ."""
  before, after = fw.model_state(case), fw.model_state(exported)
  return {
    label: (before[label], after[label])
    for label in before
    if not np.array_equal(np.asarray(before[label]), np.asarray(after[label]))
  }


def _assert_close(actual, expected):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), **CLOSE)


@pytest.mark.parametrize("fw", BOTH)
@pytest.mark.parametrize("site", ["down", "mlp_norm"])
def test_steering_a_call_output_folds_into_the_bias_it_adds_last(corpora, fw, site):
  case = _transformer(corpora, fw)
  path = SITES[fw][site]
  tree, exported = _fold(fw, case, [fl.steer(path, VECTOR, alpha=3.0)])
  bias = _parameter(tree, path, "bias")
  changed = _changed(fw, case, exported)
  assert list(changed) == [bias.label]
  np.testing.assert_array_equal(changed[bias.label][1], bias.value + 3.0 * VECTOR)
  steered, _ = fw.native(case, wrap=Wrap(path, lambda out, *args: out + 3.0 * VECTOR))
  _assert_close(fw.native(exported)[0], steered)


@pytest.mark.parametrize("fw", BOTH)
def test_steering_a_residual_block_folds_into_the_bias_of_the_call_writing_it_last(corpora, fw):
  case = _transformer(corpora, fw)
  block, down = SITES[fw]["block"], SITES[fw]["down"]
  tree, exported = _fold(fw, case, [fl.steer(block, VECTOR, alpha=3.0)])
  bias = _parameter(tree, down, "bias")
  changed = _changed(fw, case, exported)
  assert list(changed) == [bias.label]  # the block's output is x + down(...): its bias
  np.testing.assert_array_equal(changed[bias.label][1], bias.value + 3.0 * VECTOR)
  steered, _ = fw.native(case, wrap=Wrap(block, lambda out, *args: out + 3.0 * VECTOR))
  _assert_close(fw.native(exported)[0], steered)


@pytest.mark.parametrize("fw", BOTH)
def test_steering_a_feature_region_by_a_value_of_its_shape_folds_into_its_bias_entries(corpora, fw):
  """A steering vector shaped as the region an index where= selects, as fl.run takes it:
  the same at every position, it is the region's bias entries that change."""
  case = _transformer(corpora, fw)
  path = SITES[fw]["down"]
  _, cache = fl.capture(fw.convert(case), case.args, path)
  region = jnp.broadcast_to(VECTOR[2:5], (*cache[path].shape[:-1], 3))
  steer = fl.steer(path, region, alpha=3.0, where=jnp.s_[..., 2:5])
  tree, exported = _fold(fw, case, [steer])
  bias = _parameter(tree, path, "bias")
  changed = _changed(fw, case, exported)
  assert list(changed) == [bias.label]
  np.testing.assert_array_equal(changed[bias.label][1], bias.value.at[2:5].add(3.0 * VECTOR[2:5]))
  steered, _ = fw.native(case, wrap=Wrap(path, lambda out, *a: out.at[..., 2:5].add(3.0 * region)))
  _assert_close(fw.native(exported)[0], steered)
  _assert_close(fw.native(exported)[0], fl.run(tree, case.args, interventions=[steer]))


@pytest.mark.parametrize("fw", BOTH)
def test_a_zero_ablated_head_folds_into_the_output_projection_rows_of_that_head(corpora, fw):
  case = _transformer(corpora, fw)
  path = SITES[fw]["attention_out"]
  ablate = fl.ablate(path, on="input", where=jnp.s_[..., 1, :])
  tree, exported = _fold(fw, case, [ablate])
  kernel = _parameter(tree, path, "kernel")
  changed = _changed(fw, case, exported)
  assert list(changed) == [kernel.label]
  np.testing.assert_array_equal(changed[kernel.label][1], kernel.value.at[1].set(0.0))
  _assert_close(fw.native(exported)[0], fl.run(tree, case.args, interventions=[ablate]))


@pytest.mark.parametrize("fw", BOTH)
def test_scaling_a_linear_call_output_folds_into_its_kernel_and_bias(corpora, fw):
  case = _transformer(corpora, fw)
  path = SITES[fw]["up"]
  factor = jnp.linspace(0.0, 2.0, 16)
  tree, exported = _fold(fw, case, [fl.scale(path, factor)])
  kernel, bias = _parameter(tree, path, "kernel"), _parameter(tree, path, "bias")
  assert set(_changed(fw, case, exported)) <= {kernel.label, bias.label}
  after = fw.model_state(exported)
  np.testing.assert_array_equal(after[kernel.label], kernel.value * factor)
  np.testing.assert_array_equal(after[bias.label], bias.value * factor)
  scaled, _ = fw.native(case, wrap=Wrap(path, lambda out, *args: out * factor))
  _assert_close(fw.native(exported)[0], scaled)


@pytest.mark.parametrize("fw", BOTH)
def test_steering_the_input_of_an_affine_call_folds_into_its_bias(corpora, fw):
  case = _transformer(corpora, fw)
  up, norm = SITES[fw]["up"], SITES[fw]["mlp_norm"]  # the norm's output is up's input
  tree, exported = _fold(fw, case, [fl.steer(up, VECTOR, alpha=2.0, on="input")])
  assert list(_changed(fw, case, exported)) == [_parameter(tree, up, "bias").label]
  steered, _ = fw.native(case, wrap=Wrap(norm, lambda out, *args: out + 2.0 * VECTOR))
  _assert_close(fw.native(exported)[0], steered)


@pytest.mark.parametrize("fw", BOTH)
def test_several_interventions_fold_together_in_order(corpora, fw):
  case = _transformer(corpora, fw)
  sites = SITES[fw]
  edits = [
    fl.scale(sites["down"], 0.5),
    fl.steer(sites["down"], VECTOR),
    fl.ablate(sites["attention_out"], on="input", where=jnp.s_[..., 0, :]),
  ]
  tree, exported = _fold(fw, case, edits)
  _assert_close(fw.native(exported)[0], fl.run(tree, case.args, interventions=edits))


@pytest.mark.parametrize("fw", BOTH)
def test_fold_refuses_unfoldable_interventions_listing_each_with_its_reason(corpora, fw):
  case = _transformer(corpora, fw)
  sites = SITES[fw]
  edits = [
    fl.steer(sites["down"], VECTOR),  # foldable: not listed
    fl.patch(sites["down"], jnp.zeros(8)),
    fl.ablate(sites["down"], "mean", jnp.ones((3, 8))),
    fl.modify(sites["down"], lambda argument, y: jnp.tanh(y)),
    fl.steer(sites["down"], VECTOR, where=jnp.s_[:, 2]),  # one position
    fl.steer(sites["block"], VECTOR, on="input"),  # no parameters of its own
    fl.steer(sites["embed"], VECTOR),  # no bias
  ]
  with pytest.raises(fl.ExportError) as raised:
    fl.fold(fw.convert(case), case.args, edits)
  message = str(raised.value)
  assert "6 of 7 interventions cannot be folded" in message
  assert "[0]" not in message
  for number, reason in [
    (1, "given activations"),
    (2, "mean of other activations"),
    (3, "arbitrary function"),
    (4, "same at every position"),
    (5, "no parameters of its own"),
    (6, "as a bias is"),
  ]:
    assert f"[{number}]" in message and reason in message.split(f"[{number}]")[1], number


@pytest.mark.parametrize("fw", BOTH)
def test_fold_refuses_a_head_site_naming_the_same_edit_of_the_call_holding_the_heads(corpora, fw):
  case = _transformer(corpora, fw)
  out = SITES[fw]["attention_out"]
  heads = fl.ablate(fl.heads(out.removesuffix("/out"), 1))
  tree = fw.convert(case)
  with pytest.raises(fl.ExportError) as raised:
    fl.fold(tree, case.args, [heads])
  suggested = f"fl.ablate({out!r}, on='input', where=jnp.s_[..., 1, :])"
  assert f"[0] fl.ablate({heads.at!r}, how='zero'): " in str(raised.value)
  assert suggested in str(raised.value)
  # What the message suggests folds, and Flax runs the export as the head edit runs.
  _, exported = _fold(fw, case, [fl.ablate(out, on="input", where=jnp.s_[..., 1, :])])
  _assert_close(fw.native(exported)[0], fl.run(tree, case.args, interventions=[heads]))


@pytest.mark.parametrize(
  "make, operand",
  [
    (lambda site, bad: fl.scale(site, bad), "factor"),
    (lambda site, bad: fl.scale(site, jnp.full(8, -bad)), "factor"),
    (lambda site, bad: fl.steer(site, VECTOR, alpha=bad), "alpha"),
    (lambda site, bad: fl.steer(site, VECTOR.at[3].set(bad)), "vector"),
  ],
  ids=["nan_factor", "inf_factor", "nan_alpha", "inf_vector"],
)
@pytest.mark.parametrize("fw", BOTH)
def test_fold_refuses_operands_that_are_not_finite_naming_the_site(
  corpora, fw, make, operand, request
):
  # Made inside jax.jit, the operands were traced and not checked by their maker.
  case = _transformer(corpora, fw)
  site = SITES[fw]["down"]
  bad = jnp.inf if "inf" in request.node.callspec.id else jnp.nan
  made = jax.jit(lambda x: make(site, x))(bad)
  expected = rf"\[0\] fl\.(scale|steer)\('{site}'.*its {operand} holds nan or inf.*give finite"
  with pytest.raises(fl.ExportError, match=expected):
    fl.fold(fw.convert(case), case.args, [made])


@pytest.mark.parametrize("fw", BOTH)
def test_fold_leaves_the_tree_unmodified_also_when_it_refuses(corpora, fw):
  case = _transformer(corpora, fw)
  tree = fw.convert(case)
  before = {v.label: v.value for v in fl.variables_in(tree)}
  fl.fold(tree, case.args, [fl.steer(SITES[fw]["down"], VECTOR)])
  with pytest.raises(fl.ExportError):
    fl.fold(tree, case.args, [fl.steer(SITES[fw]["down"], VECTOR), fl.patch("**", 0.0)])
  assert_trees_equal({v.label: v.value for v in fl.variables_in(tree)}, before)


@pytest.mark.parametrize("fw", BOTH)
def test_fold_checks_a_model_with_dropout_under_the_same_random_streams(corpora, fw):
  name, path = DROPOUT[fw]
  case = corpora[fw][name]
  tree = fw.convert(case)
  edits = [fl.steer(path, 0.5)]
  folded = fl.fold(tree, fw.argument(case), edits, **fw.side_inputs(case))
  steered, _ = fw.native(case, wrap=Wrap(path, lambda out, *args: out + 0.5))
  _assert_close(fw.native(fw.with_exported(case, fw.export(folded)))[0], steered)


@pytest.mark.parametrize("fw", BOTH)
def test_fold_leaves_the_state_of_the_tree_and_of_its_copy_as_it_was(corpora, fw):
  name, path = STATEFUL[fw]
  case = corpora[fw][name]
  tree = fw.convert(case)
  labels = [v.label for v in fl.variables_in(tree) if isinstance(v, fl.StateVariable)]
  before = {v.label: v.value for v in fl.variables_in(tree)}
  folded = fl.fold(tree, fw.argument(case), [fl.steer(path, 0.5)], **fw.side_inputs(case))
  assert_trees_equal({v.label: v.value for v in fl.variables_in(tree)}, before)
  folded_state = {v.label: v.value for v in fl.variables_in(folded) if v.label in labels}
  assert_trees_equal(folded_state, {label: before[label] for label in labels})


@pytest.mark.parametrize("fw", BOTH)
def test_fold_refuses_a_result_outside_the_tolerance_giving_the_difference(corpora, fw):
  case = _transformer(corpora, fw)
  edits = [fl.scale(SITES[fw]["up"], 1 / 3), fl.steer(SITES[fw]["down"], VECTOR / 3)]
  with pytest.raises(fl.ExportError, match=r"max abs difference \d"):
    fl.fold(fw.convert(case), case.args, edits, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("fw", BOTH)
def test_fold_refuses_calls_inside_scan_whose_parameters_are_stacked(corpora, fw):
  case = corpora[fw]["scan"]
  tree = fw.convert(case)
  with pytest.raises(fl.ExportError, match="stacked per iteration"):
    fl.fold(tree, case.args, [fl.steer(lambda node: node.sliced, 1.0)])


@pytest.mark.parametrize("fw", BOTH)
def test_fold_refuses_one_call_of_a_module_whose_weights_another_call_uses(corpora, fw):
  name, path = TIED[fw]
  case = corpora[fw][name]
  with pytest.raises(fl.ExportError, match=f"{path}.__call__ also uses"):
    fl.fold(fw.convert(case), case.args, [fl.steer(f"{path}#1", 1.0)])


@pytest.mark.parametrize("fw", BOTH)
def test_steering_every_call_of_a_tied_module_folds_into_its_shared_bias(corpora, fw):
  name, path = TIED[fw]
  case = corpora[fw][name]
  tree, exported = _fold(fw, case, [fl.steer(path, 0.25)])
  assert list(_changed(fw, case, exported)) == [_parameter(tree, path, "bias").label]
  steered, _ = fw.native(case, wrap=Wrap(path, lambda out, *args: out + 0.25))
  _assert_close(fw.native(exported)[0], steered)
