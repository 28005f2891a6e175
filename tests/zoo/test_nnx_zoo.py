"""google-tunix Llama3 (NNX, random weights, tiny config): exact conversion and patching."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl

from ._tunix import load_llama3, tunix_settings

pytestmark = pytest.mark.slow

B, T = 2, 8


@pytest.fixture(scope="module")
def llama():
  with tunix_settings():
    yield _build()


def _build():
  llama3 = load_llama3()
  config = llama3.ModelConfig(
    num_layers=2,
    vocab_size=128,
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
    rope_theta=10_000,
    norm_eps=1e-5,
  )
  model = llama3.Llama3(config, rngs=nnx.Rngs(0))
  # Tunix initialises MLP kernels to zeros; random values make the comparison meaningful.
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  leaves = [
    0.1 * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    for k, x in zip(keys, leaves, strict=True)
  ]
  model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
  tokens = jax.random.randint(jax.random.key(2), (B, T), 0, 128)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = jnp.tril(jnp.ones((T, T), jnp.bool_))[None].repeat(B, 0)
  return model, (tokens, positions, None, mask)


def test_converted_llama3_matches_the_model_bit_for_bit(llama):
  model, args = llama
  before = jax.tree_util.tree_leaves(nnx.state(model))
  tree = fl.unflaxify(model, *args)
  assert_trees_equal(tree(fl.ArgsAndKwargs.capture(*args)), model(*args))
  assert all(
    a is b for a, b in zip(before, jax.tree_util.tree_leaves(nnx.state(model)), strict=True)
  )


def test_replacing_one_layers_mlp_matches_the_model_with_that_mlp_replaced(llama):
  model, args = llama
  tree = fl.unflaxify(model, *args)
  (mlp,) = tree.select().at_path("layers/1/mlp").get_sequence()

  class Zero(fl.Layer):
    def __call__(self, argument, /, **side_inputs):
      return jnp.zeros_like(argument.args[0])

  patched = tree.select().at_path("layers/1/mlp").set(Zero())
  reference = nnx.clone(model)
  reference.layers[1].mlp = _ZeroMLP()
  assert_trees_equal(patched(fl.ArgsAndKwargs.capture(*args)), reference(*args))
  assert mlp.readable_path() == ("layers/1/mlp", "__call__")


class _ZeroMLP(nnx.Module):
  def __call__(self, x):
    return jnp.zeros_like(x)


def test_one_decoder_layer_isolates_and_replays_exactly(llama):
  model, args = llama
  isolated = fl.isolate(fl.unflaxify(model, *args), args, "layers/0")
  assert isolated.replay()


def test_llama3_exports_without_edits_to_the_same_graph_and_arrays(llama):
  model, args = llama
  graphdef, state = nnx.split(fl.unflaxify(model, *args).export())
  original_graphdef, original = nnx.split(model)
  assert graphdef == original_graphdef
  assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(original)
  assert all(
    a is b
    for a, b in zip(
      jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(original), strict=True
    )
  )


def test_llama3_edited_and_exported_computes_as_the_tree(llama):
  model, args = llama
  tree = fl.unflaxify(model, *args)
  for p in fl.variables_in(tree):
    if isinstance(p, fl.Parameter):
      p.value = p.value * 1.25
  assert fl.check_equivalence(tree, tree.export(), tuple(args))
