"""Attention's share (`flg.attention_share`): for one entry of an attention pattern (a head,
a query position, a key position), how much each node of the graph (active features,
error terms, tokens) moves the entry's query-key score, computed through the same frozen
replacement model as the graph's edges.

The score is the attention's softmax exponent at that entry (the scaled, masked
`q . k`, less the row's maximum, which carries no gradient), read inside the attention
call's own computation (`_freeze.py`'s scores). A node's share is `grad(score) . write`:
the score's first-order change when the node's write is removed, with the other
attentions' patterns and every norm's scale frozen. The score is bilinear in the residual
stream (queries and keys both read it), so the shares are a linear estimate: the
contributions through the query side and through the key side each add up to the
bilinear part, and their total counts it twice. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.errors import ArgumentError
from flaxlens.tools.graphs._graph import (
  Columns,
  clean_run,
  dictionary_layers,
  write_edges,
)
from flaxlens.tools.graphs._model import Freeze, Plan, found_calls, frozen_reads, frozen_shapes


class AttentionShare(NamedTuple):
  """Each node's share of one attention pattern entry's score.

  Attributes:
    score: the entry's score on the clean run as the softmax's exponent: the scaled,
      masked `q . k` less the largest of its row (a shift the pattern does not see).
    active_features: the active features, `(layer, position, feature)`, `[n, 3]`, as in
      a graph.
    features: each active feature's share, `[n]`.
    errors: each error term's share, `[layers, positions]`.
    tokens: each token's share, `[positions]`.
  """

  score: float
  active_features: np.ndarray
  features: np.ndarray
  errors: np.ndarray
  tokens: np.ndarray


def _score_gradient(tree, args, plan, skips, zeros, attention, entry):
  plan = dataclasses.replace(plan, shapes=frozen_shapes(tree, args, plan.calls))  # once
  found: list = []

  def score(deltas):
    frozen_reads(tree, args, plan, skips, deltas, scores=(attention, found))
    scores = found[0]
    shape = scores.shape[-3:]
    if scores.ndim < 3 or not all(0 <= i < n for i, n in zip(entry, shape, strict=True)):
      raise ArgumentError(
        f"flg.attention_share: entry={entry} is outside {attention}'s scores, (heads,"
        f" queries, keys) = {tuple(shape)}. Give a head, a query and a key position in them."
      )
    return scores.reshape((-1, *shape))[(0, *entry)]

  value, grads = jax.value_and_grad(score)(zeros)
  return value, grads


_score_gradient_compiled = variable_jit(_score_gradient)


def attention_share(
  tree: CallNode,
  args: Any,
  transcoders: Any,
  at: Sequence[Any],
  attention: str,
  entry: Sequence[int],
  *,
  embed: Any = None,
  freeze: Freeze | None = None,
  logits: Callable[[Any], Any] | None = None,
) -> AttentionShare:
  """Each node's share of the query-key score of one attention pattern entry.

  Args:
    tree: the converted model, as for `flg.attribute`.
    args: the prompt, as for `flg.attribute`.
    transcoders: the transcoders (a list, or a CLT), as for `flg.attribute`.
    at: the MLP calls, as for `flg.attribute`.
    attention: the attention call (its site name), one the replacement model freezes.
    entry: `(head, query, key)`: the pattern entry, its scores laid out `(batch...,
      heads, queries, keys)` as Flax's attention computes them.
    embed: as for `flg.attribute`.
    freeze: as for `flg.attribute`.
    logits: as for `flg.attribute`.

  Example:
    >>> import flaxlens.graphs as flg, numpy as np
    >>> tree, tokens, transcoders, mlps = flg.demo_model()
    >>> share = flg.attention_share(tree, tokens, transcoders, mlps, "block_1/attn", (0, 7, 3))
    >>> share.tokens.shape, share.errors.shape
    ((8,), (2, 8))
  """
  where = "flg.attention_share"
  check_tree(tree, where)
  calls = found_calls(tree, at, embed, freeze, where)
  if attention not in calls.attention:
    raise ArgumentError(
      f"{where}: attention={attention!r} is not one of the attention calls the replacement"
      f" model freezes ({list(calls.attention)}). Give one of them, or name it with"
      " freeze=flg.Freeze(attention=[...])."
    )
  layers = dictionary_layers(transcoders, len(calls.mlps), where)
  clean = clean_run(tree, args, calls, layers, logits, where)
  plan = Plan(calls=calls, shapes=(), logits_of=logits)  # shapes: found when compiling
  entry = tuple(int(i) for i in entry)
  if len(entry) != 3:
    raise ArgumentError(f"{where}: entry={entry!r} is (head, query, key). Give three indices.")
  value, (g_embed, g_mlp) = _score_gradient_compiled(
    tree, args, plan, layers.skips, clean["zeros"], attention, entry
  )
  features = np.zeros((1, len(clean["active"])), np.float32)
  Columns(clean, layers.decoders, 1024, 0).edges(g_mlp[None], features)
  errors, tokens = write_edges(g_embed[None], g_mlp[None], clean["embedded"], clean["errors"])
  L, P = len(calls.mlps), clean["embedded"].shape[0]
  return AttentionShare(
    score=float(value),
    active_features=clean["active"],
    features=np.asarray(features)[0],
    errors=np.asarray(errors)[0].reshape(L, P),
    tokens=np.asarray(tokens)[0],
  )
