"""`fld.stream`: a dictionary's training data captured from the model as it goes, through a
shuffle buffer, with no store.

Each model input runs through one compiled program per input shape (`fl.variable_jit` of
`fl.run`'s capture, as `fl.harvest`'s step): it captures the sites read and written (a
call's output, or with `on="input"` the read calls' first argument), stacks a CLT's
layers, flattens `(example, position)` into rows and casts them, so only rows leave the
device. The host keeps a buffer of at most `buffer` rows and draws each batch from it at
random (the next input's forward is dispatched before the current rows are buffered), so
memory is bounded by the buffer whatever the dataset. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.errors import ArgumentError
from flaxlens.tools.base._calling import model_arguments
from flaxlens.tools.base._probed import run
from flaxlens.tools.base._sites import select_sites, sites_of
from flaxlens.tools.harvest._step import as_arrays


class Rows(NamedTuple):
  """One batch of a dictionary's data: `inputs` `[B, d_in]` and `targets` `[B, d_out]`
  (`[B, layers, d]` for a CLT)."""

  inputs: Any
  targets: Any


@dataclasses.dataclass(frozen=True)
class _StreamPlan:
  """What the compiled step captures and how it makes rows; static (hashable)."""

  reads: tuple[str, ...]  # the captured keys read ("site" or "site:input")
  writes: tuple[str, ...]
  capture: tuple[str, ...]  # the sites run captures
  on_input: bool
  layered: bool  # rows [B, layers, d] (a CLT's lists of sites) or [B, d]
  positions: Any  # "all", "last", None or a function of the input giving a mask
  dtype: Any


def _stacked(plan: _StreamPlan, captured: dict[str, Any], keys: tuple[str, ...]) -> Any:
  values = []
  for key in keys:
    value = captured[key]
    if isinstance(value, tuple):  # a call's several positional arguments: the first
      value = value[0]
    if not isinstance(value, jax.Array):
      raise ArgumentError(
        f"fld.stream: {key!r} is a {type(value).__name__}, where rows are read from one"
        " array of shape (batch, positions, d). Read a site whose value is one array."
      )
    values.append(value)
  shapes = {value.shape for value in values}
  if len(shapes) > 1:
    raise ArgumentError(
      f"fld.stream: the sites {list(keys)} give values of shapes"
      f" {[tuple(v.shape) for v in values]}; a CLT's layers must share one shape. Read"
      " sites of one width (every layer's MLP input, every layer's MLP output)."
    )
  stacked = jnp.stack(values, axis=-2) if plan.layered else values[0]
  return stacked if plan.dtype is None else stacked.astype(plan.dtype)


def _step_rows(tree: CallNode, model_input: Any, plan: _StreamPlan, random_streams: Any) -> Any:
  """The rows of one input: `(inputs, targets, keep)`; `keep` (a mask's rows) or None."""
  _, captured = run(
    tree,
    model_arguments(model_input),
    capture=plan.capture,
    inputs=plan.on_input,
    jit=False,
    random_streams=random_streams,
  )
  inputs, targets = _stacked(plan, captured, plan.reads), _stacked(plan, captured, plan.writes)
  feature_axes = 2 if plan.layered else 1
  if plan.positions is None:
    lead = 1
  elif plan.positions == "last":
    inputs, targets, lead = inputs[:, -1], targets[:, -1], 1
  else:
    lead = 2
  if inputs.ndim != lead + feature_axes or inputs.shape[:lead] != targets.shape[:lead]:
    raise ArgumentError(
      f"fld.stream: the read sites give {tuple(inputs.shape)} and the written"
      f" {tuple(targets.shape)}, where positions={plan.positions!r} takes values of shape"
      f" {'(batch, positions, d)' if lead == 2 else '(batch, d)'} sharing their leading"
      " axes. Give positions=None for values without a position axis, or sites of that shape."
    )
  rows = int(np.prod(inputs.shape[:lead]))
  inputs = inputs.reshape(rows, *inputs.shape[lead:])
  targets = targets.reshape(rows, *targets.shape[lead:])
  if not callable(plan.positions):
    return inputs, targets, None
  keep = jnp.asarray(plan.positions(model_input))
  if keep.dtype != jnp.bool_ or keep.size != rows:
    raise ArgumentError(
      f"fld.stream: positions= gave a {keep.dtype}{list(keep.shape)} mask, where the sites"
      f" have {rows} (example, position) rows. Return a boolean (batch, positions) mask."
    )
  return inputs, targets, keep.reshape(rows)


_compiled_rows = variable_jit(_step_rows)


class Stream:
  """A dictionary's data captured from a model as it runs (`fld.stream` builds it): the
  `DictionaryData` protocol, each epoch one pass over `model_inputs`.

  Attributes:
    d_in: the width read; d_out: the width written; layers: the layers (1 unless a CLT).
    reads, writes: the names of the values read and written, as `fl.capture` names them
      (`"layers_1/mlp:input"` for a call's input).
    buffer: the most rows held on the host.
  """

  def __init__(
    self,
    tree: CallNode,
    model_inputs: Any,
    plan: _StreamPlan,
    random_streams: Any,
    buffer: int,
  ):
    self._tree, self._model_inputs, self._plan = tree, model_inputs, plan
    self._random_streams, self.buffer = random_streams, buffer
    self.reads, self.writes = plan.reads, plan.writes
    self.layers = len(plan.reads) if plan.layered else 1
    first = next(self._inputs(), _NONE)
    if first is _NONE:
      raise ArgumentError(
        "fld.stream: model_inputs gave no input, so there are no rows. Give at least one."
      )
    inputs, targets, _ = self._rows(first)
    self.d_in, self.d_out = int(inputs.shape[-1]), int(targets.shape[-1])
    self.dtype = np.dtype(inputs.dtype)

  def __repr__(self) -> str:
    return (
      f"Stream(reads={list(self.reads)}, writes={list(self.writes)}, d_in={self.d_in},"
      f" d_out={self.d_out}, layers={self.layers}, buffer={self.buffer})"
    )

  def _inputs(self) -> Iterator[Any]:
    source = self._model_inputs
    return iter(source() if callable(source) else source)

  def _rows(self, model_input: Any) -> Any:
    return _compiled_rows(self._tree, as_arrays(model_input), self._plan, self._random_streams)

  def batches(self, batch_size: int, *, seed: int) -> Iterator[Rows]:
    """One pass over the model's inputs as shuffled batches of `batch_size` rows (the
    last one holds the rest, fewer). Rows wait in the buffer and each batch is drawn at
    random from it, so a batch mixes inputs; the same `seed` gives the same batches.

    Raises:
      ArgumentError: `batch_size` is not a positive int, or exceeds the buffer.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise ArgumentError(f"batches: batch_size={batch_size!r} is not a positive int.")
    if batch_size > self.buffer:
      raise ArgumentError(
        f"batches: batch_size={batch_size} is larger than the stream's buffer of"
        f" {self.buffer} rows. Give fld.stream(..., buffer=) of at least the batch size"
        " (several times it, for well-mixed batches)."
      )
    shuffle = _Buffer(self.buffer, np.random.default_rng(seed))
    pending = None
    for model_input in self._inputs():
      step = self._rows(model_input)  # dispatched: runs while the last rows are buffered
      if pending is not None:
        yield from shuffle.add(*pending, batch_size)
      pending = step
    if pending is not None:
      yield from shuffle.add(*pending, batch_size)
    yield from shuffle.drain(batch_size)


class _Buffer:
  """The host's shuffle buffer: at most `size` rows; a batch is `batch_size` rows drawn at
  random from a full buffer, their places filled by the last rows."""

  def __init__(self, size: int, random: np.random.Generator):
    self.size, self.random = size, random
    self.inputs: np.ndarray | None = None
    self.targets: np.ndarray | None = None
    self.count = 0

  def add(self, inputs: Any, targets: Any, keep: Any, batch_size: int) -> Iterator[Rows]:
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    if keep is not None:
      keep = np.asarray(keep)
      inputs, targets = inputs[keep], targets[keep]
    if self.inputs is None:
      self.inputs = np.empty((self.size, *inputs.shape[1:]), inputs.dtype)
      self.targets = np.empty((self.size, *targets.shape[1:]), targets.dtype)
    start = 0
    while start < len(inputs):
      taken = min(len(inputs) - start, self.size - self.count)
      self.inputs[self.count : self.count + taken] = inputs[start : start + taken]
      self.targets[self.count : self.count + taken] = targets[start : start + taken]
      self.count += taken
      start += taken
      while self.count == self.size:
        yield self._draw(batch_size)

  def _draw(self, batch_size: int) -> Rows:
    chosen = np.sort(self.random.choice(self.count, batch_size, replace=False))
    batch = Rows(self.inputs[chosen], self.targets[chosen])
    # Fill the chosen places with the last rows that were not chosen.
    tail = np.arange(self.count - batch_size, self.count)
    movers = np.setdiff1d(tail, chosen, assume_unique=True)
    holes = chosen[chosen < self.count - batch_size]
    self.inputs[holes] = self.inputs[movers]
    self.targets[holes] = self.targets[movers]
    self.count -= batch_size
    return batch

  def drain(self, batch_size: int) -> Iterator[Rows]:
    if self.inputs is None:
      return
    order = self.random.permutation(self.count)
    for start in range(0, self.count, batch_size):
      chosen = order[start : start + batch_size]
      yield Rows(self.inputs[chosen], self.targets[chosen])
    self.count = 0


_NONE = object()
_POSITIONS = ("all", "last", None)


def _site_names(tree: CallNode, at: Any, what: str) -> tuple[tuple[str, ...], bool]:
  """The one site each of `at` names (a site, or a list of them for a CLT), and whether
  `at` is a list."""
  layered = isinstance(at, list | tuple)
  options = list(at) if layered else [at]
  if not options:
    raise ArgumentError(f"fld.stream: {what}= is an empty list. Give a site or a list of sites.")
  sites = sites_of(tree)
  names = []
  for option in options:
    chosen = select_sites(tree, option, sites)
    if len(chosen) != 1:
      raise ArgumentError(
        f"fld.stream: {what}={option!r} names {len(chosen)} calls"
        f" ({[s.name for s in chosen][:6]}), where each read or written site is one call."
        " Give one site's name (a list of names for a CLT's layers)."
      )
    names.append(chosen[0].name)
  return tuple(names), layered


def stream(
  tree: CallNode,
  model_inputs: Iterable[Any] | Callable[[], Iterator[Any]],
  reads: Any,
  writes: Any = None,
  *,
  on: str = "output",
  buffer: int = 65536,
  positions: Any = "all",
  dtype: Any = None,
  random_streams: Any = None,
) -> Stream:
  """A dictionary's data captured from the model as it runs, with no store (see
  `Stream`): each epoch runs the model over `model_inputs`, one compiled program per input
  shape, and yields shuffled rows through a host buffer of `buffer` rows.

  Args:
    tree: a converted tree (`fl.unflaxify`).
    model_inputs: the model's inputs (each one value, as `fl.run` takes them), as an
      iterable that iterates afresh each epoch (a list, a data set object) or a function
      returning a fresh iterator. The first input runs once here, to learn the widths.
    reads: the site read: one site (an SAE, a transcoder), or a list of `layers` sites
      for a CLT (rows `[B, layers, d]`).
    writes: the site (or list of sites) the rows' targets come from; None: the rows
      read (an SAE).
    on: "output" (default): the read calls' outputs; "input": their first positional
      argument (a transcoder reads an MLP call's input, as `fl.splice(..., reads="input")`).
      Written sites give their outputs.
    buffer: the most rows held on the host; each batch is drawn at random from them.
    positions: the rows of `(batch, positions, d)` values: "all" (default), "last", None
      (values `(batch, d)`, one row per example), or a function of the input giving a
      boolean `(batch, positions)` mask (`lambda tokens: tokens != PAD`).
    dtype: the rows' dtype (cast on device), or None for what the sites compute.
    random_streams: as for a tree call (Linen: `{"dropout": key}`).

  Returns:
    A `Stream`, with `batches(batch_size, *, seed)`, `d_in`, `d_out`, `layers`, `reads`
    and `writes`.

  Raises:
    SelectionError: a site matches no call.
    ArgumentError: a site names several calls, an option is of the wrong kind, the sites'
      values are not arrays of the shape `positions` takes, or there is no input.

  Example:
    >>> import flaxlens as fl, flaxlens.dictionaries as fld, flax.linen as nn, jax
    >>> import jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(6), nn.relu, nn.Dense(3)]), jnp.ones((2, 5, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> data = fld.stream(tree, [x, 2 * x, 3 * x], "layers_2", on="input", buffer=16)
    >>> data.d_in, data.d_out, [rows.inputs.shape for rows in data.batches(12, seed=0)]
    (6, 6, [(12, 6), (12, 6), (6, 6)])
  """
  check_tree(tree, "fld.stream")
  if not callable(model_inputs) and (
    not isinstance(model_inputs, Iterable) or iter(model_inputs) is model_inputs
  ):
    raise ArgumentError(
      f"fld.stream: model_inputs is a {type(model_inputs).__name__}, which does not"
      " iterate afresh each epoch. Give a list of inputs, or a function returning a new"
      " iterator (lambda: iter(loader))."
    )
  if on not in ("output", "input"):
    raise ArgumentError(f"fld.stream: on= is 'output' or 'input', got {on!r}.")
  if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
    raise ArgumentError(f"fld.stream: buffer={buffer!r} is not a positive number of rows.")
  if not (callable(positions) or (isinstance(positions, str | None) and positions in _POSITIONS)):
    raise ArgumentError(
      f"fld.stream: positions= is 'all', 'last', None or a function of the input giving a"
      f" boolean (batch, positions) mask, got {positions!r}."
    )
  if dtype is not None:
    dtype = np.dtype(jnp.dtype(dtype))
  read_names, layered = _site_names(tree, reads, "reads")
  write_names, write_layered = (
    (read_names, layered) if writes is None else _site_names(tree, writes, "writes")
  )
  if write_layered != layered or len(write_names) != len(read_names):
    raise ArgumentError(
      f"fld.stream: reads= names {list(read_names)} and writes= {list(write_names)}; give"
      " one site each (an SAE, a transcoder) or lists of the same length (a CLT's layers)."
    )
  if writes is None and on == "input":
    write_names = tuple(f"{name}:input" for name in read_names)
  plan = _StreamPlan(
    reads=tuple(f"{n}:input" for n in read_names) if on == "input" else read_names,
    writes=write_names,
    capture=tuple(dict.fromkeys(read_names + tuple(n.removesuffix(":input") for n in write_names))),
    on_input=on == "input",
    layered=layered,
    positions=positions,
    dtype=dtype,
  )
  random_streams = resolve_random_streams(random_streams, tree.where())
  return Stream(tree, model_inputs, plan, random_streams, buffer)
