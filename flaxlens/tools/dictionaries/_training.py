"""`fld.train`: trains a dictionary on `DictionaryData` with one compiled step, on one
device, data-parallel over a mesh, or across processes (`jax.distributed`).

The dictionary is split into its parameters and its other state (BatchTopK's running
threshold); one `jax.jit` step (the training state donated) computes the recipe's loss
(`_recipes.py`), applies the optax update, renormalises decoders where the recipe says and
counts the steps since each feature fired. A step whose loss is not finite changes nothing
and stops every later one, so the state stays the last good one; the loop finds it when it
next reads the metrics and raises `fl.TrainingError` with the step. With `mesh=`, rows are
split over the mesh's "data" axis and the features over its "features" axis (a missing
axis: not split); each process feeds its own rows of every global batch
(`jax.make_array_from_process_local_data`), and JAX's SPMD partitioner does the rest.
Checkpoints (`_checkpoints.py`) hold everything a resumed run needs to continue bit for
bit. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxlens.errors import ArgumentError, TrainingError
from flaxlens.tools.dictionaries._checkpoints import Checkpoints, Position, checkpoints_of
from flaxlens.tools.dictionaries._data import Rows, check_data
from flaxlens.tools.dictionaries._modules import Dictionary
from flaxlens.tools.dictionaries._recipes import (
  METRICS,
  Recipe,
  fired,
  objective,
  renormalise,
  schedule,
)

DATA_AXIS = "data"
FEATURES_AXIS = "features"
REPORT_EVERY = 50  # steps between reads of the metrics (progress, the non-finite check)
_WIDE = ("W_enc", "b_enc", "threshold", "since_fired")  # arrays whose last axis is the width


@dataclasses.dataclass
class TrainResult:
  """What `fld.train` returns.

  Attributes:
    dictionary: the trained dictionary (the one given, updated in place; in eval mode).
    history: per step, NumPy arrays: "loss", "reconstruction" (squared error per row),
      "sparsity" (the recipe's sparsity or aux-k term), "l0" (features per row and
      layer), "dead_fraction", "learning_rate".
    since_fired: per feature, the steps since it last fired (`[width]`, `[layers, width]`).
    steps: the steps taken in all (a resumed run's included).
    seconds: the wall time of this call.
    rows_per_second: the rows (tokens) this call trained on per second.
  """

  dictionary: Dictionary
  history: dict[str, np.ndarray]
  since_fired: np.ndarray
  steps: int
  seconds: float
  rows_per_second: float

  def __repr__(self) -> str:
    last = {name: float(values[-1]) for name, values in self.history.items() if len(values)}
    shown = ", ".join(f"{name}={value:.4g}" for name, value in last.items())
    return f"TrainResult({self.steps} steps, {self.rows_per_second:,.0f} rows/s; {shown})"


class _Stepper:
  """The compiled step and how the training state and batches are placed."""

  def __init__(self, dictionary, recipe, optimizer, mesh, state):
    self.graphdef = nnx.graphdef(dictionary)
    self.recipe, self.optimizer, self.mesh = recipe, optimizer, mesh
    self.unit = recipe.decoder_rule(dictionary.config.activation) == "unit"
    self.clt = dictionary.config.kind == "clt"
    self.width = dictionary.config.width
    self.state_sharding = None if mesh is None else _state_shardings(state, mesh, self.width)
    batch = None if mesh is None else _batch_sharding(mesh, self.clt)
    self.batch_sharding = batch
    shardings = {} if mesh is None else {
      "in_shardings": (self.state_sharding, batch, batch),
      "out_shardings": (self.state_sharding, NamedSharding(mesh, PartitionSpec())),
    }  # fmt: skip
    self.step = jax.jit(self._step, donate_argnums=0, **shardings)

  def place_state(self, state):
    if self.mesh is None:
      return state
    return jax.tree.map(_place, state, self.state_sharding)

  def place(self, rows: Rows) -> tuple[jax.Array, jax.Array]:
    inputs, targets = np.asarray(rows.inputs), np.asarray(rows.targets)
    if self.clt:
      inputs, targets = np.swapaxes(inputs, 0, 1), np.swapaxes(targets, 0, 1)
    if self.mesh is None:
      return jax.device_put(inputs), jax.device_put(targets)
    return _place(inputs, self.batch_sharding), _place(targets, self.batch_sharding)

  def _step(self, state, inputs, targets):
    def loss_of(params):
      dictionary = nnx.merge(self.graphdef, params, state["rest"], copy=True)
      loss, metrics, features = objective(
        dictionary, self.recipe, inputs, targets, state["since_fired"]
      )
      return loss, (metrics, features, nnx.state(dictionary, nnx.Not(nnx.Param)))

    (loss, (metrics, features, rest)), grads = jax.value_and_grad(loss_of, has_aux=True)(
      state["params"]
    )
    updates, opt = self.optimizer.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    if self.unit:
      dictionary = nnx.merge(self.graphdef, params, rest, copy=True)
      renormalise(dictionary)
      params = nnx.state(dictionary, nnx.Param)
    since = jnp.where(fired(features, state["since_fired"]), 0, state["since_fired"] + 1)
    good = jnp.isfinite(loss) & ~state["stopped"]
    new = {"params": params, "rest": rest, "opt": opt, "since_fired": since}
    old = {name: state[name] for name in new}
    kept = jax.tree.map(lambda n, o: jnp.where(good, n, o), new, old)
    return {**kept, "stopped": ~good}, metrics


def _place(value: Any, sharding: NamedSharding) -> jax.Array:
  """`value` (the same on every process) as a global array placed with `sharding`: each
  process gives the rows of its own devices."""
  value = np.asarray(value)
  if jax.process_count() == 1:
    return jax.device_put(value, sharding)
  spans = sharding.addressable_devices_indices_map(value.shape).values()
  local = tuple(
    slice(min(s[axis].indices(n)[0] for s in spans), max(s[axis].indices(n)[1] for s in spans))
    for axis, n in enumerate(value.shape)
  )
  return jax.make_array_from_process_local_data(sharding, value[local], value.shape)


def _batch_sharding(mesh: Mesh, clt: bool) -> NamedSharding:
  data = DATA_AXIS if DATA_AXIS in mesh.axis_names else None
  spec = PartitionSpec(None, data) if clt else PartitionSpec(data)
  return NamedSharding(mesh, spec)


def _state_shardings(state: Any, mesh: Mesh, width: int) -> Any:
  """Per leaf of the training state: the width axis of the feature arrays (decoders'
  first, `W_enc`/`b_enc`/`threshold`/`since_fired`'s last) over the "features" axis of
  `mesh`, the rest replicated."""
  split = FEATURES_AXIS in mesh.axis_names
  if split and width % mesh.shape[FEATURES_AXIS]:
    raise ArgumentError(
      f"fld.train: the width {width} does not divide over the mesh's {FEATURES_AXIS!r} axis"
      f" ({mesh.shape[FEATURES_AXIS]} devices). Give a width it divides, or a mesh without"
      f" a {FEATURES_AXIS!r} axis."
    )

  def sharding(path, leaf) -> NamedSharding:
    names = {_key_name(key) for key in path}
    shape = np.shape(leaf)
    spec = [None] * len(shape)
    if split and "W_dec" in names and shape and shape[0] == width:
      spec[0] = FEATURES_AXIS
    elif split and names & set(_WIDE) and shape and shape[-1] == width:
      spec[-1] = FEATURES_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))

  return jax.tree_util.tree_map_with_path(sharding, state)


def _key_name(key: Any) -> str:
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  return ""


def _epochs(
  data, batch_size: int, seed: int, position: Position
) -> Iterator[tuple[Position, Rows]]:
  """The batches from `position` on, epoch after epoch (epoch `e` shuffled by a seed drawn
  from `(seed, e)`), each with its position; batches of another size are left out."""
  epoch, index = position.epoch, position.batch
  while True:
    taken = 0
    epoch_seed = int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])
    for number, rows in enumerate(data.batches(batch_size, seed=epoch_seed)):
      if number < index or len(rows.inputs) != batch_size:
        continue
      taken += 1
      yield Position(epoch, number + 1), rows
    if taken == 0 and index == 0:
      raise ArgumentError(
        f"fld.train: a pass over the data gave no batch of {batch_size} rows. Give a smaller"
        " batch_size, or more rows."
      )
    epoch, index = epoch + 1, 0


class _Display:
  """A rich progress bar (steps, rows/s, loss, L0, dead fraction) or nothing."""

  def __init__(self, show: bool, steps: int, done: int):
    self._progress = None
    if not show or jax.process_index() != 0:
      return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    self._progress = Progress(
      TextColumn("train"),
      BarColumn(),
      TextColumn("{task.completed}/{task.total} steps"),
      TextColumn("{task.fields[rate]} tok/s"),
      TextColumn("loss {task.fields[loss]}"),
      TextColumn("L0 {task.fields[l0]}"),
      TextColumn("dead {task.fields[dead]}"),
      TimeElapsedColumn(),
      console=Console(file=sys.stderr),
    )
    self._task = self._progress.add_task(
      "train", total=steps, completed=done, rate="-", loss="-", l0="-", dead="-"
    )
    self._progress.start()

  def update(self, step: int, rate: float, last: dict[str, float]) -> None:
    if self._progress is not None:
      self._progress.update(
        self._task, completed=step, rate=f"{rate:,.0f}", loss=f"{last['loss']:.4g}",
        l0=f"{last['l0']:.3g}", dead=f"{last['dead_fraction']:.1%}",
      )  # fmt: skip

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()


def _check_arguments(steps, batch_size, recipe, optimizer, seed, mesh) -> None:
  for name, value in (("steps", steps), ("batch_size", batch_size)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ArgumentError(f"fld.train: {name}={value!r}; give a positive int.")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ArgumentError(f"fld.train: seed={seed!r}; give an int >= 0.")
  if recipe is not None and not isinstance(recipe, Recipe):
    raise ArgumentError(
      f"fld.train: recipe is a {type(recipe).__name__}; give fld.Recipe(...) or None."
    )
  if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
    raise ArgumentError(
      f"fld.train: optimizer is a {type(optimizer).__name__}; give an optax"
      " GradientTransformation (optax.adam(1e-3)) or None for adam on the recipe's schedule."
    )
  if mesh is not None and not isinstance(mesh, Mesh):
    raise ArgumentError(
      f"fld.train: mesh is a {type(mesh).__name__}; give a jax.sharding.Mesh with a"
      f" {DATA_AXIS!r} and/or {FEATURES_AXIS!r} axis, or None."
    )


def train(
  dictionary: Dictionary,
  data: Any,
  *,
  steps: int,
  batch_size: int,
  recipe: Recipe | None = None,
  optimizer: optax.GradientTransformation | None = None,
  seed: int = 0,
  checkpoint: str | Checkpoints | None = None,
  mesh: Mesh | None = None,
  progress: bool = True,
) -> TrainResult:
  """Trains `dictionary` on `data` for `steps` steps of `batch_size` rows.

  Long because it is the training loop: the state, resuming, the steps, the reports and
  the checkpoints in order, each a call into the helpers above.

  Args:
    dictionary: an `fld.SAE`, `fld.Transcoder`, `fld.CrossLayerTranscoder` (any
      `fld.Dictionary`); trained in place (BatchTopK in training mode during, eval after).
    data: a `fld.DictionaryData` whose widths and layers match the dictionary.
    steps: the steps to train (in all, a resumed run's earlier steps included).
    batch_size: rows per step (global: over every process and device).
    recipe: the loss and its rules (`fld.Recipe()` by default).
    optimizer: an optax optimizer; adam on the recipe's learning-rate schedule by default.
    seed: the seed of the data order (epoch `e`'s order is drawn from `(seed, e)`).
    checkpoint: a directory (checkpoints every 1000 steps, the last two kept) or
      `fld.Checkpoints(directory, every=, keep=)`; a run finds the latest there and
      resumes from it.
    mesh: a `jax.sharding.Mesh`: rows split over its "data" axis, features over its
      "features" axis. With several processes and no mesh, all devices on "data".
    progress: show a progress bar (rows/s, loss, L0, dead fraction) on stderr.

  Returns:
    `fld.TrainResult`: the dictionary, per-step history, the dead-feature counters.

  Raises:
    ArgumentError: bad arguments, or data that does not fit the dictionary.
    TrainingError: the loss was not finite at `error.step`; the dictionary keeps the last
      good parameters and no checkpoint after the last good step is written.

  Example:
    >>> import numpy as np, flaxlens.dictionaries as fld
    >>> from flax import nnx
    >>> rows = np.random.default_rng(0).normal(size=(512, 8)).astype(np.float32)
    >>> sae = fld.SAE(8, 16, activation="topk", k=2, rngs=nnx.Rngs(0))
    >>> recipe = fld.Recipe(learning_rate=1e-2)
    >>> result = fld.train(
    ...   sae, fld.from_arrays(rows), steps=60, batch_size=64, recipe=recipe, progress=False
    ... )
    >>> losses = result.history["loss"]
    >>> result.steps, bool(np.mean(losses[-5:]) < np.mean(losses[:5]))
    (60, True)
  """
  _check_arguments(steps, batch_size, recipe, optimizer, seed, mesh)
  check_data(dictionary, data, "fld.train")
  recipe = recipe or Recipe()
  rates = schedule(recipe, steps)
  optimizer = optimizer or optax.adam(rates)
  if mesh is None and jax.process_count() > 1:
    mesh = Mesh(np.array(jax.devices()), (DATA_AXIS,))
  if mesh is not None and DATA_AXIS in mesh.axis_names and batch_size % mesh.shape[DATA_AXIS]:
    raise ArgumentError(
      f"fld.train: batch_size={batch_size} does not divide over the mesh's {DATA_AXIS!r}"
      f" axis ({mesh.shape[DATA_AXIS]} devices). Give a multiple of {mesh.shape[DATA_AXIS]}."
    )
  dictionary.train()
  params, rest = nnx.state(dictionary, nnx.Param), nnx.state(dictionary, nnx.Not(nnx.Param))
  state = {
    "params": params,
    "rest": rest,
    "opt": optimizer.init(params),
    "since_fired": jnp.zeros(_feature_shape(dictionary), jnp.int32),
    "stopped": jnp.zeros((), bool),
  }
  stepper = _Stepper(dictionary, recipe, optimizer, mesh, state)
  state = stepper.place_state(state)
  saver = checkpoints_of(checkpoint, steps=steps, batch_size=batch_size, seed=seed)
  history = {name: np.zeros(steps, np.float32) for name in METRICS}
  position = Position(0, 0)
  done = 0
  if saver is not None:
    resumed = saver.restore(state, history)
    if resumed is not None:
      state, history, position, done = resumed
  display = _Display(progress, steps, done)
  pending: list[dict[str, jax.Array]] = []
  start, first = time.perf_counter(), done
  try:
    batches = _epochs(data, batch_size, seed, position)
    step = done
    while step < steps:
      position, rows = next(batches)
      inputs, targets = stepper.place(rows)
      state, metrics = stepper.step(state, inputs, targets)
      pending.append(metrics)
      if len(pending) > 1:
        # At most two steps in flight: the host waits for the step before this one, so
        # batches do not queue up on the device when it is the slower side (memory stays
        # flat however long the run; the next batch is still prepared during a step).
        pending[-2]["loss"].block_until_ready()
      step += 1
      saving = saver is not None and saver.due(step, steps)
      if saving or step % REPORT_EVERY == 0 or step == steps:
        _record(pending, history, step, dictionary, state, checkpoint)
        pending = []
        rate = (step - first) * batch_size / max(time.perf_counter() - start, 1e-9)
        display.update(step, rate, {n: float(history[n][step - 1]) for n in METRICS})
      if saving:
        saver.save(step, state, history, position)
  finally:
    display.close()
    _into(dictionary, state)  # its own arrays were donated to the first step
    dictionary.eval()
    if saver is not None:
      saver.close()
  seconds = time.perf_counter() - start
  return TrainResult(
    dictionary,
    {**history, "learning_rate": np.asarray([rates(i) for i in range(steps)], np.float32)},
    np.asarray(_host(state["since_fired"])),
    steps,
    seconds,
    (steps - first) * batch_size / max(seconds, 1e-9),
  )


def _feature_shape(dictionary: Dictionary) -> tuple[int, ...]:
  config = dictionary.config
  return ((config.layers,) if config.kind == "clt" else ()) + (config.width,)


def _host(value: Any) -> Any:
  """`value`'s arrays as NumPy arrays, gathered from every process where there are several."""
  if jax.process_count() > 1:
    return multihost_utils.process_allgather(value, tiled=True)
  return jax.device_get(value)


def _into(dictionary: Dictionary, state: dict[str, Any]) -> None:
  """Puts the state's parameters and other variables into `dictionary` (placed as they
  were trained: with a mesh, sharded over it)."""
  nnx.update(dictionary, state["params"], state["rest"])


def _record(pending, history, step, dictionary, state, checkpoint) -> None:
  """Writes the pending steps' metrics into `history`; raises `TrainingError` at the first
  step whose loss was not finite (the state then still holds the last good one)."""
  got = jax.device_get(pending)
  first = step - len(got)
  for offset, metrics in enumerate(got):
    if not np.isfinite(metrics["loss"]):
      bad = first + offset
      _into(dictionary, state)
      dictionary.eval()
      where = f" The checkpoints in {checkpoint} end before it." if checkpoint else ""
      raise TrainingError(
        f"fld.train: the loss became {metrics['loss']} at step {bad} (from 0); the"
        f" dictionary holds the parameters of the steps before it.{where} Lower the learning"
        " rate or the sparsity coefficient, or check the data for nan or inf rows.",
        step=bad,
        trained=[dictionary],
        losses=history["loss"][:bad].copy(),
      )
    for name in METRICS:
      history[name][first + offset] = metrics[name]
