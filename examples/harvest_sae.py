"""Harvest a model's residual stream over a dataset, then train a sparse autoencoder on it.

A two-block Linen transformer with random weights reads a synthetic token dataset (with
padding); `fl.harvest` streams the residual stream after block 1 (every non-padding
position, stored as bfloat16) into a TensorStore (zarr v3) store; a sparse autoencoder
trains on the store's shuffled iterator with optax. The autoencoder is this example's,
not the library's. Sizes are tiny so CI runs it in seconds; raise them at will.

    pip install "flaxlens[harvest]"
    python examples/harvest_sae.py
"""

from __future__ import annotations

import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import flaxlens as fl

VOCAB, WIDTH, LENGTH, PAD = 64, 32, 16, 0


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + nn.SelfAttention(num_heads=2)(nn.LayerNorm()(x))
    return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))))


class LM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    for _ in range(2):
      x = Block()(x)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def token_batches(count: int, size: int, seed: int = 0):
  """A synthetic dataset: sequences of random tokens, padded after a random length."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    tokens = rng.integers(1, VOCAB, (size, LENGTH)).astype(np.int32)
    lengths = rng.integers(4, LENGTH + 1, size)
    tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
    yield tokens


def not_padding(tokens):
  return tokens != PAD


model = LM()
example = jnp.zeros((8, LENGTH), jnp.int32)
tree = fl.unflaxify(model, model.init(jax.random.key(0), example), example)

# 1. Harvest: one compiled program per batch shape; only non-padding rows leave the device.
store = fl.harvest(
  tree,
  token_batches(count=32, size=16),
  "Block_1",
  tempfile.mkdtemp() + "/residual",
  positions=not_padding,
  dtype=jnp.bfloat16,
  ids=lambda tokens: tokens,
)
print(store)
rows = store["Block_1"]
assert store.complete and rows.shape[1:] == (WIDTH,)


# 2. A sparse autoencoder (ReLU code, L1 penalty), trained with optax on shuffled batches.
class SAE(nn.Module):
  hidden: int = 4 * WIDTH

  @nn.compact
  def __call__(self, x):
    code = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(WIDTH)(code), code


sae = SAE()
params = sae.init(jax.random.key(1), jnp.zeros((1, WIDTH)))
optimizer = optax.adam(3e-3)
state = optimizer.init(params)


def loss_of(params, x):
  reconstruction, code = sae.apply(params, x)
  return jnp.mean((reconstruction - x) ** 2) + 1e-3 * jnp.mean(jnp.abs(code).sum(-1))


@jax.jit
def step(params, state, x):
  loss, grads = jax.value_and_grad(loss_of)(params, x)
  updates, state = optimizer.update(grads, state, params)
  return optax.apply_updates(params, updates), state, loss


losses = []
for epoch in range(3):
  for batch in store.batches(256, seed=epoch):
    params, state, loss = step(params, state, jnp.asarray(batch["Block_1"], jnp.float32))
    losses.append(float(loss))
  print(f"epoch {epoch}: loss {np.mean(losses[-5:]):.4f}")
assert np.mean(losses[-5:]) < losses[0], "the autoencoder should learn"

# 3. Random access: a row, where it came from, and its token.
example, position = rows.index[100]
print(f"row 100: example {example}, position {position}, token {rows.ids[100]}")
