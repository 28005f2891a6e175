"""Attribution patching and gradients at calls (`fl.attribute`, `fl.grad_at`).

`fl.attribute` estimates the patches `fl.sweep` makes linearly, from one clean forward
and one corrupted forward and backward: `(clean - corrupted) * d metric / d value` at each
site, summed. `fl.grad_at` differentiates any function of a run with respect to the
outputs of chosen calls, by adding zero-valued deltas there and differentiating with
respect to them. The sites, positions and runs are `fl.sweep`'s (`_sweeps.py`), each run
on a fresh copy of the tree. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from flaxlens.core._functions import jit_keyed_on_function
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.errors import ArgumentError
from flaxlens.tools.analysis import _statistics
from flaxlens.tools.analysis._sweep_result import SweepResult
from flaxlens.tools.analysis._sweeps import (
  captured_values,
  checked_positions,
  chosen_sites,
  indexed_run,
  is_axis,
  metric_value,
  paired_runs,
  row_labels,
  scan_iteration,
  stacked_lead,
  sweep_result,
)
from flaxlens.tools.base._calling import (
  check_callable,
  model_arguments,
  takes_model_arguments,
)
from flaxlens.tools.base._intervention import make_intervention
from flaxlens.tools.base._parts import checked_part, get_part
from flaxlens.tools.base._probed import Copies
from flaxlens.tools.base._sites import Site


def _check_differentiable(sites: list[Site], values: list[Any], part: Any, tool: str) -> None:
  """Refuses sites whose value (its `part`) is not floating-point: no gradient reaches it."""
  for site, value in zip(sites, values, strict=True):
    if not jnp.issubdtype(value.dtype, jnp.inexact):
      of = "output" if part is None else f"output's part {part!r}"
      raise ArgumentError(
        f"{site.name}: {tool} takes gradients at the site's {of}, which is"
        f" {value.dtype}{list(value.shape)}: an integer or boolean value has no gradient."
        " Choose sites with floating-point values (an embedding's output, not the token"
        " ids it reads)."
      )


# --- attribution patching and gradients ----------------------------------------------------


def _adder(name: str, lead: tuple[int, ...]) -> Callable:
  """The edit adding a delta (stacked over the site's scans) to a site's value."""

  def add_delta(argument: Any, value: Any, delta: Any) -> Any:
    del argument
    found = scan_iteration(name, lead)
    if found is None:
      return value
    iterations, _ = found
    return value + (delta[tuple(iterations)] if iterations else delta)

  return add_delta


def _with_deltas(copies: Copies, leads: list, part: Any, deltas: list, capture: bool) -> tuple:
  """A fresh copy of the tree, the edits adding `deltas` at its sites, and what to capture."""
  tree, sites = copies.fresh()
  edits = tuple(
    make_intervention(
      "modify", site.node, (delta,), None, "output", part, fn=_adder(site.name, lead)
    )
    for site, lead, delta in zip(sites, leads, deltas, strict=True)
  )
  return tree, sites, edits, tuple(s.node for s in sites) if capture else None


def _reduce(contribution: Any, lead: int, positions: Any, axis: int, name: str) -> Any:
  """Sums a site's contribution over each iteration's axes (all but `axis` with positions)."""
  rank = contribution.ndim - lead
  if positions is None:
    return contribution.sum(axis=tuple(range(lead, contribution.ndim)))
  if not is_axis(axis, rank):
    raise ArgumentError(
      f"{name}: axis={axis!r} is not an axis of the value, of shape"
      f" {tuple(contribution.shape[lead:])}. Pass the axis of positions (axis=1 for (batch,"
      " sequence, ...) values)."
    )
  moved = jnp.moveaxis(contribution, lead + axis % rank, -1)
  per_position = moved.sum(axis=tuple(range(lead, moved.ndim - 1)))
  size = per_position.shape[-1]
  outside = [p for p in positions if not 0 <= p < size]
  if outside:
    raise ArgumentError(
      f"{name}: positions {outside} are outside axis {axis % rank} of the value, of shape"
      f" {tuple(contribution.shape[lead:])}. Give positions from 0 to {size - 1}."
    )
  return per_position[..., jnp.asarray(positions)]


def _attribute(tree, clean, corrupted, chosen, metric, positions, axis, part, streams):
  copies = Copies(tree, chosen)
  clean_output, clean_values = captured_values(copies, clean, part, streams)
  _, sites = copies.fresh()
  _check_differentiable(sites, clean_values, part, "fl.attribute")
  leads = [stacked_lead(s, v, part) for s, v in zip(sites, clean_values, strict=True)]

  def corrupted_metric(deltas: list) -> Any:
    copy, sites, edits, capture = _with_deltas(copies, leads, part, deltas, capture=True)
    output, cache = indexed_run(copy, corrupted, edits, capture, streams)
    values = [get_part(cache[s.name], part, s.name, "output") for s in sites]
    return metric_value(metric, output, scalar=True), values

  zeros = [jnp.zeros_like(v) for v in clean_values]
  (corrupted_metric_value, corrupted_values), grads = jax.value_and_grad(
    corrupted_metric, has_aux=True
  )(zeros)
  values = [
    _reduce((c - x) * g, len(lead), positions, axis, s.name).reshape(
      -1, *(() if positions is None else (len(positions),))
    )
    for s, lead, c, x, g in zip(sites, leads, clean_values, corrupted_values, grads, strict=True)
  ]
  baselines = (metric_value(metric, clean_output, scalar=True), corrupted_metric_value)
  return jnp.concatenate(values), row_labels(leads), baselines


_attribute_compiled = jit_keyed_on_function(_attribute, "metric", "fl.attribute")


@takes_model_arguments("fl.attribute(tree, clean, corrupted, 'Block_*', metric)")
def attribute(
  tree: CallNode,
  clean: Any,
  corrupted: Any,
  /,
  at: Any,
  metric: Callable[[Any], Any],
  *,
  positions: Any = None,
  axis: int = 1,
  part: Any = None,
  random_streams: Any = None,
  jit: bool = True,
) -> SweepResult:
  """Attribution patching: the linear estimate of `fl.sweep`'s patches from gradients.

  For each site, `sum((clean - corrupted) * d metric / d value)` with the value and its
  gradient taken on the corrupted run: the first-order change of the metric if the
  site were patched with its clean value. One clean forward, one corrupted forward and
  one backward pass estimate every site (every iteration of a call inside an
  `nn.scan`/`nnx.scan` body) and, with `positions`, every position (the sum then runs
  over all axes but `axis`). Arguments and result as for `fl.sweep`; `metric` must
  return a scalar. The result's `measure` is `"change"` (values estimate `patched -
  corrupted`); its `clean` and `corrupted` metrics come from the two forwards it runs
  anyway. It holds no per-example values: for intervals and p-values, run `fl.sweep`
  with `per_example=True`.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> clean, corrupted = jnp.ones((1, 3)), -jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), clean), clean)
    >>> result = fl.attribute(tree, clean, corrupted, "layers_2", lambda out: out[0, 0])
    >>> exact = fl.sweep(tree, clean, corrupted, "layers_2", lambda out: out[0, 0])
    >>> baseline = fl.run(tree, corrupted)[0, 0]
    >>> bool(jnp.allclose(result.values, exact.values - baseline, atol=1e-6))  # linear site
    True
  """
  check_tree(tree, "fl.attribute")
  check_callable(metric, "metric", "fl.attribute")
  part = checked_part(part, "fl.attribute")
  positions = checked_positions(positions)
  chosen = chosen_sites(tree, at, part)
  runs = paired_runs(tree, clean, corrupted, random_streams, "fl.attribute", _MATCHING, True)
  run = _attribute_compiled if jit else _attribute
  values, rows, (clean_metric, corrupted_metric) = run(
    tree, runs.clean, runs.corrupted, chosen, metric, positions, axis, part, runs.random_streams
  )
  result = dataclasses.replace(
    sweep_result(tree, chosen, values, rows, positions), measure="change"
  )
  return _statistics.with_runs(
    result, clean_metric, corrupted_metric, per_example=False, where="fl.attribute"
  )


_MATCHING = (
  "fl.attribute multiplies the difference of each site's clean and corrupted values by"
  " the gradient there, so the clean run's values must have the corrupted run's shapes"
  " (or broadcast to them)."
)


def _grad_at(tree, argument, chosen, loss, part, streams):
  copies = Copies(tree, chosen)

  def values() -> list:
    copy, sites = copies.fresh()
    _, cache = indexed_run(copy, argument, (), tuple(s.node for s in sites), streams)
    return [get_part(cache[s.name], part, s.name, "output") for s in sites]

  shapes = jax.eval_shape(values)
  _, sites = copies.fresh()
  _check_differentiable(sites, shapes, part, "fl.grad_at")
  leads = [stacked_lead(s, v, part) for s, v in zip(sites, shapes, strict=True)]

  def loss_of(deltas: list) -> Any:
    copy, _, edits, _ = _with_deltas(copies, leads, part, deltas, capture=False)
    output, _ = indexed_run(copy, argument, edits, None, streams)
    return metric_value(loss, output, scalar=True)

  zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
  value, grads = jax.value_and_grad(loss_of)(zeros)
  return value, {s.name: g for s, g in zip(sites, grads, strict=True)}


_grad_at_compiled = jit_keyed_on_function(_grad_at, "loss", "fl.grad_at")


@takes_model_arguments("fl.grad_at(tree, x, 'Block_*', lambda out: out.sum())")
def grad_at(
  tree: CallNode,
  args: Any,
  /,
  at: Any,
  metric: Callable[[Any], Any],
  *,
  part: Any = None,
  random_streams: Any = None,
  jit: bool = True,
) -> tuple[Any, dict[str, Any]]:
  """The gradient of `metric(output)` with respect to the outputs of chosen calls.

  Runs the tree on `args` with a zero delta added to each site's output and
  differentiates with respect to the deltas, as Flax's `perturb` does, without editing
  the model. A call inside an `nn.scan`/`nnx.scan` body gets its gradient stacked along
  the scan axis.

  Args:
    tree: a converted tree (`fl.unflaxify`).
    args: the model's arguments, as `fl.run` takes them: one value, a tuple of
      positional arguments, or `fl.ArgsAndKwargs` (keyword arguments too).
    at: the sites, as `fl.run` takes them.
    metric: a function of the model's output returning a scalar (a loss, say).
    part: for sites returning a tuple, dict or dataclass, which part to differentiate
      by (Hugging Face blocks return tuples: `part=0`; docs/interventions.md,
      "Structured values: part=").
    random_streams: as for a tree call.
    jit: compile (default); pass False inside your own `jax.jit`.

  Returns:
    `(metric value, {site: gradient})`, each gradient shaped as the site's output.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> loss, grads = fl.grad_at(tree, x, "layers_2", lambda out: out.sum())
    >>> grads["layers_2"].tolist()  # d sum(out) / d out
    [[1.0, 1.0]]
  """
  check_tree(tree, "fl.grad_at")
  check_callable(metric, "metric", "fl.grad_at")
  part = checked_part(part, "fl.grad_at")
  chosen = chosen_sites(tree, at, part)
  streams = resolve_random_streams(random_streams, tree.where())
  run = _grad_at_compiled if jit else _grad_at
  return run(tree, model_arguments(args), chosen, metric, part, streams)
