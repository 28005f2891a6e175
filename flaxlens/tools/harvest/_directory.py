"""A harvest store's directory, agreed by every process: whether `path` holds this call's
store (complete, or to resume), nothing yet, another call's store or something else;
then process 0 alone creates, overwrites or reopens it, and every process checks that it
sees the store and can write to it. Each step is agreed: where it fails on one process,
every process raises. The files themselves are `_store`'s. No Flax internals here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from flaxlens.core._node import CallNode
from flaxlens.errors import HarvestError
from flaxlens.tools.harvest import _store
from flaxlens.tools.harvest._metadata import differences, store_metadata
from flaxlens.tools.harvest._plan import HarvestPlan
from flaxlens.tools.harvest._processes import failed_processes


def adopted_metadata(
  path: str, tree: CallNode, batch: Any, plan: HarvestPlan, random_streams: Any
) -> dict[str, Any] | None:
  """The metadata of the store at `path` where this call made it (to resume, or complete
  already), found without tracing the model; None where there is none, or another call's
  (or in a multi-process run, where every process must trace alike)."""
  if jax.process_count() > 1 or not os.path.isdir(path):
    return None
  try:
    existing = _store.read_metadata(path)
  except HarvestError:
    return None  # a damaged store: refused or overwritten by `prepare_store`
  if existing is None or existing.get("format") != _store.FORMAT:
    return None
  guess = store_metadata(tree, batch, plan, None, random_streams, stored=existing["sites"])
  return existing if not differences(existing, guess) else None


def prepare_store(path: str, metadata: dict[str, Any], overwrite: bool) -> dict[str, Any]:
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
    lambda: _create_or_reopen(path, metadata, action) if jax.process_index() == 0 else None, path
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
    if existing is not None and not differences(existing, metadata):
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
  found = differences(existing, metadata)
  if not overwrite:
    raise HarvestError(
      f"fl.harvest: the store at {path} was made by another call; nothing was"
      f" overwritten. What differs: {'; '.join(found)}. Give another path, run the"
      " call that made it to resume, or pass overwrite=True to start it afresh."
    )
  return "overwrite"


def _create_or_reopen(path: str, metadata: dict[str, Any], action: str) -> None:
  """Does `action` ("resume", "create" or "overwrite", from `_inspect`) at `path`."""
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
  failed = failed_processes(error is None)
  if error is not None:
    raise error
  if failed:
    raise HarvestError(
      f"fl.harvest: preparing the store at {path} failed on process(es) {failed} (their"
      " error says why); this process stops too. Fix what they report and run again."
    )
  return result
