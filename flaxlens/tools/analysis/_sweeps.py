"""Sweeps: many interventions, one compiled call.

`fl.sweep` patches each chosen call (site), one at a time, from a clean run into a
corrupted run and returns a metric per site (and per position): one compiled function
runs the clean forward once, then every patched corrupted forward batched with
`jax.vmap` (or in chunks with `jax.lax.map`). Every patched forward carries an edit at
every site, which keeps the corrupted value unless the forward's number (a traced
input of the batch) names that site, so the N forwards are one program. A call inside
an `nn.scan`/`nnx.scan` body is one node for all iterations: the sweep treats each
iteration as a site of its own (`"layers/mlp[3]"`), the edit reading the iteration
number that an indexed probing (`core/_probes.py`) passes into the scan body. With
shared prefixes (`_shared_prefix_sweep`), each site's edit reads a pair of inputs of its
own instead (the iteration and position to patch, or none), so that the forward's
dataflow shows which operations depend on which site, and `_shared_prefix.py` runs each
patched forward from its site on, the rest taken from the unpatched corrupted run.

The result is `_sweep_result.SweepResult`; `fl.attribute` and `fl.grad_at`
(`_attribution.py`) estimate the same patches linearly from the machinery here; a site
object (`fl.heads`) sweeps itself (`Sweepable`, `tools/base/_site_objects.py`).

Every run here starts from a copy of the tree's variables, so state a run would update
(batch statistics, NNX random counts) is left as it was, and each patched forward sees
the same state. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._functions import jit_keyed_on_function
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._probes import scan_iterations
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.errors import ArgumentError, BudgetError, UnsupportedFlaxFeatureError
from flaxlens.tools.analysis import _shared_prefix, _statistics
from flaxlens.tools.analysis._sweep_result import SweepResult
from flaxlens.tools.base import _budget
from flaxlens.tools.base._calling import (
  check_callable,
  check_matching_runs,
  model_arguments,
  takes_model_arguments,
)
from flaxlens.tools.base._intervention import Intervention, make_intervention
from flaxlens.tools.base._parts import checked_part, get_part
from flaxlens.tools.base._probed import Copies, RunOptions, abstract_run, edited_calls, probed_run
from flaxlens.tools.base._site_objects import (
  SiteObject,
  Sweepable,
  SweepOptions,
  refuse_site_object,
)
from flaxlens.tools.base._sites import Site, check_part, select_sites, sites_of

# --- shared machinery ---------------------------------------------------------------------


def chosen_sites(tree: CallNode, at: Any, part: Any) -> tuple[int, ...]:
  """The indices, among `sites_of(tree)`, of the sites `at` names; each checked for `part`."""
  sites = sites_of(tree)
  chosen = select_sites(tree, tuple(at) if isinstance(at, list) else at, sites)
  for site in chosen:
    check_part(site, part, "output", at, sites)
  return tuple(sites.index(site) for site in chosen)


def indexed_run(
  tree: CallNode,
  argument: ArgsAndKwargs,
  edits: tuple[Intervention, ...],
  capture: tuple[CallNode, ...] | None,
  random_streams: Any,
) -> tuple[Any, dict[str, Any]]:
  """Runs `tree` with `edits`, capturing `capture`; edits may read `scan_iterations()`."""
  probes = edited_calls(tree, edits, capture, False, None)
  return probed_run(
    tree, argument, probes, random_streams, (edits, capture), UNREACHED_IN_PAIRED_RUNS, indexed=True
  )


UNREACHED_IN_PAIRED_RUNS = (
  "Choose sites that every run makes (the clean and the corrupted one), or convert with"
  " example arguments that take this branch."
)


def captured_values(
  copies: Copies, argument: ArgsAndKwargs, part: Any, random_streams: Any
) -> tuple:
  """The output of a run on `argument` and the chosen sites' values (their `part`) in it,
  stacked over scans."""
  tree, sites = copies.fresh()
  output, cache = indexed_run(tree, argument, (), tuple(s.node for s in sites), random_streams)
  return output, [get_part(cache[s.name], part, s.name, "output") for s in sites]


def stacked_lead(site: Site, value: Any, part: Any) -> tuple[int, ...]:
  """The leading axes a capture stacked `value` along (one per enclosing scan or vmap)."""
  if site.output is None:
    return ()
  treedef, leaves = site.output
  once = get_part(jax.tree_util.tree_unflatten(treedef, leaves), part, site.name, "output")
  return tuple(value.shape[: value.ndim - len(once.shape)])


def scan_iteration(name: str, lead: tuple[int, ...]) -> tuple[tuple[Any, ...], Any] | None:
  """The scan iterations the current call runs in, and their number in row-major order.

  None in a trace Flax makes of a scan body to learn its shapes (it sees no iteration
  numbers; what it computes is not kept).
  """
  iterations = scan_iterations()
  if any(i is None for i in iterations):
    raise UnsupportedFlaxFeatureError(
      f"{name}: this call runs inside an nn.vmap/nnx.vmap body, which computes all its"
      " elements at once, so they cannot be patched one at a time; only the iterations of"
      " nn.scan/nnx.scan bodies can. Choose the call that encloses the vmap instead."
    )
  if len(iterations) < len(lead):
    return None
  number = 0
  for i, size in zip(iterations, lead, strict=True):
    number = number * size + i
  return iterations, number


def position_mask(name: str, value: Any, axis: int, positions: tuple[int, ...], at: Any) -> Any:
  """A boolean mask, broadcasting to `value`, true at position `at` along `axis`."""
  if not is_axis(axis, value.ndim):
    raise ArgumentError(
      f"{name}: axis={axis!r} is not an axis of the value, of shape {tuple(value.shape)}."
      " Pass the axis of positions (axis=1 for (batch, sequence, ...) values)."
    )
  axis %= value.ndim
  size = value.shape[axis]
  outside = [p for p in positions if not 0 <= p < size]
  if outside:
    raise ArgumentError(
      f"{name}: positions {outside} are outside axis {axis} of the value, of shape"
      f" {tuple(value.shape)}. Give positions from 0 to {size - 1}."
    )
  shape = [1] * value.ndim
  shape[axis] = size
  return (jnp.arange(size) == at).reshape(shape)


def is_axis(axis: Any, rank: int) -> bool:
  """Whether `axis` is an int naming one of `rank` axes (negative: from the end)."""
  return isinstance(axis, int | np.integer) and not isinstance(axis, bool) and -rank <= axis < rank


def _units(names: list[str], leads: list[tuple[int, ...]]) -> tuple[str, ...]:
  """The row names: a site's name, with `[i]` (or `[i,j]`) per iteration of its scans."""
  out = []
  for name, lead in zip(names, leads, strict=True):
    if not lead:
      out.append(name)
      continue
    for index in np.ndindex(*lead):
      out.append(f"{name}[{','.join(map(str, index))}]")
  return tuple(out)


def row_labels(leads: list[tuple[int, ...]]) -> tuple[Any, ...]:
  """Each site's row numbers in the values, shaped as its scan axes (`()` for none)."""
  rows, start = [], 0
  for lead in leads:
    size = math.prod(lead)
    rows.append(jnp.arange(start, start + size).reshape(lead))
    start += size
  return tuple(rows)


def sweep_result(
  tree: CallNode, chosen: tuple[int, ...], values: Any, rows: Any, positions: Any
) -> SweepResult:
  sites = sites_of(tree)
  names = [sites[k].name for k in chosen]
  return SweepResult(values, _units(names, [r.shape for r in rows]), positions)


def checked_positions(positions: Any) -> tuple[int, ...] | None:
  if positions is None:
    return None
  try:
    given = np.asarray(positions).reshape(-1)
  except (TypeError, ValueError):
    given = None
  if given is not None and not given.size:
    raise ArgumentError("positions= is empty; give at least one position, or None.")
  # Bools and floats are refused, as index rules refuse them for where=: int() would
  # read True as position 1 and cut 1.7 to position 1 without a word. Ints too large
  # for NumPy come as objects, refused below as positions no axis has.
  listed = isinstance(positions, list | tuple)
  if (
    given is None
    or given.dtype.kind not in "iuO"
    or not all(isinstance(p, int | np.integer) and not isinstance(p, bool) for p in given)
    or (listed and any(isinstance(p, bool | np.bool_) for p in positions))
  ):
    raise ArgumentError(
      f"positions= takes integers (for example range(seq_len)), got {positions!r}. Give"
      " the positions as ints (not bools, floats or float arrays)."
    )
  out = tuple(int(p) for p in given)
  limits = np.iinfo(np.int32)
  beyond = [p for p in out if not limits.min <= p <= limits.max]
  if beyond:
    raise ArgumentError(
      f"positions= holds {beyond}, which no axis has: positions count from 0 along axis=."
      " Give positions from 0 to the axis's size - 1 (for example range(seq_len))."
    )
  return out


class PairedRuns(NamedTuple):
  """The clean and corrupted runs of a patching tool, checked against each other.

  Attributes:
    clean: the clean run's model arguments.
    corrupted: the corrupted run's model arguments.
    random_streams: the runs' random streams, resolved.
    arguments: `(name, shape)` of the corrupted run's arrays (what `with_runs` reads
      the batch from).
  """

  clean: ArgsAndKwargs
  corrupted: ArgsAndKwargs
  random_streams: Any
  arguments: list[tuple[str, tuple[int, ...]]]


def paired_runs(
  tree: CallNode,
  clean: Any,
  corrupted: Any,
  random_streams: Any,
  tool: str,
  why: str,
  broadcast: bool,
) -> PairedRuns:
  """The runs `tool` (`"fl.sweep"`) compares, as model arguments; refused where their
  values' shapes differ (or, with `broadcast`, do not broadcast), `why` saying why."""
  streams = resolve_random_streams(random_streams, tree.where())
  clean, corrupted = model_arguments(clean), model_arguments(corrupted)
  check_matching_runs(clean, corrupted, f"{tool} of {tree.where()}", why, broadcast=broadcast)
  arguments = [(name, tuple(x.shape)) for name, x in _budget.arrays_of(corrupted)]
  return PairedRuns(clean, corrupted, streams, arguments)


def metric_value(
  metric: Callable[[Any], Any],
  output: Any,
  scalar: bool,
  what: str = "metric",
  where: str | None = None,
) -> Any:
  """`metric(output)`, refused unless it is an array and, with `scalar` (a gradient is
  taken of it), a real floating-point scalar; `what` ("loss") and `where` (the tool,
  `"fl.train_interventions"`) name the function in the messages."""
  value = metric(output)
  the, gradients = (f"{where}: the", f"{where}: gradients") if where else ("The", "Gradients")
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    raise ArgumentError(
      f"{the} {what} must return an array (a scalar, say), got {type(value).__name__}."
    )
  if scalar and value.shape != ():
    raise ArgumentError(
      f"{gradients} need a scalar {what}; this one returned shape {tuple(value.shape)}."
      " Reduce it (for example .mean() or .sum())."
    )
  if scalar and not jnp.issubdtype(value.dtype, jnp.floating):
    raise ArgumentError(
      f"{gradients} need a real floating-point {what}; this one returned {value.dtype}."
      " Return a float computed from the output (a logit difference, a loss): an integer"
      " (an argmax, a count) has no gradient, and of a complex value take a real one"
      " (jnp.real(...), jnp.abs(...))."
    )
  return value


# --- sweep --------------------------------------------------------------------------------


def _patcher(name: str, base: int, lead: tuple[int, ...], positions: Any, axis: int) -> Callable:
  """The edit of one site in every patched forward: the clean value where chosen."""

  def patch_if_chosen(argument: Any, value: Any, clean: Any, unit: Any, at: Any) -> Any:
    del argument
    found = scan_iteration(name, lead)
    if found is None:
      return value
    iterations, number = found
    if iterations:
      clean = clean[tuple(iterations)]
    chosen = unit == base + number
    if positions is not None:
      chosen = chosen & position_mask(name, value, axis, positions, at)
    return jnp.where(chosen, clean, value)

  return patch_if_chosen


CORRUPTED_UNIT, CLEAN_UNIT = -1, -2  # the numbers of the unpatched forwards: no site has them
BASELINES = (CORRUPTED_UNIT, CLEAN_UNIT)


def with_clean(unit: Any, clean_output: Any, output: Any) -> Any:
  """`output`, or the clean forward's output for the clean baseline's unit."""
  return jax.tree_util.tree_map(
    lambda c, o: jnp.where(unit == CLEAN_UNIT, c, o) if isinstance(o, jax.Array) else o,
    clean_output,
    output,
  )


def patched_forwards(
  patched: Callable[[tuple[Any, Any]], Any], total: int, positions: Any, chunk_size: Any
) -> tuple[Any, tuple[Any, Any]]:
  """`patched((unit, position))` for every unit below `total` (× each position), batched
  with `jax.vmap` (or `jax.lax.map` in chunks), and for the two baselines: the values
  `(total[, positions], ...)` and the `(clean, corrupted)` metrics. The baselines patch
  nothing (units no site has): the corrupted run, and the clean run (its output taken
  from the clean forward, `with_clean`), so the metric is traced once for every number."""
  count = 1 if positions is None else len(positions)
  units = jnp.concatenate([jnp.repeat(jnp.arange(total), count), jnp.array(BASELINES)])
  at = jnp.tile(jnp.asarray(positions or (0,)), total)
  at = jnp.concatenate([at, jnp.zeros(len(BASELINES), at.dtype)])
  if chunk_size is None:
    values = jax.vmap(patched)((units, at))
  else:
    values = jax.lax.map(patched, (units, at), batch_size=chunk_size)
  values, baselines = values[: -len(BASELINES)], (values[-1], values[-2])
  if positions is not None:
    values = values.reshape(total, count, *values.shape[1:])
  return values, baselines


def _clean_run(tree, chosen, clean, part, streams) -> tuple[Copies, Any, list, list]:
  """What every sweep starts from: the copies of the tree, the clean run's output and the
  chosen sites' clean values, and each site's scan axes (`stacked_lead`)."""
  copies = Copies(tree, chosen)
  clean_output, clean_values = captured_values(copies, clean, part, streams)
  _, sites = copies.fresh()
  leads = [stacked_lead(s, v, part) for s, v in zip(sites, clean_values, strict=True)]
  return copies, clean_output, clean_values, leads


class SitePatch(NamedTuple):
  """How one swept site takes its clean value in the patched forwards.

  Attributes:
    on: the side of the call patched, "output" or "input".
    part: the part of the value patched, or None.
    clean: the site's clean value (stacked over the scans around it).
    patcher: `fn(argument, value, clean, unit, position)` (as `fl.modify` calls it): the
      clean value where the forward's `unit` (and `position`) is this site's, the
      value elsewhere.
  """

  on: str
  part: Any
  clean: Any
  patcher: Callable[..., Any]


def sweep_forwards(
  copies: Copies,
  clean_output: Any,
  patches: list[SitePatch],
  units: int,
  corrupted: ArgsAndKwargs,
  metric: Callable[[Any], Any],
  positions: tuple[int, ...] | None,
  chunk_size: int | None,
  streams: Any,
) -> tuple[Any, Any]:
  """`(values, baselines)` of the patched corrupted forwards of `units` units (and
  positions), one program: every forward carries each site's patch (`copies`' chosen
  sites, in order), which keeps the corrupted value but for the forward's unit."""

  def patched(unit_and_position: tuple[Any, Any]) -> Any:
    unit, position = unit_and_position
    copy, sites = copies.fresh()
    edits = tuple(
      make_intervention(
        "modify", site.node, (p.clean, unit, position), None, p.on, p.part, fn=p.patcher
      )
      for site, p in zip(sites, patches, strict=True)
    )
    output, _ = indexed_run(copy, corrupted, edits, None, streams)
    return metric_value(metric, with_clean(unit, clean_output, output), scalar=False)

  return patched_forwards(patched, units, positions, chunk_size)


def _sweep(tree, clean, corrupted, chosen, metric, positions, axis, part, chunk_size, streams):
  copies, clean_output, clean_values, leads = _clean_run(tree, chosen, clean, part, streams)
  bases = np.cumsum([0, *(math.prod(lead) for lead in leads)]).tolist()
  _, sites = copies.fresh()
  patches = [
    SitePatch("output", part, value, _patcher(site.name, base, lead, positions, axis))
    for site, base, lead, value in zip(sites, bases, leads, clean_values, strict=False)
  ]
  values, baselines = sweep_forwards(
    copies, clean_output, patches, bases[-1], corrupted, metric, positions, chunk_size, streams
  )
  return values, row_labels(leads), baselines


def _shared_prefix_sweep(tree, clean, corrupted, chosen, metric, positions, axis, part, streams):
  """The values of `_sweep`, each patched forward run one after another with the calls
  before its site handed on from one corrupted base run (`_shared_prefix.py`)."""
  copies, clean_output, clean_values, leads = _clean_run(tree, chosen, clean, part, streams)
  count = 1 if positions is None else len(positions)

  def patched(*inputs: Any) -> Any:
    copy, sites = copies.fresh()
    edits = tuple(
      make_intervention(
        "modify",
        site.node,
        (value, inputs[2 * k], inputs[2 * k + 1]),
        None,
        "output",
        part,
        fn=_patcher(site.name, 0, lead, positions, axis),
      )
      for k, (site, lead, value) in enumerate(zip(sites, leads, clean_values, strict=True))
    )
    output, _ = indexed_run(copy, corrupted, edits, None, streams)
    # The last input is CLEAN_UNIT for the clean baseline's unit: the metric is traced once.
    return metric_value(metric, with_clean(inputs[-1], clean_output, output), scalar=False)

  # Each input pair (iteration, position) belongs to one site; a unit sets its site's
  # pair and leaves every other at the base pair (-1: no iteration, so nothing patched).
  owners, iterations, at = [], [], []
  for k, lead in enumerate(leads):
    for n in range(math.prod(lead)):
      for p in positions or (0,):
        owners.append(k)
        iterations.append(n)
        at.append(p)
  clean = len(leads)  # the owner of the last input: the unit taking the clean output
  owners.append(clean)
  owners = np.asarray(owners, np.int32)
  inputs = []
  for k in range(len(leads)):
    mine = owners == k
    inputs.append(jnp.asarray(np.where(mine, iterations + [0], -1).astype(np.int32)))
    inputs.append(jnp.asarray(np.where(mine, at + [0], 0).astype(np.int32)))
  inputs.append(jnp.asarray(np.where(owners == clean, CLEAN_UNIT, CORRUPTED_UNIT).astype(np.int32)))
  base = [jnp.int32(-1), jnp.int32(0)] * len(leads) + [jnp.int32(CORRUPTED_UNIT)]
  of_input = [*(k for k in range(len(leads)) for _ in (0, 1)), clean]
  corrupted_metric, values = _shared_prefix.mapped_over_units(
    patched, base, of_input, inputs, owners, len(leads) + 1
  )
  values, clean_metric = values[:-1], values[-1]
  if positions is not None:
    values = values.reshape(-1, count, *values.shape[1:])
  return values, row_labels(leads), (clean_metric, corrupted_metric)


_sweep_compiled = jit_keyed_on_function(_sweep, "metric", "fl.sweep")
_shared_prefix_sweep_compiled = jit_keyed_on_function(_shared_prefix_sweep, "metric", "fl.sweep")


def _forwards_in(tree: CallNode, corrupted: ArgsAndKwargs, metric: Callable, streams, budget):
  """How many patched forwards fit `budget` bytes at once, each estimated as the abstract
  size of one forward on `corrupted`: every call's output (what a forward holds when
  each call's output is kept) and the metric's value.

  Raises:
    BudgetError: one forward does not fit; the largest calls are named.
  """
  options = RunOptions(capture=True, random_streams=streams, unreached="ignore")
  (output, captured), _ = abstract_run(tree, corrupted, options)
  value = jax.eval_shape(lambda out: metric_value(metric, out, scalar=False), output)
  per_forward = _budget.nbytes(captured) + _budget.nbytes(value)
  if per_forward > budget:
    sizes = {name: _budget.nbytes(v) for name, v in captured.items()}
    ranked = sorted(sizes.items(), key=lambda item: -item[1])
    listed = ", ".join(f"{k}: {v:,}" for k, v in ranked[:8])
    raise BudgetError(
      f"fl.sweep of {tree.where()}: budget={budget:,} bytes does not hold one patched"
      f" forward, estimated at {per_forward:,} bytes (every call's output: {listed}"
      f"{' ...' if len(ranked) > 8 else ''}; and the metric's value). Sweep a smaller"
      f" batch, or give a budget of at least {per_forward:,} bytes."
    )
  return budget // per_forward


@takes_model_arguments("fl.sweep(tree, clean, corrupted, 'Block_*', metric, positions=range(8))")
def sweep(
  tree: CallNode,
  clean: Any,
  corrupted: Any,
  /,
  at: Any,
  metric: Callable[[Any], Any],
  *,
  positions: Any = None,
  axis: int = 1,
  part: Any = None,
  chunk_size: int | None = None,
  budget: int | None = None,
  per_example: bool = False,
  share_prefix: bool | None = None,
  random_streams: Any = None,
  jit: bool = True,
) -> SweepResult:
  """Activation patching over many sites in one compiled call: a metric per site.

  For each site (and each position), runs the tree on `corrupted` with that site's
  output replaced by its value in a run on `clean`, and returns `metric(output)`. The
  clean forward runs once, and the patched forwards run in one program, compiled once
  per shape, sites and metric. With shared prefixes (the default on CPU), the corrupted
  forward runs once unpatched and each patched forward then runs alone, computing only
  what depends on its site (about (L+1)/2 of L blocks) and taking the rest from that
  run. Batched (the default elsewhere), the patched forwards run whole under
  `jax.vmap` (or `jax.lax.map` in batches of `chunk_size`, to bound memory). A call
  inside an `nn.scan`/`nnx.scan` body is swept one iteration at a time
  (`"layers/mlp[3]"`: iteration 3).

  Each result equals the single patch `fl.run(tree, corrupted, interventions=
  [fl.patch(site, clean_value, where=...)])` followed by `metric`: the same operations
  on the same values. With shared prefixes each runs at the single patch's shapes and
  equals it bit for bit in our tests (XLA does not promise it). Batched, XLA may round
  the batch differently (a float32 ulp or two; bit for bit where the arithmetic is
  exact). Every forward starts from the tree's state, which the sweep leaves unchanged.

  Args:
    tree: a converted tree (`fl.unflaxify`).
    clean: the clean run's model arguments, as `fl.run` takes them: one value, a tuple
      of positional arguments, or `fl.ArgsAndKwargs` (keyword arguments too).
    corrupted: the corrupted run's arguments, alike.
    at: the sites, as `fl.run` takes them (`"h/*"`, `"**/mlp"`, a module class, ...),
      an `fl.heads` (one row per head), or a list mixing these: its rows in the list's
      order (each `fl.heads`, and each run of other sites, swept as one sweep).
    metric: a function of the model's output returning an array (a scalar, say: the
      logit difference of two answers).
    positions: patch one position at a time, for each of these integers (for example
      `range(seq_len)`) along `axis`; None patches the whole value.
    axis: the axis of positions in each site's value (per iteration): 1 for
      `(batch, sequence, features)`.
    part: for sites returning a tuple, dict or dataclass, which part to patch (Hugging
      Face blocks return tuples: `part=0`; docs/interventions.md, "Structured values: part=").
    chunk_size: run the patched forwards in batches of this many (None: all at once).
    budget: the most bytes the patched forwards computed at once may take, or None:
      `chunk_size` is chosen as `budget // (bytes of one forward)`, one forward being
      estimated from its abstract shapes as every call's output and the metric's
      value (a forward's own temporaries inside calls are not counted). Not with
      `chunk_size`.
    per_example: the metric returns one value per example (its leading axis: shape
      `(batch, ...)`, for example `lambda out: out[:, -1, a] - out[:, -1, b]`); the
      result keeps every example's value (`per_example`, examples last) and `values` is
      their mean. Needed for `SweepResult.bootstrap` and `SweepResult.p_values`.
    share_prefix: True: patched forwards one at a time, each sharing what precedes its
      site with one unpatched corrupted run (see docs/sweeps.md). False: batched. None
      (default): True on CPU for sweeps over calls without `chunk_size` or `budget`,
      else False. Not for `fl.heads` sites or with `chunk_size`; with `budget`, the
      budget must hold two forwards.
    random_streams: as for a tree call, used by every run.
    jit: compile (default); pass False inside your own `jax.jit`.

  Returns:
    A `SweepResult`: `values` of shape `(sites, [positions,] *metric shape)`, `sites`
    (names), `positions`, the unpatched clean and corrupted runs' metrics (`clean`,
    `corrupted`: the forwards patching nothing) and, with
    `per_example`, every example's values.

  Raises:
    SelectionError: a site matches no call (the closest names are listed).
    ArgumentError: a site returns a structure and `part` is missing, a position or
      `axis` does not fit a site's value, `per_example` with a scalar metric, or the
      clean and corrupted arguments differ in structure or shapes.
    UnsupportedFlaxFeatureError: a site runs inside an `nn.vmap`/`nnx.vmap` body.
    BudgetError: one patched forward does not fit `budget` (two, with shared prefixes).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> clean, corrupted = jnp.ones((1, 3)), -jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), clean), clean)
    >>> result = fl.sweep(tree, clean, corrupted, "layers_*", lambda out: out[0, 0])
    >>> result.sites, result.values.shape
    (('layers_0', 'layers_2', 'layers_4'), (3,))
    >>> bool(result.values[-1] == model.apply(tree.export(), clean)[0, 0])
    True
  """
  check_tree(tree, "fl.sweep")
  check_callable(metric, "metric", "fl.sweep")
  part = checked_part(part, "fl.sweep")
  if isinstance(at, list | tuple) and any(isinstance(a, SiteObject) for a in at):
    # One sweep per site object (fl.heads) and per run of other sites, rows joined.
    options = dict(positions=positions, axis=axis, part=part, chunk_size=chunk_size)
    options.update(budget=budget, per_example=per_example, share_prefix=share_prefix)
    options.update(random_streams=random_streams, jit=jit)
    groups = _site_groups(at)
    return _joined([sweep(tree, clean, corrupted, g, metric, **options) for g in groups])
  positions = checked_positions(positions)
  if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
    raise ArgumentError(f"chunk_size= is a positive integer or None, got {chunk_size!r}.")
  budget = _budget.checked_budget(budget, "fl.sweep")
  if budget is not None and chunk_size is not None:
    raise ArgumentError(
      f"fl.sweep: chunk_size={chunk_size} and budget={budget} both set how many patched"
      " forwards run at once. Pass one of them: budget= chooses the chunk size for you."
    )
  if isinstance(at, SiteObject) and not isinstance(at, Sweepable):
    raise refuse_site_object(at, Sweepable, "fl.sweep")
  sweeps_itself = at if isinstance(at, Sweepable) else None  # a site of many units (fl.heads)
  chosen = None if sweeps_itself is not None else chosen_sites(tree, at, part)
  runs = paired_runs(tree, clean, corrupted, random_streams, "fl.sweep", _MATCHING, True)
  clean, corrupted, streams = runs.clean, runs.corrupted, runs.random_streams
  if share_prefix not in (None, False, True):
    raise ArgumentError(
      f"fl.sweep: share_prefix= is True, False or None (chosen for you), got {share_prefix!r}."
    )
  if share_prefix is None:
    share_prefix = _shares_by_default(sweeps_itself, chunk_size, budget)
  if share_prefix:
    _check_shared_prefix(tree, sweeps_itself, chunk_size, corrupted, metric, streams, budget)
    run = _shared_prefix_sweep_compiled if jit else _shared_prefix_sweep
    values, rows, baselines = run(
      tree, clean, corrupted, chosen, metric, positions, axis, part, streams
    )
    result = sweep_result(tree, chosen, values, rows, positions)
  else:
    if budget is not None:
      chunk_size = _forwards_in(tree, corrupted, metric, streams, budget)
    if sweeps_itself is not None:
      options = SweepOptions(positions, axis, part, chunk_size, streams, jit)
      swept = sweeps_itself.sweep_units(tree, clean, corrupted, metric, options)
      result = SweepResult(swept.values, swept.names, positions, heads=swept.heads)
      baselines = (swept.clean, swept.corrupted)
    else:
      run = _sweep_compiled if jit else _sweep
      values, rows, baselines = run(
        tree, clean, corrupted, chosen, metric, positions, axis, part, chunk_size, streams
      )
      result = sweep_result(tree, chosen, values, rows, positions)
  return _statistics.with_runs(
    result, *baselines, per_example=per_example, where="fl.sweep", arguments=runs.arguments
  )


_MATCHING = (
  "fl.sweep patches each site's value from the clean run into the corrupted run, so the"
  " clean run's values must have the corrupted run's shapes (or broadcast to them)."
)


def _site_groups(at: list | tuple) -> list[Any]:
  """The sites of a list holding site objects (`fl.heads`): each site object alone, and
  each run of other sites between them as one list, in the list's order."""
  groups: list[Any] = []
  for a in at:
    if isinstance(a, SiteObject):
      groups.append(a)
    elif groups and isinstance(groups[-1], list):
      groups[-1].append(a)
    else:
      groups.append([a])
  return groups


def _joined(results: list[SweepResult]) -> SweepResult:
  """The rows of `results` (sweeps of the same runs and options) as one result; the clean
  and corrupted metrics are the first sweep's. The rows are heads (`heads`, drawn as a
  grid) only where every sweep's rows are."""
  first = results[0]
  per_example = first.per_example
  if per_example is not None:
    per_example = jnp.concatenate([r.per_example for r in results])
  heads = None
  if all(r.heads is not None for r in results):
    heads = tuple(head for r in results for head in r.heads)
  return dataclasses.replace(
    first,
    values=jnp.concatenate([r.values for r in results]),
    sites=tuple(name for r in results for name in r.sites),
    per_example=per_example,
    heads=heads,
  )


def _shares_by_default(sweeps_itself: Any, chunk_size: Any, budget: Any) -> bool:
  """Whether a sweep shares prefixes when not told: for calls (not `fl.heads` units),
  with no `chunk_size` or `budget`, on CPU, where one patched forward at a time with its
  prefix shared costs less than the batch of whole forwards (see docs/sweeps.md)."""
  return (
    sweeps_itself is None
    and chunk_size is None
    and budget is None
    and jax.default_backend() == "cpu"
  )


def _check_shared_prefix(tree, sweeps_itself, chunk_size, corrupted, metric, streams, budget):
  """Refuses what a sweep with `share_prefix=True` cannot do."""
  if sweeps_itself is not None:
    raise ArgumentError(
      f"fl.sweep of {tree.where()}: share_prefix=True sweeps calls, and fl.heads units are"
      " parts of one call's value. Leave share_prefix=False for a heads sweep."
    )
  if chunk_size is not None:
    raise ArgumentError(
      f"fl.sweep of {tree.where()}: share_prefix=True runs the patched forwards one at a"
      f" time, so chunk_size={chunk_size} has nothing to set. Pass one of them."
    )
  if budget is not None and _forwards_in(tree, corrupted, metric, streams, budget) < 2:
    raise BudgetError(
      f"fl.sweep of {tree.where()}: share_prefix=True holds the corrupted base run's values"
      " while it runs one patched forward, about two forwards at once, and"
      f" budget={budget:,} bytes holds one. Give a budget of at least two forwards, or"
      " leave share_prefix=False."
    )
