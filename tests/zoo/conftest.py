"""Third-party models with random weights and tiny configs, built once per session."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import flaxlens as fl


@dataclasses.dataclass
class ZooModel:
  module: Any
  variables: dict
  args: tuple
  kwargs: dict
  rngs: Any = None
  mutable: Any = False

  def apply(self, variables=None, **kwargs):
    return self.module.apply(
      self.variables if variables is None else variables,
      *self.args,
      rngs=self.rngs,
      mutable=self.mutable,
      **{**self.kwargs, **kwargs},
    )

  def convert(self):
    return fl.unflaxify(
      self.module, self.variables, *self.args, rngs=self.rngs, mutable=self.mutable, **self.kwargs
    )

  def call(self, tree, **kwargs):
    return tree(
      fl.ArgsAndKwargs.capture(*self.args, **{**self.kwargs, **kwargs}), random_streams=self.rngs
    )


@pytest.fixture(scope="session")
def griffin() -> ZooModel:
  rg = pytest.importorskip("recurrentgemma.jax")
  recurrent, attention = rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.ATTENTION
  config = rg.GriffinConfig(
    vocab_size=128,
    width=32,
    mlp_expanded_width=64,
    num_heads=2,
    block_types=(recurrent, recurrent, attention),
    embeddings_scale_by_sqrt_dim=True,
    attention_window_size=16,
    logits_soft_cap=30.0,
    scan_type=rg.ScanType.LINEAR_NATIVE,
  )
  module = rg.Griffin(config)
  tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, 128)
  positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
  variables = jax.jit(module.init)(jax.random.key(0), tokens, positions)
  return ZooModel(module, dict(variables), (tokens, positions), {})


@pytest.fixture(scope="session")
def gpt2() -> ZooModel:
  transformers = pytest.importorskip("transformers")
  transformers.utils.logging.set_verbosity_error()
  config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
  model = transformers.FlaxGPT2LMHeadModel(config, _do_init=False)
  ids = jax.random.randint(jax.random.key(6), (2, 8), 0, 100)
  mask = jnp.ones_like(ids)
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  variables = jax.jit(model.module.init)(jax.random.key(0), ids, mask, positions)
  return ZooModel(
    model.module,
    {"params": variables["params"]},
    (ids, mask, positions),
    {"deterministic": False},
    rngs={"dropout": jax.random.key(1)},
  )


@pytest.fixture(scope="session")
def resnet18() -> ZooModel:
  flaxmodels = pytest.importorskip("flaxmodels")
  module = flaxmodels.ResNet18(output="logits", pretrained=None, num_classes=10)
  x = jax.random.uniform(jax.random.key(7), (2, 32, 32, 3))
  variables = jax.jit(lambda k: module.init(k, x, train=False))(jax.random.key(0))
  return ZooModel(module, dict(variables), (x,), {"train": True}, mutable=["batch_stats"])
