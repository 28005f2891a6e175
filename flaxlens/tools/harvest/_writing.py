"""`fl.harvest`'s writing: the rows of each step moved off the device shard by shard (each
row written once, by the process whose device computed it, never gathered), written to
the store's arrays by TensorStore as futures while the next step runs, and each batch
committed once its writes completed (`Writer`). No Flax internals here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from flaxlens.errors import HarvestError
from flaxlens.tools.harvest import _store
from flaxlens.tools.harvest._display import Display
from flaxlens.tools.harvest._plan import HarvestPlan
from flaxlens.tools.harvest._processes import barrier, fetch_whole
from flaxlens.tools.harvest._step import row_features

IN_FLIGHT = 2  # Batches whose writes may be pending at once (host memory: this many batches).
# One process commits a written batch at most this often (seconds): each commit syncs
# progress.json to disk, and a later commit covers the batches before it. A stopped run
# redoes at most this long's batches. Several processes commit every batch (a barrier each).
COMMIT_EVERY = 0.5


def _bucket(count: int, size: int) -> int:
  """The smallest power of two at least `count`, at most `size`: one slice per bucket."""
  return min(size, 1 << max(0, count - 1).bit_length()) if count else 0


def pieces(array: Any, counts: np.ndarray | None) -> list[tuple[int, tuple[slice, ...], Any]]:
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
class Step:
  """A dispatched step: its outputs, its batch's number, whether it is the batch's last."""

  out: dict[str, Any]
  number: int
  last: bool


class _Written:
  """The pending writes of one step (a batch, or a chunk of one), and what the store holds
  once they complete."""

  def __init__(self) -> None:
    self.futures: list[Any] = []
    self.held: list[np.ndarray] = []  # host arrays a write reads from, kept until it completes
    self.rows: dict[str, int] = {}  # the rows written, by site
    self.progress: dict[str, Any] | None = None  # None: a chunk before its batch's last

  def write(self, target: Any, first: int, rest: tuple[slice, ...], data: np.ndarray) -> None:
    """Issues the write of `data` at rows `first:` and region `rest` of the other axes."""
    region = target[(slice(first, first + len(data)), *rest)]
    # Rows are never changed after they leave the device: TensorStore may keep reading
    # them instead of copying them first.
    self.futures.append(region.write(data, can_reference_source_data_indefinitely=True))
    self.held.append(data)

  def nbytes(self) -> int:
    """The bytes written."""
    return sum(data.nbytes for data in self.held)

  def done(self) -> bool:
    """Whether every write of the step has completed."""
    return all(future.commit.done() for future in self.futures)

  def wait(self) -> None:
    """Returns once every write of the step has completed (raises where one failed)."""
    for future in self.futures:
      future.commit.result()  # written to the files, not only copied out of `held`


def _write_batch(
  arrays: dict[str, dict[str, Any]],
  out: dict[str, Any],
  plan: HarvestPlan,
  sizes: np.ndarray,
  example: int,
  rows: dict[str, int],
) -> _Written:
  """Issues the writes of one step's rows at rows `rows` (by site), its first example being
  `example`. The rows each block of a mask keeps are agreed by every process
  (`fetch_whole`)."""
  written = _Written()
  for k, site in enumerate(plan.sites):
    found, target, start = out[site.name], arrays[site.name], rows[site.name]
    counts = fetch_whole(found["count"]) if "count" in found else None
    for name in ("values", "index", "ids"):
      if name not in found:
        continue
      array = found[name]
      if counts is not None:
        kept = _bucket(int(counts.max(initial=0)), array.shape[1])
        if not kept:
          continue
        array = array[:, :kept]  # only the selected rows leave the device
      for first, rest, data in pieces(array, counts):
        if name == "index":
          data = data.astype(np.int64) + np.asarray([example, 0], np.int64)
        written.write(target[name], start + first, rest, data)
        if counts is None and name == "values" and all(r.start == 0 for r in rest):
          index = _index(site.rule, first, len(data), int(sizes[1 + k])) + [example, 0]
          written.write(target["index"], start + first, (), index)
    written.rows[site.name] = found["values"].shape[0] if counts is None else int(counts.sum())
  return written


def _index(rule: Any, first: int, count: int, length: int) -> np.ndarray:
  """The `(example, position)` within the batch of rows `first : first + count` of a site
  without a mask, whose output has `length` positions."""
  rows = np.arange(first, first + count, dtype=np.int64)
  if rule == "all":
    return np.stack([rows // length, rows % length], 1)
  return np.stack([rows, np.full(count, -1 if rule is None else length - 1)], 1)


def _check_batch(
  out: dict[str, Any], expected: dict[str, Any], number: int, path: str, committed: int
) -> None:
  """Refuses a batch whose rows do not fit the store (another feature shape or dtype)."""
  for name, site in expected.items():
    features, dtype = row_features(out[name]), np.dtype(out[name]["values"].dtype).name
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


class Writer:
  """The writes of a harvest's steps and the commits of its batches, on one process.

  `add` takes each dispatched step, one step ahead: the rows of the step before it are
  fetched and their writes issued only then, so the device never waits for the host
  between steps. At most `IN_FLIGHT` batches' writes are pending; a batch is committed
  once its writes completed. One process saves its progress on a thread of its own (at
  most every `COMMIT_EVERY` seconds: a later save covers the batches before it); in a
  multi-process run every batch is committed after a barrier confirming every process's
  writes of it, by process 0 alone, at the same point of the loop on every process.
  """

  def __init__(
    self,
    path: str,
    metadata: dict[str, Any],
    progress: dict[str, Any],
    plan: HarvestPlan,
    display: Display,
  ) -> None:
    self.path, self.plan, self.display = path, plan, display
    self.arrays = _store.open_arrays(path, metadata, write=True)
    self.several = jax.process_count() > 1
    self.lead = jax.process_index() == 0
    self.expected = {s["name"]: s for s in metadata["sites"]}
    self.batches, self.examples = progress["batches"], progress["examples"]
    self.rows = {site.name: int(progress["rows"].get(site.name, 0)) for site in plan.sites}
    self.pending: collections.deque[_Written] = collections.deque()
    self.written_bytes = 0
    self.ahead: Step | None = None  # dispatched, its rows not fetched yet
    self.last_commit = time.perf_counter()
    self.unsaved: list[dict[str, Any]] = []  # the latest written batch's progress, not saved
    # Syncing the writes (before progress.json counts them) waits for the disk, which the
    # loop need not do.
    self.saver = (
      None if self.several else concurrent.futures.ThreadPoolExecutor(1, "flaxlens-harvest")
    )
    self.saving: collections.deque[concurrent.futures.Future] = collections.deque()

  def add(self, step: Step) -> None:
    """Issues the writes of the step ahead, and keeps `step` ahead."""
    self.write_ahead()
    self.ahead = step

  def write_ahead(self) -> None:
    """Issues the writes of the step ahead, if any."""
    if self.ahead is not None:
      step, self.ahead = self.ahead, None
      self._write(step)

  def stopped(self) -> None:
    """What stopped the run (a refused batch, an error) came after the step ahead; one
    process of several does not write it (the others may not reach its barriers)."""
    if not self.several:
      self.write_ahead()

  def finish(self) -> None:
    """Writes the step ahead and commits every batch (all batches ran)."""
    self.write_ahead()
    while self.pending:
      self._commit(self.pending.popleft())

  def close(self) -> None:
    """Whatever stopped the run, batches whose writes complete are committed; a write that
    fails leaves its batch uncommitted, and the error that stopped the run propagates.
    Several processes stopped by an error commit nothing more (another process may not
    reach the barrier): their pending batches are written again on resume."""
    try:
      while self.pending and not self.several:
        self._commit(self.pending.popleft())
    except Exception:
      self.pending.clear()
    if not self.several:
      self._save_unsaved()  # every batch whose writes completed

  def complete(self) -> None:
    """Marks the store complete, once every process's batches are written."""
    barrier("every batch written")
    if self.lead:
      _store.shrink(self.arrays, self.rows)
      progress = {"batches": self.batches, "examples": self.examples, "rows": self.rows}
      _store.commit(self.path, {**progress, "complete": True})
    barrier("complete")  # no process returns before the store says complete

  def _write(self, step: Step) -> None:
    """Checks a dispatched step's rows and issues their writes (waiting for its sizes)."""
    _check_batch(step.out, self.expected, step.number, self.path, self.batches)
    # Processes commit at the same points (a barrier each), so not when a write is done.
    pending = self.pending
    while pending and (len(pending) >= IN_FLIGHT or (not self.several and pending[0].done())):
      self._commit(pending.popleft())
    sizes = fetch_whole(step.out["sizes"])
    written = _write_batch(self.arrays, step.out, self.plan, sizes, self.examples, self.rows)
    self.examples += int(sizes[0])
    self.rows = {name: self.rows[name] + written.rows[name] for name in self.rows}
    self.written_bytes += written.nbytes()
    if step.last:
      self.batches = step.number + 1
      written.progress = {
        "batches": self.batches,
        "examples": self.examples,
        "rows": self.rows,
        "complete": False,
      }
    pending.append(written)
    tokens = int(sizes[0]) * int(sizes[1:].max())
    self.display.update(step.number + step.last, self.examples, tokens, self.written_bytes)

  def _commit(self, written: _Written) -> None:
    written.wait()
    if written.progress is None:
      return  # a chunk of a batch: the batch commits with its last chunk
    if not self.several:
      self.unsaved[:] = [written.progress]  # written; saved with a later batch or at the end
      if time.perf_counter() - self.last_commit >= COMMIT_EVERY:
        self._save(self.unsaved.pop())
        self.last_commit = time.perf_counter()
      return
    _store.flush(self.path)  # every process's writes durable before the barrier
    barrier(f"batch {written.progress['batches'] - 1} written")
    if self.lead:
      _store.write_progress(self.path, written.progress)
    self.last_commit = time.perf_counter()

  def _save(self, progress: dict[str, Any]) -> None:
    self.saving.append(self.saver.submit(_store.commit, self.path, progress))
    while self.saving and self.saving[0].done():
      self.saving.popleft().result()  # a failed save stops the run

  def _save_unsaved(self) -> None:
    """Saves the last written batch's progress, and waits for every save."""
    try:
      if self.unsaved:
        self._save(self.unsaved.pop())
    finally:
      self.saver.shutdown(wait=True)
    while self.saving:
      self.saving.popleft().result()
