"""Feature views: what a dictionary's chosen features respond to and what they write.

`feature_views` reads the harvested rows of the site a dictionary reads, in order, a batch
at a time (the next batch's read runs while this one is encoded), and keeps per feature
the top rows by activation (a running merge, so memory holds one batch and `top` rows per
feature, whatever the store's size), the count, least and largest of its nonzero values;
a second pass counts them into a histogram whose bins are those `numpy.histogram` draws
over all of them. Each top row's `(example, position)` (the harvest's index) places it in
the dataset's tokens, given as an array, to show the tokens around it. The decoder
direction of each feature goes through the model's unembedding (an array, or the call of a
tree that applies it) to give the tokens it promotes and suppresses. `FeatureViews` holds
it all as data (`to_dict`, JSON-ready) and writes the page (`to_html`, `_views_html`).
No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import check_type, refuse, shown
from flaxlens.core._node import CallNode, check_tree
from flaxlens.errors import ArgumentError
from flaxlens.tools.base._sites import select_sites
from flaxlens.tools.dictionaries._modules import Dictionary
from flaxlens.tools.harvest._store import Harvest, HarvestedSite

WHERE = "fld.feature_views"


@dataclasses.dataclass(frozen=True)
class Context:
  """One of a feature's top-activating rows, and the tokens around it.

  Attributes:
    row: the row's number in the harvested site.
    example: the example it came from (its place in the harvest's stream).
    position: its position in the example.
    activation: the feature's value on this row.
    ids: the token ids around it (`before` tokens, its own, `after` tokens, cut at the
      example's ends), or None without `tokens=`.
    texts: those tokens as text (`vocabulary=`), or None without a vocabulary.
    center: the index in `ids` of the row's own token, or None without `tokens=`.
  """

  row: int
  example: int
  position: int
  activation: float
  ids: tuple[int, ...] | None
  texts: tuple[str, ...] | None
  center: int | None

  def to_dict(self) -> dict[str, Any]:
    """The context as plain JSON-ready values."""
    return dataclasses.asdict(self) | {
      "ids": None if self.ids is None else list(self.ids),
      "texts": None if self.texts is None else list(self.texts),
    }


@dataclasses.dataclass(frozen=True)
class Histogram:
  """A feature's nonzero values over the rows read, binned.

  The bins are those `numpy.histogram(values, bins)` draws over the nonzero values (equal
  widths from the least to the largest; `[0, 1]` when there are none).

  Attributes:
    counts: rows per bin, `[bins]` int64.
    edges: the bins' edges, `[bins + 1]`.
    active: the rows where the feature is nonzero.
    rows: the rows read.
  """

  counts: np.ndarray
  edges: np.ndarray
  active: int
  rows: int

  @property
  def fraction_active(self) -> float:
    """The fraction of the rows read on which the feature is nonzero."""
    return self.active / self.rows if self.rows else 0.0

  def to_dict(self) -> dict[str, Any]:
    """The histogram as plain JSON-ready values."""
    return {
      "counts": [int(c) for c in self.counts],
      "edges": [float(e) for e in self.edges],
      "active": self.active,
      "rows": self.rows,
      "fraction_active": self.fraction_active,
    }


@dataclasses.dataclass(frozen=True)
class TokenScore:
  """A token and the logit a feature's decoder direction gives it through the unembedding.

  Attributes:
    id: the token id.
    text: its text (`vocabulary=`), or None without a vocabulary.
    logit: `W_dec[feature] @ W_U` at this token.
  """

  id: int
  text: str | None
  logit: float

  def to_dict(self) -> dict[str, Any]:
    """The score as plain JSON-ready values."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class FeatureView:
  """What one feature responds to and what it writes.

  Attributes:
    feature: the feature's number (for a cross-layer transcoder, within its layer).
    contexts: its top-activating rows, largest first (ties: the earlier row first); only
      rows where it is nonzero, so fewer than `top` for a rarely active feature.
    histogram: its nonzero values, binned, and how often it is active.
    promoted: the tokens its decoder direction raises most through the unembedding,
      largest logit first; empty without `unembedding=`.
    suppressed: the tokens it lowers most, smallest logit first; empty without
      `unembedding=`.
  """

  feature: int
  contexts: tuple[Context, ...]
  histogram: Histogram
  promoted: tuple[TokenScore, ...]
  suppressed: tuple[TokenScore, ...]

  def to_dict(self) -> dict[str, Any]:
    """The view as plain JSON-ready values."""
    return {
      "feature": self.feature,
      "contexts": [context.to_dict() for context in self.contexts],
      "histogram": self.histogram.to_dict(),
      "promoted": [score.to_dict() for score in self.promoted],
      "suppressed": [score.to_dict() for score in self.suppressed],
    }


@dataclasses.dataclass(frozen=True)
class FeatureViews:
  """The views of chosen features of a dictionary, from one harvested site.

  `views[feature]` is the `FeatureView` of a feature by its number; iterating gives
  them in the order they were asked for.

  Attributes:
    site: the harvested site the dictionary read.
    store: the harvest store's path.
    dictionary: the dictionary's config (`DictionaryConfig.to_dict()`).
    layer: the layer of a cross-layer transcoder's features, else None.
    views: one `FeatureView` per feature.
  """

  site: str
  store: str
  dictionary: dict[str, Any]
  layer: int | None
  views: tuple[FeatureView, ...]

  def __getitem__(self, feature: int) -> FeatureView:
    for view in self.views:
      if view.feature == feature:
        return view
    raise KeyError(
      f"Feature {feature!r} has no view here; these views hold {self.features}. Ask"
      " fld.feature_views for it."
    )

  def __iter__(self) -> Iterator[FeatureView]:
    return iter(self.views)

  def __len__(self) -> int:
    return len(self.views)

  @property
  def features(self) -> list[int]:
    """The features viewed, in the order they were asked for."""
    return [view.feature for view in self.views]

  def to_dict(self) -> dict[str, Any]:
    """The views as plain JSON-ready values (`json.dumps` takes them as they are)."""
    return {
      "site": self.site,
      "store": self.store,
      "dictionary": dict(self.dictionary),
      "layer": self.layer,
      "views": [view.to_dict() for view in self.views],
    }

  def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
    """The views as one self-contained web page (no server, no network: open the file).

    Args:
      path: if given, the file the page is written to (UTF-8).

    Returns:
      The page's HTML source.
    """
    from flaxlens.tools.dictionaries._views_html import write_page

    return write_page(self, path)


@dataclasses.dataclass(frozen=True)
class _Scan:
  """What the first pass over the rows kept, per feature (columns in asked order)."""

  top_values: list[np.ndarray]
  top_rows: list[np.ndarray]
  active: np.ndarray
  least: np.ndarray
  largest: np.ndarray
  dtype: np.dtype
  rows: int


def feature_views(
  dictionary: Dictionary,
  harvest: Harvest,
  site: str,
  features: Sequence[int],
  *,
  layer: int | None = None,
  tokens: Any = None,
  vocabulary: Sequence[str] | Callable[[int], str] | None = None,
  unembedding: Any = None,
  tree: CallNode | None = None,
  top: int = 20,
  before: int = 8,
  after: int = 3,
  bins: int = 32,
  top_tokens: int = 10,
  batch_size: int = 4096,
) -> FeatureViews:
  """Views of chosen features: top contexts, activation histogram, promoted tokens.

  The rows of `site` in `harvest` (what the dictionary reads) are encoded a batch at a
  time, in order; memory holds one batch and the `top` best rows per feature, whatever
  the store's size. The rows are read twice: once for the top rows and the range of each
  feature's values, once to count them into the histogram's bins.

  Args:
    dictionary: the dictionary (`fld.SAE`, `fld.Transcoder`, `fld.CrossLayerTranscoder`
      or your own `fld.Dictionary`), encoding as it is set (a BatchTopK dictionary in
      `.eval()` mode, the default, uses its running threshold).
    harvest: the `fl.Harvest` (`fl.open_harvest(path)`) holding the rows it reads.
    site: the harvested site it reads (a transcoder's: the input site), rows `[d_in]`.
    features: the features' numbers (a list, or one int).
    layer: for a cross-layer transcoder, the layer whose features to view (`site` holds
      that layer's input); None for other dictionaries.
    tokens: the dataset's token ids, `[examples, positions]`, in the order of the
      harvest's stream (the harvest's index gives each row's example and position), to
      show the tokens around each top row; None shows rows by their example and position.
    vocabulary: token texts: a sequence indexed by id, or a function of an id (say
      `lambda i: tokenizer.decode([i])`); None shows ids.
    unembedding: `W_U`, to score tokens by the decoder direction, `W_dec[feature] @ W_U`:
      an array `[d_out, vocabulary]`, or the path of the call of `tree` that applies it
      (`"lm_head"`, `"Embed_0.attend"`; a Linen `nn.Dense`, `Embed.attend`, an NNX
      `nnx.Linear` ...), whose linear part is read by calling it (its bias taken away);
      None leaves `promoted`/`suppressed` empty. For a cross-layer transcoder the
      direction is the sum of what the feature writes into every layer it reaches.
    tree: the converted tree `unembedding` names a call of.
    top: top rows kept per feature.
    before: tokens shown before a top row's token.
    after: tokens shown after it.
    bins: histogram bins.
    top_tokens: tokens listed as promoted, and as suppressed.
    batch_size: rows encoded at once.

  Returns:
    The `fld.FeatureViews`: `views[feature]` per feature, `to_dict()`, `to_html(path)`.

  Raises:
    ArgumentError: a feature out of range, a site the harvest lacks or whose rows do not
      have the dictionary's `d_in`, tokens that do not cover the harvest's examples and
      positions, an unembedding whose width is not the dictionary's `d_out` (or a call
      that is not linear), or an option of the wrong type.

  Example:
    >>> import tempfile, flaxlens as fl, flaxlens.dictionaries as fld, flax.linen as nn
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> model, ids = nn.Sequential([nn.Embed(12, 4), nn.Dense(12)]), jnp.arange(12).reshape(2, 6)
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), ids), ids)
    >>> store = fl.harvest(tree, [ids], "layers_0", tempfile.mkdtemp() + "/store")
    >>> sae = fld.SAE(4, 8, rngs=nnx.Rngs(0))
    >>> views = fld.feature_views(sae, store, "layers_0", [0, 3], tokens=ids,
    ...   unembedding="layers_1", tree=tree, top=3, top_tokens=2)
    >>> view = views[3]
    >>> len(view.contexts) <= 3, len(view.promoted), view.histogram.rows
    (True, 2, 12)
  """
  rows = _checked_rows(dictionary, harvest, site, layer)
  config = dictionary.config
  chosen = _checked_features(features, config.width)
  for name, value in (("top", top), ("bins", bins), ("top_tokens", top_tokens)):
    _check_count(name, value, 1)
  _check_count("batch_size", batch_size, 1)
  _check_count("before", before, 0)
  _check_count("after", after, 0)
  token_ids = _checked_tokens(tokens)
  _check_vocabulary(vocabulary)
  logits = (
    None if unembedding is None else _unembedded(dictionary, chosen, layer, unembedding, tree)
  )
  encode = _encoder(dictionary, chosen, layer)
  scan = _scan(rows, encode, len(chosen), top, batch_size)
  counts, edges = _histograms(rows, encode, scan, bins, batch_size)
  places = _places(rows, scan)
  views = []
  for column, feature in enumerate(chosen):
    contexts = tuple(
      _context(int(row), float(value), places[int(row)], token_ids, vocabulary, before, after)
      for value, row in zip(scan.top_values[column], scan.top_rows[column], strict=True)
    )
    histogram = Histogram(counts[column], edges[column], int(scan.active[column]), scan.rows)
    promoted, suppressed = (
      ((), ()) if logits is None else _scores(logits[column], top_tokens, vocabulary)
    )
    views.append(FeatureView(feature, contexts, histogram, promoted, suppressed))
  return FeatureViews(site, harvest.path, config.to_dict(), layer, tuple(views))


# --- checks ----------------------------------------------------------------------------------


def _checked_rows(dictionary: Any, harvest: Any, site: Any, layer: Any) -> HarvestedSite:
  """The harvested rows of `site`, once the dictionary, the harvest, the site and `layer`
  are checked against each other."""
  check_type(
    dictionary, Dictionary, WHERE, "dictionary", "a dictionary (fld.SAE, fld.Transcoder,"
    " fld.CrossLayerTranscoder or an fld.Dictionary)", "Build one, or load it (fld.load).",
  )  # fmt: skip
  check_type(
    harvest, Harvest, WHERE, "harvest", "an fl.Harvest",
    "Open the store the rows were harvested to: fl.open_harvest(path).",
  )  # fmt: skip
  if not isinstance(site, str) or site not in harvest.sites:
    raise ArgumentError(
      f"{WHERE}: site={shown(site)} is no site of the harvest at {harvest.path}; its sites"
      f" are {harvest.sites}. Give the site the dictionary reads."
    )
  config = dictionary.config
  if config.kind == "clt":
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < config.layers:
      raise ArgumentError(
        f"{WHERE}: layer={shown(layer)}; a cross-layer transcoder's features belong to one"
        f" of its {config.layers} layers. Give layer= (0 to {config.layers - 1}), the layer"
        f" whose input {site!r} holds."
      )
  elif layer is not None:
    raise ArgumentError(
      f"{WHERE}: layer={shown(layer)} is for a cross-layer transcoder; this dictionary is"
      f" a {config.kind!r}. Drop layer=."
    )
  rows = harvest[site]
  if rows.shape[1:] != (config.d_in,):
    raise ArgumentError(
      f"{WHERE}: the rows of {site!r} in the harvest at {harvest.path} are"
      f" {list(rows.shape[1:])} each, and the dictionary reads rows of d_in={config.d_in}."
      " Give the site the dictionary was trained on (harvested with one row per position,"
      " the default positions='all'), or the dictionary of this site."
    )
  return rows


def _checked_features(features: Any, width: int) -> tuple[int, ...]:
  fix = f"Give feature numbers from 0 to {width - 1} (the dictionary's width is {width})."
  if isinstance(features, int | np.integer) and not isinstance(features, bool):
    features = [features]
  if isinstance(features, np.ndarray):
    features = features.tolist()
  if not isinstance(features, list | tuple) or not features:
    raise refuse(WHERE, "features", features, "a non-empty list of feature numbers", fix)
  for feature in features:
    if isinstance(feature, bool) or not isinstance(feature, int | np.integer):
      raise refuse(WHERE, "features", features, "a list of ints", fix)
    if not 0 <= feature < width:
      raise ArgumentError(f"{WHERE}: feature {feature} is out of range. {fix}")
  if len(set(features)) != len(features):
    raise ArgumentError(
      f"{WHERE}: features={list(features)} names a feature twice. Give each feature once."
    )
  return tuple(int(feature) for feature in features)


def _check_count(name: str, value: Any, least: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < least:
    raise refuse(WHERE, name, value, f"an int of at least {least}", f"Give {name}= as such an int.")


def _checked_tokens(tokens: Any) -> np.ndarray | None:
  if tokens is None:
    return None
  ids = np.asarray(tokens) if isinstance(tokens, np.ndarray | jax.Array | list) else None
  if ids is None or ids.ndim != 2 or ids.dtype.kind not in "iu":
    raise refuse(
      WHERE, "tokens", tokens, "an int array [examples, positions]",
      "Give the dataset's token ids, one row per example, in the order they were harvested.",
    )  # fmt: skip
  return ids


def _check_vocabulary(vocabulary: Any) -> None:
  if vocabulary is None or callable(vocabulary):
    return
  if not isinstance(vocabulary, list | tuple) or not all(isinstance(t, str) for t in vocabulary):
    raise refuse(
      WHERE, "vocabulary", vocabulary, "a list of token texts (indexed by id) or a function"
      " of an id", "Give tokenizer texts, or lambda i: tokenizer.decode([i]).",
    )  # fmt: skip


# --- encoding and the passes over the rows ---------------------------------------------------


def _encoder(
  dictionary: Dictionary, chosen: tuple[int, ...], layer: int | None
) -> Callable[[np.ndarray], np.ndarray]:
  """A compiled function from a batch of rows `[B, d_in]` to the chosen features `[B, F]`.
  A cross-layer transcoder's rows are placed at `layer` among zero inputs of its other
  layers (its features of one layer read only that layer's input)."""
  graph, state = nnx.split(dictionary)
  columns = jnp.asarray(chosen)
  layers = dictionary.config.layers

  @jax.jit
  def encode(state: Any, x: jax.Array) -> jax.Array:
    model = nnx.merge(graph, state)
    if layer is None:
      return model.encode(x)[:, columns]
    stacked = jnp.zeros((layers, *x.shape), x.dtype).at[layer].set(x)
    return model.encode(stacked)[layer][:, columns]

  return lambda rows: np.asarray(encode(state, rows))


def _batches(rows: HarvestedSite, batch_size: int) -> Iterator[tuple[int, np.ndarray]]:
  """`(first row, values)` of each batch of `rows` in order, the last one padded with
  zeros to `batch_size` rows (one compiled shape); the next batch is read while the
  caller works on this one."""
  length = len(rows)
  starts = range(0, length, batch_size)
  pending = rows.values.read(0, min(batch_size, length)) if length else None
  for start in starts:
    values = pending.result()
    following = start + batch_size
    if following < length:
      pending = rows.values.read(following, min(following + batch_size, length))
    if len(values) < batch_size:
      padding = np.zeros((batch_size - len(values), *values.shape[1:]), values.dtype)
      values = np.concatenate([values, padding])
    yield start, values


def _scan(
  rows: HarvestedSite,
  encode: Callable[[np.ndarray], np.ndarray],
  count: int,
  top: int,
  batch_size: int,
) -> _Scan:
  """The first pass: per feature (`count` of them), the `top` largest nonzero values and
  their rows (a running merge; ties keep the earlier row), how many rows are nonzero, and
  the least and largest nonzero value (in float64, exact for any float dtype)."""
  length = len(rows)
  dtype = np.dtype(np.float32)
  top_values = [np.zeros(0, dtype) for _ in range(count)]
  top_rows = [np.zeros(0, np.int64) for _ in range(count)]
  active = np.zeros(count, np.int64)
  least, largest = np.full(count, np.inf), np.full(count, -np.inf)
  for start, values in _batches(rows, batch_size):
    found = encode(values)[: min(batch_size, length - start)]
    dtype = found.dtype
    for column in range(count):
      value = found[:, column]
      nonzero = np.flatnonzero(value)
      if not len(nonzero):
        continue
      kept = value[nonzero]
      active[column] += len(nonzero)
      least[column] = min(least[column], kept.min())
      largest[column] = max(largest[column], kept.max())
      if len(kept) > top:  # Only rows at least the top-th value can enter.
        enough = kept >= np.partition(kept, -top)[-top]
        nonzero, kept = nonzero[enough], kept[enough]
      merged_values = np.concatenate([top_values[column], kept])
      merged_rows = np.concatenate([top_rows[column], start + nonzero])
      order = np.lexsort((merged_rows, -merged_values))[:top]
      top_values[column], top_rows[column] = merged_values[order], merged_rows[order]
  return _Scan(top_values, top_rows, active, least, largest, dtype, length)


def _histograms(
  rows: HarvestedSite,
  encode: Callable[[np.ndarray], np.ndarray],
  scan: _Scan,
  bins: int,
  batch_size: int,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """The second pass: each feature's nonzero values counted into the bins
  `numpy.histogram(values, bins)` draws (from the least to the largest of them)."""
  count = len(scan.active)
  edges = [
    np.histogram_bin_edges(
      np.array([scan.least[c], scan.largest[c]] if scan.active[c] else [], scan.dtype), bins
    )
    for c in range(count)
  ]
  counts = [np.zeros(bins, np.int64) for _ in range(count)]
  if not scan.active.any():
    return counts, edges
  length = len(rows)
  for start, values in _batches(rows, batch_size):
    found = encode(values)[: min(batch_size, length - start)]
    for column in range(count):
      value = found[:, column]
      counts[column] += np.histogram(value[value != 0], edges[column])[0]
  return counts, edges


def _places(rows: HarvestedSite, scan: _Scan) -> dict[int, tuple[int, int]]:
  """`{row: (example, position)}` of every top row, read from the harvest's index."""
  kept = np.unique(np.concatenate([np.zeros(0, np.int64), *scan.top_rows]))
  if not len(kept):
    return {}
  index = rows.index[kept]
  return {int(row): (int(place[0]), int(place[1])) for row, place in zip(kept, index, strict=True)}


def _text(vocabulary: Sequence[str] | Callable[[int], str], token: int) -> str:
  if callable(vocabulary):
    return str(vocabulary(token))
  if not 0 <= token < len(vocabulary):
    raise ArgumentError(
      f"{WHERE}: token id {token} is outside the vocabulary given ({len(vocabulary)}"
      " texts). Give the model's whole vocabulary."
    )
  return vocabulary[token]


def _context(
  row: int,
  activation: float,
  place: tuple[int, int],
  tokens: np.ndarray | None,
  vocabulary: Any,
  before: int,
  after: int,
) -> Context:
  example, position = place
  if tokens is None:
    return Context(row, example, position, activation, None, None, None)
  if not (0 <= example < tokens.shape[0] and 0 <= position < tokens.shape[1]):
    raise ArgumentError(
      f"{WHERE}: row {row} of the harvest comes from example {example}, position"
      f" {position}, and tokens= holds {tokens.shape[0]} examples of {tokens.shape[1]}"
      " positions. Give the token ids of every example harvested, in the harvest's order."
    )
  first = max(0, position - before)
  ids = tuple(int(token) for token in tokens[example, first : position + after + 1])
  texts = None if vocabulary is None else tuple(_text(vocabulary, token) for token in ids)
  return Context(row, example, position, activation, ids, texts, position - first)


# --- through the unembedding -----------------------------------------------------------------


def _directions(dictionary: Dictionary, chosen: tuple[int, ...], layer: int | None) -> jax.Array:
  """The chosen features' decoder directions `[F, d_out]`; for a cross-layer transcoder,
  the sum of what each writes into every layer it reaches."""
  columns = jnp.asarray(chosen)
  if layer is None:
    return dictionary.W_dec[...][columns]
  return dictionary.W_dec[layer][...][columns].sum(axis=1)


def _unembedded(
  dictionary: Dictionary,
  chosen: tuple[int, ...],
  layer: int | None,
  unembedding: Any,
  tree: CallNode | None,
) -> np.ndarray:
  """`W_dec[chosen] @ W_U`, `[F, vocabulary]`: with an array `W_U`, the product; with the
  path of a call of `tree`, the call on the directions less the call on zeros (its bias),
  refused unless that is linear (twice the directions give twice the logits)."""
  d_out = dictionary.config.d_out
  directions = _directions(dictionary, chosen, layer)
  if not isinstance(unembedding, str):
    matrix = jnp.asarray(unembedding) if isinstance(unembedding, np.ndarray | jax.Array) else None
    if matrix is None or matrix.ndim != 2 or matrix.shape[0] != d_out:
      raise refuse(
        WHERE, "unembedding", unembedding, f"an array [d_out={d_out}, vocabulary] or the path"
        " of a call of tree=", "Give W_U as the decoder writes into it, or the unembedding's"
        " call, unembedding='lm_head', tree=tree.",
      )  # fmt: skip
    return np.asarray(directions @ matrix)
  check_tree(tree, WHERE, "tree")
  found = select_sites(tree, unembedding)
  if len(found) != 1:
    raise ArgumentError(
      f"{WHERE}: unembedding={unembedding!r} names {len(found)} calls of {tree.where()}"
      f" ({[s.name for s in found][:6]}). Name the one call that applies the unembedding."
    )
  call, name = found[0].node, found[0].name
  try:  # The call's own refusal of a [F, d_out] input is the user's to fix.
    bias, logits, doubled = (
      call(ArgsAndKwargs.capture(value))
      for value in (jnp.zeros_like(directions), directions, 2 * directions)
    )
  except Exception as error:
    raise ArgumentError(
      f"{WHERE}: calling {name!r} on the decoder directions [{len(chosen)}, {d_out}] raised"
      f" {type(error).__name__}: {error}. Name the call that reads the residual stream the"
      f" dictionary writes (width {d_out}), or give W_U as an array."
    ) from error
  if not isinstance(logits, jax.Array) or logits.shape[:1] != (len(chosen),) or logits.ndim != 2:
    raise ArgumentError(
      f"{WHERE}: the call {name!r} maps directions [{len(chosen)}, {d_out}] to"
      f" {shown(logits)}, not to logits [{len(chosen)}, vocabulary]. Name the call that"
      " applies the unembedding to the residual stream, or give W_U as an array."
    )
  logits, doubled = logits - bias, doubled - bias
  scale = float(jnp.abs(logits).max()) or 1.0
  if not np.allclose(np.asarray(doubled), 2 * np.asarray(logits), rtol=1e-3, atol=1e-4 * scale):
    raise ArgumentError(
      f"{WHERE}: the call {name!r} is not linear in its input (twice the"
      " directions do not give twice the logits), so it is no unembedding (a final norm?)."
      " Name the call that multiplies by W_U, or give W_U as an array."
    )
  return np.asarray(logits)


def _scores(
  logits: np.ndarray, top_tokens: int, vocabulary: Any
) -> tuple[tuple[TokenScore, ...], tuple[TokenScore, ...]]:
  """The `top_tokens` largest logits (largest first) and smallest (smallest first); ties
  keep the lower id first."""

  def scored(order: np.ndarray) -> tuple[TokenScore, ...]:
    return tuple(
      TokenScore(
        int(token),
        None if vocabulary is None else _text(vocabulary, int(token)),
        float(logits[token]),
      )
      for token in order[:top_tokens]
    )

  return scored(np.argsort(-logits, kind="stable")), scored(np.argsort(logits, kind="stable"))
