"""Freezing a call for the replacement model: its output keeps its value, bit for bit,
while its gradient is that of the call with some of its intermediates held constant.

The frozen call is the call's own computation, traced to a jaxpr and evaluated again
with `jax.lax.stop_gradient` on the outputs of chosen primitives (`frozen_eval`):
- a normalisation (`NORM`): its square roots (`rsqrt`, `sqrt`, and `pow`, as in `var **
  -0.5`), so the scale (denominator) is constant while mean-centring and the gain keep
  their gradient;
- an attention (`ATTENTION`): its exponentials, the softmax's numerator, so the
  pattern (numerator over its sum) is constant and attention is a fixed mixing of values.
The frozen output is `stop_gradient(value) + (frozen - stop_gradient(frozen))`: the
model's own value with the frozen computation's gradient. No Flax internals here; the
jaxpr is walked through `jax.extend.core`'s public classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import UnsupportedFlaxFeatureError

NORM = frozenset({"rsqrt", "sqrt", "pow"})
ATTENTION = frozenset({"exp"})


def _sub_jaxpr(params: dict[str, Any]) -> ClosedJaxpr | None:
  """The one closed jaxpr a call-like equation runs (`pjit`, `custom_jvp_call`, ...)."""
  found = [p for p in params.values() if isinstance(p, ClosedJaxpr)]
  return found[0] if len(found) == 1 else None


def holds(jaxpr: Jaxpr, primitives: frozenset[str]) -> int:
  """How many equations of `jaxpr` (or of the call-like equations it makes) bind one of
  `primitives`."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in primitives:
      count += 1
    inner = _sub_jaxpr(eqn.params)
    if inner is not None:
      count += holds(inner.jaxpr, primitives)
  return count


def frozen_eval(
  jaxpr: Jaxpr,
  consts: Sequence[Any],
  args: Sequence[Any],
  freeze: frozenset[str],
  inputs_of_frozen: list | None = None,
) -> list:
  """Evaluates `jaxpr` on `args` with a stop-gradient on the output of every equation
  binding a primitive in `freeze`, inlining call-like equations that hold one; appends
  the first input of each such equation to `inputs_of_frozen` where given (an
  attention's scores: its softmax's exponent)."""
  env: dict[Any, Any] = {}

  def read(var: Any) -> Any:
    return var.val if isinstance(var, Literal) else env[var]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    inner = _sub_jaxpr(eqn.params)
    if inner is not None and holds(inner.jaxpr, freeze):
      outs = frozen_eval(inner.jaxpr, inner.consts, values, freeze, inputs_of_frozen)
    else:
      # `(subfuns, params)` before jax 0.10, the params alone since.
      found = eqn.primitive.get_bind_params(eqn.params)
      subfuns, params = found if isinstance(found, tuple) else ((), found)
      outs = eqn.primitive.bind(*subfuns, *values, **params)
      outs = list(outs) if eqn.primitive.multiple_results else [outs]
      if eqn.primitive.name in freeze:
        outs = [jax.lax.stop_gradient(o) for o in outs]
        if inputs_of_frozen is not None:
          inputs_of_frozen.append(values[0])
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


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
  return isinstance(x, jax.Array | jnp.ndarray) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def call_shape(argument: ArgsAndKwargs) -> CallShape:
  """The `CallShape` of a call's argument, as a run gave it."""
  leaves, treedef = jax.tree.flatten(argument)
  arrays = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array(x) else None for x in leaves)
  statics = tuple(None if is_array(x) else x for x in leaves)
  return CallShape(treedef, arrays, statics)


def traced_call(node: CallNode, shape: CallShape) -> tuple[ClosedJaxpr, Any]:
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
    arrays = [x for x in jax.tree.leaves(argument) if is_array(x)]
    frozen = jax.tree.unflatten(
      self.output, frozen_eval(self.jaxpr, self.consts, arrays, self.freeze, self.scores)
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
  if not holds(closed.jaxpr, freeze):
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
