"""Harvest a model's residual stream, train a sparse autoencoder on it, evaluate it,
splice it in, ablate a feature and look at it.

A two-block Linen transformer with random weights reads a synthetic token dataset (with
padding); `fl.harvest` streams the residual stream after block 1 (every non-padding
position, stored as bfloat16) into a TensorStore (zarr v3) store; `flaxlens.dictionaries`
trains a TopK SAE on the store's shuffled rows, measures it (alone and spliced into the
model), splices it into the tree, ablates one of its features, and writes the feature's
page. Sizes are tiny so CI runs it in seconds; raise them at will (docs/dictionaries.md).

    pip install "flaxlens[harvest]"
    python examples/harvest_sae.py
"""

from __future__ import annotations

import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flaxlens as fl
import flaxlens.dictionaries as fld

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


# 2. Train a TopK sparse autoencoder on the store's shuffled rows (one compiled step).
sae = fld.SAE(WIDTH, 4 * WIDTH, activation="topk", k=8, rngs=nnx.Rngs(1))
data = fld.from_harvest(store, "Block_1")
trained = fld.train(sae, data, steps=300, batch_size=128, recipe=fld.Recipe(3e-3), progress=False)
losses = trained.history["loss"]
print(f"trained: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {trained.steps} steps")
assert losses[-1] < losses[0], "the autoencoder should learn"

# 3. Evaluate: L0, variance unexplained, dead features; spliced into the model, the
#    next-token loss recovered against zero-ablating the site.
evaluation = fld.evaluate(
  sae, data, batch_size=256, tree=tree, model_inputs=list(token_batches(4, 16, seed=1)),
  at="Block_1",
)  # fmt: skip
print(evaluation)
assert evaluation.l0 <= 8 and 0 <= evaluation.fvu < 1

# 4. Splice it in (the output is unchanged, bit for bit) and ablate one feature.
tokens = next(token_batches(1, 4, seed=2))
spliced = fld.splice(tree, sae, "Block_1")
assert bool((fl.run(spliced, tokens) == fl.run(tree, tokens)).all())
feature = int(jnp.argmax(evaluation.frequencies))
ablated = fl.run(spliced, tokens, interventions=[
  fl.ablate("Block_1/sae/activation", where=jnp.s_[..., feature]),
])  # fmt: skip
moved = float(jnp.abs(ablated - fl.run(tree, tokens)).max())
print(f"ablating feature {feature} moves the logits by {moved:.4f}")

# 5. Look at it: top contexts, histogram, the tokens it promotes (a static HTML page).
views = fld.feature_views(
  sae, store, "Block_1", [feature], tokens=np.concatenate(list(token_batches(32, 16))),
  unembedding="Dense_0", tree=tree, top=5,
)  # fmt: skip
page = tempfile.mkdtemp() + "/features.html"
views.to_html(page)
print(f"feature {feature}: {views[feature].histogram.active} active rows; page at {page}")

# 6. Random access: a row, where it came from, and its token.
example, position = rows.index[100]
print(f"row 100: example {example}, position {position}, token {rows.ids[100]}")
