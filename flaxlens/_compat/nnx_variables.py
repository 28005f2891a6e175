"""An NNX `Variable`'s slots, and NNX's registry of variable types by collection name.

Checked with flax 0.12.0–0.12.8. A `flax.nnx.variablelib.Variable` keeps its value in
the slot `_raw_value` (`raw_value` in flax 0.12.0, which has no `get_raw_value`; later
releases deprecate reading `raw_value`, and their `set_raw_value` first checks that the
current trace is the one the variable was made in) and its metadata in the slot `_var_metadata`
(`get_metadata` copies it). `flax.nnx.variablelib.VariableTypeCache` maps collection
names to the types `nnx.register_variable_name` registered.
"""

from __future__ import annotations

from typing import Any

from flaxlens._compat import Formerly, Internal

RAW_VALUE = Internal(
  "flax.nnx.variablelib",
  "Variable._raw_value",
  formerly=(Formerly("flax.nnx.variablelib", "Variable.raw_value", "flax 0.12.0"),),
)
GET_VALUE = Internal("flax.nnx.variablelib", "Variable.get_value", added_in="flax 0.12.1")
SET_VALUE = Internal("flax.nnx.variablelib", "Variable.set_value", added_in="flax 0.12.1")
VAR_METADATA = Internal("flax.nnx.variablelib", "Variable._var_metadata")
VARIABLE_TYPE_CACHE = Internal("flax.nnx.variablelib", "VariableTypeCache")


def raw_value(variable: Any) -> Any:
  """An NNX variable's value as stored, what `Variable.get_raw_value()` returns from flax 0.12.1.

  Example:
    >>> from flax import nnx
    >>> from flaxlens._compat import nnx_variables
    >>> nnx_variables.raw_value(nnx.Param(1.5))
    1.5
  """
  return RAW_VALUE().__get__(variable)


def value(variable: Any) -> Any:
  """An NNX variable's value as NNX gives it: `get_value()`, or `.value` in flax 0.12.0.

  (Later releases deprecate `.value`; flax 0.12.0 has no `get_value`.)

  Example:
    >>> from flax import nnx
    >>> from flaxlens._compat import nnx_variables
    >>> nnx_variables.value(nnx.Param(1.5))
    1.5
  """
  get_value = GET_VALUE.or_none()
  return variable.value if get_value is None else get_value(variable)


def set_value(variable: Any, new: Any) -> None:
  """Sets an NNX variable's value as NNX does: `set_value`, or `.value =` in flax 0.12.0."""
  setter = SET_VALUE.or_none()
  if setter is None:
    variable.value = new
  else:
    setter(variable, new)


def set_raw_value(variable: Any, value: Any) -> None:
  """Sets an NNX variable's value without NNX's trace-level check (about a microsecond).

  Only for variables made in the current trace.
  """
  RAW_VALUE().__set__(variable, value)


def metadata(variable: Any) -> dict[str, Any]:
  """An NNX variable's own metadata dict (not a copy: `get_metadata` copies it)."""
  return VAR_METADATA().__get__(variable)


def variable_mode(variable: Any) -> str | None:
  """`"ref"` or `"hijax"` if the NNX variable lives in that mode, else None."""
  found = variable.get_metadata()
  for mode in ("ref", "hijax"):
    if found.get(mode):
      return mode
  return None


def collection_name(variable_type: type) -> str:
  """The collection an NNX variable type belongs to, as `nnx.bridge` names it.

  The name NNX's registry (`nnx.register_variable_name`) gives the exact type
  (`batch_stats` for `nnx.BatchStat`, `cache` for `nnx.Cache`), else the type's class
  name, which is what `variable_name_from_type(..., allow_register=True)` would register
  for it (without registering it here).
  """
  for name, registered in VARIABLE_TYPE_CACHE().items():
    if registered is variable_type:
      return name
  return variable_type.__name__
