"""`fl.harvest`: stream captured activations over a dataset into a resumable on-disk store.

Each batch runs through one compiled program (`fl.variable_jit` of `fl.run`'s capture
plus the selection of rows: the positions rule, the cast to the stored dtype, the
example and position of each row), so only the selected rows leave the device, shard by
shard. The writes of a batch go to TensorStore as futures while the next batch's forward
runs; a batch counts as committed (`progress.json`, replaced atomically) only once its
writes have completed, and a run of the same call resumes after the committed batches.
In a multi-process run (`jax.distributed`) every process runs the same loop: each step is
one SPMD program over the global mesh, each process writes the rows of its own shards into
the one store, and what must be agreed (the rows a mask keeps per block of examples, the
barriers before process 0 commits) goes through JAX's collectives
(`jax.experimental.multihost_utils`). No Flax internals here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
import shutil
import sys
import time
import types
from collections.abc import Callable, Iterable
from importlib import metadata as package_metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from flaxlens.core._checks import check_path
from flaxlens.core._functions import global_names
from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.core._selectors import path_matches
from flaxlens.core._variables import (
  StateVariable,
  Uninitialized,
  bind_variables,
  unbind_variables,
  variables_in,
)
from flaxlens.errors import ArgumentError, BudgetError, HarvestError
from flaxlens.tools.base import _budget
from flaxlens.tools.base._calling import model_arguments
from flaxlens.tools.base._parts import checked_part, one_array
from flaxlens.tools.base._probed import nodes_by_name, run
from flaxlens.tools.base._sites import check_part, select_sites, sites_of
from flaxlens.tools.harvest import _store
from flaxlens.tools.harvest._store import Harvest

IN_FLIGHT = 2  # Batches whose writes may be pending at once (host memory: this many batches).
# One process commits a written batch at most this often (seconds): each commit syncs
# progress.json to disk, and a later commit covers the batches before it. A stopped run
# redoes at most this long's batches. Several processes commit every batch (a barrier each).
COMMIT_EVERY = 0.5
_RULES = ("all", "last", None)
_SETTINGS = ("model", "sites", "ids", "inputs", "first_batch", "random_streams")

# --- the plan: what each site keeps ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SitePlan:
  name: str
  rule: Any  # "all", "last", None, or a function of the batch giving a (batch, positions) mask
  dtype: Any  # the stored dtype, or None to keep the captured one
  part: Any = None  # which part of a structured output is stored (the `part=` rule)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What the compiled step does; static (hashable) so one program serves every batch of a
  shape."""

  capture: Any
  sites: tuple[_SitePlan, ...]
  ids: Callable[[Any], Any] | None


def _per_site(value: Any, names: list[str], what: str, check: Callable[[Any], Any]) -> list[Any]:
  """`value` for each site name: one value for all, or `{pattern: value}` (first match)."""
  if not isinstance(value, dict):
    return [check(value)] * len(names)
  chosen = []
  for name in names:
    key = next((k for k in value if k == name or path_matches(str(k), name)), _MISSING)
    if key is _MISSING:
      raise ArgumentError(
        f"fl.harvest: {what}= gives no value for the site {name!r} (its keys:"
        f" {list(value)}). Add a key matching it, or '**' for every other site."
      )
    chosen.append(check(value[key]))
  return chosen


_MISSING = object()


def _check_rule(rule: Any) -> Any:
  if callable(rule) or (isinstance(rule, str | type(None)) and rule in _RULES):
    return rule
  raise ArgumentError(
    f"fl.harvest: positions= is 'all', 'last', None (no position axis) or a function of"
    f" the batch giving a boolean (batch, positions) mask, got {rule!r}. Give one of these,"
    " or a dict of them by site."
  )


def _check_dtype(dtype: Any) -> Any:
  if dtype is None:
    return None
  try:
    return np.dtype(jnp.dtype(dtype))
  except TypeError as error:
    raise ArgumentError(
      f"fl.harvest: dtype={dtype!r} is no dtype. Give one (jnp.bfloat16, 'float32') or"
      " None to store what the site computes."
    ) from error


def _plan(tree: CallNode, at: Any, positions: Any, dtype: Any, ids: Any, part: Any) -> _Plan:
  if isinstance(at, list):
    at = tuple(at)
  sites = sites_of(tree)
  chosen = select_sites(tree, at, sites)
  names = [site.name for site in chosen]
  _, capture = nodes_by_name(tree, (), at)
  rules = _per_site(positions, names, "positions", _check_rule)
  dtypes = _per_site(dtype, names, "dtype", _check_dtype)
  parts = _per_site(part, names, "part", lambda p: checked_part(p, "fl.harvest"))
  for site, site_part in zip(chosen, parts, strict=True):
    check_part(site, site_part, "output", at, sites)
  if ids is not None and not callable(ids):
    raise ArgumentError(
      f"fl.harvest: ids= must be a function of the batch giving an integer array of shape"
      f" (batch,) or (batch, positions), got {type(ids).__name__}. For token ids:"
      " ids=lambda tokens: tokens."
    )
  planned = zip(names, rules, dtypes, parts, strict=True)
  return _Plan(capture, tuple(_SitePlan(*site) for site in planned), ids)


# --- the compiled step: capture and select rows -------------------------------------------------


def _rows(
  tree: CallNode, batch: Any, plan: _Plan, random_streams: Any, groups: int
) -> dict[str, Any]:
  """For each site: its rows (`values`) and their `ids`; `sizes` is the batch's examples,
  then each site's positions (1 with `positions=None`). A mask's rows are selected within
  each of `groups` equal blocks of examples (the blocks the batch is sharded in, so each
  device keeps its own rows): `(groups, rows per block, ...)`, each block's selected rows
  first, with each row's `(example, position)` within the batch (`index`) and `count`,
  the rows each block selects."""
  _, captured = run(
    tree, model_arguments(batch), capture=plan.capture, jit=False, random_streams=random_streams
  )
  ids = None if plan.ids is None else jnp.asarray(plan.ids(batch))
  masks: dict[int, Any] = {}
  found: dict[str, Any] = {}
  sizes, lengths = None, []
  for site in plan.sites:
    value = one_array(captured[site.name], site.part, site.name, "output")
    if value.ndim < (1 if site.rule is None else 2):
      raise ArgumentError(
        f"{site.name}: fl.harvest stores a site's output as rows, and this output has shape"
        f" {tuple(value.shape)}. Give a site whose output is one array of shape (batch,"
        " positions, ...) (or (batch, ...) with positions=None)."
      )
    size = value.shape[:1] if site.rule is None else value.shape[:2]
    lengths.append(1 if site.rule is None else value.shape[1])
    if sizes is None or len(size) > len(sizes):
      if sizes is not None and size[0] != sizes[0]:
        raise _unbatched(plan, captured)
      sizes = size
    elif size[0] != sizes[0]:
      raise _unbatched(plan, captured)
    found[site.name] = _select(site, value, batch, ids, masks, groups)
  found["sizes"] = jnp.asarray([sizes[0], *lengths], jnp.int32)
  return found


def _features(found: dict[str, Any]) -> list[int]:
  """A site's feature shape, from the step's output for it (a mask's rows come in blocks)."""
  return list(found["values"].shape[2 if "count" in found else 1 :])


def _unbatched(plan: _Plan, captured: dict[str, Any]) -> ArgumentError:
  shapes = {s.name: tuple(captured[s.name].shape) for s in plan.sites}
  return ArgumentError(
    f"fl.harvest: the sites' outputs {shapes} do not share a leading batch axis. Harvest"
    " sites whose outputs have the batch first (one harvest per batch layout)."
  )


def _select(
  site: _SitePlan, value: Any, batch: Any, ids: Any, masks: dict[int, Any], groups: int
) -> Any:
  """A site's rows: `values` and `ids`; with a mask, also each row's `index` and the rows'
  `count` per block (without one, the host knows each row's example and position)."""
  examples = value.shape[0]
  if site.rule is None:
    out = {"values": value, "ids": _ids_of(site, ids, examples, None)}
  elif site.rule == "last":
    if value.shape[1] == 0:
      raise ArgumentError(
        f"{site.name}: positions='last' keeps the last position, and this batch has none"
        f" (the site's output has shape {tuple(value.shape)}). Give batches of at least one"
        " position, or drop the empty ones."
      )
    row_ids = _ids_of(site, ids, examples, value.shape[1])
    out = {"values": value[:, -1], "ids": None if row_ids is None else row_ids[:, -1]}
  else:
    length = value.shape[1]
    rows = examples * length
    row_ids = _ids_of(site, ids, examples, length)
    out = {
      "values": value.reshape(rows, *value.shape[2:]),
      "ids": None if row_ids is None else row_ids.reshape(rows),
    }
    if site.rule != "all":
      out = _masked(site, out, batch, masks, groups, examples, length)
  if site.dtype is not None:
    out["values"] = out["values"].astype(site.dtype)
  return {k: v for k, v in out.items() if v is not None}


def _masked(
  site: _SitePlan,
  flat: dict[str, Any],
  batch: Any,
  masks: dict[int, Any],
  groups: int,
  examples: int,
  length: int,
) -> dict[str, Any]:
  """The rows a mask selects, within each of `groups` blocks of whole examples."""
  mask = masks.get(id(site.rule))
  if mask is None:
    mask = masks[id(site.rule)] = jnp.asarray(site.rule(batch))
  if mask.shape != (examples, length) or mask.dtype != jnp.bool_:
    raise ArgumentError(
      f"{site.name}: positions= gave a {mask.dtype}{list(mask.shape)} mask, where the"
      f" site's output has {examples} examples of {length} positions. Give a function"
      f" returning a boolean mask of shape ({examples}, {length})."
    )
  rows = examples * length
  flat["index"] = jnp.stack(
    [jnp.arange(rows, dtype=jnp.int32) // length, jnp.arange(rows, dtype=jnp.int32) % length], 1
  )
  groups = math.gcd(groups, examples)
  keep = mask.reshape(groups, rows // groups)
  order = jnp.argsort(~keep, axis=1, stable=True)  # Selected rows first, in stream order.
  block = jnp.arange(groups)[:, None]
  out = {
    k: None if v is None else v.reshape(groups, rows // groups, *v.shape[1:])[block, order]
    for k, v in flat.items()
  }
  out["count"] = keep.sum(axis=1, dtype=jnp.int32)
  return out


def _ids_of(site: _SitePlan, ids: Any, examples: int, length: int | None) -> Any:
  if ids is None:
    return None
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ArgumentError(
      f"{site.name}: ids= gave an array of {ids.dtype}, where ids are integers"
      " (an example's number, a token id). Return an integer array (.astype(jnp.int32))."
    )
  if ids.shape == (examples,) and length is not None:
    return jnp.broadcast_to(ids[:, None], (examples, length))
  if ids.shape == ((examples,) if length is None else (examples, length)):
    return ids
  wanted = f"({examples},)" if length is None else f"({examples},) or ({examples}, {length})"
  raise ArgumentError(
    f"{site.name}: ids= gave an array of shape {tuple(ids.shape)}, where the site's rows"
    f" take ids of shape {wanted}. Give one id per example or per position."
  )


_step = variable_jit(_rows)


def _traced_leaf(leaf: Any) -> bool:
  return isinstance(leaf, jax.Array | np.ndarray | np.generic) or hasattr(leaf, "__array__")


def _as_arrays(batch: Any) -> Any:
  """The batch with array-likes (a tf.data tensor, a list of numbers stays) as arrays."""
  return jax.tree_util.tree_map(
    lambda leaf: (
      leaf
      if isinstance(leaf, jax.Array | np.ndarray) or not _traced_leaf(leaf)
      else np.asarray(leaf)
    ),
    batch,
  )


# --- processes: placing batches, reading small results, agreeing ----------------------------


def _place(batch: Any, sharding: Any) -> Any:
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
    return jax.tree_util.tree_map(lambda leaf: _placed(leaf, target), part)

  if sharding is None:
    return batch
  try:
    return jax.tree_util.tree_map(place, sharding, batch)
  except ValueError as error:
    raise ArgumentError(
      f"fl.harvest: cannot place a batch by sharding=: {error}. Give one Sharding for every"
      " array of the batch, or a pytree of them that is a prefix of the batch's structure."
    ) from error


def _placed(leaf: Any, target: Any) -> Any:
  if not _traced_leaf(leaf):
    return leaf
  if isinstance(leaf, jax.Array) and (
    not leaf.is_fully_addressable or leaf.sharding.is_equivalent_to(target, leaf.ndim)
  ):
    return leaf  # global already, or placed so already
  return jax.make_array_from_process_local_data(target, np.asarray(leaf))


def _check_global(batch: Any, number: int) -> None:
  """In a multi-process run, refuses a batch holding host arrays (each process might hold
  other rows, where JAX takes a host array to be the same global value everywhere)."""
  if jax.process_count() == 1:
    return
  local = [
    type(leaf).__name__
    for leaf in jax.tree_util.tree_leaves(batch)
    if _traced_leaf(leaf) and not (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable)
  ]
  if local:
    raise ArgumentError(
      f"fl.harvest: batch {number} holds arrays of this process only ({', '.join(local)}) in"
      f" a run of {jax.process_count()} processes. Pass sharding= (each process's batches"
      " are then its own rows of the global batches, as jax.make_array_from_process_local_data"
      " takes them) or give global jax.Arrays."
    )


def _groups(batch: Any) -> int:
  """The blocks of examples the batch is sharded in: the most distinct ranges of the first
  axis among its arrays (1 for host arrays or arrays on one device)."""
  blocks = 1
  for leaf in jax.tree_util.tree_leaves(batch):
    if isinstance(leaf, jax.Array) and leaf.ndim and len(leaf.sharding.device_set) > 1:
      indices = leaf.sharding.devices_indices_map(leaf.shape).values()
      blocks = max(blocks, len({index[0].indices(leaf.shape[0])[0] for index in indices}))
  return blocks


def _fetch(array: Any) -> np.ndarray:
  """The whole value of a small array on every process (gathered where it spans processes
  unreplicated: a collective, so every process calls it at the same point)."""
  if not isinstance(array, jax.Array) or array.is_fully_addressable:
    return np.asarray(array)
  if array.is_fully_replicated:
    return np.asarray(array.addressable_data(0))
  return multihost_utils.process_allgather(array, tiled=True)


def _barrier(name: str) -> None:
  """Returns once every process reached the barrier `name` (a collective over all devices)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"flaxlens.harvest: {name}")


def _failed_processes(ok: bool) -> list[int]:
  """The processes where `ok` is False (every process calls this at the same point)."""
  if jax.process_count() == 1:
    return [] if ok else [0]
  flags = multihost_utils.process_allgather(np.asarray([ok], np.int32), tiled=True)
  return [int(i) for i in np.flatnonzero(flags == 0)]


def _shapes(
  tree: CallNode, batch: Any, plan: _Plan, random_streams: Any
) -> tuple[dict[str, Any], list[str]]:
  """The step's output shapes for `batch`, traced abstractly on a copy of the tree (nothing
  computed, the tree left alone), and the labels of the state variables a run updates."""
  leaves, treedef = jax.tree_util.tree_flatten(batch)
  arrays = [i for i, leaf in enumerate(leaves) if _traced_leaf(leaf)]
  groups = _groups(batch)
  slots, held = unbind_variables(tree, freeze=True)
  updated: list[str] = []

  def rows(values: list[Any]) -> Any:
    filled = list(leaves)
    for i, value in zip(arrays, values, strict=True):
      filled[i] = value
    copy = bind_variables(slots, held)
    before = _state(copy)
    out = _rows(copy, jax.tree_util.tree_unflatten(treedef, filled), plan, random_streams, groups)
    updated[:] = _updated(before, copy)
    return out

  return jax.eval_shape(rows, [leaves[i] for i in arrays]), updated


def _state(tree: CallNode) -> list[tuple[str, Any]]:
  """`(label, value)` of the tree's state variables."""
  return [(v.label or "?", v.value) for v in variables_in(tree) if isinstance(v, StateVariable)]


def _updated(before: list[tuple[str, Any]], tree: CallNode) -> list[str]:
  """The labels of the state variables whose value is not the one `before` held (a run
  stores a new value only in the variables it updates)."""
  now = _state(tree)
  return [label for (label, old), (_, new) in zip(before, now, strict=True) if new is not old]


# --- a budget: batches in chunks ------------------------------------------------------------


class _Chunks:
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
    self, tree: CallNode, plan: _Plan, random_streams: Any, budget: int, sharding: Any
  ) -> None:
    self.tree, self.plan, self.random_streams, self.budget = tree, plan, random_streams, budget
    self.sharding = sharding
    self.where = f"fl.harvest with budget={budget:,} bytes"
    self.sizes: dict[Any, int] = {}
    self.checked = False

  def size(self, batch: Any, number: int) -> int:
    """The examples per chunk of `batch` (its whole size where it fits)."""
    leaves = jax.tree_util.tree_leaves(batch)
    key = tuple((np.shape(x), np.dtype(x.dtype).name) for x in leaves if _traced_leaf(x))
    if key in self.sizes:
      return self.sizes[key]
    examples = _budget.batch_size(model_arguments(batch), f"{self.where}, batch {number}")
    whole, updated = _shapes(self.tree, batch, self.plan, self.random_streams)
    held = IN_FLIGHT + 2
    if _budget.nbytes(whole) * held <= self.budget:
      self.sizes[key] = examples
      return examples
    self._refuse_split(number, updated)
    one, _ = _shapes(self.tree, _part(batch, 0, 1), self.plan, self.random_streams)
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
    return [_part(batch, start, min(start + size, examples)) for start in range(0, examples, size)]

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


def _part(batch: Any, start: int, stop: int) -> Any:
  """Examples `start:stop` of `batch` (every array sliced along its first axis)."""
  return jax.tree_util.tree_map(lambda x: x[start:stop] if _traced_leaf(x) else x, batch)


def _taken(batch: Any, indices: np.ndarray) -> Any:
  return jax.tree_util.tree_map(lambda x: x[indices] if _traced_leaf(x) else x, batch)


# --- metadata and fingerprints --------------------------------------------------------------


@jax.jit
def _checksums(leaves: list[Any]) -> Any:
  """Two 32-bit sums per array of its bits (plain and position-weighted), on device."""
  sums = []
  for leaf in leaves:
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):  # real and imaginary parts in turn
      leaf = jnp.stack([leaf.real, leaf.imag], axis=-1)
    if leaf.dtype == jnp.bool_ or leaf.dtype.itemsize == 1:
      bits = leaf.astype(jnp.uint32)
    else:
      unsigned = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
      bits = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)
    bits = bits.reshape(-1)
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) % 65521) + 1
    sums.append(jnp.stack([bits.sum(dtype=jnp.uint32), (bits * weights).sum(dtype=jnp.uint32)]))
  return jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)


# The position weights' period, and the elements summed at a time on the host: a whole
# number of periods, so every slice starts at weight 1 and one table of weights serves all.
_PERIOD = 65521
_SPAN = 16 * _PERIOD
_host_weights = functools.cache(
  lambda: (np.arange(_SPAN, dtype=np.uint32) % _PERIOD + 1).astype(np.uint32)
)


def _on_host(value: Any) -> np.ndarray | None:
  """`value` as a NumPy array without a transfer where it already is one in host memory (a
  NumPy array, at the dtype `jnp.asarray` would give it, or a JAX array on one CPU device);
  None for anything else (arrays on accelerators or over several devices)."""
  if isinstance(value, np.ndarray | np.generic):
    if value.dtype.kind not in "biufc" and value.dtype.name != "bfloat16":
      return None  # other dtypes: jnp.asarray says what it makes of them
    return np.asarray(value).astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)
  if (
    isinstance(value, jax.Array)
    and not jnp.issubdtype(value.dtype, jax.dtypes.prng_key)
    and value.is_fully_addressable
    and len(value.sharding.device_set) == 1
    and next(iter(value.sharding.device_set)).platform == "cpu"
  ):
    return np.asarray(value)
  return None


def _host_checksum(array: np.ndarray) -> tuple[int, int]:
  """`_checksums`' pair for one host array, computed with NumPy a slice at a time (the same
  unsigned 32-bit arithmetic, so the same numbers, in memory bounded by `_SPAN`)."""
  if array.dtype.kind == "c":  # real and imaginary parts in turn, as `_checksums` sums them
    array = np.stack([array.real, array.imag], axis=-1)
  flat = array.reshape(-1)
  if array.dtype.itemsize in (2, 4, 8) and array.dtype != np.bool_:
    flat = flat.view({2: np.uint16, 4: np.uint32, 8: np.uint32}[array.dtype.itemsize])
  weights, plain, weighted = _host_weights(), 0, 0
  for start in range(0, flat.size, _SPAN):
    bits = flat[start : start + _SPAN].astype(np.uint32)
    plain += int(bits.sum(dtype=np.uint32))
    weighted += int((bits * weights[: bits.size]).sum(dtype=np.uint32))
  return plain % 2**32, weighted % 2**32


def _fingerprint(named: list[tuple[str, Any]]) -> str:
  """A checksum of named arrays: their names, shapes, dtypes and bits (not cryptographic).

  Arrays already in host memory are summed there with NumPy (on CPU, the model's variables:
  no program to trace and compile in each new process); the others in one jitted program
  on their devices. Both give the same numbers, so a store fingerprinted on one resumes
  on the other."""
  arrays = []  # each value as a host array where it is in host memory, else on device
  for _, value in named:
    host = _on_host(value)
    if host is None:  # not an array yet (a Python number), or on an accelerator
      value = jnp.asarray(value)
      host = _on_host(value)
    arrays.append(value if host is None else host)
  on_device = [a for a in arrays if isinstance(a, jax.Array)]
  device_sums = iter(_fetch(_checksums(on_device)) if on_device else ())
  digest = hashlib.sha256()
  for (name, _), array in zip(named, arrays, strict=True):
    on_host = isinstance(array, np.ndarray)
    pair = list(_host_checksum(array)) if on_host else next(device_sums).tolist()
    digest.update(f"{name}|{array.dtype}|{tuple(array.shape)}|{pair};".encode())
  return digest.hexdigest()[:32]


def _function_id(fn: Any, depth: int = 0) -> str:
  """A function as text that is the same in every process for the same computation: its
  qualified name, the hash of its code, and the values it closes over, has as defaults
  and reads as globals; a `functools.partial` by its function and arguments, a method by
  its function and its object's attributes, an object with `__call__` by its class's
  `__call__` and its attributes. Numbers, strings and None by value, arrays by shape,
  dtype and checksum, functions in turn, modules by name, anything else by type (not its
  module's name, which differs between a script and its import)."""
  if depth > _MAX_DEPTH:
    return type(fn).__qualname__
  if isinstance(fn, functools.partial):
    arguments = _values_text([*fn.args, *sorted(fn.keywords.items())], depth + 1)
    return f"partial({_function_id(fn.func, depth + 1)};{arguments})"
  if isinstance(fn, types.MethodType):
    owner = fn.__self__
    return f"{_function_id(fn.__func__, depth + 1)} of {_object_text(owner, depth + 1)}"
  code = getattr(fn, "__code__", None)
  name = getattr(fn, "__qualname__", type(fn).__name__)
  if code is None:
    call = inspect.getattr_static(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType):  # an object with __call__: its method, its state
      return f"{_function_id(call, depth + 1)} of {_object_text(fn, depth + 1)}"
    return name
  values = [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ())]
  values += list(getattr(fn, "__defaults__", None) or ())
  values += sorted((getattr(fn, "__kwdefaults__", None) or {}).items())
  namespace = getattr(fn, "__globals__", {})
  values += [(n, namespace[n]) for n in global_names(code) if n in namespace]
  text = f"{_code_text(code)}|{_values_text(values, depth)}"
  return f"{name}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@functools.lru_cache(maxsize=1024)
def _code_text(code: types.CodeType) -> str:
  """`code` as text without addresses (a nested code object's `repr` holds one)."""
  consts = [_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
  return f"{code.co_code.hex()}|{consts}|{code.co_names!r}"


_MAX_DEPTH = 6  # Functions read through functions: deeper ones by their type alone.


def _object_text(owner: Any, depth: int) -> str:
  attributes = sorted(getattr(owner, "__dict__", {}).items())
  return f"{type(owner).__qualname__}({_values_text(attributes, depth)})"


def _values_text(values: list[Any], depth: int = 0) -> str:
  parts = []
  for value in values:
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
      parts.append(repr(value))
    elif isinstance(value, jax.Array | np.ndarray | np.generic):
      parts.append(_fingerprint([("", value)]))
    elif isinstance(value, tuple | list) and len(value) <= 64:
      parts.append(f"[{_values_text(list(value), depth)}]")
    elif isinstance(value, dict) and len(value) <= 64:
      parts.append(f"{{{_values_text(sorted(value.items(), key=lambda kv: repr(kv[0])), depth)}}}")
    elif isinstance(value, types.ModuleType):
      parts.append(f"module {value.__name__}")
    elif isinstance(value, types.FunctionType | functools.partial | types.MethodType):
      parts.append(_function_id(value, depth + 1))
    else:
      parts.append(type(value).__qualname__)
  return ",".join(parts)


def _rule_text(rule: Any) -> Any:
  return f"mask {_function_id(rule)}" if callable(rule) else rule


def _metadata(
  tree: CallNode,
  batch: Any,
  plan: _Plan,
  shapes: dict[str, Any] | None,
  random_streams: Any,
  stored: list[dict[str, Any]] | None = None,
  updates: list[str] | None = None,
  variables: list[tuple[str, Any]] | None = None,
) -> dict[str, Any]:
  """The store's metadata for this call. The sites' dtypes, feature shapes, chunking and
  ids dtypes come from `shapes` (the step's output, or its abstract value), or, with
  `shapes` None, from the sites `stored` in a store: they follow from the settings that
  are compared (the model, the sites and rules, the first batch's shapes and dtypes), so a
  store whose other settings are this call's has this call's (and every batch is checked
  against them before it is written)."""
  if variables is None:
    variables = _variables(tree)
  leaves, treedef = jax.tree_util.tree_flatten(batch)
  arrays = [leaf for leaf in leaves if _traced_leaf(leaf)]
  # Leaves that are no arrays (a Python number given as an argument) are inputs too.
  values = [_values_text([leaf]) for leaf in leaves if not _traced_leaf(leaf)]
  sites = []
  for k, site in enumerate(plan.sites):
    if shapes is None:
      derived = ("dtype", "features", "chunk", "ids")
      entry = stored[k] if stored is not None and k < len(stored) else {}
      sites.append(
        {
          "name": site.name,
          "group": f"s{k}",
          "positions": _rule_text(site.rule),
          **_part_entry(site),
          **{key: entry.get(key) for key in derived},
        }
      )
      if site.dtype is not None:
        sites[-1]["dtype"] = site.dtype.name
      continue
    found = shapes[site.name]
    dtype = np.dtype(found["values"].dtype)
    if 0 in _features(found):
      raise ArgumentError(
        f"{site.name}: fl.harvest stores rows of the site's features, and its rows have the"
        f" feature shape {tuple(_features(found))}, which holds no value. Harvest a site"
        " whose rows hold values."
      )
    sites.append(
      {
        "name": site.name,
        "group": f"s{k}",
        "positions": _rule_text(site.rule),
        **_part_entry(site),
        "dtype": dtype.name,
        "features": _features(found),
        "chunk": _store.chunk_rows(
          _features(found), dtype.itemsize, None if "count" in found else found["values"].shape[0]
        ),
        "ids": np.dtype(found["ids"].dtype).name if "ids" in found else None,
      }
    )
  streams = jax.tree_util.tree_leaves(random_streams)
  found = {
    "format": _store.FORMAT,
    "flaxlens": package_metadata.version("flaxlens"),
    "model": {
      "call": tree.where(),
      "class": tree.module_type.__qualname__,
      "variables": len(variables),
      "fingerprint": _fingerprint(variables),
    },
    "sites": sites,
    "ids": None if plan.ids is None else _function_id(plan.ids),
    "inputs": {
      "structure": str(treedef),
      "arrays": [[np.dtype(a.dtype).name, np.ndim(a)] for a in arrays],
      **({"values": values} if values else {}),
    },
    "first_batch": _fingerprint([(str(i), a) for i, a in enumerate(arrays)]),
    "random_streams": _fingerprint([(str(i), s) for i, s in enumerate(streams)])
    if streams
    else None,
  }
  settings = json.dumps({key: found[key] for key in _SETTINGS}, sort_keys=True)
  found["fingerprint"] = hashlib.sha256(settings.encode()).hexdigest()[:32]
  if updates:
    found["updates"] = list(updates)  # state a run updates: skipped batches are run again
  return found


def _part_entry(site: _SitePlan) -> dict[str, Any]:
  """A site's `part` in the metadata: absent for the whole output (as stores made before
  `part=` existed record it), so that their fingerprints stay theirs."""
  return {} if site.part is None else {"part": site.part}


def _variables(tree: CallNode) -> list[tuple[str, Any]]:
  """The model's variables as `(label, array)`, as the store's model fingerprint sums them
  (taken before a step that may update the model's state)."""
  return [
    (v.label or str(i), leaf)  # a boxed value (nn.Partitioned) by its array
    for i, v in enumerate(variables_in(tree))
    if not isinstance(v.value, Uninitialized)
    for leaf in jax.tree_util.tree_leaves(v.value)
  ]


def _differences(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
  if there.get("format") != here["format"]:
    return [f"format: {there.get('format')!r} there, {here['format']!r} now"]
  found = [
    f"{key}: {json.dumps(there.get(key))} there, {json.dumps(here[key])} now"
    for key in _SETTINGS
    if there.get(key) != here[key]
  ]
  if there.get("model") != here["model"] and there.get("updates"):
    found.append(
      f"(the model's state is part of it, and a run of this model updates {there['updates'][:3]}:"
      " each harvest or call of the model advances it, as the model's own calls do)"
    )
  return found


# --- the store on disk ------------------------------------------------------------------------


def _adopted(
  path: str, tree: CallNode, batch: Any, plan: _Plan, random_streams: Any
) -> dict[str, Any] | None:
  """The metadata of the store at `path` where this call made it (to resume, or complete
  already), found without tracing the model; None where there is none, or another call's
  (or in a multi-process run, where every process must trace alike)."""
  if jax.process_count() > 1 or not os.path.isdir(path):
    return None
  try:
    existing = _store.read_metadata(path)
  except HarvestError:
    return None  # a damaged store: refused or overwritten by `_prepare`
  if existing is None or existing.get("format") != _store.FORMAT:
    return None
  guess = _metadata(tree, batch, plan, None, random_streams, stored=existing["sites"])
  return existing if not _differences(existing, guess) else None


def _prepare(path: str, metadata: dict[str, Any], overwrite: bool) -> dict[str, Any]:
  """Creates the store, or checks the one at `path` was made by this call; its progress.

  Every process checks what `path` holds (reading only); then process 0 alone creates,
  overwrites or reopens the store; then every process checks it sees the store and can
  write to it. Each step is agreed: where it fails on one process, every process raises.
  """
  _same_call(metadata)
  action = _agreed(lambda: _inspect(path, metadata, overwrite), path)
  if action == "complete":  # returned as it is: nothing written, not even where read-only
    return _agreed(lambda: _store.read_progress(path, metadata), path)
  _agreed(
    lambda: make_intervention(path, metadata, action) if jax.process_index() == 0 else None, path
  )
  _agreed(lambda: _check_shared(path, metadata), path)
  return _store.read_progress(path, metadata)


def _inspect(path: str, metadata: dict[str, Any], overwrite: bool) -> str:
  """What to do at `path`: "complete" (this call's store, complete), "resume", "create" or
  "overwrite"; refuses anything else. A damaged store (files that do not fit their
  schema) is overwritten with `overwrite`, else refused."""
  if os.path.lexists(path) and not os.path.isdir(path):
    raise HarvestError(
      f"fl.harvest: {path} exists and is not a directory. Give a new path or a harvest"
      " store's directory."
    )
  try:
    existing = _store.read_metadata(path) if os.path.isdir(path) else None
    if existing is not None and not _differences(existing, metadata):
      progress = _store.read_progress(path, metadata)
      _store.open_arrays(path, existing, write=False)  # refuses damaged arrays
      return "complete" if progress["complete"] else "resume"
  except HarvestError as error:
    if overwrite:
      return "overwrite"
    raise HarvestError(f"fl.harvest: {error} Nothing was overwritten.") from None
  if existing is None and os.path.isdir(path) and os.listdir(path):
    raise HarvestError(
      f"fl.harvest: {path} is a directory holding other files, not a harvest store; nothing"
      " was written. Give a new path or an empty directory."
    )
  if existing is None:
    return "create"
  differences = _differences(existing, metadata)
  if not overwrite:
    raise HarvestError(
      f"fl.harvest: the store at {path} was made by another call; nothing was"
      f" overwritten. What differs: {'; '.join(differences)}. Give another path, run the"
      " call that made it to resume, or pass overwrite=True to start it afresh."
    )
  return "overwrite"


def make_intervention(path: str, metadata: dict[str, Any], action: str) -> None:
  if action == "resume":
    _store.open_arrays(path, metadata, write=True)  # grows arrays shrunk by a stopped run
    return
  if action == "overwrite":
    _check_writable(path)
    shutil.rmtree(path)
  try:
    _store.create(path, metadata)
  except (OSError, ValueError) as error:
    raise HarvestError(
      f"fl.harvest: cannot write the store at {path}: {error}. Give a directory you can write to."
    ) from error


def _check_shared(path: str, metadata: dict[str, Any]) -> None:
  """Refuses a store this process does not see (no path shared by the processes) or cannot
  write to."""
  if _store.read_metadata(path) != metadata:
    raise HarvestError(
      f"fl.harvest: process {jax.process_index()} does not see the store process 0 made at"
      f" {path}. Give a path every process of the run sees (a shared file system)."
    )
  _check_writable(path)


def _check_writable(path: str) -> None:
  probe = os.path.join(path, f".write-check-{jax.process_index()}")
  try:
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as error:
    raise HarvestError(
      f"fl.harvest: cannot write to the store at {path}: {error}. Give a directory you can"
      " write to."
    ) from error


def _same_call(metadata: dict[str, Any]) -> None:
  """Refuses a multi-process run whose processes harvest different calls (other sites,
  rules, model variables or first batch)."""
  if jax.process_count() == 1:
    return
  mine = np.frombuffer(bytes.fromhex(metadata["fingerprint"]), np.uint8)
  every = multihost_utils.process_allgather(mine)
  differ = [i for i, found in enumerate(every) if not np.array_equal(found, every[0])]
  if differ:
    raise HarvestError(
      f"fl.harvest: processes {differ} harvest another call than process 0 (the fingerprints"
      " of their settings differ: model variables, sites, rules, ids, inputs or first batch)."
      " Run the same call, with the same model and batches, on every process."
    )


def _agreed(action: Callable[[], Any], path: str) -> Any:
  """Runs `action` on this process; where it failed on any process, raises on every one
  (this process's own error where it failed here). A barrier in a multi-process run."""
  error, result = None, None
  try:
    result = action()
  except Exception as found:
    error = found
  failed = _failed_processes(error is None)
  if error is not None:
    raise error
  if failed:
    raise HarvestError(
      f"fl.harvest: preparing the store at {path} failed on process(es) {failed} (their"
      " error says why); this process stops too. Fix what they report and run again."
    )
  return result


# --- moving rows off the device ------------------------------------------------------------------


def _bucket(count: int, size: int) -> int:
  """The smallest power of two at least `count`, at most `size`: one slice per bucket."""
  return min(size, 1 << max(0, count - 1).bit_length()) if count else 0


def _pieces(array: Any, counts: np.ndarray | None) -> list[tuple[int, tuple[slice, ...], Any]]:
  """`(first row, region of the other axes, host values)` of the rows of `array` this
  process writes: those of its addressable shards that are the first replica of their
  region, so each row is written once, by the process whose device computed it, and never
  gathered. `counts` None: `array` is `(rows, ...)`, every row kept; otherwise it is
  `(blocks, rows, ...)`, block `b` keeps its first `counts[b]` rows, stored after the rows
  the blocks before it keep."""
  offsets = None if counts is None else np.cumsum(counts) - counts
  pieces = []
  for shard in array.addressable_shards:
    if shard.replica_id != 0:
      continue
    region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(shard.index, array.shape, strict=True))
    data = np.asarray(shard.data)
    if counts is None:
      pieces.append((region[0].start, region[1:], data))
      continue
    blocks, rows = region[0], region[1]
    for block in range(blocks.start, blocks.stop):
      keep = min(rows.stop, int(counts[block])) - rows.start
      if keep > 0:
        first = int(offsets[block]) + rows.start
        pieces.append((first, region[2:], data[block - blocks.start, :keep]))
  return pieces


@dataclasses.dataclass(frozen=True)
class _Step:
  """A dispatched step: its outputs, its batch's number, whether it is the batch's last."""

  out: dict[str, Any]
  number: int
  last: bool


class _Written:
  """The pending writes of one batch, and what the store holds once they complete."""

  def __init__(self, futures: list[Any], progress: dict[str, Any], held: list[Any]):
    self.futures = futures
    self.progress = progress
    self.held = held  # host arrays a write reads from, kept until it completes

  def done(self) -> bool:
    return all(future.commit.done() for future in self.futures)

  def wait(self) -> None:
    for future in self.futures:
      future.commit.result()  # written to the files, not only copied out of `held`


def _write(
  arrays: dict[str, dict[str, Any]],
  out: dict[str, Any],
  plan: _Plan,
  sizes: np.ndarray,
  example: int,
  rows: dict[str, int],
) -> tuple[list[Any], list[Any], dict[str, int], int]:
  """Issues the writes of one batch at rows `rows` (by site), its first example being
  `example`; returns the futures, the host arrays, the rows written and the bytes. The rows
  each block of a mask keeps are agreed by every process (`_fetch`)."""
  futures, held, written, size = [], [], {}, 0

  def write(target: Any, first: int, rest: tuple[slice, ...], data: np.ndarray) -> None:
    nonlocal size
    region = target[(slice(first, first + len(data)), *rest)]
    # Rows are never changed after they leave the device: TensorStore may keep reading
    # them instead of copying them first.
    futures.append(region.write(data, can_reference_source_data_indefinitely=True))
    held.append(data)
    size += data.nbytes

  for k, site in enumerate(plan.sites):
    found, target, start = out[site.name], arrays[site.name], rows[site.name]
    counts = _fetch(found["count"]) if "count" in found else None
    for name in ("values", "index", "ids"):
      if name not in found:
        continue
      array = found[name]
      if counts is not None:
        kept = _bucket(int(counts.max(initial=0)), array.shape[1])
        if not kept:
          continue
        array = array[:, :kept]  # only the selected rows leave the device
      for first, rest, data in _pieces(array, counts):
        if name == "index":
          data = data.astype(np.int64) + np.asarray([example, 0], np.int64)
        write(target[name], start + first, rest, data)
        if counts is None and name == "values" and all(r.start == 0 for r in rest):
          index = _index(site.rule, first, len(data), int(sizes[1 + k])) + [example, 0]
          write(target["index"], start + first, (), index)
    written[site.name] = found["values"].shape[0] if counts is None else int(counts.sum())
  return futures, held, written, size


def _index(rule: Any, first: int, count: int, length: int) -> np.ndarray:
  """The `(example, position)` within the batch of rows `first : first + count` of a site
  without a mask, whose output has `length` positions."""
  rows = np.arange(first, first + count, dtype=np.int64)
  if rule == "all":
    return np.stack([rows // length, rows % length], 1)
  return np.stack([rows, np.full(count, -1 if rule is None else length - 1)], 1)


# --- progress display -------------------------------------------------------------------------


class _Display:
  """A rich progress bar (batches, examples, tokens/s, bytes written) or nothing."""

  def __init__(self, show: bool, total: int | None, committed: int):
    self._progress = None
    self._start = time.perf_counter()
    self._tokens = 0
    if not show:
      return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    self._progress = Progress(
      TextColumn("harvest"),
      BarColumn(),
      TextColumn("{task.completed}/{task.total} batches" if total else "{task.completed} batches"),
      TextColumn("{task.fields[examples]} examples"),
      TextColumn("{task.fields[rate]} tok/s"),
      TextColumn("{task.fields[size]}"),
      TimeElapsedColumn(),
      console=Console(file=sys.stderr),
    )
    self._task = self._progress.add_task(
      "harvest", total=total, completed=committed, examples=0, rate="-", size="0 B"
    )
    self._progress.start()

  def update(self, batches: int, examples: int, tokens: int, size: int) -> None:
    if self._progress is None:
      return
    self._tokens += tokens
    rate = self._tokens / max(time.perf_counter() - self._start, 1e-9)
    self._progress.update(
      self._task, completed=batches, examples=examples, rate=f"{rate:,.0f}", size=_bytes(size)
    )

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()


def _bytes(size: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if size < 1024 or unit == "GiB":
      return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
    size /= 1024
  return f"{size:.1f} TiB"


# --- fl.harvest ---------------------------------------------------------------------------------


def harvest(
  tree: CallNode,
  batches: Iterable[Any],
  at: Any,
  path: Any,
  /,
  *,
  positions: Any = "all",
  dtype: Any = None,
  ids: Callable[[Any], Any] | None = None,
  part: Any = None,
  random_streams: Any = None,
  progress: bool | None = None,
  overwrite: bool = False,
  sharding: Any = None,
  budget: int | None = None,
) -> Harvest:
  """Streams the activations of `at` over `batches` into a store at `path`.

  Each batch (the model's arguments as one value, as `fl.run` takes them: an array, a
  tuple, or `fl.ArgsAndKwargs`) runs through one compiled program per input shape,
  which captures the sites, keeps the rows `positions` selects, casts them to `dtype`
  and records each row's example (its place in the stream) and position; only those
  rows leave the device. Each site's rows go to one zarr v3 array, `(rows, *features)`,
  written by TensorStore while the next batch's forward runs; at most two batches'
  writes are pending, so memory does not grow with the dataset. A batch is committed
  once its writes have completed; running the same call again after an interruption
  skips the committed batches of `batches` and continues, with no row missing or
  repeated. The store is `complete` only once `batches` is exhausted and every write is
  done. See docs/harvest.md for the layout and the reasons behind it.

  Args:
    tree: a converted tree (`fl.unflaxify`).
    batches: an iterable of batches (a list, a generator, a Grain or tf.data iterator);
      each is the model's arguments as one value. Every batch's sites must give the
      same feature shapes; batch size and sequence length may vary (each new input
      shape compiles once).
    at: the sites, as `fl.capture` takes them; each site's output must be one array
      with the batch as its first axis.
    path: the store's directory (created; an existing store of the same call resumes).
    positions: which rows of a `(batch, positions, ...)` output to keep: `"all"` (every
      position, rows in example-then-position order), `"last"` (the last position),
      None (one row per example: the whole output but its first axis), or a function of
      the batch giving a boolean `(batch, positions)` mask (for example
      `lambda tokens: tokens != PAD`). A dict `{site pattern: rule}` gives rules per site.
    dtype: the stored dtype (`jnp.bfloat16`), or None for what the site computes; a dict
      `{site pattern: dtype}` gives one per site. The cast happens on device.
    ids: a function of the batch giving one integer id per example `(batch,)` or per
      position `(batch, positions)` (token ids: `lambda tokens: tokens`), stored beside
      each row; None: none.
    part: for a site whose output is a tuple, dict or dataclass, which part is stored
      (`part=0`: a Hugging Face block's hidden states); None (default): the whole output,
      which must then be one array. A dict `{site pattern: part}` gives one per site.
      See docs/interventions.md, "Structured values: part=".
    random_streams: as for a tree call (Linen: `{"dropout": key}`), the same for every
      batch.
    progress: show a progress bar (batches, examples, tokens/s, bytes written) on
      stderr; None (default): only when stderr is a terminal.
    overwrite: where `path` holds a store made by another call, delete it and start
      afresh (otherwise that is refused).
    sharding: a `jax.sharding.Sharding` (or a pytree of them, a prefix of each batch)
      placing each batch: each process's batches are its own rows of the global batches,
      assembled as `jax.make_array_from_process_local_data(sharding, local)` assembles
      them (in one process: the whole batch, placed). The forward runs as one SPMD
      program over the mesh and each process writes the rows its devices computed. None:
      batches are used as given (in a multi-process run they must then be global
      `jax.Array`s). See "Scale out" in docs/harvest.md.
    budget: the most bytes of rows the harvest holds at once (a positive int), or None.
      A harvest holds the rows of up to four steps (the one dispatched, the one whose
      writes are being issued, two on the host waiting for their writes), so a batch
      whose four steps' rows exceed `budget` runs
      in chunks of equal size along its examples, each a step of its own (a last,
      smaller chunk compiles once more). Refused where chunks cannot give the batch's
      rows: a model that couples the examples of a batch, random streams, several
      processes or `sharding=`. See "Bounded memory" in docs/harvest.md.

  Returns:
    The `fl.Harvest` handle of the complete store.

  Raises:
    SelectionError: a site matches no call.
    ArgumentError: an option is of the wrong kind, or a site's output (its `part`) cannot
      be stored as rows (not one array, no batch axis, a mask of another shape); in a
      multi-process run, a batch of host arrays without `sharding=`, or variables on one
      process only.
    BudgetError: `budget` does not hold the rows of one example, or a batch that needs
      splitting cannot be split (see `budget`).
    HarvestError: `path` cannot be written, holds another call's store (what differs is
      listed; nothing is overwritten) or something else, a batch gives other feature
      shapes or dtypes than the store holds, `batches` is empty, or TensorStore is not
      installed; in a multi-process run, the processes harvest different calls or do
      not share the path.

  Example:
    >>> import tempfile, flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((4, 5, 2))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> batches = [x, 2 * x, 3 * x]
    >>> stored = fl.harvest(tree, batches, "layers_0", tempfile.mkdtemp() + "/acts",
    ...                     positions="last", dtype=jnp.bfloat16)
    >>> stored["layers_0"].shape, stored["layers_0"].dtype, len(stored)
    ((12, 3), dtype(bfloat16), 12)
    >>> stored["layers_0"].index[5].tolist()  # example 5 (second batch), position 4
    [5, 4]
  """
  check_tree(tree, "fl.harvest")
  _store.tensorstore()
  path = os.path.abspath(
    check_path(path, "fl.harvest", "Pass the directory to write the store to.", "path")
  )
  if not isinstance(batches, Iterable) or isinstance(batches, str | bytes | jax.Array | np.ndarray):
    raise ArgumentError(
      f"fl.harvest: batches must be an iterable of batches (a list, a generator, a data"
      f" loader), got {type(batches).__name__}. Pass [x] for one batch."
    )
  if progress not in (None, True, False):
    raise ArgumentError(f"fl.harvest: progress= is True, False or None, got {progress!r}.")
  plan = _plan(tree, at, positions, dtype, ids, part)
  random_streams = resolve_random_streams(random_streams, tree.where())
  budget = _budget.checked_budget(budget, "fl.harvest")
  total = _length(batches)
  stream = iter(batches)
  first = next(stream, _MISSING)
  if first is _MISSING:
    raise HarvestError(
      f"fl.harvest: batches gave no batch, so there is nothing to harvest into {path}."
      " Pass at least one batch."
    )
  _check_variables(tree)
  first = _place(_as_arrays(first), sharding)
  _check_global(first, 0)
  chunks = None if budget is None else _Chunks(tree, plan, random_streams, budget, sharding)
  if chunks is not None:
    chunks.split(first, 0)  # refuses what the budget cannot split before anything is written
  metadata, first_out = _adopted(path, tree, first, plan, random_streams), None
  if metadata is None and jax.process_count() > 1:
    shapes, updated = _shapes(tree, first, plan, random_streams)
    metadata = _metadata(tree, first, plan, shapes, random_streams, updates=updated)
  elif metadata is None:
    # The first step, dispatched now, gives the rows' shapes (its trace is the one the loop
    # reuses) and runs while the store is prepared; the model is fingerprinted as it was
    # before the step (which may update its state).
    part = first if chunks is None else chunks.split(first, 0)[0]
    variables, state = _variables(tree), _state(tree)
    first_out = _step(tree, part, plan, random_streams, _groups(part))
    metadata = _metadata(
      tree,
      first,
      plan,
      first_out,
      random_streams,
      updates=_updated(state, tree),
      variables=variables,
    )
  state = _prepare(path, metadata, overwrite)
  if state["complete"]:
    return _store.open_harvest(path)
  show = (sys.stderr.isatty() if progress is None else progress) and jax.process_index() == 0
  display = _Display(show, total, state["batches"])
  try:
    _run(
      tree,
      first,
      stream,
      plan,
      random_streams,
      sharding,
      path,
      metadata,
      state,
      display,
      chunks,
      first_out,
    )
  finally:
    display.close()
  return _store.open_harvest(path)


def _length(batches: Iterable[Any]) -> int | None:
  """The number of batches where `batches` says (for the progress bar), else None: an
  iterable may have no `len`, or one that raises (tf.data's of unknown cardinality)."""
  try:
    length = len(batches)  # type: ignore[arg-type]
  except Exception:
    return None
  return length if isinstance(length, int) and length >= 0 else None


def _run(
  tree: CallNode,
  first: Any,
  stream: Any,
  plan: _Plan,
  random_streams: Any,
  sharding: Any,
  path: str,
  metadata: dict[str, Any],
  state: dict[str, Any],
  display: _Display,
  chunks: _Chunks | None,
  first_out: dict[str, Any] | None = None,
) -> None:
  """The loop over batches. In a multi-process run every process runs it alike: the same
  batches skipped, each step one SPMD program over the global devices, each process writing
  its own rows; a batch is committed after a barrier confirming every process's writes of
  it completed, by process 0 alone, at the same point of the loop on every process."""
  arrays = _store.open_arrays(path, metadata, write=True)
  several = jax.process_count() > 1
  lead = jax.process_index() == 0
  expected = {s["name"]: s for s in metadata["sites"]}
  skip = state["batches"]
  # A model that updates its state (batch statistics, NNX random counts) runs the batches
  # committed before too, their rows unused, so that it reaches the state it had there.
  replay = bool(metadata.get("updates"))
  batches, examples = state["batches"], state["examples"]
  rows = {site.name: int(state["rows"].get(site.name, 0)) for site in plan.sites}
  pending: collections.deque[_Written] = collections.deque()
  written_bytes = 0

  last_commit = time.perf_counter()
  unsaved: list[dict[str, Any]] = []  # the latest written batch's progress, not yet saved
  # One process saves its progress on a thread of its own: syncing the writes (before
  # progress.json counts them) waits for the disk, which the loop need not do.
  saver = None if several else concurrent.futures.ThreadPoolExecutor(1, "flaxlens-harvest")
  saving: collections.deque[concurrent.futures.Future] = collections.deque()

  def save(progress: dict[str, Any]) -> None:
    saving.append(saver.submit(_store.commit, path, progress))
    while saving and saving[0].done():
      saving.popleft().result()  # a failed save stops the run

  def commit(written: _Written) -> None:
    nonlocal last_commit
    written.wait()
    if written.progress is None:
      return  # a chunk of a batch: the batch commits with its last chunk
    if not several:
      unsaved[:] = [written.progress]  # written; saved with a later batch or at the end
      if time.perf_counter() - last_commit >= COMMIT_EVERY:
        save(unsaved.pop())
        last_commit = time.perf_counter()
      return
    _store.flush(path)  # every process's writes durable before the barrier
    _barrier(f"batch {written.progress['batches'] - 1} written")
    if lead:
      _store.write_progress(path, written.progress)
    last_commit = time.perf_counter()

  def save_unsaved() -> None:
    """Saves the last written batch's progress, and waits for every save."""
    try:
      if unsaved:
        save(unsaved.pop())
    finally:
      saver.shutdown(wait=True)
    while saving:
      saving.popleft().result()

  def written(step: _Step) -> None:
    """Checks a dispatched step's rows and issues their writes (waiting for its sizes)."""
    nonlocal examples, rows, written_bytes, batches
    _check_batch(step.out, expected, step.number, path, batches)
    # Processes commit at the same points (a barrier each), so not when a write is done.
    while pending and (len(pending) >= IN_FLIGHT or (not several and pending[0].done())):
      commit(pending.popleft())
    sizes = _fetch(step.out["sizes"])
    futures, held, counts, size = _write(arrays, step.out, plan, sizes, examples, rows)
    examples += int(sizes[0])
    rows = {name: rows[name] + counts[name] for name in rows}
    written_bytes += size
    progress = None
    if step.last:
      batches = step.number + 1
      progress = {"batches": batches, "examples": examples, "rows": rows, "complete": False}
    pending.append(_Written(futures, progress, held))
    display.update(
      step.number + step.last, examples, int(sizes[0]) * int(sizes[1:].max()), written_bytes
    )

  # One step ahead: the next step is dispatched before the rows of the one before it are
  # fetched and their writes issued, so the device never waits for the host between steps.
  ahead: _Step | None = None

  def write_ahead() -> None:
    nonlocal ahead
    if ahead is not None:
      step, ahead = ahead, None
      written(step)

  try:
    try:
      for number, batch in enumerate(_chain(first, stream)):
        if number < skip and not replay:
          continue
        batch = _place(_as_arrays(batch), sharding)
        _check_global(batch, number)
        if number < skip:
          _step(tree, batch, plan, random_streams, _groups(batch))
          continue
        parts = [batch] if chunks is None else chunks.split(batch, number)
        for last, part in enumerate(parts, 1 - len(parts)):
          if first_out is not None and number == 0 and last == 1 - len(parts):
            out, first_out = first_out, None  # dispatched already, to read the rows' shapes
          else:
            out = _step(tree, part, plan, random_streams, _groups(part))
          write_ahead()
          ahead = _Step(out, number, last == 0)
    except BaseException:
      # What stopped the run (a refused batch, an error) came after the step ahead; one
      # process of several does not write it (the others may not reach its barriers).
      if not several:
        write_ahead()
      raise
    write_ahead()
    while pending:
      commit(pending.popleft())
  finally:
    # Whatever stopped the run, batches whose writes complete are committed; a write that
    # fails leaves its batch uncommitted, and the error that stopped the run propagates.
    # Several processes stopped by an error commit nothing more (another process may not
    # reach the barrier): their pending batches are written again on resume.
    try:
      while pending and not several:
        commit(pending.popleft())
    except Exception:
      pending.clear()
    if not several:
      save_unsaved()  # every batch whose writes completed
  _barrier("every batch written")
  if lead:
    _store.shrink(arrays, rows)
    _store.commit(path, {"batches": batches, "examples": examples, "rows": rows, "complete": True})
  _barrier("complete")  # no process returns before the store says complete


def _check_variables(tree: CallNode) -> None:
  """In a multi-process run, refuses variables held on this process's devices only (each
  step is one program over every process's devices)."""
  if jax.process_count() == 1:
    return
  local = [
    v.label or "?"
    for v in variables_in(tree)
    if any(
      isinstance(leaf, jax.Array) and leaf.is_fully_addressable
      for leaf in jax.tree_util.tree_leaves(v.value)
    )
  ]
  if local:
    raise ArgumentError(
      f"fl.harvest: the variables {local[:3]}{' ...' if len(local) > 3 else ''} live on"
      f" process {jax.process_index()}'s devices only, in a run of {jax.process_count()}"
      " processes. Place the model's variables on the global mesh before converting it"
      " (jax.device_put(variables, NamedSharding(mesh, P())) to replicate them, or the"
      " shardings of a sharded init)."
    )


def _chain(first: Any, stream: Any) -> Any:
  yield first
  yield from stream


def _check_batch(
  out: dict[str, Any], expected: dict[str, Any], number: int, path: str, committed: int
) -> None:
  """Refuses a batch whose rows do not fit the store (another feature shape or dtype)."""
  for name, site in expected.items():
    features, dtype = _features(out[name]), np.dtype(out[name]["values"].dtype).name
    ids = out[name].get("ids")
    ids_dtype = None if ids is None else np.dtype(ids.dtype).name
    if features != site["features"] or dtype != site["dtype"] or ids_dtype != site["ids"]:
      raise HarvestError(
        f"fl.harvest: batch {number} gives rows of {dtype}{features} at {name} (ids:"
        f" {ids_dtype}), where the store at {path} holds {site['dtype']}{site['features']}"
        f" (ids: {site['ids']}); nothing of this batch was written, and the {committed}"
        " batches before it are committed. Give batches whose sites have the same feature"
        " shapes (pad or bucket sequence lengths only along the positions axis)."
      )
