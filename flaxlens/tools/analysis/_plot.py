"""The heatmap of a sweep or path patch: what to show, its centre, its uncertainty, labels.

`SweepResult.plot` draws through here. A result that knows its clean and corrupted
metrics shows the normalised effect, centred on 0 (no effect) with 1 the whole effect
(`_statistics.MEASURES` says what that is for each kind of result, and gives the
colour-bar label); raw values are centred on the metric of the run patched into (an
attribution's estimated changes on 0), and a result with no baseline gets a sequential
colour map over its range. With per-example values, cells whose sign-flip p-value
(Holm-adjusted over the cells drawn) is not below the significance level are hatched.
Heads (`SweepResult.heads`) are drawn as a calls × heads grid. Limits are robust (the
98th percentile of the distances from the centre, so one outlier does not wash every
other cell out; cells beyond saturate and the colorbar says so), long site names lose
their shared prefix and their middle, and tick labels thin out on large grids. The
layout is matplotlib's constrained layout, which keeps every label inside the figure.
Rendering only: the numbers come from the result (`_statistics.py`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from flaxlens.errors import ArgumentError, StatisticsError
from flaxlens.tools.analysis import _statistics

_NAME_WIDTH = 30  # the most characters of a site name on the axis
_MAX_ROW_LABELS = 40
_MAX_COLUMN_LABELS = 32
_ROBUST = 98  # the percentile of distances from the centre that ends the colour scale
NOT_SIGNIFICANT = "not significant"  # the gid of the hatching over such cells


def plot_sweep(
  result: Any,
  path: Any,
  *,
  title: str | None,
  normalised: bool | None,
  significance: float | None,
) -> Any:
  """Draws `result` (a `SweepResult`) as a heatmap; saves it to `path` unless None.

  Returns:
    The matplotlib `Figure`.
  """
  try:
    import matplotlib
    from matplotlib.colors import CenteredNorm, Normalize
    from matplotlib.figure import Figure
  except ImportError:
    raise ImportError(
      'SweepResult.plot draws with matplotlib; install it: pip install "flaxlens[plots]".'
    ) from None
  values, centre, label = _shown(result, normalised)
  if values.ndim == 1:
    values = values[:, None]
  if values.ndim != 2:
    raise ArgumentError(
      f"plot draws one number per site and position; the values have shape {values.shape}"
      " (a metric that is not a scalar). Plot one entry: fl.SweepResult(result.values[...,"
      " k], result.sites, result.positions).plot(path)."
    )
  marked = _not_significant(result, significance, values.shape)
  grid = _heads_grid(result, values, marked)
  if grid is not None:
    values, marked, rows_of, heads = grid
  rows, columns = values.shape
  finite = values[np.isfinite(values)]
  if centre is None:
    low, high = (
      np.percentile(finite, [100 - _ROBUST, _ROBUST], method="nearest") if finite.size else (0, 1)
    )
    norm, cmap = Normalize(low, high if high > low else low + 1), "viridis"
  else:
    distances = np.abs(finite - centre)
    half = float(np.percentile(distances, _ROBUST, method="higher")) if finite.size else 0.0
    half = half or float(distances.max(initial=0.0)) or 1.0
    low, high = centre - half, centre + half
    norm, cmap = CenteredNorm(vcenter=centre, halfrange=half), "RdBu"
  extend = {(False, False): "neither", (True, False): "min", (False, True): "max"}.get(
    (bool((finite < low).any()), bool((finite > high).any())), "both"
  )
  note = 0.0 if marked is None else 0.7  # inches for the note on the hatching
  figure = Figure(
    figsize=(min(4.5 + 0.45 * columns, 16), min(max(3.2, 1.8 + 0.3 * rows), 20) + note),
    layout="constrained",
  )
  axes = figure.subplots()
  colours = matplotlib.colormaps[cmap].with_extremes(bad="lightgrey")
  image = axes.imshow(values, aspect="auto", cmap=colours, norm=norm, interpolation="nearest")
  bar = figure.colorbar(image, ax=axes, extend=extend, aspect=min(60, max(20, rows)))
  bar.set_label(label, fontsize="small")
  if grid is None:
    label_of_rows, names = short_names(result.sites)
  else:
    label_of_rows, names = short_names(rows_of)
  shown = range(0, rows, math.ceil(rows / _MAX_ROW_LABELS))
  axes.set_yticks(list(shown), [names[i] for i in shown])
  axes.set_ylabel(_wrapped(label_of_rows))
  _columns(result, axes, columns, None if grid is None else heads)
  if marked is not None:
    _hatch(figure, axes, marked, significance)
  if title is not None:
    axes.set_title(title)
  if path is not None:
    figure.savefig(path)
  return figure


def _columns(result: Any, axes: Any, columns: int, heads: list[int] | None) -> None:
  """The column ticks and label: heads, receivers, positions, or none."""
  shown = range(0, columns, math.ceil(columns / _MAX_COLUMN_LABELS))
  if heads is not None:
    axes.set_xticks(list(shown), [str(heads[i]) for i in shown])
    axes.set_xlabel("head")
  elif result.receivers is not None and columns == len(result.receivers) > 1:
    label_of_columns, receivers = short_names(tuple(result.receivers))
    axes.set_xticks(list(shown), [receivers[i] for i in shown], rotation=90)
    axes.set_xlabel("receiver" if label_of_columns == "site" else label_of_columns)
  elif result.positions is None:
    axes.set_xticks([])
  else:
    axes.set_xticks(list(shown), [str(result.positions[i]) for i in shown])
    axes.set_xlabel("position")


def _heads_grid(result: Any, values: np.ndarray, marked: Any) -> tuple | None:
  """A heads result of one column as a calls × heads grid: the values and the marks
  regridded (a head a call lacks is NaN, drawn grey, and unmarked), the calls and the
  heads; None for other results."""
  if result.heads is None or values.shape[1] != 1:
    return None
  calls = list(dict.fromkeys(call for call, _ in result.heads))
  heads = sorted({h for _, h in result.heads})
  at = (
    [calls.index(call) for call, _ in result.heads],
    [heads.index(h) for _, h in result.heads],
  )
  grid = np.full((len(calls), len(heads)), np.nan)
  grid[at] = values[:, 0]
  if marked is not None:
    marks = np.zeros(grid.shape, bool)
    marks[at] = marked[:, 0]
    marked = marks
  return grid, marked, tuple(calls), heads


def _not_significant(result: Any, significance: float | None, shape: tuple) -> Any:
  """Where (a boolean array of `shape`) a cell's Holm-adjusted p-value is at least
  `significance`; None without per-example values or with `significance=None`."""
  if significance is None or result.per_example is None:
    return None
  if isinstance(significance, bool) or not 0 < significance < 1:
    raise ArgumentError(
      f"plot: significance= is a level in (0, 1) or None, got {significance!r}. Pass, for"
      " example, significance=0.05, or None to mark no cells."
    )
  # Random sign flips give p-values of at least 1 / (permutations + 1); Holm needs one
  # below significance / cells, so draw enough that this floor hides no effect (or all
  # 2 ** batch sign vectors, when fewer: the test is then exact).
  permutations = max(10_000, math.ceil(2 * math.prod(shape) / significance))
  try:
    p = np.asarray(result.p_values(permutations=permutations), np.float64).reshape(shape)
  except StatisticsError as e:
    raise StatisticsError(
      f"{e} Or plot(significance=None) draws without testing the cells."
    ) from None
  return holm(p) >= significance


def holm(p: np.ndarray) -> np.ndarray:
  """Holm's step-down adjustment of the p-values `p` (any shape) for testing them all.

  Example:
    >>> holm(np.array([0.01, 0.04, 0.03])).tolist()
    [0.03, 0.06, 0.06]
  """
  flat = p.reshape(-1)
  order = np.argsort(flat, kind="stable")
  scaled = flat[order] * (flat.size - np.arange(flat.size))
  adjusted = np.empty_like(flat)
  adjusted[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
  return adjusted.reshape(p.shape)


def _hatch(figure: Any, axes: Any, marked: np.ndarray, significance: float) -> None:
  """Hatches the `marked` cells and says, under the axes, what the hatching means."""
  from matplotlib.collections import PatchCollection
  from matplotlib.patches import Patch, Rectangle

  cells = [Rectangle((c - 0.5, r - 0.5), 1, 1) for r, c in np.argwhere(marked)]
  hatched = PatchCollection(
    cells, facecolor="none", edgecolor="0.35", hatch="///", linewidth=0, gid=NOT_SIGNIFICANT
  )
  axes.add_collection(hatched)
  key = Patch(
    facecolor="none", edgecolor="0.35", hatch="///", label=_hatch_text(marked, significance)
  )
  figure.legend(handles=[key], loc="outside lower center", fontsize="small", frameon=False)


def _hatch_text(marked: np.ndarray, significance: float) -> str:
  return (
    f"{NOT_SIGNIFICANT} at {significance:g}\n(sign-flip test over the examples,"
    f"\nHolm-adjusted over {marked.size} cells)"
  )


def _shown(result: Any, normalised: bool | None) -> tuple[np.ndarray, float | None, str]:
  """The numbers drawn, the value the colour map is centred on (None: none), the label."""
  measure = _statistics.MEASURES[result.measure]
  known = result.clean is not None and result.corrupted is not None
  if normalised is None:
    normalised = known and np.ndim(result.clean) == 0
    if normalised:
      try:
        _statistics.normalised(result)
      except StatisticsError:  # clean == corrupted: the raw values, centred on the base run
        normalised = False
  if normalised:
    return _statistics.normalised(result), 0.0, measure.legend
  values = np.asarray(result.values, np.float64)
  if result.measure == "change":
    return values, 0.0, measure.raw
  base = result.corrupted if measure.base == "corrupted" else result.clean
  if base is not None and np.ndim(base) == 0:
    return values, float(base), f"{measure.raw}\ncentre: {measure.base} {float(base):.4g}"
  return values, None, "metric"


def short_names(names: tuple[str, ...]) -> tuple[str, list[str]]:
  """The axis label and the tick labels of the rows: the path components every name
  shares at its start and at its end move to the axis label (`"transformer/h/…/attn"`),
  and what is left is elided in the middle (`"blocks_3/…/out"`) when longer than
  the axis allows.

  Example:
    >>> short_names(("transformer/h/0/attn", "transformer/h/1/attn"))
    ('transformer/h/…/attn', ['0', '1'])
    >>> short_names(("Block_0", "Block_1"))
    ('site', ['Block_0', 'Block_1'])
  """
  parts = [name.split("/") for name in names]
  head = tail = 0
  if len(names) > 1:
    while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
      head += 1
    while all(len(p) > head + tail + 1 for p in parts) and len({p[-tail - 1] for p in parts}) == 1:
      tail += 1
  if not head and not tail:
    return "site", [_elided(name) for name in names]
  label = "/".join([*parts[0][:head], "…", *parts[0][len(parts[0]) - tail :]])
  return label, [_elided("/".join(p[head : len(p) - tail])) for p in parts]


def _wrapped(label: str) -> str:
  """`label` broken into lines of at most `_NAME_WIDTH` characters after a `/`."""
  lines = [""]
  for part in label.split("/"):
    piece = part if not lines[-1] else f"/{part}"
    if lines[-1] and len(lines[-1]) + len(piece) > _NAME_WIDTH:
      lines.append(piece)
    else:
      lines[-1] += piece
  return "\n".join(lines)


def _elided(name: str) -> str:
  if len(name) <= _NAME_WIDTH:
    return name
  parts = name.split("/")
  kept = [parts[-1]]
  for part in reversed(parts[1:-1]):
    if len(parts[0]) + len("/…/") + len("/".join([part, *kept])) > _NAME_WIDTH:
      break
    kept.insert(0, part)
  short = f"{parts[0]}/…/{'/'.join(kept)}" if len(parts) > 1 else name
  return short if len(short) <= _NAME_WIDTH else f"…{name[-(_NAME_WIDTH - 1) :]}"
