"""Example TARGETs for `flaxlens inspect`: factories that return a model and its inputs.

    flaxlens inspect examples/inspect_targets.py:linen_lm
    flaxlens inspect examples/inspect_targets.py:nnx_mlp --json

A factory takes no arguments and returns `(linen_module, variables, args[, kwargs])` or
`(nnx_model, args[, kwargs])`: the model, and example inputs it accepts.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


class Block(nn.Module):
  """A pre-norm transformer block."""

  width: int = 16

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.SelfAttention(num_heads=2)(h)
    return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x))))


class LM(nn.Module):
  """A two-block Linen language model."""

  vocab: int = 64
  width: int = 16

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    x = nn.Embed(self.vocab, self.width)(tokens)
    for _ in range(2):
      x = nn.Dropout(0.1, deterministic=not train)(Block(self.width)(x))
    return nn.Dense(self.vocab, name="head")(x)


def linen_lm():
  """A Linen model: `(module, variables, args, kwargs)`."""
  model, tokens = LM(), jnp.zeros((2, 6), jnp.int32)
  variables = model.init(jax.random.key(0), tokens)
  return model, variables, (tokens,), {"train": False}


class MLP(nnx.Module):
  """A small NNX model with a batch norm."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(8, 32, rngs=rngs)
    self.norm = nnx.BatchNorm(32, rngs=rngs)
    self.out = nnx.Linear(32, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def nnx_mlp():
  """An NNX model: `(model, args)`."""
  return MLP(nnx.Rngs(0)), (jnp.ones((4, 8)),)
