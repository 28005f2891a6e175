"""The probed run: a tree run once with some calls edited and some captured.

`fl.run` resolves the sites of the interventions and captures against the tree, attaches
a probe per call (`core/_probes.py`), and runs the tree once: eagerly, compiled, or
compiled in chunks of the batch under a memory budget. `fl.place` keeps the edited calls
in the tree instead. No Flax internals here."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import check_items, refuse
from flaxlens.core._edit import EditedCall
from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._probes import OneIteration, Probing, check_iteration
from flaxlens.core._runtime import resolve_random_streams, run_tree
from flaxlens.core._struct import Struct
from flaxlens.core._variables import (
  Scratch,
  StateVariable,
  variables_in,
)
from flaxlens.errors import (
  ArgumentError,
  BudgetError,
  FlaxlensError,
  SelectionError,
)
from flaxlens.tools.base import _budget
from flaxlens.tools.base._calling import model_arguments, takes_model_arguments
from flaxlens.tools.base._index import checked, is_array
from flaxlens.tools.base._index import split as _split_index
from flaxlens.tools.base._intervention import Intervention, maker_label, static_at
from flaxlens.tools.base._site_objects import Intervenable, SiteObject, refuse_site_object
from flaxlens.tools.base._sites import (
  Called,
  Site,
  check_part,
  every_call,
  no_match,
  select_iterations,
  sites_of,
)

# --- running ------------------------------------------------------------------------------


def checked_interventions(interventions: Any, where: str) -> tuple[Intervention, ...]:
  """`interventions` as a tuple of `Intervention`s (one alone counts as a list of one);
  anything else refused naming `where` (`"fl.run"`)."""
  if isinstance(interventions, Intervention):
    return (interventions,)
  expected = (
    "a list of interventions (fl.ablate, fl.patch, fl.steer, fl.scale, fl.modify,"
    " fl.low_rank_edit or fl.interchange results)"
  )
  fix = "Pass [] for none, or fl.load_interventions(path) for a saved set."
  if not isinstance(interventions, list | tuple):
    raise refuse(where, "interventions", interventions, expected, fix)
  return check_items(interventions, Intervention, where, "interventions", expected, fix)


def edited_calls(
  tree: CallNode,
  interventions: Sequence[Intervention],
  capture: Any,
  inputs: bool,
  shape: Callable[[Any], Any] | None,
  unreached: str = "raise",
) -> dict[int, EditedCall]:
  """The `EditedCall` each probed call runs through, by `id` of its node;
  `unreached="raise"` requires the run to make every call a site names, save where the
  site is every call (`capture=True`, `"all"`, `"**"`)."""
  sites = sites_of(tree)
  found: dict[int, dict[str, Any]] = {}

  def probe(site: Site) -> dict[str, Any]:
    fields = found.get(id(site.node))
    if fields is None:
      fields = found[id(site.node)] = {"node": site.node, "site": site.name, "edits": []}
    return fields

  for intervention in interventions:
    required = unreached == "raise" and not every_call(intervention.at)
    for site, edit in _edits_of(tree, intervention, sites):
      check_part(site, edit.part, edit.on, intervention.at, sites)
      fields = probe(site)
      fields["edits"].append(edit)
      fields["required"] = fields.get("required", False) or required
  if capture is not None and capture is not False:
    options = capture if isinstance(capture, tuple) else (capture,)
    # A site object (`fl.heads`) captures through edits of its own and says where they go.
    recording = [o for o in options if isinstance(o, SiteObject)]
    plain = tuple(o for o in options if not isinstance(o, SiteObject))
    # An empty list names no site: refused (`select_sites`), as a patch at no site is.
    chosen = (
      sites
      if capture is True
      else [site for site, _ in select_iterations(tree, plain, sites)]
      if plain or not recording
      else []
    )
    required = unreached == "raise" and not every_call(capture)
    for site in chosen:
      fields = probe(site)
      fields.update(output=True, input=inputs)
      fields["shape"] = None if shape is None else functools.partial(shape, site.name)
      fields["required"] = fields.get("required", False) or required
    for option in recording:
      for site, edit in option.capture_edits(tree, sites, shape):
        fields = probe(site)
        fields["edits"].append(edit)
        fields["required"] = fields.get("required", False) or unreached == "raise"
  return {
    key: EditedCall(**{**fields, "edits": tuple(fields["edits"])}) for key, fields in found.items()
  }


def probed_run(
  tree: CallNode,
  argument: ArgsAndKwargs,
  probes: dict[int, EditedCall],
  random_streams: Any,
  key: Any,
  unreached_fix: str,
  *,
  indexed: bool = False,
  every_call: bool = False,
) -> tuple[Any, dict[str, Any]]:
  """`(output, captured)` of one run of `tree` on `argument`, each call in `probes` (by
  `id` of its node, as `edited_calls` makes them) run through its `EditedCall`.

  Args:
    tree: the tree run (a `Copies.fresh()` copy where the run may write state).
    argument: the model's arguments.
    probes: the edited calls.
    random_streams: the run's random streams, resolved.
    key: what, with the tree's structure, tells compiled runs apart (the edits and
      captures, hashable).
    unreached_fix: the end of the refusal of a required call the run did not make.
    indexed: whether edits read the scan iterations they run in (`scan_iterations()`).
    every_call: whether the probes are every call (the run's, not conversion's).
  """
  probing = Probing(probes, indexed=indexed, unreached_fix=unreached_fix, every_call=every_call)
  output = run_tree(tree, argument, random_streams, {}, probing=probing, probing_key=key)
  return output, probing.captured


class Copies:
  """Fresh copies of a tree to run and throw away, and of the sites chosen among
  `sites_of(tree)` (by index): each copy's variables are its own (`Scratch`), so a run
  that writes state leaves the tree and the other copies alone.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.tools.base._probed import Copies
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> copy, sites = Copies(tree, (2,)).fresh()
    >>> copy is tree, [site.name for site in sites]
    (False, ['layers_2'])
  """

  def __init__(self, tree: CallNode, chosen: tuple[int, ...] | None = None):
    self.scratch = Scratch(tree)
    self.chosen = chosen

  def fresh(self) -> tuple[CallNode, list[Site]]:
    """A copy of the tree and its chosen sites (every site where none were chosen)."""
    copy = self.scratch.copy()
    sites = sites_of(copy)
    return copy, sites if self.chosen is None else [sites[k] for k in self.chosen]


def _edits_of(
  tree: CallNode, intervention: Intervention, sites: list[Site]
) -> list[tuple[Site, Any]]:
  """The calls `intervention` edits and the edit each runs: itself at each site its `at`
  names, or what a site object (`fl.heads`) says."""
  if isinstance(intervention.at, Intervenable):
    return intervention.at.edits_of(tree, sites, intervention)
  if isinstance(intervention.at, SiteObject):
    raise refuse_site_object(intervention.at, Intervenable, "fl.run")
  return [
    (site, intervention if iteration is None else OneIteration(intervention, iteration))
    for site, iteration in select_iterations(tree, intervention.at, sites)
  ]


def _check_dtype(dtype: Any) -> None:
  """Refuses a capture `dtype=` that is no numeric or boolean dtype, before anything runs."""
  if dtype is None:
    return
  try:
    numeric = jnp.issubdtype(jnp.dtype(dtype), jnp.number) or jnp.dtype(dtype) == jnp.bool_
  except (TypeError, ValueError):
    numeric = False
  if not numeric:
    raise ArgumentError(
      f"fl.run/fl.capture: dtype={dtype!r} is not a dtype JAX computes with. Give the dtype"
      " to cast every captured array to (jnp.float16, 'bfloat16'), or leave dtype= out."
    )


def _shaper(index: Any, dtype: Any) -> Callable[[str, Any], Any] | None:
  """Slicing and casting of a site's captured arrays, `shape(site name, array)`; `index`
  as `_split_index` returns it, checked against each array (index rules)."""
  if index is None and dtype is None:
    return None

  def shape(site: str, x: Any) -> Any:
    if x is None:
      return None
    if index is not None:
      x = x[checked(*index, tuple(x.shape), f"{site}: index=", "captured value")]
    return x if dtype is None else x.astype(dtype)

  return shape


class RunOptions(NamedTuple):
  """What one probed run does besides running the tree: a pytree (its arrays, the
  interventions' operands, are inputs of the compiled program; the rest is static).

  Attributes:
    interventions: the interventions, applied in order.
    capture: the sites to capture (a pattern, class, node, predicate or tuple of these,
      True for every call), or None.
    inputs: whether each captured call's positional arguments are captured too.
    index: the static structure of `index=` (`_index.split`), or None.
    dtype: the dtype captured arrays are cast to, or None.
    random_streams: the run's random streams (Linen: `{"dropout": key}`), or None.
    unreached: "raise" or "ignore" (see `fl.run`).
  """

  interventions: tuple[Intervention, ...] = ()
  capture: Any = None
  inputs: bool = False
  index: Any = None
  dtype: Any = None
  random_streams: Any = None
  unreached: str = "raise"


def run_once(tree: CallNode, argument: ArgsAndKwargs, options: RunOptions) -> Any:
  """`(output, captured)` of one run of `tree` on `argument`, traced or eager."""
  interventions, capture, unreached = options.interventions, options.capture, options.unreached
  shape = _shaper(options.index, options.dtype)
  probes = edited_calls(tree, interventions, capture, options.inputs, shape, unreached)
  all_calls = unreached == "raise" and (
    every_call(capture) or any(every_call(i.at) for i in interventions)
  )
  key = (interventions, capture, options.inputs, options.index, options.dtype)
  slices, whole = _iteration_captures(tree, capture)
  indexed = bool(slices) or any(
    isinstance(edit, OneIteration) for call in probes.values() for edit in call.edits
  )
  probing = Probing(probes, indexed=indexed, unreached_fix=_UNREACHED_FIX, every_call=all_calls)
  output = run_tree(tree, argument, options.random_streams, {}, probing=probing, probing_key=key)
  return output, _sliced(probing, slices, whole, options.inputs)


class _IterationCapture(NamedTuple):
  """A captured site given with an iteration suffix (`"layers[2]"`)."""

  name: str  # as given: the key of its value in the result
  site: str  # the site's name: the key of its stacked value in the run's captures
  iteration: tuple[int, ...]


def _iteration_captures(tree: CallNode, capture: Any) -> tuple[list[_IterationCapture], set[str]]:
  """The captured sites `capture` names with an iteration suffix, and the names of the
  sites it names without one (captured whole)."""
  if capture is None or isinstance(capture, bool) or every_call(capture):
    return [], set()
  options = capture if isinstance(capture, tuple) else (capture,)
  sites = sites_of(tree)
  found, whole = [], set()
  for option in options:
    if isinstance(option, SiteObject):
      continue
    for site, iteration in select_iterations(tree, option, sites):
      if iteration is None:
        whole.add(site.name)
      else:
        name = f"{site.name}[{','.join(map(str, iteration))}]"
        found.append(_IterationCapture(name, site.name, iteration))
  return found, whole


def _sliced(
  probing: Probing, slices: list[_IterationCapture], whole: set[str], inputs: bool
) -> dict[str, Any]:
  """The run's captures with each site given with an iteration suffix as that iteration
  of its stacked value (`value[2]`), under its name with the suffix; a site captured
  only so is left out whole."""
  captured = dict(probing.captured)
  suffixes = ("", ":input") if inputs else ("",)
  for sliced in slices:
    check_iteration(sliced.site, sliced.iteration, probing.enclosing.get(sliced.site, ()))
    for suffix in suffixes:
      captured[sliced.name + suffix] = jax.tree_util.tree_map(
        lambda x, at=sliced.iteration: x[at], captured[sliced.site + suffix]
      )
  for site in {s.site for s in slices} - whole:
    for suffix in suffixes:
      del captured[site + suffix]
  return captured


_UNREACHED_FIX = (
  "Convert with example arguments that take this branch, or, to edit or capture these"
  " calls only where a run makes them, pass unreached='ignore' to fl.run or fl.capture."
)


@variable_jit
def _run_compiled(tree: CallNode, argument: ArgsAndKwargs, options: RunOptions) -> Any:
  return run_once(tree, argument, options)


@variable_jit
def _run_chunk(tree: CallNode, argument: ArgsAndKwargs, indices: Any, options: RunOptions) -> Any:
  """`run_once` on the examples of `argument` at `indices` (traced: one program a size)."""
  return run_once(tree, _budget.take(argument, indices), options)


def abstract_run(
  tree: CallNode, argument: ArgsAndKwargs, options: RunOptions
) -> tuple[Any, list[str]]:
  """The abstract `(output, captured)` of a run on `argument` (its arrays may be
  `jax.ShapeDtypeStruct`s) and the labels of the state variables the run would update.
  Runs a copy of the tree under `jax.eval_shape`: no FLOPs, the tree left alone."""
  scratch = Scratch(tree)
  updated: list[str] = []

  def run_copy(arg: ArgsAndKwargs) -> Any:
    copy = scratch.copy()
    variables = variables_in(copy)
    before = [v.value for v in variables]
    result = run_once(copy, arg, options)
    updated[:] = [
      v.label
      for v, old in zip(variables, before, strict=True)
      if isinstance(v, StateVariable) and v.value is not old
    ]
    return result

  return _budget.abstractly(run_copy, argument), updated


def _site_key(path: Any) -> str:
  return str(path[0].key)


def _output_key(path: Any) -> str:
  return f"the output{jax.tree_util.keystr(path)}"


def _run_budgeted(tree: CallNode, argument: ArgsAndKwargs, options: RunOptions, budget: int) -> Any:
  """`(output, captured)` of a run on `argument`, on the host, the captures of each compiled
  call taking at most `budget` bytes: the batch split into equal chunks where needed,
  refused where splitting cannot give the result of the whole batch."""
  where = f"{tree.where()} with budget={budget:,} bytes"
  whole, updated = abstract_run(tree, argument, options)
  if _budget.nbytes(whole[1]) <= budget:
    return jax.device_get(_run_compiled(tree, argument, options))
  batch = _budget.batch_size(argument, where)
  _refuse_splitting(where, updated, options)
  if batch == 1:
    sizes = {key: _budget.nbytes(value) for key, value in whole[1].items()}
    _budget.examples_per_chunk(_budget.nbytes(whole[1]), 0, sizes, budget, 1, where)
  try:
    one, _ = abstract_run(tree, _budget.shrunk(argument, 1), options)
  except FlaxlensError as e:
    raise BudgetError(
      f"{where}: the captures exceed the budget, so the batch of {batch} would be split"
      f" into chunks, and a run on one example fails: {e} An intervention whose arrays"
      " hold the whole batch (a patch of every example, resampling, a mask or index over"
      " the batch axis) cannot apply to a chunk. Give arrays that broadcast over the batch,"
      " or capture less (fewer sites, index=, dtype=) and run without splitting."
    ) from e
  outputs = _budget.layout(whole[0], one[0], batch, where, _output_key)
  captures = _budget.layout(whole[1], one[1], batch, where, _site_key)
  size = _budget.examples_per_chunk(
    captures.per_example, captures.fixed, captures.sizes(one[1]), budget, batch, where
  )
  argument = jax.tree_util.tree_map(lambda x: jnp.asarray(x) if is_array(x) else x, argument)
  chunks = _Chunks(tree, argument, options)
  # Where the budget holds one example, the check's chunks of two capture nothing and
  # their outputs are compared. The message names the first site that differs.
  captured = size > 1
  order = [(site.name, tuple(site.node.path)) for site in sites_of(tree)]
  _budget.check_independent(
    lambda indices: chunks.run(indices, captured)[: 1 + captured],
    (outputs, captures)[: 1 + captured],
    size,
    batch,
    where,
    exceeding="the captures",
    fix=(
      "Capture less (fewer sites, index=, dtype=) and run without splitting, or give a"
      " larger budget."
    ),
    named=lambda found: _innermost(found, order),
  )
  chunk_starts = _budget.starts(batch, size)
  ran = [chunks.run(tuple(_budget.examples(start, size, batch).tolist())) for start in chunk_starts]
  varying = _budget.varying([r[1] for r in ran], captures)
  if varying is not None:
    raise BudgetError(
      f"{where}: the capture {varying} has the same shape for any number of examples (it"
      " holds no batch axis: index= dropped it, or it reduces over the batch), yet differs"
      " between chunks of the batch, so no chunk gives the whole batch's value. Keep the"
      " batch axis in what you capture (index=jnp.s_[:, ...]), or capture less and run"
      " without splitting."
    )
  return (
    _budget.joined([r[0] for r in ran], chunk_starts, size, outputs),
    _budget.joined([r[1] for r in ran], chunk_starts, size, captures),
  )


def _refuse_splitting(where: str, updated: list[str], options: RunOptions) -> None:
  """Refuses to split a batch whose chunks would not give the whole batch's result: a run
  that updates state, draws random numbers, or selects examples by where=."""
  if updated:
    raise BudgetError(
      f"{where}: the captures exceed the budget, and a run updates the state variables"
      f" {updated[:6]}{' ...' if len(updated) > 6 else ''}: chunks of the batch would each"
      " update them, in turn, where the whole batch updates them once (batch statistics"
      " over the batch, a counter, NNX random counts). Run the model in a mode that updates"
      " no state (train=False, model.eval()), or capture less (fewer sites, index=, dtype=)."
    )
  if options.random_streams is not None:
    raise BudgetError(
      f"{where}: the captures exceed the budget, and the run is given random_streams:"
      " every chunk of the batch would draw the same random numbers (a dropout mask made"
      " for a chunk's rows), where the whole batch draws them once for all its rows. Run"
      " without random_streams (a deterministic mode: train=False), or capture less"
      " (fewer sites, index=, dtype=)."
    )
  picking = [
    maker_label(i.kind, i.at) for i in options.interventions if _budget.picks_examples(i.index)
  ]
  if picking:
    raise BudgetError(
      f"{where}: the captures exceed the budget, and the where= of {', '.join(picking)}"
      " selects along the leading (batch) axis: applied to each chunk of the batch, it"
      " would select its examples in every chunk. Edit every example alike (where="
      " starting with ':' or '...'), or capture less (fewer sites, index=, dtype=) and run"
      " without splitting."
    )


class _Chunks:
  """Runs of chunks of a batch, each on the host and run once."""

  def __init__(self, tree: CallNode, argument: ArgsAndKwargs, options: RunOptions):
    self.tree, self.argument, self.options = tree, argument, options
    self.done: dict[tuple[tuple[int, ...], bool], Any] = {}

  def run(self, indices: tuple[int, ...], captured: bool = True) -> Any:
    """The host `(output, captured)` of the examples at `indices` (without captures where
    not `captured`)."""
    if (indices, captured) not in self.done:
      options = self.options if captured else self.options._replace(capture=None)
      ran = _run_chunk(self.tree, self.argument, np.asarray(indices, np.int32), options)
      # Copied out, so the device's buffers go now: on CPU a NumPy view of an array would
      # keep its buffer alive, and the chunks would together hold the whole batch's bytes.
      self.done[indices, captured] = jax.tree_util.tree_map(lambda x: np.array(x, copy=True), ran)
      del ran
    return self.done[indices, captured]


def _innermost(found: list[str], order: list[tuple[str, tuple]]) -> str:
  """Of the captures that differ, the first in call order (`order`: each site's name and
  module path) that encloses no other one: where a difference starts, not a call around
  it; the output where no site differs."""
  paths = {name: path for name, path in order}
  sites = [name for name, _ in order if name in found or f"{name}:input" in found]
  inner = [
    name
    for name in sites
    if not any(o != name and paths[o][: len(paths[name])] == paths[name] for o in sites)
  ]
  return inner[0] if inner else found[0]


@takes_model_arguments("fl.run(tree, fl.ArgsAndKwargs.capture(x, train=False), capture='**')")
def run(
  tree: CallNode,
  args: Any,
  /,
  *,
  interventions: Sequence[Intervention] = (),
  capture: Any = None,
  inputs: bool = False,
  index: Any = None,
  dtype: Any = None,
  random_streams: Any = None,
  jit: bool = True,
  unreached: str = "raise",
  budget: int | None = None,
) -> Any:
  """Runs a converted tree on `args` with interventions, capturing calls.

  The tree runs once, natively (every call not intervened on is Flax's own), compiled
  with `jax.jit` by default: the tree's variables, the arguments' arrays and the
  interventions' arrays are inputs of the compiled program, so new values (a steering
  strength, a patch, edited weights) reuse it; sites, kinds and Python values of the
  arguments are compiled in. Called inside your own `jax.jit`, `jax.vmap` or `jax.grad`,
  pass `jit=False`.

  Sites (for `interventions` and `capture`) are path patterns as
  `tree.select().at_path` takes them (`"Block_3/Dense_0"`, `"**/mlp"`, `".method"`
  suffixes), Flax module classes (subclasses included), call nodes, predicates on call
  nodes, or lists of these (each element must match a call); `capture=True` (or
  `"all"`) captures every call. A call inside `nn.scan`/`nnx.scan` (or `vmap`) is one
  site, edited at every iteration and captured stacked along a new leading axis (outer
  transforms first); the site name with an iteration suffix (`"layers[2]"`, as
  `fl.sweep` names its rows) edits and captures one iteration of the scans only. Sites,
  parts and values are checked while the run is traced, before anything is compiled;
  `fl.save_interventions` saves a list of interventions.
  Every call a site names must be made by the run (a run that takes another branch
  than conversion raises), unless `unreached="ignore"`.

  Args:
    tree: a converted tree (`fl.unflaxify`).
    args: the model's arguments: one value (its only positional argument), a tuple of
      positional arguments, or `fl.ArgsAndKwargs.capture(*args, **kwargs)` for keyword
      arguments too. Every other parameter is an option of `fl.run`, keyword-only, so
      none can be mistaken for an argument of the model.
    interventions: `fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify` results,
      applied in order (input edits before the call, output edits after it).
    capture: the sites whose outputs to return, or None.
    inputs: also capture each captured call's positional arguments, as
      `"site:input"` (one argument as itself, several as a tuple).
    index: keep only `value[index]` of every captured array (memory control).
    dtype: cast every captured array to this dtype.
    random_streams: as for a tree call (Linen: `{"dropout": key}`).
    jit: compile the run (default) or run it eagerly.
    unreached: "raise" (default): a call that an intervention or capture names and this
      run does not make (it takes another branch than conversion) is an error;
      "ignore": such edits are not applied and such captures are left out of the
      result (for sites that a run may skip). Capturing every call (`capture=True`)
      captures the calls the run makes.
    budget: the most bytes the captured values of one compiled run may take on the
      device, or None. Where the batch's captures exceed it, the batch is split along
      the leading axis of the model's array arguments into equal chunks that fit, run
      one after the other by one compiled program, each chunk's values moved to the
      host before the next; see docs/interventions.md (budgets) for what is refused.
      With a budget, the output and captures come back as NumPy arrays.

  Returns:
    The output, or `(output, {site: value})` when `capture` is given.

  Raises:
    SelectionError: a site matches no call (the closest names are listed).
    ArgumentError: a value cannot apply to its site (the site and shapes are named), or
      the call spreads the model's arguments over `fl.run`'s own.
    CallStructureError: the run did not make a call a site names (`unreached="raise"`).
    UnsupportedFlaxFeatureError: a captured site runs where values cannot leave.
    BudgetError: the captures of one example exceed `budget`, or the batch cannot be
      split exactly (the message says why).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> tree = fl.unflaxify(model, variables, x)
    >>> out, cache = fl.run(tree, x, capture="layers_*")
    >>> sorted(cache), bool((out == model.apply(variables, x)).all())
    (['layers_0', 'layers_2'], True)
  """
  check_tree(tree, "fl.run")
  if unreached not in ("raise", "ignore"):
    raise ArgumentError(f"fl.run: unreached= is 'raise' or 'ignore', got {unreached!r}.")
  interventions = checked_interventions(interventions, "fl.run")
  capture = static_at(capture)
  if isinstance(capture, str) and capture == "all":
    capture = True
  interventions, capture = nodes_by_name(tree, interventions, capture)
  argument = model_arguments(args)
  random_streams = resolve_random_streams(random_streams, tree.where())
  if index is not None:
    index = _split_index(index if isinstance(index, tuple) else (index,))
  _check_dtype(dtype)
  budget = _budget.checked_budget(budget, "fl.run")
  if budget is not None and (capture is None or capture is False or not jit):
    raise BudgetError(
      f"fl.run: budget= bounds what a compiled run captures, and this run"
      f" {'captures nothing' if jit else 'is not compiled (jit=False)'}. Pass capture=..."
      " with jit=True (the default), or leave budget= out."
    )
  options = RunOptions(interventions, capture, inputs, index, dtype, random_streams, unreached)
  if budget is not None:
    return _run_budgeted(tree, argument, options, budget)
  output, captured = (_run_compiled if jit else run_once)(tree, argument, options)
  return output if capture is None or capture is False else (output, captured)


def place(tree: CallNode, interventions: Any, /) -> CallNode:
  """The tree with each intervention placed as a layer wrapping the call it edits.

  Each edited call's node is replaced by an `EditedCall` layer holding the node and
  the interventions of that call: the same layer `fl.run` runs a call through, kept in
  the tree. Calling the placed tree (or `fl.run`, `fl.capture` and `fl.variable_jit`
  of it) applies the edits wherever their calls run, inside `nn.scan`/`nnx.scan` at
  every iteration; the interventions' arrays are leaves of the tree, so
  `fl.variable_jit` reuses one compiled program for new values. As with any replaced
  call, a run that skips an edited call raises, and export refuses the tree (fold the
  interventions into weights with `fl.fold` instead). `tree` is not modified.

  Args:
    tree: a converted tree.
    interventions: `fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify`
      results (one, or a list), applied in order where several edit one call.

  Returns:
    The tree with the edited calls wrapped.

  Raises:
    SelectionError: a site matches no call.
    ArgumentError: an intervention cannot apply to its site, or edits the root call
      (which has no caller to hand it to a layer: pass it to `fl.run`).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> steered = fl.place(tree, fl.steer("layers_0", jnp.ones(3), alpha=2.0))
    >>> run = fl.variable_jit(lambda t, v: t(fl.ArgsAndKwargs.capture(v)))
    >>> run(steered, x).shape
    (1, 2)
  """
  check_tree(tree, "fl.place")
  interventions = checked_interventions(interventions, "fl.place")
  return placed(tree, interventions, "fl.place")


def placed(tree: CallNode, edits: tuple[Any, ...], where: str) -> CallNode:
  """`tree` with an `EditedCall` holding `edits` (objects with `at`, `on`, `part` and
  `edit`: interventions, `fl.splice`'s edit) wrapping each call they edit."""
  edits, _ = nodes_by_name(tree, edits, None)
  layers = edited_calls(tree, edits, None, False, None)
  for layer in layers.values():
    if any(isinstance(edit, OneIteration) for edit in layer.edits):
      raise ArgumentError(
        f"{where}: an intervention edits one iteration of {layer.site} (a site with an"
        " iteration suffix), which needs the iteration numbers a run of fl.run passes"
        " into scan bodies; a placed layer has none. Pass that intervention to fl.run"
        f" (interventions=[...]), or place it at {layer.site!r}, every iteration."
      )
  if id(tree) in layers:
    raise ArgumentError(
      f"{where}: an intervention edits the root call {layers[id(tree)].site}, which has no"
      " caller in the tree to hand it to a layer. Pass that intervention to fl.run"
      " (interventions=[...]), or edit a call inside the model."
    )

  def rebuilt(x: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(
      x, is_leaf=lambda y: y is not x and isinstance(y, Struct)
    )
    new = [rebuilt(leaf) if isinstance(leaf, Struct) else leaf for leaf in leaves]
    if any(a is not b for a, b in zip(new, leaves, strict=True)):
      x_new = jax.tree_util.tree_unflatten(treedef, new)
    else:
      x_new = x
    layer = layers.get(id(x))
    if layer is None:
      return x_new
    return dataclasses.replace(layer, node=x_new, required=False)

  return rebuilt(tree)


def nodes_by_name(
  tree: CallNode, interventions: tuple[Any, ...], capture: Any
) -> tuple[tuple[Any, ...], Any]:
  """The interventions and captured sites with every call node given as a site replaced
  by its site's name (see `Called`), so that sites resolve alike inside a compiled run."""
  sites: list[Site] = []

  def by_name(at: Any) -> Any:
    if isinstance(at, tuple):
      return tuple(by_name(a) for a in at)
    if not isinstance(at, CallNode):
      return at
    sites[:] = sites or sites_of(tree)
    site = next((s for s in sites if s.node is at), None)
    if site is None:
      raise SelectionError(no_match(tree, at, sites))
    return Called(site.name)

  edited = []
  for intervention in interventions:
    at = by_name(intervention.at) if isinstance(intervention, Intervention) else None
    changed = at is not None and at != intervention.at
    edited.append(dataclasses.replace(intervention, at=at) if changed else intervention)
  return tuple(edited), by_name(capture)


@takes_model_arguments("fl.capture(tree, fl.ArgsAndKwargs.capture(x, train=False), 'Block_*')")
def capture(
  tree: CallNode,
  args: Any,
  /,
  at: Any = True,
  *,
  inputs: bool = False,
  index: Any = None,
  dtype: Any = None,
  interventions: Sequence[Intervention] = (),
  random_streams: Any = None,
  jit: bool = True,
  unreached: str = "raise",
  budget: int | None = None,
) -> tuple[Any, dict[str, Any]]:
  """Runs a tree and returns `(output, {site: value})`: every call's output by default.

  `fl.capture(tree, x, "**/mlp")` is `fl.run(tree, x, capture="**/mlp")`; see
  `fl.run` for the model's arguments (one value: `x`, a tuple, or `fl.ArgsAndKwargs`),
  sites, options and compilation. `budget=` (bytes) bounds what one compiled run
  captures, splitting the batch into chunks where needed (see `fl.run`).

  Example:
    >>> import flaxlens as fl
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.relu)
    >>> tree = fl.unflaxify(model, jnp.ones((1, 4)))
    >>> out, cache = fl.capture(tree, jnp.ones((1, 4)))
    >>> sorted(cache)
    ['Sequential.__call__', 'layers/0']
  """
  check_tree(tree, "fl.capture")
  return run(
    tree,
    args,
    interventions=checked_interventions(interventions, "fl.capture"),
    capture=at,
    inputs=inputs,
    index=index,
    dtype=dtype,
    random_streams=random_streams,
    jit=jit,
    unreached=unreached,
    budget=budget,
  )
