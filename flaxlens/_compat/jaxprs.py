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


# Primitives not linear in an operand that carries a tangent (with the exceptions below).
NONLINEAR = frozenset({
  "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "cbrt", "pow",
  "integer_pow", "square", "erf", "erfc", "erf_inv", "sin", "cos", "tan", "atan2", "max", "min",
  "abs", "sign", "reduce_max", "reduce_min", "argmax", "argmin", "sort", "top_k", "clamp",
  "round", "floor", "ceil", "rem", "reduce_prod", "cumprod", "cummax", "cummin",
})  # fmt: skip
_BILINEAR = frozenset({"mul", "dot_general", "conv_general_dilated"})
_CONTROL = frozenset({"scan", "while", "cond"})


def _nonlinear_in(eqn: Any, tainted: list[bool]) -> bool:
  name = eqn.primitive.name
  if not any(tainted) or name == "stop_gradient":
    return False
  if name in _BILINEAR:
    return sum(tainted) >= 2
  if name == "div":
    return tainted[1]
  if name == "select_n":
    return tainted[0]
  return name in NONLINEAR


def _forward(jaxpr: Any, tainted_in: Sequence[bool]) -> dict[Any, bool]:
  """Which variables of `jaxpr` depend on a tainted input (other than through a
  stop-gradient)."""
  taint = dict(zip(jaxpr.invars, tainted_in, strict=True))

  def of(atom: Any) -> bool:
    return False if is_literal(atom) else taint.get(atom, False)

  for eqn in jaxpr.eqns:
    ins = [of(v) for v in eqn.invars]
    inner = sub_jaxpr(eqn)
    if eqn.primitive.name == "stop_gradient":
      outs = [False] * len(eqn.outvars)
    elif inner is not None:
      inner_taint = _forward(inner.jaxpr, ins)
      outs = [False if is_literal(v) else inner_taint.get(v, False) for v in inner.jaxpr.outvars]
    else:
      outs = [any(ins)] * len(eqn.outvars)
    taint.update(zip(eqn.outvars, outs, strict=True))
  return taint


def nonlinear_on_gradient_path(
  jaxpr: Any, tainted_in: Sequence[bool], relevant_out: Sequence[bool] | None = None
) -> list[str]:
  """The primitives of `jaxpr` (and of the calls it makes) that are not linear in a
  tainted input and whose outputs reach a relevant output other than through a
  stop-gradient: where a function of the tainted inputs is not affine."""
  taint = _forward(jaxpr, tainted_in)
  relevant = {
    v
    for v, r in zip(jaxpr.outvars, relevant_out or [True] * len(jaxpr.outvars), strict=True)
    if r and not is_literal(v)
  }
  found: list[str] = []
  for eqn in reversed(jaxpr.eqns):
    outs = [v in relevant for v in eqn.outvars]
    if not any(outs) or eqn.primitive.name == "stop_gradient":
      continue
    ins = [False if is_literal(v) else taint.get(v, False) for v in eqn.invars]
    inner = sub_jaxpr(eqn)
    if inner is not None:
      found += nonlinear_on_gradient_path(inner.jaxpr, ins, outs)
      inner_relevant = _relevant_inputs(inner.jaxpr, outs)
      relevant.update(
        v for v, r in zip(eqn.invars, inner_relevant, strict=True) if r and not is_literal(v)
      )
      continue
    if eqn.primitive.name in _CONTROL and any(ins):
      found += [f"{eqn.primitive.name} (holding {n})" for n in sorted(NONLINEAR) if _holds(eqn, n)][
        :1
      ]
    elif _nonlinear_in(eqn, ins):
      found.append(eqn.primitive.name)
    relevant.update(v for v in eqn.invars if not is_literal(v))
  return found


def _holds(eqn: Any, name: str) -> bool:
  return any(
    count_primitives(p.jaxpr if isinstance(p, CLOSED_JAXPR()) else p, frozenset({name}))
    for p in eqn.params.values()
    if isinstance(p, CLOSED_JAXPR() | JAXPR())
  )


def _relevant_inputs(jaxpr: Any, relevant_out: Sequence[bool]) -> list[bool]:
  relevant = {
    v for v, r in zip(jaxpr.outvars, relevant_out, strict=True) if r and not is_literal(v)
  }
  for eqn in reversed(jaxpr.eqns):
    outs = [v in relevant for v in eqn.outvars]
    if eqn.primitive.name == "stop_gradient" or not any(outs):
      continue
    inner = sub_jaxpr(eqn)
    ins = _relevant_inputs(inner.jaxpr, outs) if inner is not None else [True] * len(eqn.invars)
    relevant.update(v for v, r in zip(eqn.invars, ins, strict=True) if r and not is_literal(v))
  return [v in relevant for v in jaxpr.invars]
