"""`fld.evaluate`: how well a dictionary reconstructs its data, and what splicing it into
the model costs.

Over batches of a dictionary's data (`DictionaryData`: `fld.stream`, a harvest, arrays)
one compiled program per batch shape gives the batch's sums (active features, squared
errors, the targets' sums and squares, each feature's activations); the host adds them
up in float64, so nothing holds more than one batch and the variance is the data's own
(the mean is the data's, not a batch's). Given a tree, the dictionary is spliced into it
(`fl.splice`, reconstruction only) and each model input runs clean, spliced and with the
site zero-ablated: the next-token loss (or a given metric) and KL of each. No Flax
internals here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxlens.core._node import CallNode, check_tree
from flaxlens.errors import ArgumentError
from flaxlens.tools.analysis._interventions import ablate
from flaxlens.tools.analysis._splice import splice
from flaxlens.tools.base._probed import run
from flaxlens.tools.dictionaries._modules import Dictionary


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """What `fld.evaluate` measured.

  Attributes:
    rows: the rows evaluated.
    l0: the mean number of active (non-zero) features per row (for a CLT, summed over its
      layers).
    fvu: the fraction of variance unexplained, `sum |target - reconstruction|^2 / sum
      |target - mean(target)|^2` (the mean over all rows, per output dimension).
    mse: the mean squared error per row and output dimension.
    frequencies: each feature's fraction of rows it is active on, `[width]` (`[layers,
      width]` for a CLT).
    dead: the fraction of features never active over the rows.
    dense: the fraction of features active on more than `dense_above` of the rows.
    dense_above: the frequency above which a feature counts as dense.
    loss_clean, loss_spliced, loss_ablated: with a tree, the mean next-token loss (or
      `metric`) of the clean model, with the dictionary's reconstruction in place of the
      site, and with the site zero-ablated; else None.
    kl_spliced, kl_ablated: the mean next-token KL(clean || spliced), KL(clean || ablated)
      (None with a `metric` or without a tree).
    loss_recovered: `(loss_ablated - loss_spliced) / (loss_ablated - loss_clean)`: 1 for a
      perfect dictionary, 0 for one no better than ablating the site.
  """

  rows: int
  l0: float
  fvu: float
  mse: float
  frequencies: np.ndarray
  dead: float
  dense: float
  dense_above: float
  loss_clean: float | None = None
  loss_spliced: float | None = None
  loss_ablated: float | None = None
  kl_spliced: float | None = None
  kl_ablated: float | None = None
  loss_recovered: float | None = None

  def __repr__(self) -> str:
    shown = [
      f"rows={self.rows}",
      f"l0={self.l0:.4g}",
      f"fvu={self.fvu:.4g}",
      f"mse={self.mse:.4g}",
      f"dead={self.dead:.3g}",
      f"dense={self.dense:.3g} (>{self.dense_above:g})",
    ]
    spliced = {
      "loss_clean": self.loss_clean,
      "loss_spliced": self.loss_spliced,
      "loss_ablated": self.loss_ablated,
      "kl_spliced": self.kl_spliced,
      "kl_ablated": self.kl_ablated,
      "loss_recovered": self.loss_recovered,
    }
    shown += [f"{name}={value:.4g}" for name, value in spliced.items() if value is not None]
    return f"Evaluation({', '.join(shown)})"


@nnx.jit
def _batch_sums(dictionary: Dictionary, inputs: jax.Array, targets: jax.Array) -> dict[str, Any]:
  """One batch's sums; a CLT's rows `[B, layers, d]` go in layer-first."""
  if dictionary.config.kind == "clt":
    inputs, targets = jnp.swapaxes(inputs, 0, 1), jnp.swapaxes(targets, 0, 1)
  features = dictionary.encode(inputs)
  reconstruction = dictionary.decode(features)
  skipped = dictionary.skip_of(inputs)
  if skipped is not None:
    reconstruction = reconstruction + skipped
  targets = targets.astype(jnp.float32)
  rows_axis = 1 if dictionary.config.kind == "clt" else 0
  active = features != 0
  return {
    "active": active.sum(dtype=jnp.int32),
    "squared_error": jnp.sum((targets - reconstruction.astype(jnp.float32)) ** 2),
    "target_sum": targets.sum(axis=rows_axis),
    "target_squares": jnp.sum(targets**2, axis=rows_axis),
    "feature_counts": active.sum(axis=rows_axis, dtype=jnp.int32),
  }


def _check_data(dictionary: Dictionary, data: Any) -> None:
  config = dictionary.config
  layers = config.layers if config.kind == "clt" else 1
  if (data.d_in, data.d_out, data.layers) != (config.d_in, config.d_out, layers):
    raise ArgumentError(
      f"fld.evaluate: the dictionary reads {config.d_in} and writes {config.d_out} over"
      f" {layers} layer(s), and the data (reads {list(data.reads)}, writes"
      f" {list(data.writes)}) gives rows of {data.d_in} -> {data.d_out} over {data.layers}."
      " Evaluate on data of the sites the dictionary was trained for."
    )


def _row_metrics(
  dictionary: Dictionary, data: Any, batch_size: int, batches: int | None, seed: int, dense: float
) -> dict[str, Any]:
  """The rows' metrics over `batches` batches of `data` (all of one pass: None)."""
  _check_data(dictionary, data)
  totals: dict[str, Any] = {}
  rows = 0
  for found in itertools.islice(data.batches(batch_size, seed=seed), batches):
    inputs, targets = jnp.asarray(found.inputs), jnp.asarray(found.targets)
    sums = _batch_sums(dictionary, inputs, targets)
    rows += int(inputs.shape[0])
    for key, value in sums.items():
      totals[key] = totals.get(key, 0) + np.asarray(value, np.float64)
  if rows == 0:
    raise ArgumentError(
      "fld.evaluate: the data gave no rows. Give data with rows (and batches= of at least 1)."
    )
  outputs = data.layers * data.d_out
  variance = np.sum(totals["target_squares"] - totals["target_sum"] ** 2 / rows)
  frequencies = totals["feature_counts"] / rows
  return {
    "rows": rows,
    "l0": float(totals["active"] / rows),
    "fvu": float(totals["squared_error"] / variance),
    "mse": float(totals["squared_error"] / (rows * outputs)),
    "frequencies": frequencies,
    "dead": float(np.mean(frequencies == 0)),
    "dense": float(np.mean(frequencies > dense)),
    "dense_above": dense,
  }


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The summed cross-entropy of `logits[:, :-1]` predicting `tokens[:, 1:]`, and the
  number of predictions."""
  logprobs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]
  return -picked.sum(), jnp.asarray(picked.size)


def _kl_sum(clean: jax.Array, other: jax.Array) -> jax.Array:
  """The summed KL(clean || other) of next-token distributions over positions."""
  clean_log = jax.nn.log_softmax(clean[:, :-1].astype(jnp.float32), axis=-1)
  other_log = jax.nn.log_softmax(other[:, :-1].astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.exp(clean_log) * (clean_log - other_log))


def _model_metrics(
  dictionary: Dictionary,
  tree: CallNode,
  model_inputs: Iterable[Any],
  at: Any,
  metric: Callable[[Any, Any], Any] | None,
) -> dict[str, Any]:
  """The clean, spliced and ablated losses (or metric) over `model_inputs`. Long because
  it holds the loop's two ways (next-token loss and KL, or a metric) side by side."""
  kind = dictionary.config.kind
  if kind == "clt":
    raise ArgumentError(
      "fld.evaluate: a CLT's spliced metrics need the CLT splice (fld.splice at a list of"
      " MLP calls), which fld.evaluate does not run yet. Evaluate its rows (leave tree= out)."
    )
  reads = "output" if kind == "sae" else "input"
  spliced = splice(tree, at, dictionary, error=False, reads=reads)
  ablation = [ablate(at)]
  sums = {"clean": 0.0, "spliced": 0.0, "ablated": 0.0, "kl_spliced": 0.0, "kl_ablated": 0.0}
  count = 0
  for model_input in model_inputs:
    clean = run(tree, model_input)
    replaced = run(spliced, model_input)
    ablated = run(tree, model_input, interventions=ablation)
    if metric is not None:
      for name, out in (("clean", clean), ("spliced", replaced), ("ablated", ablated)):
        sums[name] += float(metric(clean, out))
      count += 1
      continue
    tokens = jnp.asarray(model_input)
    if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 2:
      raise ArgumentError(
        f"fld.evaluate: model_inputs gave a {tokens.dtype}{list(tokens.shape)} input, where"
        " the next-token loss takes token ids (batch, positions) and the model's logits."
        " Give metric=lambda clean_out, out: ... for other models."
      )
    for name, out in (("clean", clean), ("spliced", replaced), ("ablated", ablated)):
      total, predictions = next_token_loss(out, tokens)
      sums[name] += float(total)
    sums["kl_spliced"] += float(_kl_sum(clean, replaced))
    sums["kl_ablated"] += float(_kl_sum(clean, ablated))
    count += int(predictions)
  if count == 0:
    raise ArgumentError("fld.evaluate: model_inputs gave no input (or no predictions). Give some.")
  means = {name: value / count for name, value in sums.items()}
  gap = means["ablated"] - means["clean"]
  return {
    "loss_clean": means["clean"],
    "loss_spliced": means["spliced"],
    "loss_ablated": means["ablated"],
    "kl_spliced": None if metric is not None else means["kl_spliced"],
    "kl_ablated": None if metric is not None else means["kl_ablated"],
    "loss_recovered": (means["ablated"] - means["spliced"]) / gap if gap != 0 else float("nan"),
  }


def evaluate(
  dictionary: Dictionary,
  data: Any,
  *,
  batch_size: int = 4096,
  batches: int | None = None,
  seed: int = 0,
  dense_above: float = 0.1,
  tree: CallNode | None = None,
  model_inputs: Iterable[Any] | None = None,
  at: Any = None,
  metric: Callable[[Any, Any], Any] | None = None,
) -> Evaluation:
  """Measures `dictionary` on `data`, and spliced into a model where `tree` is given.

  Over `batches` batches of `data` (one pass over it by default), batch by batch (the
  dictionary as it is: `.eval()` first for BatchTopK's inference threshold): L0, the
  fraction of variance unexplained, each feature's activation frequency, and the dead
  and dense features. With `tree`, `model_inputs` and `at`, the dictionary replaces the
  site (`fl.splice` with `error=False`: its reconstruction alone; an SAE at the site's
  output, a transcoder from the call's input to its output) and each input runs clean,
  spliced and with the site zero-ablated: the next-token cross-entropy and KL against the
  clean model (the inputs are token ids `(batch, positions)`, the output logits), or
  `metric(clean_out, out)` averaged over inputs; and the loss recovered.

  Args:
    dictionary: a `Dictionary` (SAE, transcoder, CLT).
    data: its data (`DictionaryData`: `fld.stream`, `fld.from_harvest`, `fld.from_arrays`).
    batch_size: rows per batch.
    batches: the most batches to evaluate; None: one pass over `data`.
    seed: the data's shuffle seed.
    dense_above: the activation frequency above which a feature counts as dense.
    tree: a converted tree to splice the dictionary into; None: rows only.
    model_inputs: the model inputs (an iterable) for the spliced metrics.
    at: the site the dictionary stands in for (the call whose output it replaces).
    metric: `metric(clean_out, out) -> scalar`, lower is better, averaged over inputs,
      in place of the next-token loss (then no KL is given).

  Returns:
    An `Evaluation`.

  Raises:
    ArgumentError: the data's widths are not the dictionary's, there are no rows or
      inputs, `tree` comes without `model_inputs` and `at`, the inputs are not token ids
      and no `metric` is given, or a CLT is to be spliced (not yet: rows only).

  Example:
    >>> import flaxlens.dictionaries as fld, jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> sae = fld.SAE(4, 8, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (2, 64, 4))
    >>> import flaxlens as fl
    >>> tree = fl.unflaxify(nnx.Linear(4, 4, rngs=nnx.Rngs(1)), x)
    >>> data = fld.stream(tree, [x], "Linear.__call__", on="input", buffer=128)
    >>> result = fld.evaluate(sae, data, batch_size=32)
    >>> result.rows, result.frequencies.shape, 0 <= result.dead <= 1
    (128, (8,), True)
  """
  if not isinstance(dictionary, Dictionary):
    raise ArgumentError(
      f"fld.evaluate: dictionary is a {type(dictionary).__name__}, not a fld.Dictionary."
      " Give an SAE, Transcoder or CrossLayerTranscoder (fld.load reads one from a file)."
    )
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ArgumentError(f"fld.evaluate: batch_size={batch_size!r} is not a positive int.")
  if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
    raise ArgumentError(f"fld.evaluate: batches={batches!r} is not a positive int (or None: all).")
  if not 0 <= dense_above < 1:
    raise ArgumentError(f"fld.evaluate: dense_above={dense_above!r} is not a frequency in [0, 1).")
  rows = _row_metrics(dictionary, data, batch_size, batches, seed, dense_above)
  if tree is None:
    if model_inputs is not None or at is not None or metric is not None:
      raise ArgumentError(
        "fld.evaluate: model_inputs=, at= and metric= are for the spliced metrics, which"
        " need tree=. Give tree= (the converted model), or leave them out."
      )
    return Evaluation(**rows)
  check_tree(tree, "fld.evaluate")
  if model_inputs is None or at is None:
    raise ArgumentError(
      "fld.evaluate: tree= measures the dictionary spliced into the model, which needs"
      " model_inputs= (the inputs to run) and at= (the site it stands in for). Give both."
    )
  return Evaluation(**rows, **_model_metrics(dictionary, tree, model_inputs, at, metric))
