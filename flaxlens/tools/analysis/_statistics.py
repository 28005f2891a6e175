"""How sure a result is: the normalised effect, bootstrap intervals and permutation p-values.

A sweep (or path patch) run with `per_example=True` keeps the metric of every example in
every patched run and in the clean and corrupted runs, examples on the last axis. From
those this module computes, with NumPy on the host: the normalised effect (0: no effect,
1: the whole effect; `MEASURES` says what that is for each kind of result), a percentile
bootstrap over examples (each resample is a vector of counts, so all resamples of all
cells are one matrix product) and a paired sign-flip permutation test per cell (exact
when the flips can be enumerated). Each statistic is finite or refused with a
`StatisticsError` naming the rows and examples at fault. Nothing here runs the model or
touches Flax or JAX internals.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from flaxlens.errors import ArgumentError, StatisticsError

# The most float64 numbers one block of resamples (or sign flips) times cells may hold.
_BLOCK = 1 << 22
_ROUNDING = 4  # float32 ulps within which the clean and corrupted metrics count as equal

_PER_EXAMPLE_FIX = (
  "Sweep with per_example=True and a metric returning one value per example (shape"
  " (batch,), for example lambda out: out[:, -1, a] - out[:, -1, b], not its .mean())."
)


class Measure(NamedTuple):
  """What a result's values are, and so what its normalised effect is.

  Attributes:
    effect: the formula of the normalised effect, as the docs and messages write it.
    base: the run whose metric means "no effect" (the run patched into).
    legend: the plot's colour-bar label for the normalised effect.
    raw: the plot's colour-bar label for the raw values (centred on `base`'s metric).
  """

  effect: str
  base: str
  legend: str
  raw: str


MEASURES = {
  "patched": Measure(
    "(patched - corrupted) / (clean - corrupted)",
    "corrupted",
    "normalised effect\n0: no effect (corrupted run)\n1: clean run restored",
    "patched metric",
  ),
  "change": Measure(
    "change / (clean - corrupted)",
    "corrupted",
    "estimated normalised effect\n0: no effect (corrupted run)\n1: clean run restored",
    "estimated change\nof the metric",
  ),
  "path": Measure(
    "(clean - patched) / (clean - corrupted)",
    "clean",
    "normalised path effect\n0: no effect (clean run)\n1: corrupted run reached",
    "path-patched metric",
  ),
}


def with_runs(
  result: Any,
  clean: Any,
  corrupted: Any,
  *,
  per_example: bool,
  where: str,
  arguments: Sequence[tuple[str, tuple[int, ...]]] = (),
) -> Any:
  """`result` (a `SweepResult`) with the clean and corrupted runs' metrics added.

  With `per_example`, the metric's leading axis is the examples: `result.values` (shaped
  `(*grid, batch, *metric)`) becomes its mean over the examples, and the per-example values
  of the patched, clean and corrupted runs are kept with the examples moved last.
  `arguments` are the `(name, shape)` of the model's array arguments: the metric's leading
  axis must be as long as the leading axis of one of them (the batch).

  Raises:
    ArgumentError: `per_example` with a metric that returned a scalar, or one whose leading
      axis is not the batch.
  """
  if not per_example:
    return dataclasses.replace(result, clean=clean, corrupted=corrupted)
  if clean.ndim == 0:
    raise ArgumentError(
      f"{where}: per_example=True takes the metric's leading axis as the examples, but the"
      " metric returned a scalar. Return one value per example (shape (batch, ...)), for"
      " example lambda out: out[:, -1, a] - out[:, -1, b] instead of its .mean()."
    )
  batches = {shape[0] for _, shape in arguments if shape}
  if batches and corrupted.shape[0] not in batches:
    shapes = ", ".join(f"{name}: {shape}" for name, shape in arguments)
    raise ArgumentError(
      f"{where}: per_example=True takes the metric's leading axis as the examples, but the"
      f" metric returned shape {tuple(corrupted.shape)}, whose leading axis of"
      f" {corrupted.shape[0]} is no batch of the model's arguments ({shapes}). Return one"
      " value per example (shape (batch, ...)), indexing every example: for example"
      " lambda out: out[:, -1, a] - out[:, -1, b], not out[0, :, a] - out[0, :, b]."
    )
  grid = result.values.ndim - clean.ndim
  patched = jnp.moveaxis(result.values, grid, -1)
  clean, corrupted = jnp.moveaxis(clean, 0, -1), jnp.moveaxis(corrupted, 0, -1)
  return dataclasses.replace(
    result,
    values=patched.mean(axis=-1),
    clean=clean.mean(axis=-1),
    corrupted=corrupted.mean(axis=-1),
    per_example=patched,
    clean_per_example=clean,
    corrupted_per_example=corrupted,
  )


def normalised(result: Any) -> np.ndarray:
  """The normalised effect of each cell, `MEASURES[result.measure].effect` (with
  per-example values: of the means over the examples).

  Raises:
    StatisticsError: the clean or corrupted metric is unknown or not finite, a value is
      not finite, or clean and corrupted are equal within rounding somewhere.
  """
  clean, corrupted = _baselines(result, "normalised()")
  values = np.asarray(result.values, np.float64)
  _check_finite(result, values, clean, corrupted, "normalised()", per_example=False)
  span = _span(result, clean, corrupted, "normalised()")
  return _effect(values, clean, corrupted, result.measure) / span


def bootstrap(
  result: Any, *, n: int, confidence: float, seed: int, normalised: bool
) -> tuple[np.ndarray, np.ndarray]:
  """The percentile bootstrap interval of each cell's value (or normalised effect).

  Draws `np.random.default_rng(seed).integers(0, batch, size=(n, batch))`: row `r` holds
  the examples of resample `r`. A resample's statistic is the mean over its examples of
  the per-example values (with `normalised`: the normalised effect of the same examples'
  means, a ratio of means). The interval is the `(1 - confidence) / 2` and `(1 +
  confidence) / 2` quantiles (`np.quantile`, linear) of the `n` statistics.

  Raises:
    StatisticsError: bad settings, too few examples for `confidence` (see
      `_check_enough`), non-finite values, or with `normalised` a denominator `clean -
      corrupted` that vanishes in a resample or whose sign `confidence` does not settle.
  """
  _check_count(n, "n", "bootstrap()")
  if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real):
    raise StatisticsError(
      f"SweepResult.bootstrap(): confidence= is a fraction in (0, 1), got {confidence!r}."
      " Pass, for example, confidence=0.95 for a 95% interval."
    )
  if not 0 < confidence < 1:
    raise StatisticsError(
      f"SweepResult.bootstrap(): confidence={confidence} is outside (0, 1). Pass a"
      " fraction, for example confidence=0.95 for a 95% interval."
    )
  patched, clean, corrupted = _examples(result, "bootstrap()")
  batch = patched.shape[-1]
  _check_enough(batch, confidence)
  if normalised:
    _span(result, clean.mean(axis=-1), corrupted.mean(axis=-1), "bootstrap()", clean, corrupted)
  draws = np.random.default_rng(seed).integers(0, batch, size=(n, batch))
  offsets = (draws + batch * np.arange(n)[:, None]).reshape(-1)
  weights = np.bincount(offsets, minlength=n * batch).reshape(n, batch) / batch
  metric_shape = clean.shape[:-1]
  flat_clean = clean.reshape(-1, batch) @ weights.T  # (metric cells, n)
  flat_corrupted = corrupted.reshape(-1, batch) @ weights.T
  if normalised:
    span = _resampled_span(result, clean, corrupted, flat_clean, flat_corrupted, confidence)
  cells = patched.reshape(-1, flat_clean.shape[0], batch)
  quantiles = [(1 - confidence) / 2, (1 + confidence) / 2]
  block = max(1, _BLOCK // (n * flat_clean.shape[0]))
  bounds = []
  for start in range(0, cells.shape[0], block):
    statistic = cells[start : start + block] @ weights.T  # (block, metric cells, n)
    if normalised:
      statistic = _effect(statistic, flat_clean, flat_corrupted, result.measure) / span
    bounds.append(np.quantile(statistic, quantiles, axis=-1))
  lower, upper = np.concatenate(bounds, axis=1)
  shape = (*patched.shape[: patched.ndim - 1 - len(metric_shape)], *metric_shape)
  return lower.reshape(shape), upper.reshape(shape)


def p_values(result: Any, *, permutations: int, seed: int) -> np.ndarray:
  """Each cell's two-sided p-value for "patching this cell does not change the metric".

  A paired sign-flip test: the per-example differences from the run patched into
  (`patched - corrupted` for a sweep, `patched - clean` for a path patch) have, under
  that hypothesis, a distribution symmetric about 0, so flipping the sign of any
  example's difference is as likely as not. The statistic is `|sum of differences|`.
  When `2 ** batch <= permutations` every sign vector is enumerated and the p-value is
  exact; otherwise `permutations` sign vectors `1 - 2 * np.random.default_rng(seed)
  .integers(0, 2, size=(permutations, batch))` are drawn and the p-value is `(1 + count)
  / (1 + permutations)`, never 0. Statistics within `100 * eps` (relative) of the
  observed one count as ties, as in `scipy.stats.permutation_test`.
  """
  _check_count(permutations, "permutations", "p_values()")
  patched, clean, corrupted = _examples(result, "p_values()")
  batch = patched.shape[-1]
  differences = _effect(patched, clean, corrupted, result.measure).reshape(-1, batch).T
  exact = 2**batch <= permutations
  if exact:
    bits = np.arange(2**batch)[:, None] >> np.arange(batch)
    signs = 1 - 2 * (bits & 1)
  else:
    signs = 1 - 2 * np.random.default_rng(seed).integers(0, 2, size=(permutations, batch))
  observed = np.abs(differences.sum(axis=0))
  ties = np.abs(observed) * 100 * np.finfo(np.float64).eps
  count = np.zeros(differences.shape[1], dtype=np.int64)
  block = max(1, _BLOCK // max(1, differences.shape[1]))
  for start in range(0, signs.shape[0], block):
    flipped = np.abs(signs[start : start + block] @ differences)
    count += (flipped >= observed - ties).sum(axis=0)
  p = count / signs.shape[0] if exact else (count + 1) / (permutations + 1)
  return p.reshape(patched.shape[:-1])


def max_confidence(batch: int) -> float:
  """The highest confidence `bootstrap` gives an interval at over `batch` examples:
  `1 - 2 / 2 ** batch`, the complement of the smallest p-value the exact sign-flip test
  over those examples can reach."""
  return 1 - 2.0 ** (1 - batch)


def _check_enough(batch: int, confidence: float) -> None:
  """Refuses a confidence the examples cannot support.

  An interval at confidence `c` that leaves out a value claims a test rejecting it at
  level `1 - c`. Over `batch` examples the exact paired sign-flip test (`p_values`) can
  reject nothing below `2 / 2 ** batch`, its p-value when every example agrees in sign;
  a percentile interval claiming more is the bootstrap's small-sample optimism (it
  resamples only the examples seen). So `c` may be at most `1 - 2 / 2 ** batch`.
  """
  if confidence <= max_confidence(batch):
    return
  needed = 1 + math.ceil(math.log2(1 / (1 - confidence)) - 1e-12)
  raise StatisticsError(
    f"SweepResult.bootstrap(): {batch} examples cannot support a {confidence:.4g}"
    f" interval. No test over {batch} examples rejects anything at level"
    f" {1 - confidence:.4g}: the exact sign-flip test's smallest p-value is 2 / 2**{batch} ="
    f" {2.0 ** (1 - batch):.4g}, so a percentile interval this confident would be the"
    " bootstrap's small-sample optimism. Sweep at least"
    f" {needed} examples, or pass confidence <= {max_confidence(batch):.4g}."
  )


def _effect(values: Any, clean: Any, corrupted: Any, measure: str) -> Any:
  """The numerator of the normalised effect: what patching changed, signed so that it
  has the sign of `clean - corrupted` when the patch moves the metric the whole way."""
  if measure == "patched":
    return values - corrupted
  if measure == "path":
    return clean - values
  return values


def _close(clean: Any, corrupted: Any) -> Any:
  """Where `clean - corrupted` is 0 within a few float32 ulps of the metrics."""
  scale = np.maximum(np.abs(clean), np.abs(corrupted))
  return np.abs(clean - corrupted) <= _ROUNDING * np.finfo(np.float32).eps * scale


def _span(
  result: Any,
  clean: Any,
  corrupted: Any,
  what: str,
  clean_examples: Any = None,
  corrupted_examples: Any = None,
) -> np.ndarray:
  """`clean - corrupted`, refused where it is 0 within a few ulps of the metrics."""
  close = _close(clean, corrupted)
  if not np.any(close):
    return clean - corrupted
  at = "" if np.ndim(close) == 0 else f" at metric entries {_first(np.argwhere(close))}"
  if clean_examples is None and result.clean_per_example is not None:
    clean_examples = np.asarray(result.clean_per_example, np.float64)
    corrupted_examples = np.asarray(result.corrupted_per_example, np.float64)
  examples = "" if clean_examples is None else _differing(clean_examples, corrupted_examples)
  raise StatisticsError(
    f"SweepResult.{what}: the clean and the corrupted run's metrics are equal within"
    f" rounding{at} (clean {np.asarray(clean)[close].ravel()[:4]}, corrupted"
    f" {np.asarray(corrupted)[close].ravel()[:4]}){examples}, so"
    f" {MEASURES[result.measure].effect} divides by about 0. Choose a corrupted input that"
    " changes the metric, or read the raw values (result.values)."
  )


def _differing(clean: np.ndarray, corrupted: np.ndarray) -> str:
  """Which examples' clean and corrupted metrics differ (beyond rounding), in words."""
  differ = ~_close(clean, corrupted).reshape(-1, clean.shape[-1]).all(axis=0)
  found = np.flatnonzero(differ).tolist()
  return f"; they differ on {len(found)} of {clean.shape[-1]} examples ({_first(found)})"


def _resampled_span(result, clean, corrupted, flat_clean, flat_corrupted, confidence):
  """Each resample's `clean - corrupted` (metric cells, n), refused unless it is bounded
  away from 0: a resample's ratio must exist, and the denominator's sign must be
  settled at `confidence` (else the ratio's confidence set is unbounded, as Fieller's
  theorem says of a ratio of means)."""
  span = flat_clean - flat_corrupted
  full = (clean.mean(axis=-1) - corrupted.mean(axis=-1)).reshape(-1, 1)
  vanished = _close(flat_clean, flat_corrupted)
  fix = (
    " Sweep examples whose corruption changes the metric (drop the others: they carry"
    " nothing to normalise by), or bootstrap the raw values (normalised=False)."
  )
  if vanished.any():
    cell = int(np.argwhere(vanished.any(axis=1))[0, 0])
    count = int(vanished[cell].sum())
    raise StatisticsError(
      f"SweepResult.bootstrap(normalised=True): in {count} of {span.shape[1]} resamples"
      " the clean and corrupted means are equal within rounding"
      f"{'' if span.shape[0] == 1 else f' (metric entry {cell})'}, so their normalised"
      f" effect is 0/0 or infinite{_differing(clean, corrupted)}: a resample that misses"
      f" those has nothing to normalise by.{fix}"
    )
  flipped = (np.sign(span) != np.sign(full)).mean(axis=1)
  if np.any(flipped >= (1 - confidence) / 2):
    cell = int(np.argmax(flipped))
    signs = np.sign(clean - corrupted).reshape(-1, clean.shape[-1])[cell]
    up, down = np.flatnonzero(signs > 0).tolist(), np.flatnonzero(signs < 0).tolist()
    raise StatisticsError(
      f"SweepResult.bootstrap(normalised=True): clean - corrupted changes sign in"
      f" {flipped[cell]:.1%} of the resamples"
      f"{'' if span.shape[0] == 1 else f' (metric entry {cell})'}, so at confidence"
      f" {confidence:.4g} it is not distinguishable from 0 and the normalised effect's"
      " interval is unbounded (a ratio of means has a bounded interval only when its"
      " denominator's interval excludes 0): it is positive on examples"
      f" {_first(up)} and negative on {_first(down)}. Sweep more examples, or examples"
      " whose corruption moves the metric the same way, or bootstrap the raw values"
      " (normalised=False)."
    )
  return span


def _check_finite(result, values, clean, corrupted, what: str, *, per_example: bool) -> None:
  """Refuses values, clean or corrupted metrics that are inf or NaN, naming where."""
  examples = " at examples" if per_example else ""
  for name, array in (("clean", clean), ("corrupted", corrupted)):
    bad = ~np.isfinite(array)
    if bad.any():
      found = np.argwhere(bad)[:, -1].tolist() if per_example else []
      raise StatisticsError(
        f"SweepResult.{what}: the {name} run's metric is not finite (inf or NaN)"
        f"{f'{examples} {_first(found)}' if per_example else ''}, so every statistic"
        f" of it would be NaN. {_FINITE_FIX}"
      )
  bad = ~np.isfinite(values)
  if bad.any():
    where = np.argwhere(bad)
    rows = [result.sites[i] for i in dict.fromkeys(where[:, 0].tolist())]
    found = sorted(set(where[:, -1].tolist())) if per_example else []
    raise StatisticsError(
      f"SweepResult.{what}: the patched metric is not finite (inf or NaN) in rows"
      f" {_first(rows)}{f'{examples} {_first(found)}' if per_example else ''}, so their"
      f" statistics would be NaN. {_FINITE_FIX}"
    )


_FINITE_FIX = (
  "Make the metric finite (a log-probability from log_softmax, not the log of a softmax"
  " that underflows to 0), or sweep without the examples at fault."
)


def _first(items: Any) -> str:
  listed = [tuple(i) if isinstance(i, np.ndarray) else i for i in items]
  return f"{listed[:8]}{' ...' if len(listed) > 8 else ''}"


def _baselines(result: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
  if result.clean is None or result.corrupted is None:
    raise StatisticsError(
      f"SweepResult.{what} needs the clean and corrupted runs' metrics, which this result"
      " does not hold. Use the result fl.sweep or fl.attribute returns, or build it with"
      " clean= and corrupted=."
    )
  return np.asarray(result.clean, np.float64), np.asarray(result.corrupted, np.float64)


def _examples(result: Any, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The per-example values of the patched, clean and corrupted runs (examples last),
  refused when missing, fewer than 2 examples or not finite."""
  held = (result.per_example, result.clean_per_example, result.corrupted_per_example)
  if any(v is None for v in held):
    raise StatisticsError(
      f"SweepResult.{what} resamples examples, and this result holds no per-example"
      f" values. {_PER_EXAMPLE_FIX}"
    )
  patched, clean, corrupted = (np.asarray(v, np.float64) for v in held)
  if patched.shape[-1] < 2:
    raise StatisticsError(
      f"SweepResult.{what}: the sweep saw {patched.shape[-1]} example; resampling needs at"
      " least 2. Sweep a batch of examples (the more, the narrower the interval)."
    )
  _check_finite(result, patched, clean, corrupted, what, per_example=True)
  return patched, clean, corrupted


def _check_count(value: Any, name: str, what: str) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise StatisticsError(
      f"SweepResult.{what}: {name}= is a positive integer, got {value!r}. Pass, for example,"
      f" {name}=10_000."
    )
