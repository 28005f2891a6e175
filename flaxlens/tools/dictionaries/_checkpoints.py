"""Checkpoints of a training run (Orbax): everything a killed run needs to go on bit for
bit as if it had not stopped.

A checkpoint holds the training state (parameters, other variables such as BatchTopK's
running threshold, the optimizer state, the steps since each feature fired), the history
so far, and the data position (epoch and batch within it) with the run's settings (seed,
batch size, steps), which a resumed run must repeat. Training has no randomness but the
data order, which the seed and the position fix. Checkpoints are written synchronously
after steps whose losses were all checked finite, so the last one is always good. No Flax
internals here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import jax
import numpy as np

from flaxlens.errors import ArgumentError, TrainingError


class Position(NamedTuple):
  """Where in the data the next batch comes from: the epoch and the batch within it."""

  epoch: int
  batch: int


@dataclasses.dataclass(frozen=True)
class Checkpoints:
  """Where and how often `fld.train` writes checkpoints.

  Attributes:
    directory: the folder (created if missing); a run finds the latest checkpoint there
      and resumes from it.
    every: steps between checkpoints (the last step is always saved).
    keep: how many of the latest checkpoints to keep.

  Example:
    >>> import flaxlens.dictionaries as fld
    >>> fld.Checkpoints("/tmp/sae-run", every=500).keep
    2
  """

  directory: str
  every: int = 1000
  keep: int = 2

  def __post_init__(self):
    if not isinstance(self.directory, (str, os.PathLike)):
      raise ArgumentError(
        f"fld.Checkpoints: directory={self.directory!r} is not a path. Give a folder."
      )
    for name in ("every", "keep"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"fld.Checkpoints: {name}={value!r}; give a positive int.")


_SETTINGS = ("seed", "batch_size", "steps")


class Saver:
  """Writes and reads one run's checkpoints through an Orbax `CheckpointManager`."""

  def __init__(self, checkpoints: Checkpoints, settings: dict[str, int]):
    import orbax.checkpoint as ocp

    self._ocp = ocp
    self.checkpoints = checkpoints
    self.settings = settings
    self.directory = os.path.abspath(os.fspath(checkpoints.directory))
    options = ocp.CheckpointManagerOptions(
      max_to_keep=checkpoints.keep, enable_async_checkpointing=False, create=True
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def due(self, step: int, steps: int) -> bool:
    """Whether to save after `step` steps."""
    return step % self.checkpoints.every == 0 or step == steps

  def save(self, step: int, state: Any, history: dict[str, np.ndarray], position: Position):
    tree = {
      "state": _named(jax.tree.leaves(state)),
      "history": history,
      "position": np.asarray(position, np.int64),
      "settings": np.asarray([self.settings[name] for name in _SETTINGS], np.int64),
    }
    self._manager.save(step, args=self._ocp.args.StandardSave(tree))

  def restore(self, state: Any, history: dict[str, np.ndarray]):
    """The latest checkpoint as `(state, history, position, step)`, or None if there is
    none; `state` and `history` give the structure, shapes and placements."""
    step = self._manager.latest_step()
    if step is None:
      return None
    leaves, treedef = jax.tree.flatten(state)
    abstract = {
      "state": _named(
        [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
      ),
      "history": history,
      "position": np.zeros(2, np.int64),
      "settings": np.zeros(len(_SETTINGS), np.int64),
    }
    try:
      got = self._manager.restore(step, args=self._ocp.args.StandardRestore(abstract))
    except Exception as error:  # Orbax raises many kinds for a checkpoint of another run
      raise TrainingError(
        f"fld.train: the checkpoint of step {step} in {self.directory} does not fit this"
        f" run ({' '.join(str(error).split())[:300]}). Give checkpoint= a new directory, or"
        " the dictionary, recipe and data that run had.",
        step=step, trained=[], losses=np.zeros(0, np.float32),
      ) from error  # fmt: skip
    saved = dict(zip(_SETTINGS, (int(v) for v in got["settings"]), strict=True))
    if saved != self.settings:
      raise ArgumentError(
        f"fld.train: the checkpoints in {self.directory} are of a run with {saved}, and"
        f" this one has {self.settings}; a resumed run repeats them. Give the same seed,"
        " batch_size and steps, or checkpoint= a new directory."
      )
    restored = jax.tree.unflatten(treedef, [got["state"][name] for name in _names(len(leaves))])
    history = {name: np.asarray(values) for name, values in got["history"].items()}
    return restored, history, Position(*(int(v) for v in got["position"])), step

  def close(self) -> None:
    self._manager.close()


def _names(count: int) -> list[str]:
  return [f"{index:05d}" for index in range(count)]


def _named(leaves: list[Any]) -> dict[str, Any]:
  return dict(zip(_names(len(leaves)), leaves, strict=True))


def checkpoints_of(checkpoint: Any, **settings: int) -> Saver | None:
  """The saver for `fld.train`'s `checkpoint=` (None, a directory or `Checkpoints`)."""
  if checkpoint is None:
    return None
  if isinstance(checkpoint, (str, os.PathLike)):
    checkpoint = Checkpoints(os.fspath(checkpoint))
  if not isinstance(checkpoint, Checkpoints):
    raise ArgumentError(
      f"fld.train: checkpoint is a {type(checkpoint).__name__}; give a directory or"
      " fld.Checkpoints(directory, every=, keep=)."
    )
  return Saver(checkpoint, settings)
