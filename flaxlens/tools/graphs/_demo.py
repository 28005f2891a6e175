"""A small graph to try the tools on (`demo_graph`): a two-layer Linen language model
with Flax's own attention and norms and an `mlp` call per block, random weights, and
random transcoders whose features fire. No Flax internals here.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from flaxlens._unflaxify import unflaxify
from flaxlens.tools.dictionaries._modules import Transcoder
from flaxlens.tools.graphs._graph import Graph, attribute


class MLP(nn.Module):
  """A block's MLP (a call of its own, where a transcoder stands)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(x.shape[-1], name="out")(nn.gelu(nn.Dense(4 * x.shape[-1], name="hidden")(x)))


class Block(nn.Module):
  """Pre-norm attention (Flax's, causal) and MLP."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln_1")(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h, h, mask=mask)
    return x + MLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class DemoLM(nn.Module):
  """Token and position embeddings, `layers` blocks, a final norm, an unembedding."""

  vocab: int = 32
  width: int = 16
  layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
    x = x + nn.Embed(64, self.width, name="positions")(jnp.arange(tokens.shape[-1]))
    for layer in range(self.layers):
      x = Block(name=f"block_{layer}")(x)
    return nn.Dense(self.vocab, name="unembed")(nn.LayerNorm(name="ln_f")(x))


def demo_model() -> tuple[Any, Any, list[Transcoder], list[str]]:
  """A small random model (`DemoLM`: 2 layers, width 16) as a converted tree, a prompt
  of 8 tokens, random per-layer transcoders (width 32) whose features fire, and the MLP
  calls they stand in for: what `flg.attribute` takes.

  Example:
    >>> import flaxlens.graphs as flg
    >>> tree, tokens, transcoders, mlps = flg.demo_model()
    >>> tokens.shape, mlps
    ((1, 8), ['block_0/mlp', 'block_1/mlp'])
  """
  model = DemoLM()
  tokens = jnp.array([[3, 14, 15, 9, 2, 6, 5, 3]])
  tree = unflaxify(model, model.init(jax.random.key(0), tokens), tokens)
  transcoders = []
  for layer in range(model.layers):
    transcoder = Transcoder(model.width, model.width, 32, rngs=nnx.Rngs(layer))
    transcoder.b_enc[...] = jnp.full((32,), 0.2)
    transcoders.append(transcoder)
  return tree, tokens, transcoders, [f"block_{layer}/mlp" for layer in range(model.layers)]


@functools.cache
def demo_graph() -> Graph:
  """The attribution graph of `demo_model()`'s prompt (computed once, then cached).

  Example:
    >>> import flaxlens.graphs as flg
    >>> graph = flg.demo_graph()
    >>> graph.layers, graph.positions, graph.rows.shape[1] == graph.n_nodes
    (2, 8, True)
  """
  return attribute(*demo_model())
