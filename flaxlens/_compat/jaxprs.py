"""JAX's traced programs (jaxprs): cutting one into pieces and running a piece.

Checked with jax 0.10.0–0.10.2. `jax.make_jaxpr` is public; the classes a jaxpr is made
of (`Jaxpr`, `ClosedJaxpr`, `Literal`) and `jaxpr_as_fun`, which runs one, are exported
by `jax.extend.core`, which JAX documents without a compatibility promise. A jaxpr's
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
