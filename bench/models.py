"""The benchmark models and their sizes: GPT-style stacks written once in Linen, once in NNX.

Both are plain compact models without calls of a module's own methods (Penzai's converter,
the comparison, cannot follow those). `Sizes` fixes the model size and the repetitions of
one run: `FULL` for the report, `QUICK` for the smoke run. Most rows use the model at
`layers`; dispatch, eager calls and conversion are measured at every depth of `scales`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Model sizes and repetition counts of one run."""

  layers: int
  width: int
  heads: int
  vocab: int
  seq: int
  batch: int
  scales: tuple[int, ...]  # depths of the rows measured at several model sizes
  conversion_batches: tuple[int, int]
  forward_reps: int
  compile_reps: int
  conversion_reps: int
  eager_reps: int


FULL = Sizes(
  layers=12,
  width=256,
  heads=4,
  vocab=1024,
  seq=128,
  batch=4,
  scales=(2, 12, 48),
  conversion_batches=(4, 64),
  forward_reps=31,
  compile_reps=7,
  conversion_reps=6,
  eager_reps=21,
)
QUICK = Sizes(
  layers=1,
  width=32,
  heads=2,
  vocab=64,
  seq=8,
  batch=2,
  scales=(1, 2),
  conversion_batches=(2, 8),
  forward_reps=3,
  compile_reps=1,
  conversion_reps=2,
  eager_reps=3,
)


class LinenBlock(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class LinenGPT(nn.Module):
  layers: int
  width: int
  heads: int
  vocab: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.width)(tokens)
    for _ in range(self.layers):
      x = LinenBlock(self.width, self.heads)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class NNXBlock(nnx.Module):
  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.norm_1 = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
    self.norm_2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + self.attention(self.norm_1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm_2(x))))


class NNXGPT(nnx.Module):
  def __init__(self, layers: int, width: int, heads: int, vocab: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.blocks = nnx.List([NNXBlock(width, heads, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def tokens(sizes: Sizes, batch: int | None = None) -> jax.Array:
  shape = (batch or sizes.batch, sizes.seq)
  return jax.random.randint(jax.random.key(1), shape, 0, sizes.vocab)


def linen_model(sizes: Sizes, layers: int) -> tuple[nn.Module, dict[str, Any]]:
  """The Linen model and random variables (drawn with numpy: eager init takes seconds)."""
  model = LinenGPT(layers, sizes.width, sizes.heads, sizes.vocab)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens(sizes))
  rng = np.random.default_rng(0)
  variables = jax.tree_util.tree_map(
    lambda s: jnp.asarray(0.02 * rng.standard_normal(s.shape, dtype=np.float32)), shapes
  )
  return model, variables


def nnx_model(sizes: Sizes, layers: int | None = None) -> NNXGPT:
  """The NNX model (`sizes.layers` deep unless given), initialised by its own layers."""
  depth = sizes.layers if layers is None else layers
  return NNXGPT(depth, sizes.width, sizes.heads, sizes.vocab, nnx.Rngs(0))
