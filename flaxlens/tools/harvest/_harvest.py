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
(`jax.experimental.multihost_utils`). This module holds `harvest` and its loop over the
batches; the plan is `_plan`'s, the compiled step `_step`'s, placing and chunking
batches `_batches`', the metadata `_metadata`'s (fingerprints: `_fingerprints`), the
store's directory `_directory`'s, the writes and commits `_writing`'s, the files
`_store`'s. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from flaxlens.core._checks import check_path
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.core._variables import variables_in
from flaxlens.errors import ArgumentError, HarvestError
from flaxlens.tools.base import _budget
from flaxlens.tools.harvest import _store
from flaxlens.tools.harvest._batches import (
  Chunks,
  check_global,
  example_blocks,
  placed_batch,
  state_values,
  step_shapes,
  updated_labels,
)
from flaxlens.tools.harvest._directory import adopted_metadata, prepare_store
from flaxlens.tools.harvest._display import Display
from flaxlens.tools.harvest._metadata import model_variables, store_metadata
from flaxlens.tools.harvest._plan import HarvestPlan, plan_harvest
from flaxlens.tools.harvest._step import as_arrays, compiled_step
from flaxlens.tools.harvest._store import Harvest
from flaxlens.tools.harvest._writing import Step, Writer


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
  plan = plan_harvest(tree, at, positions, dtype, ids, part)
  random_streams = resolve_random_streams(random_streams, tree.where())
  budget = _budget.checked_budget(budget, "fl.harvest")
  total = _length(batches)
  stream = iter(batches)
  first = next(stream, _NO_BATCH)
  if first is _NO_BATCH:
    raise HarvestError(
      f"fl.harvest: batches gave no batch, so there is nothing to harvest into {path}."
      " Pass at least one batch."
    )
  _check_variables(tree)
  first = placed_batch(as_arrays(first), sharding)
  check_global(first, 0)
  chunks = None if budget is None else Chunks(tree, plan, random_streams, budget, sharding)
  if chunks is not None:
    chunks.split(first, 0)  # refuses what the budget cannot split before anything is written
  steps = _Steps(tree, plan, random_streams, sharding, chunks)
  metadata, first_out = _first_metadata(steps, path, first)
  state = prepare_store(path, metadata, overwrite)
  if state["complete"]:
    return _store.open_harvest(path)
  show = (sys.stderr.isatty() if progress is None else progress) and jax.process_index() == 0
  display = Display(show, total, state["batches"])
  try:
    writer = Writer(path, metadata, state, plan, display)
    replay = bool(metadata.get("updates"))
    _run_batches(steps, _chain(first, stream), writer, state["batches"], replay, first_out)
  finally:
    display.close()
  return _store.open_harvest(path)


@dataclasses.dataclass(frozen=True)
class _Steps:
  """How each batch runs: through `compiled_step` with the plan, placed by `sharding`, in
  `chunks` of a budget (None: whole)."""

  tree: CallNode
  plan: HarvestPlan
  random_streams: Any
  sharding: Any
  chunks: Chunks | None

  def run(self, batch: Any) -> dict[str, Any]:
    """The dispatched step of `batch` (or of a chunk of it)."""
    return compiled_step(self.tree, batch, self.plan, self.random_streams, example_blocks(batch))


def _first_metadata(
  steps: _Steps, path: str, first: Any
) -> tuple[dict[str, Any], dict[str, Any] | None]:
  """The store's metadata for this call, and the first step where it was dispatched to
  read the rows' shapes (None where the store's metadata or an abstract trace gave them)."""
  tree, plan, random_streams = steps.tree, steps.plan, steps.random_streams
  metadata = adopted_metadata(path, tree, first, plan, random_streams)
  if metadata is not None:
    return metadata, None
  if jax.process_count() > 1:
    shapes, updated = step_shapes(tree, first, plan, random_streams)
    return store_metadata(tree, first, plan, shapes, random_streams, updates=updated), None
  # The first step, dispatched now, gives the rows' shapes (its trace is the one the loop
  # reuses) and runs while the store is prepared; the model is fingerprinted as it was
  # before the step (which may update its state).
  part = first if steps.chunks is None else steps.chunks.split(first, 0)[0]
  variables, state = model_variables(tree), state_values(tree)
  first_out = steps.run(part)
  metadata = store_metadata(
    tree,
    first,
    plan,
    first_out,
    random_streams,
    updates=updated_labels(state, tree),
    variables=variables,
  )
  return metadata, first_out


def _length(batches: Iterable[Any]) -> int | None:
  """The number of batches where `batches` says (for the progress bar), else None: an
  iterable may have no `len`, or one that raises (tf.data's of unknown cardinality)."""
  try:
    length = len(batches)  # type: ignore[arg-type]
  except Exception:
    return None
  return length if isinstance(length, int) and length >= 0 else None


def _run_batches(
  steps: _Steps,
  batches: Iterator[Any],
  writer: Writer,
  skip: int,
  replay: bool,
  first_out: dict[str, Any] | None,
) -> None:
  """The loop over batches, the first `skip` committed already (run again, their rows
  unused, where a model that updates its state must `replay` them to reach the state it
  had there). In a multi-process run every process runs it alike: the same batches
  skipped, each step one SPMD program over the global devices, each process writing its
  own rows (see `Writer`)."""
  try:
    try:
      for number, batch in enumerate(batches):
        if number < skip and not replay:
          continue
        batch = placed_batch(as_arrays(batch), steps.sharding)
        check_global(batch, number)
        if number < skip:
          steps.run(batch)
          continue
        parts = [batch] if steps.chunks is None else steps.chunks.split(batch, number)
        for last, part in enumerate(parts, 1 - len(parts)):
          if first_out is not None and number == 0 and last == 1 - len(parts):
            out, first_out = first_out, None  # dispatched already, to read the rows' shapes
          else:
            out = steps.run(part)
          writer.add(Step(out, number, last == 0))
    except BaseException:
      writer.stopped()
      raise
    writer.finish()
  finally:
    writer.close()
  writer.complete()


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


def _chain(first: Any, stream: Iterator[Any]) -> Iterator[Any]:
  yield first
  yield from stream


_NO_BATCH = object()
