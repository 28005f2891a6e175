"""`fl.harvest`'s batches before they run: placed on the mesh (`sharding=`) and checked to be
global in a multi-process run, traced abstractly for the shapes of their rows and the
state a run updates, and split into chunks whose rows fit a budget (`Chunks`). No Flax
internals here.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from flaxlens.core._node import CallNode
from flaxlens.core._variables import Scratch, StateVariable, variables_in
from flaxlens.errors import ArgumentError, BudgetError
from flaxlens.tools.base import _budget
from flaxlens.tools.base._calling import model_arguments
from flaxlens.tools.base._probed import run
from flaxlens.tools.harvest._plan import HarvestPlan
from flaxlens.tools.harvest._step import is_array_like, step_rows
from flaxlens.tools.harvest._writing import IN_FLIGHT


def placed_batch(batch: Any, sharding: Any) -> Any:
  """The batch as global arrays placed by `sharding` (one, or a pytree of them that is a
  prefix of the batch): each process's batch holds its own rows of the global batch,
  assembled by `jax.make_array_from_process_local_data` (in one process: the whole batch).
  Arrays that span processes already are kept as they are."""

  def place(target: Any, part: Any) -> Any:
    if not isinstance(target, jax.sharding.Sharding):
      raise ArgumentError(
        f"fl.harvest: sharding= holds {type(target).__name__}, not a jax.sharding.Sharding."
        " Give one Sharding (NamedSharding(mesh, P('data'))) or a pytree of them matching"
        " the batch."
      )
    return jax.tree_util.tree_map(lambda leaf: _placed_leaf(leaf, target), part)

  if sharding is None:
    return batch
  try:
    return jax.tree_util.tree_map(place, sharding, batch)
  except ValueError as error:
    raise ArgumentError(
      f"fl.harvest: cannot place a batch by sharding=: {error}. Give one Sharding for every"
      " array of the batch, or a pytree of them that is a prefix of the batch's structure."
    ) from error


def _placed_leaf(leaf: Any, target: Any) -> Any:
  if not is_array_like(leaf):
    return leaf
  if isinstance(leaf, jax.Array) and (
    not leaf.is_fully_addressable or leaf.sharding.is_equivalent_to(target, leaf.ndim)
  ):
    return leaf  # global already, or placed so already
  return jax.make_array_from_process_local_data(target, np.asarray(leaf))


def check_global(batch: Any, number: int) -> None:
  """In a multi-process run, refuses a batch holding host arrays (each process might hold
  other rows, where JAX takes a host array to be the same global value everywhere)."""
  if jax.process_count() == 1:
    return
  local = [
    type(leaf).__name__
    for leaf in jax.tree_util.tree_leaves(batch)
    if is_array_like(leaf) and not (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable)
  ]
  if local:
    raise ArgumentError(
      f"fl.harvest: batch {number} holds arrays of this process only ({', '.join(local)}) in"
      f" a run of {jax.process_count()} processes. Pass sharding= (each process's batches"
      " are then its own rows of the global batches, as jax.make_array_from_process_local_data"
      " takes them) or give global jax.Arrays."
    )


def example_blocks(batch: Any) -> int:
  """The blocks of examples the batch is sharded in: the most distinct ranges of the first
  axis among its arrays (1 for host arrays or arrays on one device)."""
  blocks = 1
  for leaf in jax.tree_util.tree_leaves(batch):
    if isinstance(leaf, jax.Array) and leaf.ndim and len(leaf.sharding.device_set) > 1:
      indices = leaf.sharding.devices_indices_map(leaf.shape).values()
      blocks = max(blocks, len({index[0].indices(leaf.shape[0])[0] for index in indices}))
  return blocks


def step_shapes(
  tree: CallNode, batch: Any, plan: HarvestPlan, random_streams: Any
) -> tuple[dict[str, Any], list[str]]:
  """The step's output shapes for `batch`, traced abstractly on a copy of the tree (nothing
  computed, the tree left alone), and the labels of the state variables a run updates."""
  leaves, treedef = jax.tree_util.tree_flatten(batch)
  arrays = [i for i, leaf in enumerate(leaves) if is_array_like(leaf)]
  groups = example_blocks(batch)
  scratch = Scratch(tree)
  updated: list[str] = []

  def rows(values: list[Any]) -> Any:
    filled = list(leaves)
    for i, value in zip(arrays, values, strict=True):
      filled[i] = value
    copy = scratch.copy()
    before = state_values(copy)
    out = step_rows(
      copy, jax.tree_util.tree_unflatten(treedef, filled), plan, random_streams, groups
    )
    updated[:] = updated_labels(before, copy)
    return out

  return jax.eval_shape(rows, [leaves[i] for i in arrays]), updated


def state_values(tree: CallNode) -> list[tuple[str, Any]]:
  """`(label, value)` of the tree's state variables."""
  return [(v.label or "?", v.value) for v in variables_in(tree) if isinstance(v, StateVariable)]


def updated_labels(before: list[tuple[str, Any]], tree: CallNode) -> list[str]:
  """The labels of the state variables whose value is not the one `before` held (a run
  stores a new value only in the variables it updates)."""
  now = state_values(tree)
  return [label for (label, old), (_, new) in zip(before, now, strict=True) if new is not old]


# --- a budget: batches in chunks ------------------------------------------------------------


class Chunks:
  """Splits batches into chunks whose rows fit a budget (`fl.harvest(budget=)`).

  The bytes of one step's rows per example (and those that do not grow with the batch)
  come from the step's abstract evaluation at the batch and at one example, once per input
  shape. The harvest holds the rows of `IN_FLIGHT + 2` steps at once (those waiting for
  their writes, the one whose writes are being issued, and the next one, already
  dispatched), so a chunk takes at most a share of the budget
  that leaves room for them all. The first batch that is split is checked once: two
  chunks that differ in their first example only must give the same rows for the others
  (`fl.capture`'s check), else the model couples its examples and splitting is refused.
  """

  def __init__(
    self, tree: CallNode, plan: HarvestPlan, random_streams: Any, budget: int, sharding: Any
  ) -> None:
    self.tree, self.plan, self.random_streams, self.budget = tree, plan, random_streams, budget
    self.sharding = sharding
    self.where = f"fl.harvest with budget={budget:,} bytes"
    self.sizes: dict[Any, int] = {}
    self.checked = False

  def size(self, batch: Any, number: int) -> int:
    """The examples per chunk of `batch` (its whole size where it fits)."""
    leaves = jax.tree_util.tree_leaves(batch)
    key = tuple((np.shape(x), np.dtype(x.dtype).name) for x in leaves if is_array_like(x))
    if key in self.sizes:
      return self.sizes[key]
    examples = _budget.batch_size(model_arguments(batch), f"{self.where}, batch {number}")
    whole, updated = step_shapes(self.tree, batch, self.plan, self.random_streams)
    held = IN_FLIGHT + 2
    if _budget.nbytes(whole) * held <= self.budget:
      self.sizes[key] = examples
      return examples
    self._refuse_split(number, updated)
    one, _ = step_shapes(self.tree, _examples(batch, 0, 1), self.plan, self.random_streams)
    rows = _budget.layout(whole, one, examples, self.where, jax.tree_util.keystr)
    size = _budget.examples_per_chunk(
      rows.per_example * held,
      rows.fixed * held,
      {k: v * held for k, v in rows.sizes(one).items()},
      self.budget,
      examples,
      self.where,
    )
    self.sizes[key] = size
    return size

  def split(self, batch: Any, number: int) -> list[Any]:
    """`batch` as consecutive chunks of `size(batch)` examples (the last may be smaller)."""
    size = self.size(batch, number)
    examples = _budget.batch_size(model_arguments(batch), f"{self.where}, batch {number}")
    if size >= examples:
      return [batch]
    if not self.checked:
      self._check_independent(batch, size, examples)
      self.checked = True
    return [
      _examples(batch, start, min(start + size, examples)) for start in range(0, examples, size)
    ]

  def _refuse_split(self, number: int, updated: list[str]) -> None:
    reason = None
    if updated:
      reason = (
        f"a run updates the state variables {updated[:6]}{' ...' if len(updated) > 6 else ''}:"
        " chunks of the batch would each update them, in turn, where the whole batch updates"
        " them once (batch statistics over the batch, a counter, NNX random counts). Harvest"
        " in a mode that updates no state (train=False, model.eval()), or give smaller batches"
      )
    elif jax.process_count() > 1 or self.sharding is not None:
      reason = (
        "batches placed over devices (sharding=, or several processes) are not split: a chunk"
        " of a sharded batch would not be sharded alike. Give smaller batches (each process's"
        " share of a step is then smaller)"
      )
    elif jax.tree_util.tree_leaves(self.random_streams):
      reason = (
        "the run is given random_streams: every chunk would draw the same random numbers"
        " (a dropout mask made for a chunk's rows), where the whole batch draws them once."
        " Harvest in a deterministic mode (train=False) or give smaller batches"
      )
    if reason is not None:
      raise BudgetError(
        f"{self.where}: the rows of batch {number} exceed the budget, and {reason}, or give"
        " a larger budget."
      )

  def _check_independent(self, batch: Any, size: int, examples: int) -> None:
    """Refuses a model whose examples' values depend on the other examples of the batch."""
    names = [site.name for site in self.plan.sites]

    def chunk(indices: tuple[int, ...]) -> list[Any]:
      captured = self._captured(_taken(batch, np.asarray(indices)))
      return [[np.asarray(captured[name]) for name in names]]

    _budget.check_independent(
      chunk,
      [_budget.Layout.first_axis(names)],
      size,
      examples,
      self.where,
      exceeding="the rows",
      fix="Give smaller batches or a larger budget.",
    )

  def _captured(self, batch: Any) -> dict[str, Any]:
    _, captured = run(
      self.tree,
      model_arguments(batch),
      capture=self.plan.capture,
      random_streams=self.random_streams,
    )
    return jax.device_get(captured)


def _examples(batch: Any, start: int, stop: int) -> Any:
  """Examples `start:stop` of `batch` (every array sliced along its first axis)."""
  return jax.tree_util.tree_map(lambda x: x[start:stop] if is_array_like(x) else x, batch)


def _taken(batch: Any, indices: np.ndarray) -> Any:
  return jax.tree_util.tree_map(lambda x: x[indices] if is_array_like(x) else x, batch)
