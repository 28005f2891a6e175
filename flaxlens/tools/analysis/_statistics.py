"""How sure a sweep is: the normalised effect, bootstrap intervals and permutation p-values.

A sweep run with `per_example=True` keeps the metric of every example in every patched
run and in the clean and corrupted runs, examples on the last axis. From those this
module computes, with NumPy on the host: the normalised effect `(patched - corrupted) /
(clean - corrupted)`, a percentile bootstrap over examples (each resample is a vector of
counts, so all resamples of all cells are one matrix product) and a paired sign-flip
permutation test per cell (exact when the flips can be enumerated). Nothing here runs
the model or touches Flax or JAX internals.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from flaxlens.errors import ArgumentError, StatisticsError

# The most float64 numbers one block of resamples (or sign flips) times cells may hold.
_BLOCK = 1 << 22

_PER_EXAMPLE_FIX = (
  "Sweep with per_example=True and a metric returning one value per example (shape"
  " (batch,), for example lambda out: out[:, -1, a] - out[:, -1, b], not its .mean())."
)


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
  """`(patched - corrupted) / (clean - corrupted)` of each cell (`change / (clean -
  corrupted)` for an attribution's estimated changes).

  Raises:
    StatisticsError: the clean or corrupted metric is unknown, or they are equal within
      rounding somewhere.
  """
  clean, corrupted = _baselines(result, "normalised()")
  return _effect(np.asarray(result.values, np.float64), corrupted, result.measure) / _span(
    clean, corrupted
  )


def bootstrap(
  result: Any, *, n: int, confidence: float, seed: int, normalised: bool
) -> tuple[np.ndarray, np.ndarray]:
  """The percentile bootstrap interval of each cell's value (or normalised effect).

  Draws `np.random.default_rng(seed).integers(0, batch, size=(n, batch))`: row `r` holds
  the examples of resample `r`. A resample's statistic is the mean over its examples of
  the per-example values (with `normalised`: the ratio `(mean patched - mean corrupted) /
  (mean clean - mean corrupted)` of the same examples' means). The interval is the
  `(1 - confidence) / 2` and `(1 + confidence) / 2` quantiles (`np.quantile`, linear) of
  the `n` statistics.
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
  if normalised:
    _span(clean.mean(axis=-1), corrupted.mean(axis=-1))
  batch = patched.shape[-1]
  draws = np.random.default_rng(seed).integers(0, batch, size=(n, batch))
  offsets = (draws + batch * np.arange(n)[:, None]).reshape(-1)
  weights = np.bincount(offsets, minlength=n * batch).reshape(n, batch) / batch
  metric_shape = clean.shape[:-1]
  flat_clean = clean.reshape(-1, batch) @ weights.T  # (metric cells, n)
  flat_corrupted = corrupted.reshape(-1, batch) @ weights.T
  cells = patched.reshape(-1, flat_clean.shape[0], batch)
  quantiles = [(1 - confidence) / 2, (1 + confidence) / 2]
  block = max(1, _BLOCK // (n * flat_clean.shape[0]))
  bounds = []
  for start in range(0, cells.shape[0], block):
    means = cells[start : start + block] @ weights.T  # (block, metric cells, n)
    statistic = means
    if normalised:
      with np.errstate(divide="ignore", invalid="ignore"):
        statistic = _effect(means, flat_corrupted, result.measure) / (flat_clean - flat_corrupted)
    bounds.append(np.quantile(statistic, quantiles, axis=-1))
  lower, upper = np.concatenate(bounds, axis=1)
  shape = (*patched.shape[: patched.ndim - 1 - len(metric_shape)], *metric_shape)
  return lower.reshape(shape), upper.reshape(shape)


def p_values(result: Any, *, permutations: int, seed: int) -> np.ndarray:
  """Each cell's two-sided p-value for "patching this cell does not change the metric".

  A paired sign-flip test: the per-example differences `patched - corrupted` (an
  attribution's changes as they are) have, under that hypothesis, a distribution
  symmetric about 0, so flipping the sign of any example's difference is as likely as
  not. The statistic is `|sum of differences|`. When `2 ** batch <= permutations` every
  sign vector is enumerated and the p-value is exact; otherwise `permutations` sign
  vectors `1 - 2 * np.random.default_rng(seed).integers(0, 2, size=(permutations, batch))`
  are drawn and the p-value is `(1 + count) / (1 + permutations)`, never 0. Statistics
  within `100 * eps` (relative) of the observed one count as ties, as in
  `scipy.stats.permutation_test`.
  """
  _check_count(permutations, "permutations", "p_values()")
  patched, _, corrupted = _examples(result, "p_values()")
  batch = patched.shape[-1]
  differences = _effect(patched, corrupted, result.measure).reshape(-1, batch).T
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
  p = np.where(np.isfinite(differences).all(axis=0), p, np.nan)
  return p.reshape(patched.shape[:-1])


def _effect(values: Any, corrupted: Any, measure: str) -> Any:
  """What patching changed: `values - corrupted` for patched metrics, changes as they are."""
  return values - corrupted if measure == "patched" else values


def _span(clean: Any, corrupted: Any) -> np.ndarray:
  """`clean - corrupted`, refused where it is 0 within a few ulps of the metrics."""
  span = clean - corrupted
  ulp = np.finfo(np.result_type(clean, corrupted, np.float32)).eps
  flat = np.maximum(np.abs(clean), np.abs(corrupted))
  close = np.abs(span) <= 4 * ulp * flat
  if np.any(close):
    where = "" if np.ndim(span) == 0 else f" at {[tuple(i) for i in np.argwhere(close)][:4]}"
    raise StatisticsError(
      f"The clean and the corrupted run's metrics are equal within rounding{where}"
      f" (clean {np.asarray(clean)[close].ravel()[:4]}, corrupted"
      f" {np.asarray(corrupted)[close].ravel()[:4]}), so (patched - corrupted) / (clean -"
      " corrupted) divides by about 0. Choose a corrupted input that changes the metric,"
      " or read the raw values (result.values)."
    )
  return span


def _baselines(result: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
  if result.clean is None or result.corrupted is None:
    raise StatisticsError(
      f"SweepResult.{what} needs the clean and corrupted runs' metrics, which this result"
      " does not hold. Use the result fl.sweep or fl.attribute returns, or build it with"
      " clean= and corrupted=."
    )
  return np.asarray(result.clean, np.float64), np.asarray(result.corrupted, np.float64)


def _examples(result: Any, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The per-example values of the patched, clean and corrupted runs (examples last)."""
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
  return patched, clean, corrupted


def _check_count(value: Any, name: str, what: str) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise StatisticsError(
      f"SweepResult.{what}: {name}= is a positive integer, got {value!r}. Pass, for example,"
      f" {name}=10_000."
    )
