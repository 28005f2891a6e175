"""Induction heads in a two-layer attention-only transformer, found with flaxlens.

Run: python examples/induction_heads.py (trains three seeds in one compiled program, about
80 s of CPU, then analyses each in about 10 s; `--quick` trains one seed for 20 steps, as
CI runs it, which only shows the calls work).

The model is Flax's own `nn.MultiHeadDotProductAttention` twice over a residual stream
(token and learned position embeddings, pre-LayerNorm, no MLPs), 4 heads in layer 0 and
one in layer 1 (`--layer1-heads 4`: four, which all become induction heads and share the
work). The data are random tokens in which one segment of random length (12 to 32 tokens)
is repeated later at a random distance, so no fixed positional offset predicts the repeat:
only an induction head can ("after the previous occurrence of this token came X, so
predict X").

With the public API only, the script then
1. reads every head's attention pattern (`fl.attention_pattern`: Flax's own softmax of
   the query and key each attention computed) and scores it:
   induction score (attention from a repeated token to the token after its previous
   occurrence), previous-token score (attention to the position before);
2. ablates each head (`fl.ablate(fl.heads(...))`: zeroing what it writes), and then the
   induction heads together, measuring the loss on repeated tokens (the 2nd and later
   tokens of a repeat) and on unrepeated ones;
3. path-patches each layer-0 head into the induction heads' keys (`fl.path_patch`, every
   layer-0 head in one program; the sender's output from a run on other random tokens,
   every other component left as in the clean run): the head
   whose path raises the loss most is the previous-token head they compose with;
4. reports how much of the way each ablation takes the repeated tokens' loss back to the
   unrepeated tokens' loss: (ablated - clean repeated) / (unrepeated - clean repeated).

What it finds (numbers in docs/circuits.md): the layer-1 head is an induction head, and
ablating it takes the repeated tokens' loss all the way back to the unrepeated tokens'
(more than any layer-0 head's ablation); path patching finds the previous-token head
whose output its keys read. With four heads in layer 1, all four become induction heads
and share the work: ablating any one undoes 0-13% of it, all four together all of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import flaxlens as fl

VOCAB, LENGTH, DIM = 64, 64, 64
HEADS = (4, 1)  # per layer; with 4 in layer 1, all 4 become induction heads (see docs)
SEGMENT = (12, 32)  # lengths of the repeated segment, inclusive


class Block(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x, mask):
    return x + nn.MultiHeadDotProductAttention(self.heads, name="attn")(
      nn.LayerNorm(name="ln")(x), mask=mask
    )


class AttentionOnly(nn.Module):
  """Two attention-only blocks: embeddings, residual stream, final LayerNorm, unembedding."""

  heads: tuple[int, int] = HEADS

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, DIM, name="embed")(tokens)
    x = x + nn.Embed(LENGTH, DIM, name="pos")(jnp.arange(tokens.shape[-1]))
    mask = nn.make_causal_mask(tokens)
    for i, heads in enumerate(self.heads):
      x = Block(heads, name=f"block_{i}")(x, mask)
    return nn.Dense(VOCAB, name="unembed")(nn.LayerNorm(name="ln_f")(x))


@dataclasses.dataclass(frozen=True)
class Batch:
  """Token sequences with one repeated segment and where the repeat's tokens are."""

  tokens: jax.Array  # (batch, LENGTH) int32
  source: jax.Array  # (batch, LENGTH): the position a repeated token copies (else itself)
  repeated: jax.Array  # (batch, LENGTH - 1) bool: the target is the 2nd+ token of the repeat
  unrepeated: jax.Array  # (batch, LENGTH - 1) bool: the target is outside the repeat


def make_batch(key: jax.Array, size: int) -> Batch:
  """Random tokens; a segment [a, a + L) is copied to [a + d, a + d + L), with d >= L."""
  k_tokens, k_length, k_distance, k_start = jax.random.split(key, 4)
  tokens = jax.random.randint(k_tokens, (size, LENGTH), 0, VOCAB)
  length = jax.random.randint(k_length, (size, 1), SEGMENT[0], SEGMENT[1] + 1)
  uniform = lambda k: jax.random.uniform(k, (size, 1))
  distance = length + jnp.floor(uniform(k_distance) * (LENGTH - 2 * length + 1)).astype(jnp.int32)
  start = jnp.floor(uniform(k_start) * (LENGTH - length - distance + 1)).astype(jnp.int32)
  copy_start = start + distance
  position = jnp.arange(LENGTH)[None]
  copied = (position >= copy_start) & (position < copy_start + length)
  source = jnp.where(copied, position - distance, position)
  tokens = jnp.take_along_axis(tokens, source, axis=1)
  target = position[:, 1:]
  in_copy = (target >= copy_start) & (target < copy_start + length)
  return Batch(tokens, source, in_copy & (target > copy_start), ~in_copy)


def token_losses(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Next-token cross entropy at each position but the last: (batch, LENGTH - 1)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])


MODEL = AttentionOnly()


def train(
  seeds: list[int],
  model: AttentionOnly = MODEL,
  steps: int = 1500,
  batch_size: int = 32,
  learning_rate: float = 3e-3,
):
  """Trains one model per seed (vmapped, one compiled program); returns stacked variables."""
  optimizer = optax.adamw(learning_rate, weight_decay=0.01)

  def one(seed):
    key = jax.random.key(seed)
    variables = model.init(key, jnp.zeros((1, LENGTH), jnp.int32))

    def step(carry, step_key):
      params, state = carry
      tokens = make_batch(step_key, batch_size).tokens
      loss, grads = jax.value_and_grad(
        lambda p: token_losses(model.apply(p, tokens), tokens).mean()
      )(params)
      updates, state = optimizer.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), loss

    keys = jax.random.split(jax.random.fold_in(key, 1), steps)
    (variables, _), losses = jax.lax.scan(step, (variables, optimizer.init(variables)), keys)
    return variables, losses

  return jax.jit(jax.vmap(one))(jnp.asarray(seeds))


# --- analysis: the public API only -----------------------------------------------------
# Each step is one small function of the converted tree, so that a dedicated API (heads
# as sites, fl.path_patch) can replace its body without changing the story.


def attention_patterns(tree: fl.CallNode, tokens: jax.Array) -> list[jax.Array]:
  """Each layer's attention weights, (batch, heads, query, key), as Flax computes them."""
  _, cache = fl.capture(tree, tokens, at=fl.attention_pattern("block_*/attn"))
  return [cache[f"block_{i}/attn:pattern"] for i in range(2)]


def head_scores(patterns: list[jax.Array], batch: Batch) -> tuple[list, list]:
  """(induction, previous-token) scores: per layer, (heads,), averaged over the batch.

  Induction: the attention from each repeated token (one whose next token is the 2nd+ of
  the repeat) to the token after its previous occurrence. Previous token: the attention
  from each position to the one before it.
  """
  query = jnp.arange(LENGTH - 1)
  target = batch.source[:, :-1] + 1  # the token after the previous occurrence
  weight = batch.repeated / batch.repeated.sum()
  induction, previous = [], []
  for w in patterns:
    to_target = jnp.take_along_axis(w[:, :, :-1], target[:, None, :, None], axis=3)[..., 0]
    induction.append(jnp.einsum("bhq,bq->h", to_target, weight))
    previous.append(w[:, :, query + 1, query].mean((0, 2)))
  return induction, previous


def losses(logits: jax.Array, batch: Batch) -> tuple[float, float]:
  """Mean loss on repeated tokens (2nd+ of the repeat) and on unrepeated tokens."""
  per_token = token_losses(logits, batch.tokens)
  return (
    float(per_token.sum(where=batch.repeated) / batch.repeated.sum()),
    float(per_token.sum(where=batch.unrepeated) / batch.unrepeated.sum()),
  )


def ablate_head(layer: int, head: int | list[int]) -> fl.Intervention:
  """Zero head `head` (or heads) of layer `layer`: what it writes, before the output
  projection merges the heads (`fl.heads` finds that value in Flax's attention module)."""
  return fl.ablate(fl.heads(f"block_{layer}/attn", head))


def repeated_loss(batch: Batch):
  """The metric of a run: mean loss on the repeated tokens (traceable)."""

  def metric(logits: jax.Array) -> jax.Array:
    per_token = token_losses(logits, batch.tokens)
    return per_token.sum(where=batch.repeated) / batch.repeated.sum()

  return metric


def path_patch_keys(
  tree: fl.CallNode, batch: Batch, corrupted: jax.Array, receiver: int | list[int]
) -> jax.Array:
  """Repeated-token loss, per layer-0 head (the sender), when only the keys of layer-1
  head(s) `receiver` see that head as it was on the `corrupted` tokens; every other
  component (the layer-0 heads, the receivers' keys) keeps the clean run's value.

  `fl.path_patch` runs the three runs (corrupted; clean with the sender corrupted,
  recording the receivers' keys; clean with those keys patched) for every layer-0 head
  in one compiled program.
  """
  keys = fl.Sites("block_1/attn/key", where=jnp.s_[:, :, receiver])  # (batch, len, heads, dim)
  result = fl.path_patch(
    tree, batch.tokens, corrupted, fl.heads("block_0/attn"), keys, repeated_loss(batch)
  )
  return result.values


INDUCTION_SCORE = 0.3  # a layer-1 head at least this induction score is an induction head


@dataclasses.dataclass
class Findings:
  """What the analysis finds in one trained model (losses in nats per token)."""

  repeated: float  # clean loss on repeated tokens
  unrepeated: float  # clean loss on unrepeated tokens
  induction: list[jax.Array]  # per layer, (heads,): induction scores
  previous: list[jax.Array]  # per layer, (heads,): previous-token scores
  ablated: list[jax.Array]  # per layer, (heads,): repeated-token loss, that one head ablated
  induction_heads: tuple[int, ...]  # layer-1 heads with induction score >= INDUCTION_SCORE
  induction_heads_ablated: float  # repeated-token loss with all of them ablated
  path_patched: jax.Array  # (heads,) repeated-token loss, layer-0 head -> induction keys
  previous_token_head: int  # the layer-0 head whose path raises it most

  def fraction(self, ablated_loss: float) -> float:
    """How far an ablation takes repeated tokens' loss back to the unrepeated tokens'."""
    return (float(ablated_loss) - self.repeated) / (self.unrepeated - self.repeated)

  @property
  def strongest_head(self) -> int:
    """The layer-1 head whose ablation alone raises repeated-token loss most."""
    return int(self.ablated[1].argmax())


def analyse(variables, key: jax.Array, size: int = 256, model: AttentionOnly = MODEL) -> Findings:
  """Finds the induction heads and the previous-token head of one trained model."""
  k_batch, k_corrupted = jax.random.split(key)
  batch = make_batch(k_batch, size)
  tree = fl.unflaxify(model, variables, batch.tokens)
  repeated, unrepeated = losses(fl.run(tree, batch.tokens), batch)
  induction, previous = head_scores(attention_patterns(tree, batch.tokens), batch)
  ablated = [
    jnp.array(
      [
        losses(fl.run(tree, batch.tokens, interventions=[ablate_head(layer, head)]), batch)[0]
        for head in range(count)
      ]
    )
    for layer, count in enumerate(model.heads)
  ]
  heads = [h for h in range(model.heads[1]) if induction[1][h] >= INDUCTION_SCORE] or [
    int(ablated[1].argmax())
  ]
  all_ablated = losses(fl.run(tree, batch.tokens, interventions=[ablate_head(1, heads)]), batch)
  corrupted = make_batch(k_corrupted, size).tokens
  path_patched = path_patch_keys(tree, batch, corrupted, heads)
  return Findings(
    repeated,
    unrepeated,
    induction,
    previous,
    ablated,
    tuple(heads),
    all_ablated[0],
    path_patched,
    int(path_patched.argmax()),
  )


def report(seed: int, f: Findings) -> None:
  show = lambda values: " ".join(f"{float(v):.2f}" for v in values)
  print(f"seed {seed}: loss on repeated tokens {f.repeated:.3f}, unrepeated {f.unrepeated:.3f}")
  print(f"  induction score per head, layer 1:        {show(f.induction[1])}")
  print(f"  previous-token score per head, layer 0:   {show(f.previous[0])}")
  print(f"  repeated-token loss, one head ablated:    layer 0 {show(f.ablated[0])}")
  print(f"                                            layer 1 {show(f.ablated[1])}")
  fractions = show(f.fraction(loss) for loss in f.ablated[1])
  print(f"  one layer-1 head ablated, fraction of the way back: {fractions}")
  names = ", ".join(f"1.{h}" for h in f.induction_heads)
  print(
    f"  induction heads {names} ablated together: repeated-token loss"
    f" {f.induction_heads_ablated:.3f}, {f.fraction(f.induction_heads_ablated):.2f} of the way"
  )
  print(
    f"  path patching layer-0 heads -> the induction heads' keys: {show(f.path_patched)}"
    f" -> previous-token head 0.{f.previous_token_head}"
  )
  print(
    f"  previous-token head 0.{f.previous_token_head} ablated:"
    f" {f.fraction(f.ablated[0][f.previous_token_head]):.2f} of the way"
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="one seed, a few steps (CI)")
  parser.add_argument("--layer1-heads", type=int, default=HEADS[1], help="heads of layer 1")
  options = parser.parse_args()
  model = AttentionOnly(heads=(HEADS[0], options.layer1_heads))
  seeds, steps = ([0], 20) if options.quick else ([0, 1, 2], 1500)
  start = time.process_time()
  variables, _ = jax.block_until_ready(train(seeds, model, steps=steps))
  print(f"trained {len(seeds)} model(s), {steps} steps: {time.process_time() - start:.0f}s CPU")
  for i, seed in enumerate(seeds):
    one = jax.tree.map(lambda v, i=i: v[i], variables)
    report(seed, analyse(one, jax.random.key(1000 + seed), 32 if options.quick else 256, model))


if __name__ == "__main__":
  main()
