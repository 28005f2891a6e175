"""NNX variables among the arguments of a jitted flaxlens call (`fl.run`, `fl.capture`,
`fl.variable_jit`): an `nnx.Rngs` given to the model's call holds `RngKey`/`RngCount`
variables, which a call advances. `jax.jit` alone would advance a copy, so each call
would draw the same numbers; registered here, each variable is passed in by value, made
afresh inside the trace (same type and metadata) and written back when the call changed
it, as `nnx.jit` does. Public NNX API (`get_metadata`; `get_value` and `set_value`, or
`.value` in flax 0.12.0, through `flaxlens._compat.nnx_variables`).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from flaxlens._compat import nnx_variables
from flaxlens.core._jit import StateKind, register_state_kind


class _Held:
  """Metadata that is not hashable, kept by identity (a new object compiles anew)."""

  __slots__ = ("metadata",)

  def __init__(self, metadata: dict[str, Any]):
    self.metadata = metadata


def _spec(variable: Any) -> tuple[type, Any]:
  metadata = variable.get_metadata()
  items = tuple(sorted(metadata.items()))
  try:
    hash(items)
  except TypeError:
    return type(variable), _Held(metadata)
  return type(variable), items


def _fresh(spec: tuple[type, Any], value: Any) -> Any:
  kind, items = spec
  metadata = items.metadata if isinstance(items, _Held) else dict(items)
  return kind(value, **metadata)


register_state_kind(
  StateKind(
    kind=nnx.Variable,
    spec=_spec,
    value=nnx_variables.value,
    fresh=_fresh,
    write=nnx_variables.set_value,
  )
)
