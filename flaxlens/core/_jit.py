"""variable_jit: `jax.jit` for functions whose arguments hold bound variables.

The wrapper unbinds every variable from the arguments, passes their values into one
jitted function that rebinds fresh copies, runs the user function and returns the
values of the variables it assigned; the wrapper then writes those back into the
caller's variable objects. Array leaves are traced; every other leaf (Python numbers,
strings, bools, None) is static, so `train=True` stays a Python value and changing only
array values never recompiles. No Flax internals here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from flaxlens.core._variables import (
  AbstractVariable,
  AbstractVariableSlot,
  Parameter,
  StateVariable,
  VariableError,
)
from flaxlens.errors import ArgumentError

_ARRAY, _STATIC = -1, -2  # Leaf kinds besides variable indices.


def _is_variable_or_slot(x: Any) -> bool:
  return isinstance(x, AbstractVariable | AbstractVariableSlot)


def _is_traced(leaf: Any) -> bool:
  return isinstance(leaf, jax.Array | np.ndarray | np.generic)


class _Static:
  """Hashable wrapper for the static (non-array) leaves of a call."""

  __slots__ = ("values",)

  def __init__(self, values: tuple[Any, ...]):
    try:
      hash(values)
    except TypeError as e:
      raise ArgumentError(
        "variable_jit treats non-array leaves as static, and they must be hashable;"
        f" got an unhashable leaf ({e}). Convert it to an array or a tuple."
      ) from None
    self.values = values

  def __hash__(self) -> int:
    return hash(self.values)

  def __eq__(self, other: object) -> bool:
    return (
      isinstance(other, _Static)
      and len(self.values) == len(other.values)
      and all(type(a) is type(b) and a == b for a, b in zip(self.values, other.values, strict=True))
    )


def variable_jit(fn: Callable[..., Any] | None = None, /, **jit_kwargs: Any) -> Any:
  """Jits `fn`, whose arguments may contain bound `Parameter`s and `StateVariable`s.

  Variables assigned inside `fn` are written back after the call, as in eager mode.

  Args:
    fn: the function to jit; `variable_jit(**jit_kwargs)` returns a decorator.
    **jit_kwargs: passed to `jax.jit` (for example `device` or `backend`). Argument
      selection options (`static_argnums`, `donate_argnums`, ...) are not accepted:
      non-array leaves are static already, and arrays are always traced.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> total = fl.StateVariable(jnp.zeros(()), label="total")
    >>> @fl.variable_jit
    ... def accumulate(state, x):
    ...   state.value = state.value + x.sum()
    ...   return x * 2
    >>> _ = accumulate(total, jnp.ones(3))
    >>> _ = accumulate(total, jnp.ones(3))
    >>> float(total.value)
    6.0
  """
  if fn is None:
    return functools.partial(variable_jit, **jit_kwargs)
  refused = sorted(k for k in jit_kwargs if k.startswith(("static_arg", "donate_arg")))
  if refused:
    raise ArgumentError(
      f"variable_jit does not take {refused}: non-array leaves of the arguments are static"
      " already and array leaves are always traced. Pass Python values for static inputs."
    )
  name = getattr(fn, "__name__", "function")

  def traced(static: _Static, treedef: Any, kinds: tuple[int, ...], specs, arrays, values):
    fresh = [
      (StateVariable if is_state else Parameter)(value, label=label)
      for (label, is_state), value in zip(specs, values, strict=True)
    ]
    args, kwargs = _join_arguments(treedef, kinds, static, arrays, fresh)
    out = fn(*args, **kwargs)
    if any(isinstance(x, AbstractVariable) for x in jax.tree_util.tree_leaves(out)):
      raise VariableError(
        f"{name} under variable_jit returned a bound variable; return its .value (or"
        " unbind_variables(...)) instead."
      )
    return out, {i: v.value for i, v in enumerate(fresh) if v.value is not values[i]}

  jitted = jax.jit(traced, static_argnums=(0, 1, 2, 3), **jit_kwargs)

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    split = _SplitArguments(args, kwargs, name)
    specs = tuple((v.label, isinstance(v, StateVariable)) for v in split.variables)
    values = tuple(v.value for v in split.variables)
    static = _Static(tuple(split.static))
    out, changed = jitted(static, split.treedef, tuple(split.kinds), specs, split.arrays, values)
    for i, value in changed.items():
      split.variables[i].value = value
    return out

  return wrapper


class _SplitArguments:
  """The leaves of `(args, kwargs)` sorted into variables, arrays and static values.

  Attributes:
    treedef: the structure of `(args, kwargs)`, variables as leaves.
    kinds: per leaf, the index of its variable in `variables`, `_ARRAY` or `_STATIC`.
    variables: each bound variable once, in first-seen order.
    arrays: the array leaves (traced).
    static: the other leaves (static).
  """

  def __init__(self, args: Any, kwargs: Any, name: str):
    leaves, self.treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_variable_or_slot)
    self.kinds: list[int] = []
    self.variables: list[AbstractVariable] = []
    self.arrays: list[Any] = []
    self.static: list[Any] = []
    index: dict[int, int] = {}
    labels: dict[str, AbstractVariable] = {}
    for leaf in leaves:
      if isinstance(leaf, AbstractVariable):
        if id(leaf) not in index:
          if labels.setdefault(leaf.label, leaf) is not leaf:
            raise VariableError(
              f"Two different variables share the label {leaf.label!r}; labels identify"
              " variables, so each must be unique (for a second converted model:"
              " other = fl.relabel_variables(other, 'teacher/'))."
            )
          index[id(leaf)] = len(self.variables)
          self.variables.append(leaf)
        self.kinds.append(index[id(leaf)])
      elif _is_traced(leaf):
        self.kinds.append(_ARRAY)
        self.arrays.append(leaf)
      elif not isinstance(leaf, AbstractVariableSlot):
        self.kinds.append(_STATIC)
        self.static.append(leaf)
    unbound = [leaf.label for leaf in leaves if isinstance(leaf, AbstractVariableSlot)]
    if unbound:
      raise VariableError(
        f"{name} under variable_jit got a tree with unbound slots {unbound}; bind them"
        " first with fl.bind_variables(tree, values)."
      )


def _join_arguments(
  treedef: Any, kinds: tuple[int, ...], static: _Static, arrays: Any, variables: list[Any]
) -> Any:
  """`(args, kwargs)` again from the parts `_SplitArguments` made (inside the trace)."""
  arrays_iter, static_iter = iter(arrays), iter(static.values)
  leaves = [
    variables[k] if k >= 0 else next(arrays_iter) if k == _ARRAY else next(static_iter)
    for k in kinds
  ]
  return jax.tree_util.tree_unflatten(treedef, leaves)
