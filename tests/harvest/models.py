"""Small token models, one per Flax API, whose blocks' outputs are a residual stream.

`build(name)` gives a `Model`: the converted tree, the sites of its residual stream, a
function of token batches, and the native model's own capture of those sites (Linen's
`capture_intermediates`, NNX's `nnx.capture`). Built from fixed seeds, so a subprocess
builds the same model (same weights, same fingerprint).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flaxlens as fl

VOCAB, WIDTH, LENGTH = 32, 8, 6
PAD = 0


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(WIDTH)(nn.relu(nn.Dense(2 * WIDTH)(x)))


class Net(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    for _ in range(2):
      x = Block()(x)
    return nn.Dense(VOCAB)(x)


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
    self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.relu(self.up(x)))


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.block0 = NNXBlock(rngs)
    self.block1 = NNXBlock(rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    return self.head(self.block1(self.block0(self.embed(tokens))))


@dataclasses.dataclass
class Model:
  tree: Any
  sites: list[str]  # the blocks' site names, in call order
  native: Callable[[Any], dict[str, Any]]  # tokens -> {site: Flax's own capture}
  framework: str  # "linen" or "nnx"


def build(name: str, place: Callable[[Any], Any] | None = None) -> Model:
  """The model of Flax API `name`; `place` (a function of the variables, as `jax.device_put`
  takes them) places them before conversion, on a mesh say."""
  example = jnp.zeros((2, LENGTH), jnp.int32)
  if name == "linen":
    module = Net()
    variables = module.init(jax.random.key(0), example)
    if place is not None:
      variables = place(variables)

    def native(tokens):
      _, state = module.apply(
        variables, tokens, capture_intermediates=True, mutable=["intermediates"]
      )
      found = state["intermediates"]
      return {site: found[site]["__call__"][0] for site in ("Block_0", "Block_1")}

    tree = fl.unflaxify(module, variables, example)
    return Model(tree, ["Block_0", "Block_1"], native, name)
  model = NNXNet(nnx.Rngs(0))
  if place is not None:
    nnx.update(model, place(nnx.state(model)))

  def native(tokens):
    captured = nnx.capture(lambda m, t: m(t), nnx.Intermediate, method_outputs=nnx.Intermediate)
    _, state = captured(nnx.clone(model), tokens)
    found = {tuple(path): v.get_raw_value() for path, v in nnx.to_flat_state(state)}
    return {site: found[(site, "__call__")][0] for site in ("block0", "block1")}

  tree = fl.unflaxify(model, example)
  return Model(tree, ["block0", "block1"], native, name)


def token_batches(count: int, size: int = 3, *, seed: int = 0, last: int | None = None) -> list:
  """`count` batches of `size` token sequences (`last`: the size of the last batch), with
  padding (PAD) at the end of some sequences."""
  rng = np.random.default_rng(seed)
  batches = []
  for k in range(count):
    rows = last if (last is not None and k == count - 1) else size
    tokens = rng.integers(1, VOCAB, (rows, LENGTH)).astype(np.int32)
    lengths = rng.integers(1, LENGTH + 1, rows)
    tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
    batches.append(tokens)
  return batches


def not_padding(tokens):
  """The positions of a batch that are not padding."""
  return tokens != PAD


def token_ids(tokens):
  """Each position's token id."""
  return tokens


def store_files(path) -> dict[str, bytes]:
  """Every file under `path` by its relative path, with its bytes: to check a store was
  left byte for byte as it was."""
  found = {}
  for folder, _, names in os.walk(path):
    for name in names:
      with open(os.path.join(folder, name), "rb") as file:
        found[os.path.relpath(os.path.join(folder, name), path)] = file.read()
  return found
