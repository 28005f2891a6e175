"""The small models `flaxlens demo` converts: a Linen language model and an NNX MLP."""

from __future__ import annotations

import flax.linen as nn
from flax import nnx


class Block(nn.Module):
  """Pre-norm transformer block."""

  width: int = 32

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
    h = nn.LayerNorm()(x)
    return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))


class TinyLM(nn.Module):
  """Embedding, two blocks, a final norm and a vocabulary head."""

  vocab: int = 32
  width: int = 32

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width)(tokens)
    for i in range(2):
      x = Block(self.width, name=f"Block_{i}")(x)
    return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


class TinyMLP(nnx.Module):
  """Two NNX linear layers around a batch norm."""

  def __init__(self, rngs: nnx.Rngs, width: int = 32):
    self.hidden = nnx.Linear(width, 4 * width, rngs=rngs)
    self.norm = nnx.BatchNorm(4 * width, rngs=rngs)
    self.out = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.gelu(self.norm(self.hidden(x))))
