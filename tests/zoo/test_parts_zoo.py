"""`part=` on Hugging Face GPT-2: a block returns `(hidden_states,)`, its attention module
runs several methods; harvest, splice and fold of `part=0` against the native model."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal

import flaxlens as fl

pytestmark = pytest.mark.slow

KWARGS = {"deterministic": True}
VECTOR = jnp.linspace(-1.0, 1.0, 32)


@pytest.fixture(scope="module")
def tree(gpt2):
  return gpt2.convert()


def _arguments(gpt2):
  return fl.ArgsAndKwargs.capture(*gpt2.args, **KWARGS)


def _edited(gpt2, path, edit):
  """The native model with `edit` applied to the first output of the block at `path`."""

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if "/".join(context.module.path) == path and context.method_name == "__call__":
      out = (edit(out[0]), *out[1:])
    return out

  def native(variables):
    with nn.intercept_methods(interceptor):
      return gpt2.module.apply(variables, *gpt2.args, **KWARGS)

  return native


def test_harvest_of_a_gpt2_block_with_part_0_stores_its_hidden_states(gpt2, tree, tmp_path):
  stored = fl.harvest(tree, [_arguments(gpt2)], "transformer/h/0", str(tmp_path / "h"), part=0)
  native = jax.jit(lambda v: gpt2.module.apply(v, *gpt2.args, output_hidden_states=True, **KWARGS))
  hidden = native(gpt2.variables).hidden_states[1]  # what block 1 receives: block 0's output
  assert_trees_equal(stored["transformer/h/0"][:], np.asarray(hidden).reshape(-1, 32))


def test_splicing_a_gpt2_block_with_part_0_replaces_its_hidden_states(gpt2, tree):
  sae = nn.Dense(32)
  variables = sae.init(jax.random.key(3), jnp.ones((1, 32)))
  spliced = fl.splice(tree, "transformer/h/0", sae, variables, part=0, error=False)
  native = _edited(gpt2, "transformer/h/0", lambda h: sae.apply(variables, h))
  assert_trees_equal(fl.run(spliced, _arguments(gpt2)), jax.jit(native)(gpt2.variables))


def test_folding_steering_of_a_gpt2_blocks_hidden_states_adds_it_to_the_last_mlp_bias(gpt2, tree):
  folded = fl.fold(tree, _arguments(gpt2), [fl.steer("transformer/h/1", VECTOR, 2.0, part=0)])
  exported = folded.export()
  params = gpt2.variables["params"]["transformer"]["h"]["1"]["mlp"]["c_proj"]
  new = exported["params"]["transformer"]["h"]["1"]["mlp"]["c_proj"]
  assert_trees_equal(new["bias"], params["bias"] + jnp.float32(2.0) * VECTOR)
  native = _edited(gpt2, "transformer/h/1", lambda h: h + jnp.float32(2.0) * VECTOR)
  np.testing.assert_allclose(
    gpt2.module.apply(exported, *gpt2.args, **KWARGS).logits,
    jax.jit(native)(gpt2.variables).logits,
    atol=1e-5,
    rtol=1e-5,
  )


def test_a_gpt2_attention_receiver_names_its_methods_and_the_call_form(gpt2, tree):
  refused = (
    r"transformer/h/1/attn: the output is a tuple .* fl.Sites\(at, part=\.\.\.\) .* The site"
    r" 'transformer/h/1/attn' is a module path without a method, so it names every method"
    r" of that module that ran: \['transformer/h/1/attn', 'transformer/h/1/attn\._split_heads',"
    r" 'transformer/h/1/attn\._merge_heads'\]\. Give 'transformer/h/1/attn\.__call__' to name"
    r" its call alone\."
  )
  with pytest.raises(fl.ArgumentError, match=refused):
    fl.path_patch(
      tree,
      _arguments(gpt2),
      _arguments(gpt2),
      fl.Sites("transformer/h/0/attn.__call__", part=0),
      "transformer/h/1/attn",
      lambda out: out.logits.sum(),
    )
