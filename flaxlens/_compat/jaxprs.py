"""JAX's traced programs (jaxprs): cutting one into pieces and running a piece.

Checked with jax 0.10.0–0.10.2. `jax.make_jaxpr` is public; the classes a jaxpr is made
of (`Jaxpr`, `ClosedJaxpr`, `Literal`) and `jaxpr_as_fun`, which runs one, are exported
by `jax.extend.core`, which JAX documents without a compatibility promise. Running a
jaxpr equation by equation (`evaluate_with_stops`) binds each equation's primitive with
the parameters `Primitive.get_bind_params` gives (`(subfuns, params)` before jax 0.10,
the params alone since). A jaxpr's
equations are read through their attributes `invars`, `outvars` and `effects`, and a
jaxpr's through `constvars`, `invars`, `outvars`, `eqns` and `effects`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flaxlens._compat import Internal

JAXPR = Internal("jax.extend.core", "Jaxpr")
CLOSED_JAXPR = Internal("jax.extend.core", "ClosedJaxpr")
LITERAL = Internal("jax.extend.core", "Literal")
JAXPR_AS_FUN = Internal("jax.extend.core", "jaxpr_as_fun")


def is_literal(atom: Any) -> bool:
  """Whether an equation's operand is a literal (a constant written in the jaxpr)."""
  return isinstance(atom, LITERAL())


def literal_value(atom: Any) -> Any:
  return atom.val


def piece(
  jaxpr: Any, inputs: Sequence[Any], outputs: Sequence[Any], eqns: Sequence[Any]
) -> Callable[..., list[Any]]:
  """A function running `eqns` (equations of `jaxpr`, in order) on values of the
  variables `inputs`, returning the values of the variables `outputs`."""
  effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
  cut = JAXPR()((), list(inputs), list(outputs), list(eqns), effects, jaxpr.debug_info)
  return JAXPR_AS_FUN()(CLOSED_JAXPR()(cut, ()))


def sub_jaxpr(eqn: Any) -> Any:
  """The one closed jaxpr a call-like equation runs (`pjit`, `custom_jvp_call`, ...), or
  None."""
  found = [p for p in eqn.params.values() if isinstance(p, CLOSED_JAXPR())]
  return found[0] if len(found) == 1 else None


def count_primitives(jaxpr: Any, names: frozenset[str]) -> int:
  """How many equations of `jaxpr` (or of the call-like equations it makes) bind a
  primitive named in `names`."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in names
    inner = sub_jaxpr(eqn)
    if inner is not None:
      count += count_primitives(inner.jaxpr, names)
  return count


def evaluate_with_stops(
  jaxpr: Any,
  consts: Sequence[Any],
  args: Sequence[Any],
  stop: Callable[[Any], Any],
  names: frozenset[str],
  inputs_of_stopped: list | None = None,
) -> list[Any]:
  """Runs `jaxpr` on `args`, applying `stop` to the outputs of every equation binding a
  primitive named in `names` (inlining the call-like equations that hold one), and
  appending such an equation's first input to `inputs_of_stopped` where given."""
  env: dict[Any, Any] = {}

  def read(atom: Any) -> Any:
    return atom.val if is_literal(atom) else env[atom]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    inner = sub_jaxpr(eqn)
    if inner is not None and count_primitives(inner.jaxpr, names):
      outs = evaluate_with_stops(inner.jaxpr, inner.consts, values, stop, names, inputs_of_stopped)
    else:
      found = eqn.primitive.get_bind_params(eqn.params)
      subfuns, params = found if isinstance(found, tuple) else ((), found)
      outs = eqn.primitive.bind(*subfuns, *values, **params)
      outs = list(outs) if eqn.primitive.multiple_results else [outs]
      if eqn.primitive.name in names:
        outs = [stop(o) for o in outs]
        if inputs_of_stopped is not None:
          inputs_of_stopped.append(values[0])
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]
