"""Capture, ablate, steer and steer a cached generation on a small NNX transformer.

Run: python examples/nnx_transformer.py (random weights; nothing is downloaded).
Each task is at most three lines of flaxlens code after the model setup (a long call is
wrapped over lines).
"""

import os
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

import flaxlens as fl


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
    self.mlp = nnx.Sequential(
      nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.gelu, nnx.Linear(4 * dim, dim, rngs=rngs)
    )

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.mlp(self.ln2(x))


class Transformer(nnx.Module):
  def __init__(self, vocab=64, dim=32, heads=4, layers=2, max_length=32, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.position = nnx.Embed(max_length, dim, rngs=rngs)
    self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, ids, positions):
    x = self.embed(ids) + self.position(positions)
    mask = nnx.make_causal_mask(ids)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln_f(x))


# --- model setup ------------------------------------------------------------------------
model = Transformer(rngs=nnx.Rngs(0))
ids = jnp.array([[5, 17, 42, 8, 61, 3]])
positions = jnp.arange(6)[None]
tree = fl.unflaxify(model, ids, positions)  # one node per module call; `model` is untouched
v = jax.random.normal(jax.random.key(1), (32,))  # a steering direction

# The model's arguments go to every flaxlens call as one value: a tuple of positional
# arguments here (fl.ArgsAndKwargs.capture(...) for keyword arguments too).
inputs = (ids, positions)

# 1. Cache the residual stream: every block's output.
logits, cache = fl.capture(tree, inputs, at="blocks/*")
print("residual stream:", {site: x.shape for site, x in cache.items()})

# 2. Ablate head 2 of block 0: zero its part of the attention output projection's input,
#    which has shape (batch, length, heads, head_dim).
head_2 = fl.ablate("blocks/0/attn/out", on="input", where=jnp.s_[..., 2, :])
ablated = fl.run(tree, inputs, interventions=[head_2])
print("ablating head 2 moves the logits by", float(jnp.abs(ablated - logits).max()))

# 3. Steer: add 4 * v to block 1's output (new vectors or strengths never recompile).
steered = fl.run(tree, inputs, interventions=[fl.steer("blocks/1", v, alpha=4.0)])
print(
  "steered next token:", int(steered[0, -1].argmax()), "unsteered:", int(logits[0, -1].argmax())
)

# 4. Steer a cached generation. NNX's decode mode feeds one token per call and keeps a
#    key/value cache per attention; the cache lives in the tree's state, each fl.run
#    updates it, and the steering applies at every step.
decoding = nnx.view(model, decode=True)  # a view: `model` itself stays as it is
for block in decoding.blocks:
  block.attn.init_cache((1, 16, 32))  # (batch, max length, features)
decoder = fl.unflaxify(decoding, ids[:, :1], positions[:, :1])
steering = [fl.steer("blocks/1", v, alpha=4.0)]
tokens = ids[0].tolist()
for t in range(12):  # reads the prompt token by token, then appends its greedy choices
  step = fl.run(decoder, (jnp.array([[tokens[t]]]), jnp.array([[t]])), interventions=steering)
  if t + 1 == len(tokens):
    tokens.append(int(step[0, -1].argmax()))
print("steered generation:", tokens)
assert model.blocks[0].attn.cached_key is None  # the model itself was not changed

# 5. Sweep activation patching over blocks x positions in one compiled call: each cell
#    runs the corrupted prompt with one block's output at one position taken from the
#    clean run, and measures the clean next-token logit. Saved as a heatmap image.
corrupted, answer = ids.at[0, 2].set(9), int(logits[0, -1].argmax())
sweep = fl.sweep(
  tree,
  inputs,
  (corrupted, positions),
  "blocks/*",
  lambda out: out[0, -1, answer],
  positions=range(6),
)
sweep.plot(os.path.join(tempfile.mkdtemp(), "patching.png"))
print("patching sweep (blocks x positions):\n", sweep.values)

# 6. Attribution patching: the same grid estimated from one forward and one backward pass.
estimate = fl.attribute(
  tree,
  inputs,
  (corrupted, positions),
  "blocks/*",
  lambda out: out[0, -1, answer],
  positions=range(6),
)
print("attribution estimate:\n", estimate.values)
