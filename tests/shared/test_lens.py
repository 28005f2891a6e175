"""`fl.lens`: each captured residual read through the model's own final norm and unembedding.

The last block's lens must be the model's own logits, bit for bit; an intermediate
block's lens must be the model's final layers applied natively (`module.apply` of the
final norm and the unembedding, the NNX model's own modules) to the block's output. A
model in a training mode is lensed from the tree's state, which the lens leaves as it was.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX, Wrap

import flaxlens as fl

# (framework, corpus case, lensed blocks, the head's first and last calls)
LENSED = [
  (LINEN, "transformer", "TransformerBlock_*", ("LayerNorm_0", "Dense_0")),
  (NNX, "transformer", "blocks/*", ("norm", "head")),
]


@pytest.mark.parametrize("fw, name, at, head", LENSED)
def test_the_last_blocks_lens_equals_the_models_compiled_logits(corpora, fw, name, at, head):
  case = corpora[fw][name]
  result = fl.lens(fw.convert(case), fw.argument(case), at)
  expected, _ = fw.native(case, jit=True)
  assert_trees_equal(result.logits[-1], expected)


@pytest.mark.parametrize("fw, name, at, head", LENSED)
def test_the_head_found_is_the_final_norm_and_the_unembedding(corpora, fw, name, at, head):
  case = corpora[fw][name]
  assert fl.lens(fw.convert(case), fw.argument(case), at).head == head


@pytest.mark.parametrize("fw, name, at, head", LENSED)
def test_an_intermediate_lens_equals_the_native_head_on_the_native_residual(
  corpora, fw, name, at, head
):
  case = corpora[fw][name]
  tree = fw.convert(case)
  result = fl.lens(tree, fw.argument(case), at, jit=False)
  first = result.sites[0]
  _, native = fw.native_captures(case)
  residual = native[(*tree.select().at_path(first).get().path, "__call__")][0]
  norm, unembed = (tree.select().at_path(h).get() for h in head)
  normed, _ = fw.native_of_node(case, norm, residual)
  expected, _ = fw.native_of_node(case, unembed, normed)
  assert_trees_equal(result[first], expected)


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_tied_unembedding_is_found_and_equals_the_models_logits(corpora, fw):
  case = corpora[fw]["self_method_calls"]  # decode(h) = embed.attend(h)
  result = fl.lens(fw.convert(case), fw.argument(case), "proj")
  assert result.head == ("EncoderDecoder.decode", "EncoderDecoder.decode")
  expected, _ = fw.native(case, jit=True)
  assert_trees_equal(result["proj"], expected)


@pytest.mark.parametrize("fw, name, at, head", LENSED)
def test_a_named_head_and_a_head_function_equal_the_found_head(corpora, fw, name, at, head):
  case = corpora[fw][name]
  tree = fw.convert(case)
  found = fl.lens(tree, fw.argument(case), at, jit=False)
  named = fl.lens(tree, fw.argument(case), at, head=list(head), jit=False)
  norm, unembed = (tree.select().at_path(h).get() for h in head)

  def native_head(h):
    return fw.native_of_node(case, unembed, fw.native_of_node(case, norm, h)[0])[0]

  function = fl.lens(tree, fw.argument(case), at, head=native_head, jit=False)
  assert_trees_equal(named.logits, found.logits)
  assert_trees_equal(function.logits, found.logits)
  assert function.head is None


def test_top_tokens_are_the_largest_softmax_probabilities_largest_first(corpora):
  case = corpora[LINEN]["transformer"]
  result = fl.lens(LINEN.convert(case), LINEN.argument(case), "TransformerBlock_*", top=3)
  logits = np.asarray(result.logits, np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  expected = np.argsort(-probs, axis=-1, kind="stable")[..., :3]
  np.testing.assert_array_equal(np.asarray(result.top_tokens), expected)
  np.testing.assert_allclose(
    np.asarray(result.top_probs), np.take_along_axis(probs, expected, -1), rtol=1e-5
  )


def test_index_keeps_part_of_each_sites_logits(corpora):
  case = corpora[LINEN]["transformer"]
  tree = LINEN.convert(case)
  whole = fl.lens(tree, LINEN.argument(case), "TransformerBlock_*")
  last = fl.lens(tree, LINEN.argument(case), "TransformerBlock_*", index=jnp.s_[:, -1])
  assert_trees_equal(last.logits, whole.logits[:, :, -1])


def test_a_lens_with_no_call_after_the_last_block_says_how_to_name_the_head(corpora):
  case = corpora[LINEN]["transformer"]
  with pytest.raises(fl.SelectionError, match=r"Dense_0 on the way to the output.*head="):
    fl.lens(LINEN.convert(case), LINEN.argument(case), "Dense_0")


def test_a_head_named_last_call_first_is_refused(corpora):
  case = corpora[LINEN]["transformer"]
  with pytest.raises(
    fl.ArgumentError, match="LayerNorm_0 as the last call, but it runs before Dense_0"
  ):
    fl.lens(
      LINEN.convert(case),
      LINEN.argument(case),
      "TransformerBlock_*",
      head=["Dense_0", "LayerNorm_0"],
    )


def test_a_residual_that_cannot_enter_the_head_is_refused_naming_the_site(corpora):
  case = corpora[LINEN]["transformer"]
  with pytest.raises(fl.ArgumentError, match="residual at TransformerBlock_0/Dense_1"):
    fl.lens(
      LINEN.convert(case),
      LINEN.argument(case),
      "TransformerBlock_0/Dense_1",
      jit=False,
      head=["LayerNorm_0", "Dense_0"],
    )


# Models in a training mode (train-mode batch statistics; NNX dropout's random counts), the
# call lensed, and the head found after it.
TRAINING = [
  (LINEN, "batchnorm_train", "Conv_0", ("BatchNorm_0", "BatchNorm_0")),
  (NNX, "convnet_train", "conv", ("norm", "head")),
]


def _native_with(fw, case, last):
  """The native compiled call's output and the output of its call `last`."""

  def call(x):
    seen = []
    output, _ = fw.native(
      dataclasses.replace(case, args=(x,)), wrap=Wrap(last, lambda out, *a: seen.append(out) or out)
    )
    return output, seen[-1]

  return jax.jit(call)(case.args[0])


@pytest.mark.parametrize("fw, name, at, head", TRAINING)
def test_a_lens_of_a_model_in_training_mode_projects_from_the_trees_state_and_keeps_it(
  corpora, fw, name, at, head
):
  case = corpora[fw][name]
  tree = fw.convert(case)
  before = fw.tree_state(tree)
  result = fl.lens(tree, fw.argument(case), at)
  after = fw.tree_state(tree)
  assert before.keys() == after.keys()
  assert all(before[k] is after[k] for k in before)  # no run's update is kept
  assert result.head == head
  output, projected = _native_with(fw, case, head[1])  # one native call from that state
  # To float32 rounding: the lens is one program with its projections, fused otherwise.
  np.testing.assert_allclose(result.output, output, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(result.logits[0], projected, rtol=1e-6, atol=1e-6)


# --- a head found from the tree must give the model's own logits --------------------------


class AuxBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(16)(nn.relu(nn.Dense(32)(nn.LayerNorm()(x))))


class AuxLM(nn.Module):
  """Two blocks, then an auxiliary call (a value head) or a soft cap before the head, or
  a soft cap of the head's logits."""

  variant: str

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(50, 16)(ids)
    for _ in range(2):
      x = AuxBlock()(x)
    if self.variant == "value head":
      self.sow("intermediates", "value", nn.Dense(1, name="value_head")(x))
    if self.variant == "soft cap":
      x = 3.0 * jnp.tanh(x / 3.0)
    logits = nn.Dense(50, name="unembed")(nn.LayerNorm(name="ln_f")(x))
    if self.variant == "logit cap":  # Gemma 2's final logit soft cap
      return 0.5 * jnp.tanh(logits / 0.5)
    return logits


IDS = jnp.arange(12).reshape(2, 6)


def _aux(variant):
  model = AuxLM(variant)
  variables = {"params": model.init(jax.random.key(0), IDS)["params"]}
  return model, variables, fl.unflaxify(model, variables, IDS)


def test_a_found_head_starting_at_an_auxiliary_call_is_refused_naming_it():
  _, _, tree = _aux("value head")
  says = r"from value_head to unembed, does not read the residual.*head=\['ln_f', 'lm_head'\]"
  with pytest.raises(fl.ArgumentError, match=says):
    fl.lens(tree, IDS, "AuxBlock_*")


def test_a_named_head_past_an_auxiliary_call_equals_the_native_head():
  model, variables, tree = _aux("value head")
  result = fl.lens(tree, IDS, "AuxBlock_*", head=["ln_f", "unembed"])
  assert_trees_equal(result["AuxBlock_1"], jax.jit(model.apply)(variables, IDS))
  _, state = model.apply(variables, IDS, capture_intermediates=True, mutable="intermediates")
  residual = state["intermediates"]["AuxBlock_0"]["__call__"][0]
  params = variables["params"]
  normed = nn.LayerNorm().apply({"params": params["ln_f"]}, residual)
  native = nn.Dense(50).apply({"params": params["unembed"]}, normed)
  np.testing.assert_allclose(result["AuxBlock_0"], native, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [True, False])
def test_a_found_head_whose_input_is_not_the_last_blocks_output_is_refused(jit):
  _, _, tree = _aux("soft cap")  # 3 tanh(x / 3) runs between the last block and ln_f
  says = r"from ln_f to unembed, does not reproduce .* last block AuxBlock_1"
  with pytest.raises(fl.ArgumentError, match=says):
    fl.lens(tree, IDS, "AuxBlock_*", jit=jit)


def test_a_lensed_site_that_is_not_a_block_is_refused():
  _, _, tree = _aux("plain")  # the "head" after AuxBlock_0/Dense_0 is AuxBlock_1 on
  with pytest.raises(fl.ArgumentError, match=r"from AuxBlock_1 to unembed, does not reproduce"):
    fl.lens(tree, IDS, "AuxBlock_0/Dense_0")


@pytest.mark.parametrize("jit", [True, False])
def test_a_found_head_whose_logits_the_model_changes_after_is_refused(jit):
  _, _, tree = _aux("logit cap")  # 0.5 tanh(logits / 0.5) after the unembedding
  says = r"ends at unembed, whose output is not the model's output.*head=lambda h"
  with pytest.raises(fl.ArgumentError, match=says):
    fl.lens(tree, IDS, "AuxBlock_*", jit=jit)


def test_a_head_function_ending_as_the_model_does_gives_the_models_logits():
  model, variables, tree = _aux("logit cap")
  params = variables["params"]

  def head(h):
    normed = nn.LayerNorm().apply({"params": params["ln_f"]}, h)
    return 0.5 * jnp.tanh(nn.Dense(50).apply({"params": params["unembed"]}, normed) / 0.5)

  result = fl.lens(tree, IDS, "AuxBlock_*", head=head)
  np.testing.assert_allclose(
    result["AuxBlock_1"], model.apply(variables, IDS), rtol=1e-6, atol=1e-6
  )


# --- heads given as functions, and lenses under your own transforms -----------------------


@pytest.mark.parametrize(
  "head, got",
  [
    (lambda h: (h, h), "a tuple"),
    (lambda h: h.sum(), r"an array of shape \(\)"),
    (lambda h: h.sum(-1), r"an array of shape \(2, 6\)"),
  ],
  ids=["tuple", "scalar", "vocabulary_summed_away"],
)
def test_a_head_function_not_returning_logits_with_a_vocabulary_axis_is_refused(head, got):
  _, _, tree = _aux("plain")
  says = rf"head function returned {got} for the residual at AuxBlock_0, of shape \(2, 6, 16\)"
  with pytest.raises(fl.ArgumentError, match=says):
    fl.lens(tree, IDS, "AuxBlock_*", head=head)


@pytest.mark.parametrize("transform", ["jit", "vmap"])
def test_a_lens_under_your_own_transform_takes_the_head_found_and_checked_outside_it(transform):
  """Under jax.jit or vmap the found head's check has no values to compare, so it is
  refused naming the head; the head an eager lens found, passed in, gives the model's
  own logits for the last block and the native head on the first block's output."""
  model, variables, tree = _aux("plain")

  def lens(head):
    if transform == "jit":
      return jax.jit(lambda ids: fl.lens(tree, ids, "AuxBlock_*", head=head, jit=False).logits)(IDS)
    one = lambda ids: fl.lens(tree, ids[None], "AuxBlock_*", head=head, jit=False).logits  # noqa: E731
    return jax.vmap(one, out_axes=1)(IDS)[:, :, 0]

  with pytest.raises(fl.ArgumentError, match=r"from ln_f to unembed, .*head=\['ln_f', 'unembed'\]"):
    lens(None)
  logits = lens(fl.lens(tree, IDS, "AuxBlock_*").head)
  _, state = model.apply(variables, IDS, capture_intermediates=True, mutable="intermediates")
  residual = state["intermediates"]["AuxBlock_0"]["__call__"][0]
  params = variables["params"]
  normed = nn.LayerNorm().apply({"params": params["ln_f"]}, residual)
  native = nn.Dense(50).apply({"params": params["unembed"]}, normed)
  np.testing.assert_allclose(logits[0], native, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits[1], model.apply(variables, IDS), rtol=1e-5, atol=1e-5)
