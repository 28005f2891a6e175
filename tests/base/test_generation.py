"""Steering during cached autoregressive decoding equals the same steering done natively.

`fl.run` with interventions runs at every step of a greedy decode whose key/value cache
lives in the tree's state (Linen: a mutable "cache" collection; NNX: `nnx.Cache`
variables). The native side decodes with the real model, steered at the same call:
`nn.intercept_methods` (Linen) or the block's class swapped for a subclass that adds the
vector (NNX). Tokens, every step's logits and the final cache must be bit-identical.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import LINEN, NNX, flat_collections, model_state

import flaxlens as fl

STEPS = 6


def _greedy(step, first_ids, first_positions, steps):
  """Greedy decoding: `step(ids, positions) -> logits`; returns tokens and all logits."""
  ids, positions, tokens, logits_seen = first_ids, first_positions, [], []
  for _ in range(steps):
    logits = step(ids, positions)
    logits_seen.append(logits)
    ids = logits[:, -1].argmax(-1)[:, None]
    positions = positions[:, -1:] + 1
    tokens.append(ids)
  return jnp.concatenate(tokens, axis=1), logits_seen


# --- NNX: a small decoder with nnx.MultiHeadAttention(decode=True) ------------------------


class Block(nnx.Module):
  def __init__(self, features: int, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(features, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=2, in_features=features, decode=True, rngs=rngs
    )
    self.mlp = nnx.Sequential(
      nnx.Linear(features, 2 * features, rngs=rngs),
      nnx.gelu,
      nnx.Linear(2 * features, features, rngs=rngs),
    )

  def __call__(self, x):
    x = x + self.attention(self.norm(x))
    return x + self.mlp(x)


class Decoder(nnx.Module):
  def __init__(self, vocab: int, features: int, max_length: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, features, rngs=rngs)
    self.position = nnx.Embed(max_length, features, rngs=rngs)
    self.blocks = nnx.List([Block(features, rngs) for _ in range(2)])
    self.head = nnx.Linear(features, vocab, rngs=rngs)

  def __call__(self, ids, positions):
    x = self.embed(ids) + self.position(positions)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _nnx_decoder(batch: int, max_length: int) -> Decoder:
  model = Decoder(vocab=40, features=16, max_length=max_length, rngs=nnx.Rngs(0))
  for block in model.blocks:
    block.attention.init_cache((batch, max_length, 16))
  return model


def _steered_class(cls: type, vector, alpha: float) -> type:
  class Steered(cls):
    def __call__(self, x):
      return super().__call__(x) + alpha * vector

  return Steered


VECTOR = jax.random.normal(jax.random.key(1), (16,))
FIRST = (jnp.array([[3], [7]]), jnp.zeros((2, 1), jnp.int32))  # ids, positions


def _native_nnx_decode(model: Decoder, alpha: float):
  """Greedy decoding of a copy of `model` whose first block adds `alpha * VECTOR`."""
  native = nnx.clone(model)
  block = native.blocks[0]
  object.__setattr__(block, "__class__", _steered_class(type(block), VECTOR, alpha))
  step = nnx.jit(lambda model, ids, positions: model(ids, positions))
  tokens, logits = _greedy(functools.partial(step, native), *FIRST, STEPS)
  return tokens, logits, native


def test_steered_cached_decode_equals_native_nnx_edit():
  model = _nnx_decoder(batch=2, max_length=STEPS + 1)
  tree = fl.unflaxify(model, *FIRST)
  steering = [fl.steer("blocks/0", VECTOR, alpha=0.5)]
  tokens, logits = _greedy(
    lambda ids, pos: fl.run(tree, (ids, pos), interventions=steering), *FIRST, STEPS
  )

  native_tokens, native_logits, native = _native_nnx_decode(model, 0.5)
  _, plain_logits, _ = _native_nnx_decode(model, 0.0)
  assert not jnp.array_equal(logits[-1], plain_logits[-1])  # the steering matters
  assert_trees_equal(tokens, native_tokens)
  assert_trees_equal(logits, native_logits)
  assert_trees_equal(NNX.tree_state(tree), model_state(native))  # the cache after decoding


def test_steered_decode_compiled_as_one_scan_equals_native_step_by_step():
  # The whole generation is one program: each step binds the cache carried by the scan
  # into the tree's skeleton and runs it un-jitted; fl.run(jit=False) inside jax.jit.
  model = _nnx_decoder(batch=2, max_length=STEPS + 1)
  skeleton, start = fl.unbind_variables(fl.unflaxify(model, *FIRST), freeze=True)

  @jax.jit
  def generate(values, ids, vector, alpha):
    def step(carry, position):
      values, ids = carry
      tree = fl.bind_variables(skeleton, values)
      steering = [fl.steer("blocks/0", vector, alpha)]
      logits = fl.run(tree, (ids, jnp.full_like(ids, position)), interventions=steering, jit=False)
      ids = logits[:, -1].argmax(-1)[:, None]
      return (fl.unbind_variables(tree, freeze=True)[1], ids), (ids, logits)

    _, (tokens, logits) = jax.lax.scan(step, (values, ids), jnp.arange(STEPS))
    return jnp.concatenate(tokens, axis=1), logits

  tokens, logits = generate(start, FIRST[0], VECTOR, 0.5)

  native_tokens, native_logits, _ = _native_nnx_decode(model, 0.5)
  assert_trees_equal(tokens, native_tokens)
  assert_trees_equal(logits, jnp.stack(native_logits))


# --- Linen: a tiny Hugging Face Flax GPT-2 with its own init_cache --------------------------


def _steered_at(path: tuple[str, ...], vector, alpha):
  """A Flax interceptor adding `alpha * vector` to output[0] of the call at `path`."""

  def interceptor(next_fun, args, kwargs, context):
    output = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and context.module.path == path:
      return (output[0] + alpha * vector, *output[1:])
    return output

  return interceptor


class NativeGPT2Decoder:
  """Jitted `module.apply` with the cache mutable and kept from step to step.

  The parameters and the steering vector and strength are arguments of the compiled
  step (as they are of `fl.run`'s), steering block `path` by `nn.intercept_methods`.
  """

  def __init__(self, module, params, cache, mask, path, vector, alpha):
    self.cache = cache

    @jax.jit
    def apply(params, cache, ids, positions, vector, alpha):
      with nn.intercept_methods(_steered_at(path, vector, alpha)):
        (logits,), updates = module.apply(
          {"params": params, "cache": cache},
          ids,
          mask,
          positions,
          return_dict=False,
          mutable=["cache"],
        )
      return logits, updates["cache"]

    self._apply = functools.partial(apply, params)
    self._steering = (vector, jnp.float32(alpha))

  def step(self, ids, positions):
    logits, self.cache = self._apply(self.cache, ids, positions, *self._steering)
    return logits


def _tiny_gpt2(transformers):
  transformers.utils.logging.set_verbosity_error()
  config = transformers.GPT2Config(
    vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2
  )
  return transformers.FlaxGPT2LMHeadModel(config, _do_init=False)


@pytest.mark.slow
def test_steered_cached_decode_equals_intercepted_hf_gpt2():
  model = _tiny_gpt2(pytest.importorskip("transformers"))
  prompt = jax.random.randint(jax.random.key(6), (2, 4), 0, 100)
  positions = jnp.broadcast_to(jnp.arange(4), (2, 4))
  params = jax.jit(model.module.init)(jax.random.key(0), prompt, jnp.ones_like(prompt), positions)
  cache = jax.jit(model.init_cache, static_argnums=(0, 1))(2, 4 + STEPS)
  mask = jnp.ones((2, 4 + STEPS), jnp.int32)  # as prepare_inputs_for_generation makes it
  vector = jax.random.normal(jax.random.key(1), (32,))

  tree = fl.unflaxify(
    model.module,
    {"params": params["params"], "cache": cache},
    prompt,
    mask,
    positions,
    mutable=["cache"],
    return_dict=False,
  )
  steering = [fl.steer("transformer/h/0", vector, alpha=0.5, part=0)]  # blocks return tuples
  tokens, logits = _greedy(
    lambda ids, pos: fl.run(
      tree, fl.ArgsAndKwargs.capture(ids, mask, pos, return_dict=False), interventions=steering
    )[0],
    prompt,
    positions,
    STEPS,
  )

  block = ("transformer", "h", "0")
  native = NativeGPT2Decoder(model.module, params["params"], cache, mask, block, vector, 0.5)
  native_tokens, native_logits = _greedy(native.step, prompt, positions, STEPS)
  plain = NativeGPT2Decoder(model.module, params["params"], cache, mask, block, vector, 0.0)
  _, plain_logits = _greedy(plain.step, prompt, positions, STEPS)

  assert not jnp.array_equal(logits[-1], plain_logits[-1])  # the steering matters
  assert_trees_equal(tokens, native_tokens)
  assert_trees_equal(logits, native_logits)
  assert_trees_equal(LINEN.tree_state(tree), flat_collections({"cache": native.cache}))
