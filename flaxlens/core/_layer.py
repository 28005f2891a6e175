"""Layer: a Struct that can be called, the unit every converted Flax call becomes.

A layer is called as `layer(argument, /, **side_inputs)`: one positional argument (for
converted Flax calls an `ArgsAndKwargs`) plus keyword side inputs that flow down the
tree unchanged (random streams, flags). `stateless_call` runs a layer on variable values
instead of bound variables and returns the new state, which is what `jax.jit`, `grad`
and isolate/replay need. No Flax internals here.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any, Self

from flaxlens.core._render import color_for
from flaxlens.core._struct import Struct
from flaxlens.core._variables import (
  AbstractVariableValue,
  StateVariable,
  VariableError,
  bind_variables,
  slots_in,
  unbind_variables,
  variables_in,
)


class Layer(Struct, abc.ABC):
  """Base class of callable tree nodes.

  Example:
    >>> import flaxlens as fl
    >>> class AddOne(fl.Layer):
    ...   def __call__(self, argument, /, **side_inputs):
    ...     return argument + 1
    >>> AddOne()(41)
    42
  """

  @abc.abstractmethod
  def __call__(self, argument: Any, /, **side_inputs: Any) -> Any:
    """Runs the layer on `argument`."""

  def treescope_color(self) -> str | None:
    return color_for(type(self).__name__)

  def bind_variables(self, variables: Iterable[Any], allow_unused: bool = False) -> Self:
    """Returns a copy of this layer with its slots filled; see `fl.bind_variables`."""
    return bind_variables(self, variables, allow_unused=allow_unused)

  def stateless_call(
    self,
    variable_values: Iterable[AbstractVariableValue],
    argument: Any,
    /,
    **side_inputs: Any,
  ) -> tuple[Any, tuple[AbstractVariableValue, ...]]:
    """Calls the layer on variable values and returns `(output, new_state_values)`.

    Slots are filled from `variable_values`; variables still bound inside the layer are
    used through fresh copies, so nothing outside is modified. `new_state_values`
    holds the final value of every state variable of the call, in traversal order.

    Example:
      >>> import flaxlens as fl
      >>> class Count(fl.Layer):
      ...   n: object
      ...   def __call__(self, x, /):
      ...     self.n.value += 1
      ...     return x
      >>> layer, values = fl.unbind_variables(Count(fl.StateVariable(0, label="n")),
      ...                                      freeze=True)
      >>> layer.stateless_call(values, "x")
      ('x', (StateVariableValue(value=1, label='n'),))
    """
    given = {v.label: v for v in variable_values}
    unbound, bound_values = unbind_variables(self, freeze=True)
    values = {v.label: v for v in bound_values}
    values.update(given)
    layer = bind_variables(unbound, values.values(), allow_unused=False)
    missing = slots_in(layer)
    if missing:
      raise VariableError(
        f"{type(self).__name__}.stateless_call: no value for the slot(s)"
        f" {[s.label for s in missing]}; pass their values in variable_values."
      )
    output = layer(argument, **side_inputs)
    new_state = tuple(v.freeze() for v in variables_in(layer) if isinstance(v, StateVariable))
    return output, new_state
