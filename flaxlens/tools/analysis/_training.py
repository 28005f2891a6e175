"""Trained interventions: learn an intervention's arrays with optax while the model stays frozen.

An intervention is data whose arrays are pytree leaves (`fl.Intervention`), so training
one is `jax.grad` over those arrays of a loss of the intervened run. `train_interventions`
splits each intervention's operands into what its kind learns (`InterventionKind.learned`:
a steering vector, a low-rank edit's projection, weight and bias, an interchange's
rotation) and data (alpha, sources, masks), compiles one step (gradient, optax update) with
`fl.variable_jit`, the tree an input of that step that is never differentiated and
never written, and runs it on every batch. optax is imported on first use
(`pip install "flaxlens[train]"`). No Flax internals here.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.core._variables import (
  StateVariable,
  scratch_copy,
  variables_in,
)
from flaxlens.errors import (
  ArgumentError,
  FlaxlensError,
  TrainingError,
  error_text,
  model_call_error,
)
from flaxlens.tools.analysis._sweeps import metric_value
from flaxlens.tools.base._intervention import Intervention, kind_of
from flaxlens.tools.base._probed import checked_interventions, nodes_by_name, run
from flaxlens.tools.base._site_objects import SiteObject
from flaxlens.tools.base._sites import select_sites, sites_of


def _optax() -> Any:
  try:
    import optax
  except ImportError:
    raise ArgumentError(
      "fl.train_interventions trains with optax, which is not installed. Install it with"
      ' pip install "flaxlens[train]".'
    ) from None
  return optax


def _learned(intervention: Intervention) -> tuple[int, ...]:
  """The positions of the operands `intervention`'s kind learns."""
  return tuple(kind_of(intervention).learned(len(intervention.operands)))


def _split(interventions: tuple[Intervention, ...], where: str) -> tuple[tuple, tuple]:
  """`(parameters, frames)`: per intervention, the learned operands, and the intervention
  with those operands set to None (the data it keeps)."""
  parameters, frames = [], []
  for number, intervention in enumerate(interventions):
    learned = _learned(intervention)
    for i in learned:
      operand = intervention.operands[i]
      if not jnp.issubdtype(operand.dtype, jnp.inexact):
        raise ArgumentError(
          f"{where}: intervention {number} ({kind_of(intervention).name} at"
          f" {intervention.at!r}) has"
          f" operand {i} of dtype {operand.dtype}, and gradients need floating-point"
          " arrays. Give it as a float array."
        )
    parameters.append(tuple(intervention.operands[i] for i in learned))
    kept = tuple(None if i in learned else x for i, x in enumerate(intervention.operands))
    frames.append(dataclasses.replace(intervention, operands=kept))
  if not any(parameters):
    raise ArgumentError(
      f"{where}: none of the interventions learns anything (ablations keep no parameters;"
      " alpha, sources and masks are data). Train fl.steer vectors, fl.patch values,"
      " fl.scale factors, fl.low_rank_edit or fl.interchange rotations, or fl.modify operands."
    )
  return tuple(parameters), tuple(frames)


def _joined(frames: tuple[Intervention, ...], parameters: tuple) -> tuple[Intervention, ...]:
  """The interventions with their learned operands set to `parameters`."""
  joined = []
  for frame, learned in zip(frames, parameters, strict=True):
    values = iter(learned)
    operands = tuple(next(values) if x is None else x for x in frame.operands)
    joined.append(dataclasses.replace(frame, operands=operands))
  return tuple(joined)


def _batch(batch: Any, number: int, where: str) -> tuple[Any, Any, Any]:
  if isinstance(batch, tuple) and len(batch) in (2, 3):
    return (*batch, None) if len(batch) == 2 else batch
  raise ArgumentError(
    f"{where}: batch {number} is of type {type(batch).__name__}; each batch is a tuple (args,"
    " data) or (args, data, source_args): the model's arguments as fl.run takes them, what"
    " the loss compares with, and for fl.interchange the source run's arguments."
  )


def train_interventions(
  tree: CallNode,
  interventions: Sequence[Intervention],
  batches: Iterable[Any],
  loss: Callable[[Any, Any], Any],
  optimizer: Any,
  *,
  steps: int | None = None,
  random_streams: Any = None,
) -> tuple[list[Intervention], np.ndarray]:
  """Trains the arrays of `interventions` with `optimizer` on `loss`; the model stays frozen.

  Each step runs `fl.run(tree, args, interventions=current)` on one batch, takes
  `loss(output, data)` and its gradient with respect to what each intervention learns,
  and applies the optimizer's update (`optax`); one compiled program serves every step.
  What each kind learns (the other operands are data and stay as given):

  | kind | learns | stays |
  | --- | --- | --- |
  | `fl.steer` | the vector | alpha |
  | `fl.patch` | the values | |
  | `fl.scale` | the factor | |
  | `fl.low_rank_edit` | projection, weight, bias | |
  | `fl.interchange` | the rotation | the source, the swapped mask |
  | `fl.modify` | every operand | |
  | `fl.ablate` | nothing | |

  The tree is an input of the compiled step that is never differentiated: gradients are
  taken with respect to the interventions' learned arrays only, and the tree's variables
  come out bit for bit as they went in (a run that would update a state variable, as
  batch statistics in training mode, is refused). The low-rank projection and the
  interchange rotation are parametrised (their rows made orthonormal by QR in every run),
  so any update keeps them orthonormal.

  Batches are tuples `(args, data)`: the model's arguments (one value, a tuple, or
  `fl.ArgsAndKwargs`, as `fl.run` takes them) and what `loss` compares the output with.
  For distributed alignment search a batch is `(args, data, source_args)`: every
  `fl.interchange` then takes its source from a run of the frozen tree on `source_args`,
  captured at its own site in the same compiled step (its `source` operand is replaced);
  each must name one call.

  Args:
    tree: a converted tree (`fl.unflaxify`); it is not modified.
    interventions: the interventions to train (their current arrays are the start).
    batches: an iterable of `(args, data)` or `(args, data, source_args)` tuples.
    loss: `loss(output, data) -> scalar`, the model's output (with the interventions) and
      the batch's data; written with jax.numpy (it is traced).
    optimizer: an `optax.GradientTransformation` (`optax.adam(1e-2)`).
    steps: the most steps to take (one per batch), or None: every batch.
    random_streams: as for `fl.run` (Linen rng keys), the same at every step.

  Returns:
    `(trained, losses)`: the interventions with their learned arrays trained, in the
    order given (save them with `fl.save_interventions`, fold them with `fl.fold`), and
    the loss of each step, before its update (a NumPy array).

  Raises:
    ArgumentError: there is no batch, a batch is not a tuple `(args, data[,
      source_args])`, the loss is not a real floating-point scalar, nothing is learned,
      a learned operand is not floating-point, a source is given without any
      `fl.interchange` (or one names several calls), the run updates state variables,
      or optax is not installed.
    SelectionError: a site matches no call.
    TrainingError: the loss of a step is nan or inf: training stops there, and the error
      holds the step (`step`), the interventions with the last parameters whose loss was
      finite (`trained`: those the step before it started from) and the losses before
      it (`losses`). The losses are checked one step behind, so the host never waits for
      the device between steps.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp, optax
    >>> model, x = nn.Dense(2), jnp.ones((4, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> target = jnp.zeros((4, 2))
    >>> def loss(output, target):
    ...   return jnp.mean((output - target) ** 2)
    >>> steering = fl.steer("Dense.__call__", jnp.zeros(2))
    >>> (trained,), losses = fl.train_interventions(
    ...     tree, [steering], [(x, target)] * 50, loss, optax.adam(0.1))
    >>> bool(losses[-1] < losses[0] / 10)
    True
  """
  where = "fl.train_interventions"
  check_tree(tree, where)
  optax = _optax()
  _check_options(optimizer, loss, steps, optax, where)
  given = checked_interventions(interventions, where)
  named, _ = nodes_by_name(tree, given, None)
  parameters, frames = _split(named, where)
  objective = _Objective(
    where, loss, resolve_random_streams(random_streams, tree.where()), frames, named, tree
  )

  @variable_jit
  def step(tree: CallNode, learned: tuple, state: Any, args: Any, data: Any, source: Any) -> Any:
    value, grads = jax.value_and_grad(objective)(learned, tree, args, data, source)
    updates, state = optimizer.update(grads, state, learned)
    return optax.apply_updates(learned, updates), state, value

  state = optimizer.init(parameters)
  losses = []
  # The parameters the last three steps started from. The loss of a step is checked
  # once the next step is under way, so the host never waits for the device between
  # steps; a step whose loss is not finite leaves the parameters the step before it
  # started from as the last good ones.
  started: collections.deque = collections.deque(maxlen=3)
  for number, batch in enumerate(itertools.islice(batches, steps)):
    args, data, source = _batch(batch, number, where)
    started.append(parameters)
    parameters, state, value = step(tree, parameters, state, args, data, source)
    losses.append(value)
    if number and not np.isfinite(losses[-2]):
      step_said = f"the loss of step {number - 1} is {float(losses[-2])}"
      raise _diverged(given, where, losses[:-2], started[0], step_said)
  _check_finished(given, where, losses, started, parameters)
  trained = _joined(_split(given, where)[1], parameters)
  return list(trained), _host(losses)


def _check_options(optimizer: Any, loss: Any, steps: Any, optax: Any, where: str) -> None:
  """Refuses an optimizer that is no optax transformation, a loss that is not callable,
  or `steps` that is neither a positive int nor None."""
  if not isinstance(optimizer, optax.GradientTransformation):
    raise ArgumentError(
      f"{where}: optimizer is a {type(optimizer).__name__}, not an optax"
      " GradientTransformation. Pass one, such as optax.adam(1e-2)."
    )
  if not callable(loss):
    raise ArgumentError(f"{where}: loss={loss!r} is not callable. Give loss(output, data).")
  if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
    raise ArgumentError(f"{where}: steps={steps!r}; give a positive int, or None for every batch.")


def _check_finished(
  given: tuple, where: str, losses: list[Any], started: collections.deque, parameters: tuple
) -> None:
  """Refuses a training that took no step, whose last loss is not finite, or whose last
  update made the learned arrays nan or inf (`_diverged`)."""
  if not losses:
    raise ArgumentError(
      f"{where}: batches gave no batch (an empty dataset, or a generator already used up),"
      " so nothing would be trained. Give an iterable of at least one (args, data) tuple;"
      " a generator yields its batches once, so make a new one for every call."
    )
  if not np.isfinite(losses[-1]):
    good = started[-2] if len(started) > 1 else started[0]
    said = f"the loss of step {len(losses) - 1} is {float(losses[-1])}"
    raise _diverged(given, where, losses[:-1], good, said)
  if not all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(parameters)):
    said = f"the update of step {len(losses) - 1} made the learned arrays nan or inf"
    raise _diverged(given, where, losses, started[-1], said)


class _Objective:
  """The loss of one batch as a function of the learned operands (what `jax.grad` takes),
  with what every step shares: the loss, the random streams, the interventions' data
  (`frames`) and the sites whose source a batch's `source_args` run fills (the
  interventions whose kind has a `source` operand, `fl.interchange`'s)."""

  def __init__(
    self, where: str, loss: Callable, streams: Any, frames: tuple, named: tuple, tree: CallNode
  ) -> None:
    self.where, self.loss, self.streams, self.frames = where, loss, streams, frames
    self.sourced = [n for n, i in enumerate(named) if kind_of(i).source is not None]
    self.sites = {n: _source_site(tree, named[n].at) for n in self.sourced}

  def __call__(self, learned: tuple, tree: CallNode, args: Any, data: Any, source: Any) -> Any:
    where = self.where
    tree = scratch_copy(tree)  # variables of this trace: a run may not write them
    before = [v.value for v in variables_in(tree)]
    edits = _joined(self.frames, learned)
    if source is not None:
      edits = self.with_sources(tree, edits, source)
    output = run(tree, args, interventions=edits, random_streams=self.streams, jit=False)
    updated = [
      v.label
      for v, old in zip(variables_in(tree), before, strict=True)
      if isinstance(v, StateVariable) and v.value is not old
    ]
    if updated:
      raise ArgumentError(
        f"{where}: a run of {tree.where()} updates the state variables {updated[:6]}, and a"
        " frozen model's state must not change while interventions train. Run the model in"
        " a mode that updates no state (train=False, model.eval())."
      )
    loss = self.loss
    return metric_value(lambda out: _called(loss, out, data, where), output, True, "loss", where)

  def with_sources(self, tree: CallNode, edits: tuple, source: Any) -> tuple:
    """`edits` with each source operand set to its site's value in a run on `source`."""
    where, sites = self.where, self.sites
    if not self.sourced:
      raise ArgumentError(
        f"{where}: a batch gives source arguments, and no intervention is an fl.interchange"
        " to take its source from them. Give batches as (args, data), or train an"
        " fl.interchange."
      )
    several = {n: s for n, s in sites.items() if isinstance(s, list)}
    if several:
      n, names = next(iter(several.items()))
      raise ArgumentError(
        f"{where}: fl.interchange {n} names {len(names)} calls ({names[:4]}), and a source"
        " run gives one value per call. Give it one call's path."
      )
    _, captured = run(
      tree,
      source,
      capture=[sites[n][0] for n in self.sourced],
      random_streams=self.streams,
      jit=False,
    )
    filled = list(edits)
    for n in self.sourced:
      value = jax.lax.stop_gradient(captured[sites[n][1]])
      ops, position = filled[n].operands, kind_of(filled[n]).source
      operands = (*ops[:position], value, *ops[position + 1 :])
      filled[n] = dataclasses.replace(filled[n], operands=operands)
    return tuple(filled)


def _source_site(tree: CallNode, at: Any) -> Any:
  """`(what to capture, the key of its value)` of a source intervention's site, or the
  names of the calls it names where it names several."""
  if isinstance(at, SiteObject):  # a site object (fl.heads): captured under its keys
    keys = [edit.key for _, edit in at.capture_edits(tree, sites_of(tree), None)]
    return (at, keys[0]) if len(keys) == 1 else keys
  chosen = select_sites(tree, at)
  if len(chosen) != 1:
    return [s.name for s in chosen]
  return (chosen[0].name, chosen[0].name)


def _host(losses: list[Any]) -> np.ndarray:
  return np.asarray(jax.device_get(losses), dtype=np.float32).reshape(-1)


def _diverged(given: tuple, where: str, losses: list[Any], good: tuple, said: str) -> TrainingError:
  """The error stopping a run at step `len(losses)` (`losses`: the finite losses before
  it), where `said` what went wrong; `good`: the parameters the step before it started
  from (the start, for step 0)."""
  step = len(losses)
  before = _host(losses)
  trained = list(_joined(_split(given, where)[1], good))
  kept = (
    f"the parameters step {step - 1} started from (loss {before[-1]:.6g}), the last whose"
    " loss was finite"
    if step
    else "the interventions as given"
  )
  return TrainingError(
    f"{where}: {said}, so training stopped there. The error's .trained holds the"
    f" interventions with {kept}, and .losses the losses of the {step} step(s) before."
    " Lower the learning rate, clip the gradients (optax.chain(optax.clip_by_global_norm"
    "(1.0), ...)), or check the loss and the data of that step's batch for a division by"
    " zero or a log of 0.",
    step,
    trained,
    before,
  )


def _called(loss: Callable[..., Any], output: Any, data: Any, where: str) -> Any:
  """`loss(output, data)`; an error of the loss's own code is a `ModelCallError` (also of
  the original's class) that blames the loss and shows what it was given."""
  try:
    return loss(output, data)
  except FlaxlensError:
    raise
  except Exception as e:
    shapes = jax.tree_util.tree_map(lambda a: getattr(a, "shape", type(a).__name__), (output, data))
    raise model_call_error(
      type(e),
      f"{where}: the loss raised {error_text(e)} (the original error is this one's cause)."
      f" It was called as loss(output, data) with shapes {shapes[0]} and {shapes[1]}, traced"
      " under jax.grad. Fix the loss, or the data each batch gives it (its batch size, its"
      " dtype).",
    ) from e
