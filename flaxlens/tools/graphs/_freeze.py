"""Freezing a call for the replacement model: its output keeps its value, bit for bit,
while its gradient is that of the call with some of its intermediates held constant.

The frozen call is the call's own computation, traced to a jaxpr and evaluated again
with `jax.lax.stop_gradient` on the outputs of chosen primitives
(`flaxlens._compat.jaxprs.evaluate_with_stops`):
- a normalisation (`NORM`): its square roots (`rsqrt`, `sqrt`, and `pow`, as in `var **
  -0.5`), so the scale (denominator) is constant while mean-centring and the gain keep
  their gradient;
- an attention (`ATTENTION`): its exponentials, the softmax's numerator, so the
  pattern (numerator over its sum) is constant and attention is a fixed mixing of values.
The frozen output is `stop_gradient(value) + (frozen - stop_gradient(frozen))`: the
model's own value with the frozen computation's gradient. No Flax internals here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens._compat.jaxprs import count_primitives, evaluate_with_stops
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import UnsupportedFlaxFeatureError

NORM = frozenset({"rsqrt", "sqrt", "pow"})
ATTENTION = frozenset({"exp"})


class CallShape(NamedTuple):
  """What freezing a call needs to know of its arguments before the run: which leaves of
  `(args, kwargs)` are arrays (their shapes and dtypes) and the others (static values).

  Attributes:
    treedef: the structure of the call's `fl.ArgsAndKwargs`.
    arrays: for each leaf, a `jax.ShapeDtypeStruct` or None for a static leaf.
    statics: for each leaf, the static value or None for an array leaf.
  """

  treedef: Any
  arrays: tuple[Any, ...]
  statics: tuple[Any, ...]


def is_array(x: Any) -> bool:
  """Whether a leaf of a call's arguments is an array (traced or not), not a static value."""
  return isinstance(x, jax.Array | np.ndarray)


def call_shape(argument: ArgsAndKwargs) -> CallShape:
  """The `CallShape` of a call's argument, as a run gave it."""
  leaves, treedef = jax.tree.flatten(argument)
  arrays = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array(x) else None for x in leaves)
  statics = tuple(None if is_array(x) else x for x in leaves)
  return CallShape(treedef, arrays, statics)


def traced_call(node: CallNode, shape: CallShape) -> tuple[Any, Any]:
  """The call's computation as a closed jaxpr of its array arguments, and its output's
  structure."""

  def call(*arrays: Any) -> Any:
    found = iter(arrays)
    leaves = [
      next(found) if a is not None else s for a, s in zip(shape.arrays, shape.statics, strict=True)
    ]
    return node(jax.tree.unflatten(shape.treedef, leaves))

  return jax.make_jaxpr(call, return_shape=True)(*[a for a in shape.arrays if a is not None])


class Frozen(Struct):
  """The edit that freezes a call (see the module docstring): its output keeps its value
  and takes the gradient of the call evaluated with `freeze`'s primitives held constant.

  Attributes:
    consts: the traced call's constants (its variables, in the run's trace).
    at: the call, by its site name (`Called`).
    jaxpr: the call's computation (`traced_call`).
    output: the structure of its output.
    freeze: the primitives whose outputs are held constant.
    scores: where given, a list the edit appends those primitives' inputs to (read by
      `flg.attention_share` in the same trace).
  """

  consts: tuple[Any, ...]
  at: Any = static_field()
  jaxpr: Any = static_field()
  output: Any = static_field()
  freeze: frozenset[str] = static_field()
  scores: list | None = static_field(default=None)
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    del site
    # The barrier keeps the value and makes the cotangent reaching this call's arguments
    # an array of its own: without it XLA fuses the backward chains of every layer
    # (elementwise through the frozen norms) into one loop that recomputes them per
    # consumer (measured: a third of the time of a batch of rows at 12 layers).
    arrays = jax.lax.optimization_barrier([x for x in jax.tree.leaves(argument) if is_array(x)])
    frozen = jax.tree.unflatten(
      self.output,
      evaluate_with_stops(
        self.jaxpr, self.consts, arrays, jax.lax.stop_gradient, self.freeze, self.scores
      ),
    )
    return jax.tree.map(_straight_through, value, frozen)


def _straight_through(value: Any, frozen: Any) -> Any:
  if not jnp.issubdtype(value.dtype, jnp.inexact):
    return value
  stop = jax.lax.stop_gradient
  return stop(value) + (frozen - stop(frozen)).astype(value.dtype)


def frozen_edit(
  node: CallNode,
  name: str,
  at: Any,
  shape: CallShape,
  freeze: frozenset[str],
  what: str,
  fix: str,
  scores: list | None = None,
) -> Frozen:
  """The `Frozen` edit of call `name` (its `node`), refused where its computation binds
  none of `freeze`'s primitives (nothing to hold constant: `what`, `fix`); with `scores`,
  the edit appends the frozen primitives' inputs there as it runs."""
  closed, output = traced_call(node, shape)
  if not count_primitives(closed.jaxpr, freeze):
    raise UnsupportedFlaxFeatureError(
      f"{name}: this {what} computes no {'/'.join(sorted(freeze))}, so its"
      f" {'scale' if freeze is NORM else 'pattern'} cannot be frozen for the replacement"
      f" model. {fix}"
    )
  return Frozen(
    consts=tuple(closed.consts),
    at=at,
    jaxpr=closed.jaxpr,
    output=jax.tree.structure(output),
    freeze=freeze,
    scores=scores,
  )
