"""The heatmap of a sweep: what to show, where its colour map is centred, readable labels.

`SweepResult.plot` draws through here. A result that knows its clean and corrupted
metrics shows the normalised effect, centred on 0 (no effect) with 1 meaning the clean
run's metric restored; raw patched metrics are centred on the corrupted run's metric, an
attribution's estimated changes on 0, and a result with no baseline gets a sequential
colour map over its range. Limits are robust (the 2nd/98th percentiles of the distances
from the centre, so one outlier does not wash every other cell out; cells beyond are
saturated and the colorbar says so), long site names lose their shared prefix and their
middle, and tick labels thin out on large grids. Rendering only: the numbers come from
the result (`_statistics.py`).
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


def plot_sweep(result: Any, path: Any, *, title: str | None, normalised: bool | None) -> Any:
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
  label_of_rows, names = short_names(result.sites)
  figure = Figure(figsize=(min(3.5 + 0.45 * columns, 16), min(max(2.8, 1.5 + 0.3 * rows), 20)))
  axes = figure.subplots()
  colours = matplotlib.colormaps[cmap].with_extremes(bad="lightgrey")
  image = axes.imshow(values, aspect="auto", cmap=colours, norm=norm, interpolation="nearest")
  bar = figure.colorbar(image, ax=axes, extend=extend)
  bar.set_label(label, fontsize="small")
  shown = range(0, rows, math.ceil(rows / _MAX_ROW_LABELS))
  axes.set_yticks(list(shown), [names[i] for i in shown])
  axes.set_ylabel(label_of_rows)
  receivers = getattr(result, "receivers", None)  # fl.path_patch's columns, on main
  if receivers is not None and columns == len(receivers) > 1:
    label_of_columns, receivers = short_names(tuple(receivers))
    shown = range(0, columns, math.ceil(columns / _MAX_COLUMN_LABELS))
    axes.set_xticks(list(shown), [receivers[i] for i in shown], rotation=90)
    axes.set_xlabel("receiver" if label_of_columns == "site" else label_of_columns)
  elif result.positions is None:
    axes.set_xticks([])
  else:
    shown = range(0, columns, math.ceil(columns / _MAX_COLUMN_LABELS))
    axes.set_xticks(list(shown), [str(result.positions[i]) for i in shown])
    axes.set_xlabel("position")
  if title is not None:
    axes.set_title(title)
  figure.tight_layout()
  if path is not None:
    figure.savefig(path)
  return figure


def _shown(result: Any, normalised: bool | None) -> tuple[np.ndarray, float | None, str]:
  """The numbers drawn, the value the colour map is centred on (None: none), the label."""
  known = result.clean is not None and result.corrupted is not None
  if normalised is None:
    normalised = known and np.ndim(result.clean) == 0
    if normalised:
      try:
        _statistics.normalised(result)
      except StatisticsError:  # clean == corrupted: the raw values, centred on corrupted
        normalised = False
  if normalised:
    label = (
      "normalised effect\n0: corrupted, 1: clean"
      if result.measure == "patched"
      else "estimated normalised effect\n0: corrupted, 1: clean"
    )
    return _statistics.normalised(result), 0.0, label
  values = np.asarray(result.values, np.float64)
  if result.measure != "patched":
    return values, 0.0, "estimated change\nof the metric"
  if result.corrupted is not None and np.ndim(result.corrupted) == 0:
    corrupted = float(result.corrupted)
    return values, corrupted, f"patched metric\ncentre: corrupted {corrupted:.4g}"
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
