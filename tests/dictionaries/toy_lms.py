"""Two-layer toy language models (token ids in, logits out), Linen and NNX, each block
`x + mlp(norm(x))`: the sites the dictionary tests read (a block's output, an MLP's input
and output), with a native run that edits one of them for reference values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, WIDTH, HIDDEN, LAYERS = 11, 8, 16, 2


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(WIDTH)(nn.gelu(nn.Dense(HIDDEN)(x)))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + LinenMLP(name="mlp")(nn.LayerNorm()(x))


class LinenLM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    for layer in range(LAYERS):
      x = LinenBlock(name=f"block_{layer}")(x)
    return nn.Dense(VOCAB, name="unembed")(x)


class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    self.up, self.down = nnx.Linear(WIDTH, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.gelu(self.up(x)))


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm, self.mlp = nnx.LayerNorm(WIDTH, rngs=rngs), NNXMLP(rngs)

  def __call__(self, x):
    return x + self.mlp(self.norm(x))


class NNXLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.blocks = nnx.List([NNXBlock(rngs) for _ in range(LAYERS)])
    self.unembed = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.unembed(x)


class ToyLM:
  """One framework's toy LM: its converted `tree`, site names, and `native(tokens, edit)`,
  the model's own run with `edit(layer, "block"|"mlp", input, output)` giving the value of
  block `layer`'s output or its MLP's output (None: unedited)."""

  def __init__(self, framework: str):
    self.framework = framework
    self.tokens = jax.random.randint(jax.random.key(1), (3, 7), 0, VOCAB)
    if framework == "linen":
      self.model = LinenLM()
      self.variables = self.model.init(jax.random.key(0), self.tokens)
      self.block, self.mlp = "block_{}", "block_{}/mlp"
    else:
      self.model = NNXLM(nnx.Rngs(0))
      self.block, self.mlp = "blocks/{}", "blocks/{}/mlp"

  def tree(self) -> Any:
    import flaxlens as fl

    if self.framework == "linen":
      return fl.unflaxify(self.model, self.variables, self.tokens)
    return fl.unflaxify(self.model, self.tokens)

  def native(self, tokens: Any, edit: Callable[..., Any] | None = None) -> Any:
    edit = edit or (lambda layer, where, x, out: out)
    if self.framework == "nnx":
      x = self.model.embed(tokens)
      for layer, block in enumerate(self.model.blocks):
        normed = block.norm(x)
        x = edit(layer, "block", x, x + edit(layer, "mlp", normed, block.mlp(normed)))
      return self.model.unembed(x)

    def interceptor(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      path = context.module.path
      if context.method_name != "__call__" or not path or not path[0].startswith("block_"):
        return out
      layer = int(path[0].removeprefix("block_"))
      if path[1:] == ("mlp",):
        return edit(layer, "mlp", args[0], out)
      if len(path) == 1:
        return edit(layer, "block", args[0], out)
      return out

    with nn.intercept_methods(interceptor):
      return self.model.apply(self.variables, tokens)
