"""Attribution graphs (`flg.attribute`): the direct effects between a prompt's active
transcoder features, error terms, tokens and output logits, through the replacement
model (`_model.py`), as circuit-tracer computes them (`../shared/GRAPHS.md`).

The frozen forward is linearised once per graph (`_linearized`, its residuals kept);
rows are transposes of that linear map, `jax.vmap`ped over a batch of targets in one
compiled program per (prompt shape, batch) (`_rows`) with a branch per depth (a batch of
features transposes only the layers up to the deepest it reads), which also turns them
into the edges into the tokens and errors (dot products with their write vectors); a
second program per (shape, batch, column chunk) (`edge_columns`) gives the edges into
features (their activation times their decoder rows), in groups of columns sharing a
(layer, position) (`Columns`). What depends only on the model and the prompt's shape
(the frozen calls' argument shapes, the affine check) is done while tracing, once per
program. Logit rows come first; with a feature cap the features get rows in the order
of their influence so far (recomputed every `update_interval` batches), as the
reference does. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.errors import ArgumentError
from flaxlens.tools.base._probed import capture
from flaxlens.tools.dictionaries._modules import CrossLayerTranscoder, Dictionary
from flaxlens.tools.graphs._model import (
  Freeze,
  Plan,
  check_affine,
  found_calls,
  frozen_reads,
  frozen_shapes,
)
from flaxlens.tools.graphs._targets import Targets, chosen_targets


@dataclasses.dataclass(frozen=True)
class Graph:
  """An attribution graph: nodes `[features | errors | tokens | logits]`, edges
  `A[target, source]` (the direct effect of the source on the target).

  Attributes:
    tokens: the prompt's token ids, `[positions]`.
    active_features: every active feature as `(layer, position, feature)`, `[n, 3]`,
      in lexicographic order (position 0 excluded, as the reference does).
    activations: their activations, `[n]`.
    selected: which active features are nodes (indices into `active_features`, sorted).
    targets: the logit targets (`Targets`: ids, probabilities, directions).
    rows: the nonzero rows of the adjacency: the selected features' then the logits',
      `[len(selected) + logits, nodes]` (error and token rows are zero).
    bias: for each row, the part of its target no node explains (biases, positional
      embeddings, decoder biases, position 0): `sum(row) + bias` is the target's value
      (a feature's pre-activation less its encoder bias; a logit's demeaned value).
    layers: the transcoders' layers.
    positions: the prompt's length.
  """

  tokens: np.ndarray
  active_features: np.ndarray
  activations: np.ndarray
  selected: np.ndarray
  targets: Targets
  rows: np.ndarray
  bias: np.ndarray
  layers: int
  positions: int

  @property
  def n_features(self) -> int:
    """The feature nodes."""
    return len(self.selected)

  @property
  def n_nodes(self) -> int:
    """Every node: features, errors (`layers * positions`), tokens, logits."""
    return self.n_features + (self.layers + 1) * self.positions + len(self.targets.ids)

  @property
  def adjacency(self) -> np.ndarray:
    """The dense adjacency `[nodes, nodes]`, indexed `[target, source]`."""
    dense = np.zeros((self.n_nodes, self.n_nodes), np.float32)
    n_logits = len(self.targets.ids)
    dense[: self.n_features] = self.rows[: self.n_features]
    dense[self.n_nodes - n_logits :] = self.rows[self.n_features :]
    return dense

  @property
  def row_nodes(self) -> np.ndarray:
    """The node each of `rows` is the row of."""
    n_logits = len(self.targets.ids)
    return np.concatenate(
      [np.arange(self.n_features), np.arange(self.n_nodes - n_logits, self.n_nodes)]
    )


@dataclasses.dataclass(frozen=True)
class DictionaryLayers:
  """The transcoders as the graph reads them, stacked by layer."""

  W_enc: Any  # [layers, d_in, width]
  decoders: tuple[Any, ...]  # per layer [width, layers it writes, d_out]
  skips: Any  # [layers, d_in, d_out] or None
  encode: Callable[[Any], Any]  # inputs [layers, positions, d_in] -> features
  decode: Callable[[Any, Any], Any]  # (features, inputs) -> reconstructions


def dictionary_layers(transcoders: Any, n: int, where: str) -> DictionaryLayers:
  if isinstance(transcoders, CrossLayerTranscoder):
    clt = transcoders
    if clt.config.layers != n:
      raise ArgumentError(
        f"{where}: the CLT spans {clt.config.layers} layers and at= names {n} MLP calls."
        " Give one MLP call per layer of the CLT."
      )

    def decode(features: Any, inputs: Any) -> Any:
      out = clt.decode(features)
      skipped = clt.skip_of(inputs)
      return out if skipped is None else out + skipped

    return DictionaryLayers(
      W_enc=clt.W_enc[...],
      decoders=tuple(clt.W_dec[layer][...] for layer in range(n)),
      skips=clt.W_skip[...] if clt.config.skip else None,
      encode=clt.encode,
      decode=decode,
    )
  if not isinstance(transcoders, Sequence) or not all(
    isinstance(t, Dictionary) and t.config.kind == "transcoder" for t in transcoders
  ):
    raise ArgumentError(
      f"{where}: transcoders= is a list of fld.Transcoder (one per MLP call of at=) or an"
      f" fld.CrossLayerTranscoder, got {type(transcoders).__name__}."
    )
  if len(transcoders) != n:
    raise ArgumentError(
      f"{where}: {len(transcoders)} transcoders for {n} MLP calls in at=. Give one"
      " transcoder per MLP call, in the same order."
    )
  skips = [t.config.skip for t in transcoders]
  if any(skips) and not all(skips):
    raise ArgumentError(
      f"{where}: some transcoders have a skip and some do not ({skips}). Give"
      " transcoders of one kind."
    )

  def decode(features: Any, inputs: Any) -> Any:
    out = [t.decode(f) for t, f in zip(transcoders, features, strict=True)]
    if all(skips):
      out = [o + t.skip_of(x) for o, t, x in zip(out, transcoders, inputs, strict=True)]
    return jnp.stack(out)

  return DictionaryLayers(
    W_enc=jnp.stack([t.W_enc[...] for t in transcoders]),
    decoders=tuple(t.W_dec[...][:, None] for t in transcoders),
    skips=jnp.stack([t.W_skip[...] for t in transcoders]) if all(skips) else None,
    encode=lambda xs: jnp.stack([t.encode(x) for t, x in zip(transcoders, xs, strict=True)]),
    decode=decode,
  )


def _linearized(tree, args, plan, skips, zeros):
  """The frozen forward's reads on the clean run, and its linearisation (a pytree of the
  forward's residuals) as a function of the writes, the MLP inputs one array per layer:
  computed once per graph and transposed by every batch of rows.

  What depends only on the model and the prompt's shape is done here, while tracing, so
  once per compiled program: the frozen calls' argument shapes (an abstract run) and the
  check that the frozen forward is affine in the writes."""
  plan = dataclasses.replace(plan, shapes=frozen_shapes(tree, args, plan.calls))
  check_affine(tree, args, plan, skips, zeros, "flg.attribute")
  return jax.linearize(
    lambda d: frozen_reads(tree, args, plan, skips, d, per_layer=True), _writes(zeros)
  )


_linearized_compiled = variable_jit(_linearized)


def _writes(zeros):
  """The writes `(embedding, (layer 0, layer 1, ...))`. One array per layer, not one
  stacked array: the transpose of slicing a stacked array pads and adds, which XLA fuses
  into one loop recomputing every layer's chain for every layer (measured: half the time
  of a batch at 12 layers)."""
  return zeros[0], tuple(zeros[1][layer] for layer in range(zeros[1].shape[0]))


@jax.jit
def _rows(reads, linear, W_enc, zeros, clean, depth, layer, position, feature, valid, directions):
  """A batch of rows `[batch, ...]`: the products `d/d MLP outputs` and the edges into
  the tokens and errors, of each target: a feature `(layer, position, feature)` (read by
  its encoder row; `valid` 0 for none) plus a direction on the last position's logits.

  `depth` is the deepest layer the batch's features read, or the number of layers for
  logit rows: the transpose reads the MLP inputs up to there (and the logits only at the
  last), so it skips the layers above (a feature's row needs only the layers below it;
  measured: 40% less time per graph at 12 layers). One branch per depth, one program."""
  inputs, logits = reads
  n_layers = len(inputs)
  writes = _writes(zeros)

  def at(deepest: int) -> Callable[[], Any]:
    if deepest == n_layers:  # logit rows: every layer and the logits
      transpose = jax.linear_transpose(linear, writes)
    else:
      transpose = jax.linear_transpose(lambda t: linear(t)[0][: deepest + 1], writes)

    def one(source, p, f, v, direction):
      read = W_enc[source, :, f] * v
      readout = tuple(
        jnp.zeros_like(x).at[p].set(jnp.where(source == i, read, 0).astype(x.dtype))
        for i, x in enumerate(inputs[: deepest + 1])
      )
      if deepest == n_layers:
        readout = (readout, direction.astype(logits.dtype))
      g_embed, g_mlp = transpose(readout)[0]
      return g_embed, jnp.stack(g_mlp)

    return lambda: jax.vmap(one)(layer, position, feature, valid, directions)

  g_embed, g_mlp = jax.lax.switch(depth, [at(i) for i in range(n_layers + 1)])
  return g_mlp, *write_edges(g_embed, g_mlp, *clean)


def write_edges(g_embed, g_mlp, embedded, errors):
  """Edges of a batch of rows into the error terms `[batch, layers * positions]` and the
  tokens `[batch, positions]`: the products dotted with what each writes."""
  error_edges = jnp.einsum("blpd,lpd->blp", g_mlp, errors).reshape(g_mlp.shape[0], -1)
  return error_edges, jnp.einsum("bpd,pd->bp", g_embed, embedded)


GROUP = 16  # feature columns sharing a (layer, position) that share one read of the products


@jax.jit
def decoder_rows(decoders, layer, feature):
  """The decoder rows of groups of feature columns, `[groups, GROUP, writes, d]`: what each
  writes at its own layer and, for a CLT, at each later one (zero past the last layer).
  `layer` is each group's `[groups]`, `feature` its columns' `[groups, GROUP]`."""
  writes = max(d.shape[1] for d in decoders)
  shape = (*feature.shape, writes, decoders[0].shape[-1])
  rows = jnp.zeros(shape, decoders[0].dtype)
  for source, decoder in enumerate(decoders):
    here = decoder[jnp.clip(feature, 0, decoder.shape[0] - 1)]  # [groups, GROUP, writes here, d]
    here = jnp.pad(here, [(0, 0), (0, 0), (0, writes - here.shape[2]), (0, 0)])
    rows = jnp.where((layer == source)[:, None, None, None], here, rows)
  return rows


@jax.jit
def edge_columns(g_mlp, rows, layer, position, activation):
  """Edges of a batch of rows into a chunk of feature columns, in groups that share a
  layer and a position (`Columns`), `[batch, groups * GROUP]`: each column's activation
  times its decoder rows read by the products at the layers it writes. The products are
  read once per group and write offset (`[groups, batch, d]`) and meet the group's decoder
  rows in one batched product: gathering them per column instead took 25 times longer."""
  batch, n_layers, positions, d = g_mlp.shape
  flat = jnp.moveaxis(g_mlp.reshape(batch, n_layers * positions, d), 1, 0)
  total = jnp.zeros((activation.shape[0], batch, activation.shape[1]), g_mlp.dtype)
  for offset in range(rows.shape[2]):
    slot = jnp.clip(layer + offset, 0, n_layers - 1) * positions + position
    read = jnp.take(flat, slot, axis=0)  # [groups, batch, d]
    total = total + jnp.einsum("gbd,gkd->gbk", read, rows[:, :, offset].astype(read.dtype))
  return (jnp.moveaxis(total, 1, 0) * activation).reshape(batch, -1)


class Columns:
  """The active features as edge columns: in groups of at most `GROUP` that share a layer
  and a position (the columns are in (layer, position, feature) order, so a group is a
  run of them), the groups in chunks of `chunk // GROUP` on the device, and the decoder
  rows of each chunk kept where they fit in `keep_rows` bytes."""

  def __init__(self, clean: dict, decoders: Sequence[Any], chunk: int, keep_rows: int):
    layer, position, feature, activation = clean["columns"]
    n = len(layer)
    new_slot = np.ones(n, bool)
    new_slot[1:] = (layer[1:] != layer[:-1]) | (position[1:] != position[:-1])
    bounds = [*np.flatnonzero(new_slot), n]
    first = np.array(
      [g for a, b in zip(bounds[:-1], bounds[1:], strict=True) for g in range(a, b, GROUP)],
      np.int64,
    )  # each group's first column: a run of one (layer, position), GROUP at a time
    count = np.minimum(GROUP, np.r_[first[1:], n] - first)
    per_chunk = max(1, chunk // GROUP)
    groups = -(-max(len(first), 1) // per_chunk) * per_chunk
    index = np.zeros((groups, GROUP), np.int64)  # the column of each entry
    valid = np.zeros((groups, GROUP), bool)
    k = np.arange(GROUP)
    valid[: len(first)] = k[None] < count[:, None]
    index[: len(first)] = np.where(valid[: len(first)], first[:, None] + k[None], 0)
    g_layer = np.zeros(groups, np.int32)
    g_position = np.zeros(groups, np.int32)
    g_layer[: len(first)], g_position[: len(first)] = layer[first], position[first]
    g_feature = np.where(valid, feature[index] if n else 0, 0).astype(np.int32)
    g_activation = np.where(valid, activation[index] if n else 0, 0).astype(np.float32)
    valid = valid.reshape(-1, per_chunk * GROUP)
    self.entries = [np.flatnonzero(v) for v in valid]  # each chunk's columns, in order
    self.ends = np.cumsum(valid.sum(axis=1))  # each chunk's last column, plus one
    self.chunks = [
      tuple(
        jnp.asarray(a[start : start + per_chunk])
        for a in (g_layer, g_position, g_feature, g_activation)
      )
      for start in range(0, groups, per_chunk)
    ]
    self.decoders = decoders
    writes = max(d.shape[1] for d in decoders)
    size = groups * GROUP * writes * decoders[0].shape[-1] * decoders[0].dtype.itemsize
    self.kept = None  # decoder rows computed per batch where keeping them would not fit
    if size <= keep_rows:
      self.kept = [decoder_rows(decoders, c[0], c[2]) for c in self.chunks]

  def edges(self, g_mlp: Any, out: np.ndarray) -> None:
    """Writes the edges of a batch of rows (products `g_mlp`) into every column to
    `out`, `[rows, n]` (the first rows of the batch)."""
    for i, (layer, position, feature, activation) in enumerate(self.chunks):
      if self.kept is not None:
        rows = self.kept[i]
      else:
        rows = decoder_rows(self.decoders, layer, feature)
      found = np.asarray(edge_columns(g_mlp, rows, layer, position, activation))
      entries = self.entries[i]
      out[:, self.ends[i] - len(entries) : self.ends[i]] = np.take(found[: len(out)], entries, 1)


def _influences(
  rows: np.ndarray, weights: np.ndarray, row_nodes: np.ndarray, max_iter: int = 128
) -> np.ndarray:
  """Each column's influence on the logits through the rows computed so far: power
  iteration on the row-normalised absolute rows, seeded with the logit weights."""
  normalised = np.abs(rows)
  normalised /= np.maximum(normalised.sum(axis=1, keepdims=True), 1e-8)
  influence = np.zeros(rows.shape[1], np.float32)
  current = np.zeros(rows.shape[1], np.float32)
  current[rows.shape[1] - len(weights) :] = weights
  for _ in range(max_iter):
    current = current[row_nodes] @ normalised
    if not current.any():
      return influence
    influence += current
  raise ArgumentError(
    "flg.attribute: the influence ranking did not converge (a cycle in the rows)."
  )


class _Run:
  """One graph's computation: the clean run's arrays, the linearised forward and the
  feature columns."""

  def __init__(self, tree, args, plan, layers, clean, batch, chunk, keep_rows):
    self.layers, self.clean, self.batch = layers, clean, batch
    self.columns = Columns(clean, layers.decoders, chunk, keep_rows)
    self.reads, self.linear = _linearized_compiled(tree, args, plan, layers.skips, clean["zeros"])

  def rows(self, out, layer, position, feature, valid, directions) -> None:
    """Writes the rows `[targets, features + errors + tokens]` of a batch of targets to
    `out` (the batch is padded)."""
    c = self.clean
    n = len(layer)
    pad = self.batch - n
    padded = [
      np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
      for a in (layer, position, feature, valid, directions)
    ]
    # Logit rows read every layer; feature rows those up to their deepest.
    depth = len(self.layers.decoders) if directions.any() else int(np.max(layer, initial=0))
    g_mlp, errors, tokens = _rows(
      self.reads, self.linear, self.layers.W_enc, c["zeros"], (c["embedded"], c["errors"]),
      np.int32(depth), *padded,
    )  # fmt: skip
    n_active = len(c["active"])
    self.columns.edges(g_mlp, out[:, :n_active])
    out[:, n_active : n_active + errors.shape[1]] = np.asarray(errors)[:n]
    out[:, n_active + errors.shape[1] :] = np.asarray(tokens)[:n]


def clean_run(tree, args, calls, layers, logits_of, where) -> dict[str, Any]:
  """The clean run's arrays: MLP inputs and outputs, features (position 0 zeroed),
  errors, the embedding's output, the token ids and the last position's logits."""
  output, cache = capture(tree, args, [*calls.mlps, calls.embed], inputs=True)
  embedded = cache[calls.embed]
  positions, d_model = embedded.shape[-2], embedded.shape[-1]
  if embedded.size != positions * d_model:
    raise ArgumentError(
      f"{where}: the embedding {calls.embed} gives {list(embedded.shape)}: a graph is of one"
      " prompt. Give the model a batch of one, [1, positions]."
    )
  xs = jnp.stack([cache[f"{n}:input"].reshape(positions, -1) for n in calls.mlps])
  outs = jnp.stack([cache[n].reshape(positions, -1) for n in calls.mlps])
  d_in, width = layers.W_enc.shape[1:]
  d_out = layers.decoders[0].shape[-1]
  if xs.shape[-1] != d_in or outs.shape[-1] != d_out:
    raise ArgumentError(
      f"{where}: the transcoders read inputs of width {d_in} and write outputs of width"
      f" {d_out}, but the MLP calls"
      f" {list(calls.mlps)} take {xs.shape[-1]} and give {outs.shape[-1]}. Give transcoders"
      " trained on these calls (fld.Transcoder(d_in, d_out, width))."
    )
  features = layers.encode(xs).at[:, 0].set(0)
  errors = (outs - layers.decode(features, xs)).at[:, 0].set(0)
  logits = output if logits_of is None else logits_of(output)
  active = np.argwhere(np.asarray(features) != 0)
  activations = np.asarray(features)[tuple(active.T)]
  return {
    "xs": xs,
    "embedded": embedded.reshape(positions, d_model),
    "errors": errors,
    "tokens": np.asarray(cache[f"{calls.embed}:input"]).reshape(-1),
    "last": np.asarray(logits).reshape(-1, np.shape(logits)[-1])[-1],
    "active": active,
    "activations": activations,
    "columns": (active[:, 0], active[:, 1], active[:, 2], activations.astype(np.float32)),
    "zeros": (jnp.zeros((positions, d_model), embedded.dtype), jnp.zeros(outs.shape, outs.dtype)),
  }


def _sizes(
  clean: dict, layers: DictionaryLayers, batch_size: int, budget: int | None, where: str
) -> tuple[int, int]:
  """Rows per compiled batch and feature columns per chunk: `batch_size` and 1024, or
  what `budget` (bytes) allows."""
  xs, (embed_zeros, mlp_zeros) = clean["xs"], clean["zeros"]
  per_row = 4 * 3 * (xs.size + embed_zeros.size + 2 * mlp_zeros.size)
  if budget is None:
    return batch_size, 1024
  if budget < 2 * per_row:
    raise ArgumentError(
      f"{where}: budget={budget} bytes is too small for one row of this prompt (about"
      f" {2 * per_row} bytes: the products at every layer and position). Raise the budget"
      " or shorten the prompt."
    )
  batch = max(1, min(batch_size, budget // (2 * per_row)))
  writes = max(d.shape[1] for d in layers.decoders) * mlp_zeros.shape[-1]
  return batch, int(max(16, min(4096, (budget // 2) // (4 * 2 * batch * writes))))


def _graph_rows(
  run: _Run, clean: dict, chosen: Targets, layers: DictionaryLayers, cap: int, batch: int,
  update_interval: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
  """The rows of the graph (logits, then up to `cap` features chosen by influence), each
  row's bias and the selected features."""
  L, P = len(layers.decoders), clean["embedded"].shape[0]
  active, n_active, n_logits = clean["active"], len(clean["active"]), len(chosen.ids)
  n_cols = n_active + (L + 1) * P + n_logits
  # Rows in the order they are computed (logits, then features by influence), except in
  # a graph of every feature, whose rows go straight to their final places (features in
  # order, then logits): no copy of the matrix afterwards.
  everything = cap == n_active
  first_logit = cap if everything else 0
  edges = np.zeros((cap + n_logits, n_cols), np.float32)
  values = np.zeros(cap + n_logits, np.float32)
  row_nodes = np.zeros(cap + n_logits, np.int64)
  none = np.zeros(1, np.int64)
  for start in range(0, n_logits, batch):
    k = min(batch, n_logits - start)
    at = slice(first_logit + start, first_logit + start + k)
    run.rows(
      edges[at, : n_cols - n_logits],
      none.repeat(k),
      none.repeat(k),
      none.repeat(k),
      np.zeros(k, np.float32),
      chosen.directions[start : start + k],
    )
    values[at] = chosen.directions[start : start + k] @ clean["last"]
    row_nodes[at] = n_cols - n_logits + np.arange(start, start + k)
  row, done, visited = (0 if everything else n_logits), 0, np.zeros(n_active, bool)
  xs = np.asarray(clean["xs"])
  W_enc = np.asarray(layers.W_enc)
  no_direction = np.zeros((batch, chosen.directions.shape[1]), np.float32)
  found = np.zeros((batch, n_cols - n_logits), np.float32)
  while done < cap:
    if everything:
      pending = np.arange(n_active)
    else:
      influence = _influences(edges[:row], chosen.probabilities, row_nodes[:row])
      rank = np.argsort(-influence[:n_active], kind="stable")
      pending = rank[~visited[rank]][: min(update_interval * batch, cap - done)]
    # Batches of features of nearby layers transpose fewer layers (`_rows`); the rows
    # keep their places in the order of influence.
    by_layer = np.argsort(active[pending, 0], kind="stable")
    for start in range(0, len(pending), batch):
      places = row + by_layer[start : start + batch]
      chosen_rows = pending[by_layer[start : start + batch]]
      k = len(chosen_rows)
      at_layer, p, f = active[chosen_rows].T
      contiguous = np.array_equal(places, np.arange(places[0], places[0] + k))
      out = edges[places[0] : places[0] + k, : n_cols - n_logits] if contiguous else found[:k]
      run.rows(out, at_layer, p, f, np.ones(k, np.float32), no_direction[:k])
      if not contiguous:
        edges[places, : n_cols - n_logits] = out
      values[places] = np.einsum("kd,kd->k", xs[at_layer, p], W_enc[at_layer, :, f])
      row_nodes[places] = chosen_rows
      visited[chosen_rows] = True
    row += len(pending)
    done += len(pending)
  bias = values - edges.sum(axis=1)
  selected = np.flatnonzero(visited)
  if not everything:
    edges = edges[:, np.concatenate([selected, np.arange(n_active, n_cols)])]
    order = np.argsort(row_nodes, kind="stable")
    edges, bias = edges[order], bias[order]
  return edges, bias, selected


def attribute(
  tree: CallNode,
  args: Any,
  transcoders: Any,
  at: Sequence[Any],
  *,
  targets: Any = None,
  max_n_logits: int = 10,
  desired_logit_prob: float = 0.95,
  max_feature_nodes: int | None = None,
  batch_size: int = 32,
  update_interval: int = 4,
  budget: int | None = None,
  embed: Any = None,
  freeze: Freeze | None = None,
  logits: Callable[[Any], Any] | None = None,
) -> Graph:
  """The attribution graph of one prompt through the replacement model.

  Transcoders stand in for the MLP calls `at` (with error terms, so the forward value
  is the model's own); attention patterns and normalisation scales are frozen to the
  clean run; features are constants. Every edge is a direct effect through the residual
  stream (see the "Attribution graphs" page for what is computed and how it matches
  circuit-tracer).

  Args:
    tree: a converted model (`fl.unflaxify`) whose output is the logits `[1, positions,
      vocabulary]` (or give `logits=`).
    args: the model's arguments for one prompt, as `fl.run` takes them.
    transcoders: a list of `fld.Transcoder` (one per call of `at`) or an
      `fld.CrossLayerTranscoder` over them.
    at: the MLP calls, one per layer, in order (site names or patterns).
    targets: None (the likeliest next tokens), token ids, or a list of `flg.Target`.
    max_n_logits: with `targets=None`, at most this many tokens...
    desired_logit_prob: ...the fewest whose probability reaches this.
    max_feature_nodes: at most this many feature nodes (None: every active feature),
      chosen by their influence on the logits as rows are computed.
    batch_size: rows per compiled batch.
    update_interval: with a feature cap, batches between re-rankings.
    budget: bytes one compiled batch may hold; sets the batch and the column chunks.
    embed: the token embedding call (None: found).
    freeze: the norms and attentions to freeze (None: found; see `flg.Freeze`).
    logits: a function of the model's output giving its logits, where the output is not
      the logits array (a Hugging Face output: `lambda out: out.logits`).

  Returns:
    The `Graph` (unpruned: see `flg.prune`).

  Example:
    >>> import flaxlens.graphs as flg
    >>> tree, tokens, transcoders, mlps = flg.demo_model()  # a Linen LM, 2 transcoders
    >>> graph = flg.attribute(tree, tokens, transcoders, mlps)
    >>> graph.layers, graph.positions, graph.rows.shape[1] == graph.n_nodes
    (2, 8, True)
  """
  where = "flg.attribute"
  check_tree(tree, where)
  calls = found_calls(tree, at, embed, freeze, where)
  layers = dictionary_layers(transcoders, len(calls.mlps), where)
  clean = clean_run(tree, args, calls, layers, logits, where)
  chosen = chosen_targets(clean["last"], targets, max_n_logits, desired_logit_prob, where)
  plan = Plan(calls=calls, shapes=(), logits_of=logits)  # shapes: found when compiling
  batch, chunk = _sizes(clean, layers, batch_size, budget, where)
  keep_rows = 2**30 if budget is None else budget // 2  # bytes of decoder rows kept
  run = _Run(tree, args, plan, layers, clean, batch, chunk, keep_rows)
  n_active = len(clean["active"])
  cap = n_active if max_feature_nodes is None else min(int(max_feature_nodes), n_active)
  edges, bias, selected = _graph_rows(run, clean, chosen, layers, cap, batch, update_interval)
  return Graph(
    tokens=clean["tokens"],
    active_features=clean["active"],
    activations=clean["activations"],
    selected=selected,
    targets=chosen,
    rows=edges,
    bias=bias,
    layers=len(calls.mlps),
    positions=clean["embedded"].shape[0],
  )
