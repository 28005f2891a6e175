"""Capture, ablate, steer and steer a cached generation on a tiny Hugging Face Flax GPT-2.

Run: python examples/hf_gpt2.py (random weights, tiny config; nothing is downloaded).
Each task is at most three lines of flaxlens code after the model setup.
"""

import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import transformers

import flaxlens as fl

# --- model setup ------------------------------------------------------------------------
transformers.utils.logging.set_verbosity_error()
config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
model = transformers.FlaxGPT2LMHeadModel(config, _do_init=False)
module = model.module  # the Linen module; `model` only wraps it
ids = jnp.array([[5, 17, 42, 8, 99, 3]])
mask, positions = jnp.ones_like(ids), jnp.arange(6)[None]
params = jax.jit(module.init)(jax.random.key(0), ids, mask, positions)["params"]
tree = fl.unflaxify(module, {"params": params}, ids, mask, positions)
v = jax.random.normal(jax.random.key(1), (32,))  # a steering direction

# The model's arguments go to every flaxlens call as one value: a tuple of positional
# arguments here (fl.ArgsAndKwargs.capture(...) for keyword arguments too).
inputs = (ids, mask, positions)

# 1. Cache the residual stream: every block's output (GPT-2 blocks return tuples).
out, cache = fl.capture(tree, inputs, at="transformer/h/*")
resid = {site: hidden for site, (hidden, *_) in cache.items()}
print("residual stream:", {site: x.shape for site, x in resid.items()})

# 2. Ablate head 1 of block 0. GPT-2 merges its 2 heads of 16 features before the output
#    projection c_proj; fl.heads reads n_head from the config (head 1: features 16:32).
head_1 = fl.ablate(fl.heads("transformer/h/0/attn/c_proj", 1, on="input"))
ablated = fl.run(tree, inputs, interventions=[head_1])
print("ablating head 1 moves the logits by", float(jnp.abs(ablated.logits - out.logits).max()))

# 3. Steer: add 4 * v to block 1's hidden state (part 0 of its output).
steer = fl.steer("transformer/h/1", v, alpha=4.0, part=0)
steered = fl.run(tree, inputs, interventions=[steer])
print("steered next token:", int(steered.logits[0, -1].argmax()))

# 4. Steer a cached generation. GPT-2's key/value cache is its "cache" collection: convert
#    with it mutable and it lives in the tree's state, updated by every fl.run; the prompt
#    runs in one call, then one token per call, steered at every step.
max_length = 16
cache = jax.jit(functools.partial(model.init_cache, 1, max_length))()  # HF's own init_cache
full_mask = jnp.ones((1, max_length), jnp.int32)  # as HF's generate makes it
decoder = fl.unflaxify(
  module, {"params": params, "cache": cache}, ids, full_mask, positions, mutable=["cache"]
)
tokens, step_ids, step_positions = ids[0].tolist(), ids, positions
while len(tokens) < max_length:
  logits = fl.run(decoder, (step_ids, full_mask, step_positions), interventions=[steer]).logits
  step_ids, step_positions = logits[:, -1:].argmax(-1), step_positions[:, -1:] + 1
  tokens.append(int(step_ids[0, 0]))
print("steered generation:", tokens)

# 5. Sweep activation patching over blocks x positions in one compiled call (part 0 of a
#    block's output is its hidden state); saved as a heatmap image.
corrupted, answer = ids.at[0, 2].set(9), int(out.logits[0, -1].argmax())
sweep = fl.sweep(
  tree,
  inputs,
  (corrupted, mask, positions),
  "transformer/h/*",
  lambda o: o.logits[0, -1, answer],
  positions=range(6),
  part=0,
)
sweep.plot(os.path.join(tempfile.mkdtemp(), "patching.png"))  # centred on "no effect"
print("patching sweep (blocks x positions):\n", sweep.values)
print("normalised effect (0: corrupted, 1: clean):\n", sweep.normalised())

# 6. Attribution patching: the same grid from one forward and one backward pass.
estimate = fl.attribute(
  tree,
  inputs,
  (corrupted, mask, positions),
  "transformer/h/*",
  lambda o: o.logits[0, -1, answer],
  positions=range(6),
  part=0,
)
print("attribution estimate:\n", estimate.values)
