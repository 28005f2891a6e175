"""The result of sweeps, attribution patching and path patching (`fl.SweepResult`): a
metric per site (and per position), with the clean and corrupted runs' metrics and the
per-example values the statistics read. Its statistics are `_statistics.py`'s, its plot
`_plot.py`'s. No Flax internals here."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flaxlens.errors import ArgumentError
from flaxlens.tools.analysis import _plot, _statistics


@dataclasses.dataclass(frozen=True)
class SweepResult:
  """A metric per site (and per position), as `fl.sweep` and `fl.attribute` return it,
  with the clean and corrupted runs' metrics and, for a sweep with `per_example=True`,
  every example's value: enough to normalise the effect, bootstrap it and test it.

  Attributes:
    values: an array of shape `(sites,)`, or `(sites, positions)` when positions were
      swept, followed by the metric's own shape (for `fl.sweep`); with per-example
      values, their mean over the examples.
    sites: the name of each row: the site's name, with `[i]` for iteration `i` of a
      call inside an `nn.scan`/`nnx.scan` body (`[i,j]` inside two).
    positions: the positions of the columns, or None.
    receivers: the receivers of the columns (`fl.path_patch(..., each_receiver=True)`), or
      the receivers all rows share; None for other tools.
    clean: the metric of the unpatched clean run (mean over examples), or None.
    corrupted: the metric of the unpatched corrupted run (mean over examples), or None.
    per_example: each example's value of each cell, shaped as `values` with the
      examples added as the last axis, or None (`fl.sweep(..., per_example=True)`).
    clean_per_example: each example's clean metric, examples last, or None.
    corrupted_per_example: each example's corrupted metric, examples last, or None.
    measure: what `values` are, and so what `normalised()` is (0: no effect, 1: the
      whole effect): `"patched"`, the metric of corrupted runs with a site's clean
      value patched in (`fl.sweep`: `(patched - corrupted) / (clean - corrupted)`);
      `"change"`, an estimate of that patch's change of the metric (`fl.attribute`:
      `change / (clean - corrupted)`); `"path"`, the metric of clean runs with a
      sender's path corrupted (`fl.path_patch`: `(clean - patched) / (clean -
      corrupted)`).
    heads: for rows that are attention heads (`fl.heads` swept, or path-patched as
      senders), each row's `(call, head)`; the plot draws them as a calls × heads grid.
      None for other rows.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> result = fl.SweepResult(jnp.array([[0.5, 1.0]]), ("h/0",), (0, 1), clean=1.0, corrupted=0.0)
    >>> result.values.shape, result.sites, result.normalised().tolist()
    ((1, 2), ('h/0',), [[0.5, 1.0]])
  """

  values: Any
  sites: tuple[str, ...]
  positions: tuple[int, ...] | None = None
  receivers: tuple[str, ...] | None = None
  clean: Any = None
  corrupted: Any = None
  per_example: Any = None
  clean_per_example: Any = None
  corrupted_per_example: Any = None
  measure: str = "patched"
  heads: tuple[tuple[str, int], ...] | None = None

  def __post_init__(self) -> None:
    if self.measure not in _statistics.MEASURES:
      raise ArgumentError(
        f"SweepResult: measure={self.measure!r} is not one of 'patched' (values are the"
        " patched runs' metric), 'change' (values estimate patched - corrupted) and 'path'"
        " (values are clean runs' metric with a path corrupted). Pass one of them."
      )

  def normalised(self) -> np.ndarray:
    """The normalised effect of each cell: 0 where the patch changes nothing, 1 where it
    moves the metric the whole way from one run's to the other's.

    For `fl.sweep` (`measure == "patched"`, clean values patched into the corrupted
    run) it is `(patched - corrupted) / (clean - corrupted)`: 1 restores the clean
    metric. For `fl.attribute` (`"change"`) it is `change / (clean - corrupted)`. For
    `fl.path_patch` (`"path"`, a sender's corrupted value sent into the clean run) it is
    `(clean - patched) / (clean - corrupted)`: 1 takes the metric to the corrupted
    run's. With per-example values it is the ratio of the means over the examples.

    Raises:
      StatisticsError: the clean or corrupted metric is unknown, a value is not finite,
        or clean and corrupted are equal within a few float32 ulps (the ratio would
        divide by about 0; the message says on how many examples they differ).

    Example:
      >>> import flaxlens as fl
      >>> fl.SweepResult([1.0, 3.0], ("a", "b"), clean=3.0, corrupted=1.0).normalised()
      array([0., 1.])
      >>> fl.SweepResult([1.0, 3.0], ("a", "b"), clean=3.0, corrupted=1.0,
      ...                measure="path").normalised()
      array([1., 0.])
    """
    return _statistics.normalised(self)

  def bootstrap(
    self, *, n: int = 10_000, confidence: float = 0.95, seed: int = 0, normalised: bool = False
  ) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap confidence intervals of each cell over the examples.

    Resamples the examples with replacement `n` times (`np.random.default_rng(seed)
    .integers(0, batch, size=(n, batch))`, the same examples for every cell and for the
    clean and corrupted metrics) and takes each cell's mean over each resample, or with
    `normalised` the normalised effect of the resampled means (as `normalised()` of
    those examples: a ratio of means). Returns the `(1 - confidence) / 2` and `(1 +
    confidence) / 2` quantiles of those `n` numbers, always finite. Needs per-example
    values: `fl.sweep(..., per_example=True)` (or `fl.path_patch`'s).

    Returns:
      `(lower, upper)`, each shaped as `values`.

    Raises:
      StatisticsError: no per-example values, fewer than 2 examples, bad settings,
        values that are not finite, or a `confidence` above `1 - 2 / 2**batch` (no test
        over `batch` examples reaches that level: 0.9375 for 5 examples, so 0.95 needs 6
        and 0.99 needs 8). With `normalised`: clean equal to corrupted, a resample whose
        clean and corrupted means are equal (too few examples differ), or `clean -
        corrupted` changing sign in at least `(1 - confidence) / 2` of the resamples
        (then the ratio's interval is unbounded).

    Example:
      >>> import flaxlens as fl, numpy as np
      >>> per_example = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])  # one cell, 6 examples
      >>> result = fl.SweepResult(per_example.mean(-1), ("a",), per_example=per_example,
      ...   clean_per_example=np.ones(6), corrupted_per_example=np.zeros(6))
      >>> lower, upper = result.bootstrap(n=1000)
      >>> bool(lower[0] < 3.5 < upper[0])
      True
    """
    return _statistics.bootstrap(self, n=n, confidence=confidence, seed=seed, normalised=normalised)

  def p_values(self, *, permutations: int = 10_000, seed: int = 0) -> np.ndarray:
    """Each cell's p-value for "patching this cell leaves the metric unchanged".

    A paired, two-sided sign-flip permutation test over the examples: each example's
    difference from the run patched into (`patched - corrupted` for `fl.sweep`,
    `patched - clean` for `fl.path_patch`) is as likely, under that hypothesis, to have
    either sign; the statistic is the absolute mean difference. Exact (every sign vector
    enumerated) when `2 ** batch <= permutations`, else `permutations` random sign
    vectors from `np.random.default_rng(seed)` and `(1 + count) / (1 + permutations)`.
    The same p-value holds for the normalised effect (the same statistic scaled by a
    constant). No correction for testing many cells is made. Needs per-example values:
    `fl.sweep(..., per_example=True)`.

    Returns:
      An array shaped as `values`.

    Raises:
      StatisticsError: no per-example values, fewer than 2 examples, values that are not
        finite, or bad settings.

    Example:
      >>> import flaxlens as fl, numpy as np
      >>> per_example = np.array([[1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 0.5, -0.5]])
      >>> result = fl.SweepResult(per_example.mean(-1), ("a", "b"), per_example=per_example,
      ...   clean_per_example=np.ones(4), corrupted_per_example=np.zeros(4))
      >>> result.p_values().tolist()  # exact: all 16 sign vectors of 4 examples
      [0.125, 1.0]
    """
    return _statistics.p_values(self, permutations=permutations, seed=seed)

  def plot(
    self,
    path: Any = None,
    *,
    title: str | None = None,
    normalised: bool | None = None,
    significance: float | None = 0.05,
  ) -> Any:
    """Draws the values as a heatmap (sites down, positions or receivers across); saves
    it to `path`.

    With the clean and corrupted metrics known it shows `normalised()`, centred on 0
    (no effect) with 1 the whole effect; the colour bar says which runs 0 and 1 are (a
    sweep: 0 the corrupted run, 1 the clean run restored; a path patch: 0 the clean
    run, 1 the corrupted run reached). `normalised=False` shows the raw metric centred
    on the run patched into (an attribution's changes on 0). With per-example values,
    cells whose sign-flip p-value (`p_values()`, Holm-adjusted over the cells drawn) is
    at least `significance` are hatched, and a note under the plot says so;
    `significance=None` marks none. A heads result (`heads`) of one column is drawn as a
    calls × heads grid. The colour scale ends at the 98th percentile of the distances
    from the centre, so one outlier does not wash out the rest; long site names lose
    their shared prefix (shown as the axis label) and their middle; tick labels thin out
    on large grids. Needs matplotlib (`pip install "flaxlens[plots]"`); the image format
    follows the file's suffix (`.png`, `.svg`, `.pdf`).

    Returns:
      The matplotlib `Figure` (shown inline by notebooks).

    Raises:
      StatisticsError: per-example values that `p_values()` refuses (pass
        `significance=None` to draw without testing the cells).

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp, tempfile, pathlib
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "sweep.png"
      >>> figure = fl.SweepResult(jnp.ones((2, 3)), ("a", "b"), (0, 1, 2)).plot(path)
      >>> path.exists()
      True
    """
    return _plot.plot_sweep(
      self, path, title=title, normalised=normalised, significance=significance
    )
