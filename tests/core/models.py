"""Small Linen and NNX models the core tests of calls and state share."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import flaxlens as fl

X = jnp.arange(8.0).reshape(2, 4) / 8  # The input every model here takes.


class LinenScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.Dense(4)(x), None


class LinenScanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      LinenScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    return scan(name="layers")(x, None)[0]


class NNXScanned(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return nnx.Linear(4, 4, rngs=rngs)

    self.layers = create(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, layer):
      return layer(x)

    return forward(x, self.layers)


def scanned_tree(name):
  if name == "linen":
    module = LinenScanned()
    return fl.unflaxify(module, module.init(jax.random.key(0), X), X), "layers/Dense_0"
  return fl.unflaxify(NNXScanned(nnx.Rngs(0)), X), "layers"
