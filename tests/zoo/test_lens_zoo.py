"""`fl.lens` on Hugging Face's Flax GPT-2, whose `lm_head` is applied with the tied embedding."""

from __future__ import annotations

import jax
import pytest
from comparisons import assert_trees_equal

import flaxlens as fl

pytestmark = pytest.mark.slow


def test_gpt2s_last_block_lens_equals_its_logits_through_the_tied_lm_head(gpt2):
  kwargs = {"deterministic": True}
  result = fl.lens(
    gpt2.convert(), fl.ArgsAndKwargs.capture(*gpt2.args, **kwargs), "transformer/h/*", part=0
  )
  assert result.head[0] == "transformer/ln_f"
  native = jax.jit(lambda v: gpt2.module.apply(v, *gpt2.args, **kwargs))(gpt2.variables)
  assert_trees_equal(result.logits[-1], native.logits)


def test_gpt2s_first_block_lens_equals_ln_f_and_the_tied_embedding_applied_natively(gpt2):
  import flax.linen as nn

  kwargs = {"deterministic": True}
  tree = gpt2.convert()
  result = fl.lens(
    tree, fl.ArgsAndKwargs.capture(*gpt2.args, **kwargs), "transformer/h/*", part=0, jit=False
  )
  hidden = gpt2.module.apply(gpt2.variables, *gpt2.args, output_hidden_states=True, **kwargs)
  params = gpt2.variables["params"]["transformer"]
  normed = nn.LayerNorm(epsilon=1e-5).apply({"params": params["ln_f"]}, hidden.hidden_states[1])
  expected = nn.Dense(100, use_bias=False).apply(
    {"params": {"kernel": params["wte"]["embedding"].T}}, normed
  )
  assert_trees_equal(result["transformer/h/0"], expected)
