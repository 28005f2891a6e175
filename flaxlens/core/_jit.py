"""variable_jit: `jax.jit` for functions whose arguments hold bound variables.

The wrapper unbinds every variable from the arguments, passes their values into one
jitted function that rebinds fresh copies, runs the user function and returns the
values of the variables it assigned; the wrapper then writes those back into the
caller's variable objects. Array leaves are traced; every other leaf (Python numbers,
strings, bools, None) is static, so `train=True` stays a Python value and changing only
array values never recompiles.

Splitting a converted tree into its structure, variables and leaves walks every node, so
it is done once per tree: the split of an argument that is a `Struct` is kept while the
struct lives (`_Part`) and reused while everything it reached is unchanged. Structs are
frozen, the dicts of a converted tree are read-only (`ReadOnlyDict`) and variable labels
are fixed, so only plain dicts and lists put into a tree by hand can change in place;
each call checks that those still hold the same keys and the identical objects (a
C-speed comparison, nothing at all for a converted tree) and splits the argument again
otherwise. Variable values and array leaves are read on every call, never cached. An
argument holding a pytree node of another type (which might change unseen) is split on
every call. No Flax internals here.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from flaxlens.core._readonly import ReadOnlyDict
from flaxlens.core._struct import Struct
from flaxlens.core._variables import (
  AbstractVariable,
  AbstractVariableSlot,
  Parameter,
  StateVariable,
  VariableError,
)
from flaxlens.errors import ArgumentError

_ARRAY, _STATIC = -1, -2  # Leaf kinds besides variable indices.
_OWNED = -3  # Kind `_OWNED - j`: the part's j-th object of a framework's own state.
_TRACED = jax.Array | np.ndarray | np.generic
_traced_types: set[type] = set()  # Types all of whose instances are traced (tracers are not).
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)
_value = operator.attrgetter("_value")  # The slot itself: no Python call per variable.


def _is_variable_or_slot(x: Any) -> bool:
  return isinstance(x, AbstractVariable | AbstractVariableSlot)


class StateKind(NamedTuple):
  """How variable_jit carries one framework's own mutable state objects (NNX variables,
  which an `nnx.Rngs` given as an argument holds) through the jitted call: each object is
  passed in by value, made afresh inside the trace from `spec` (hashable: part of what the
  program is compiled for) and its value, and written back when the call changed it, as
  the framework's own jit does."""

  kind: type
  spec: Callable[[Any], Any]  # object -> hashable description (type, metadata)
  value: Callable[[Any], Any]
  fresh: Callable[[Any, Any], Any]  # (spec, value) -> a new object, inside the trace
  write: Callable[[Any, Any], None]  # (the caller's object, new value)


_state_kinds: list[StateKind] = []


def register_state_kind(kind: StateKind) -> None:
  """Lets variable_jit carry objects of `kind.kind` found in its arguments (see
  `StateKind`); registered by a framework's adapter when it is imported."""
  if all(k.kind is not kind.kind for k in _state_kinds):
    _state_kinds.append(kind)


def _state_kind(x: Any) -> int | None:
  """The index of the registered `StateKind` of `x`, or None."""
  for i, kind in enumerate(_state_kinds):
    if isinstance(x, kind.kind):
      return i
  return None


def _is_split_leaf(x: Any) -> bool:
  return _is_variable_or_slot(x) or (bool(_state_kinds) and _state_kind(x) is not None)


def _is_traced(leaf: Any) -> bool:
  kind = type(leaf)
  if kind in _traced_types:
    return True
  if not isinstance(leaf, _TRACED):
    return False
  if issubclass(kind, _TRACED):
    _traced_types.add(kind)
  return True


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

  def traced(layout: tuple[Any, ...], arrays: Any, values: tuple[Any, ...], owned: Any) -> Any:
    n_args, names, structures, maps = layout
    maps = maps or (None,) * len(structures)
    specs: list[Any] = [None] * len(values)
    for structure, indices in zip(structures, maps, strict=True):
      for i, spec in enumerate(structure.specs):
        specs[i if indices is None else indices[i]] = spec
    fresh = [
      (StateVariable if is_state else Parameter)(value, label=label)
      for (label, is_state), value in zip(specs, values, strict=True)
    ]
    made = [
      [_state_kinds[k].fresh(spec, v) for (k, spec), v in zip(s.owned, given, strict=True)]
      for s, given in zip(structures, owned, strict=True)
    ]
    elements = [
      s.join(a, fresh if indices is None else [fresh[g] for g in indices], m)
      for s, a, indices, m in zip(structures, arrays, maps, made, strict=True)
    ]
    out = fn(*elements[:n_args], **dict(zip(names, elements[n_args:], strict=True)))
    if any(isinstance(x, AbstractVariable) for x in jax.tree_util.tree_leaves(out)):
      raise VariableError(
        f"{name} under variable_jit returned a bound variable; return its .value (or"
        " unbind_variables(...)) instead."
      )
    changed = {
      (p, j): new
      for p, (s, objects, given) in enumerate(zip(structures, made, owned, strict=True))
      for j, ((k, _), obj, old) in enumerate(zip(s.owned, objects, given, strict=True))
      if (new := _state_kinds[k].value(obj)) is not old
    }
    return out, {i: v.value for i, v in enumerate(fresh) if v.value is not values[i]}, changed

  jitted = jax.jit(traced, static_argnums=0, **jit_kwargs)

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    names = tuple(sorted(kwargs)) if kwargs else ()
    elements = (*args, *map(kwargs.__getitem__, names)) if names else args
    parts = [_part(e, name) for e in elements]
    variables, maps = _merge_variables(parts)
    layout = (len(args), names, tuple(p.structure for p in parts), maps)
    owned = [
      tuple(_state_kinds[k].value(o) for (k, _), o in zip(p.structure.owned, p.owned, strict=True))
      for p in parts
    ]
    out, changed, changed_owned = jitted(
      layout, [p.arrays for p in parts], tuple(map(_value, variables)), owned
    )
    for i, value in changed.items():
      variables[i].value = value
    for (p, j), value in changed_owned.items():
      _state_kinds[parts[p].structure.owned[j][0]].write(parts[p].owned[j], value)
    return out

  return wrapper


class _Structure:
  """What the trace of one argument depends on: its treedef, leaf kinds, static leaves
  and variable specs. Hashable (the hash is computed once), compared by value.
  """

  __slots__ = ("treedef", "kinds", "static", "specs", "owned", "_hash")

  def __init__(
    self,
    treedef: Any,
    kinds: tuple[int, ...],
    static: tuple[Any, ...],
    specs: Any,
    owned: tuple[tuple[int, Any], ...] = (),
  ):
    self.treedef, self.kinds, self.static, self.specs = treedef, kinds, static, specs
    self.owned = owned  # (state kind, spec) of each object of a framework's own state
    try:
      self._hash = hash((treedef, kinds, static, specs, owned))
    except TypeError as e:
      raise ArgumentError(
        "variable_jit treats non-array leaves as static, and they must be hashable;"
        f" got an unhashable leaf ({e}). Convert it to an array or a tuple."
      ) from None

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    return (
      isinstance(other, _Structure)
      and self._hash == other._hash
      and self.treedef == other.treedef
      and self.kinds == other.kinds
      and self.specs == other.specs
      and self.owned == other.owned
      and len(self.static) == len(other.static)
      and all(type(a) is type(b) and a == b for a, b in zip(self.static, other.static, strict=True))
    )

  def join(self, arrays: Any, variables: list[Any], owned: list[Any] = ()) -> Any:
    """The argument again, from its arrays, (fresh) variables and (fresh) objects of a
    framework's own state (inside the trace)."""
    arrays_iter, static_iter = iter(arrays), iter(self.static)
    leaves = [
      variables[k]
      if k >= 0
      else next(arrays_iter)
      if k == _ARRAY
      else next(static_iter)
      if k == _STATIC
      else owned[_OWNED - k]
      for k in self.kinds
    ]
    return jax.tree_util.tree_unflatten(self.treedef, leaves)


class _Part:
  """One argument split into its structure, its variables (each once) and its arrays."""

  __slots__ = ("structure", "variables", "arrays", "owned", "watched", "__weakref__")

  def __init__(self, argument: Any, name: str):
    leaves, treedef = jax.tree_util.tree_flatten(argument, is_leaf=_is_split_leaf)
    kinds: list[int] = []
    static: list[Any] = []
    self.variables: list[AbstractVariable] = []
    self.arrays: list[Any] = []
    self.owned: list[Any] = []  # objects of a framework's own state, each once
    owned_specs: list[tuple[int, Any]] = []
    index: dict[int, int] = {}
    owned_index: dict[int, int] = {}
    for leaf in leaves:
      if isinstance(leaf, AbstractVariable):
        if id(leaf) not in index:
          index[id(leaf)] = len(self.variables)
          self.variables.append(leaf)
        kinds.append(index[id(leaf)])
      elif _state_kinds and (state := _state_kind(leaf)) is not None:
        if id(leaf) not in owned_index:
          owned_index[id(leaf)] = len(self.owned)
          self.owned.append(leaf)
          owned_specs.append((state, _state_kinds[state].spec(leaf)))
        kinds.append(_OWNED - owned_index[id(leaf)])
      elif _is_traced(leaf):
        kinds.append(_ARRAY)
        self.arrays.append(leaf)
      elif isinstance(leaf, AbstractVariableSlot):
        raise VariableError(
          f"{name} under variable_jit got a tree with unbound slots"
          f" {[x.label for x in leaves if isinstance(x, AbstractVariableSlot)]}; bind them"
          " first with fl.bind_variables(tree, values)."
        )
      else:
        kinds.append(_STATIC)
        static.append(leaf)
    _check_labels(self.variables)
    specs = tuple((v.label, isinstance(v, StateVariable)) for v in self.variables)
    self.structure = _Structure(treedef, tuple(kinds), tuple(static), specs, tuple(owned_specs))
    self.watched: _Watched | None = None

  def watch(self, argument: Any) -> bool:
    """Records the mutable containers `argument` reaches; False if it cannot be watched."""
    dicts: list[Any] = []
    lists: list[Any] = []
    if not _collect(argument, dicts, lists):
      return False
    if dicts or lists:
      filled = [d for d in dicts if d]
      self.watched = _Watched(
        dicts + lists,
        list(map(len, dicts + lists)),
        filled,
        list(itertools.chain.from_iterable(filled)),
        lists,
        _children(filled, lists),
      )
    return True

  def current(self) -> bool:
    """Whether the watched containers are as when split (always, when there are none)."""
    w = self.watched
    if w is None:
      return True
    if list(map(len, w.containers)) != w.sizes:
      return False
    # Sizes are unchanged, so only containers that held something can differ.
    return (
      all(map(operator.is_, _children(w.filled, w.lists), w.children))
      and list(itertools.chain.from_iterable(w.filled)) == w.keys
    )


class _Watched(NamedTuple):
  """The containers a split argument reaches, and what they held when it was split."""

  containers: list[Any]  # every dict and list
  sizes: list[int]
  filled: list[Any]  # the dicts that held something
  keys: list[Any]  # their keys, in order
  lists: list[Any]
  children: list[Any]  # the filled dicts' values, then the lists' items


def _children(dicts: list[Any], lists: list[Any]) -> list[Any]:
  return list(
    itertools.chain(
      itertools.chain.from_iterable(map(dict.values, dicts)),
      itertools.chain.from_iterable(lists),
    )
  )


def _collect(x: Any, dicts: list[Any], lists: list[Any]) -> bool:
  """Adds the dicts and lists `x` reaches; False if it reaches another mutable node."""
  if x is None or _is_variable_or_slot(x):
    return True
  kind = type(x)
  if kind is tuple or (issubclass(kind, tuple) and hasattr(kind, "_fields")):
    return all(_collect(c, dicts, lists) for c in x)
  if kind is list:
    lists.append(x)
    return all(_collect(c, dicts, lists) for c in x)
  if kind is ReadOnlyDict:  # Cannot change in place: nothing to watch at this level.
    return all(_collect(c, dicts, lists) for c in x.values())
  if kind in _DICTS:
    dicts.append(x)
    return all(_collect(c, dicts, lists) for c in x.values())
  if isinstance(x, Struct):
    return all(_collect(c, dicts, lists) for c in x.tree_flatten()[0])
  leaves = jax.tree_util.tree_leaves(x)
  return len(leaves) == 1 and leaves[0] is x


_parts: dict[int, tuple[weakref.ref, _Part]] = {}


def _part(argument: Any, name: str) -> _Part | _ArrayPart:
  """The split of `argument`, reused for a struct while it is unchanged."""
  if _is_traced(argument):
    return _ArrayPart(argument)
  if not isinstance(argument, Struct) or isinstance(argument, AbstractVariableSlot):
    return _Part(argument, name)
  key = id(argument)
  entry = _parts.get(key)
  if entry is not None and entry[0]() is argument and entry[1].current():
    return entry[1]
  part = _Part(argument, name)
  if part.watch(argument):
    _parts[key] = (weakref.ref(argument, lambda _, key=key: _parts.pop(key, None)), part)
  return part


def _check_labels(variables: Any) -> None:
  labels: dict[str, AbstractVariable] = {}
  for v in variables:
    if labels.setdefault(v.label, v) is not v:
      raise VariableError(
        f"Two different variables share the label {v.label!r}; labels identify"
        " variables, so each must be unique (for a second converted model:"
        " other = fl.relabel_variables(other, 'teacher/'))."
      )


def _merge_variables(parts: list[Any]) -> tuple[list[AbstractVariable], Any]:
  """The variables of all parts, each once, and per part where its variables went.

  With at most one part holding variables, that part's own list is used as is (maps None).
  """
  holding = [p for p in parts if p.variables]
  if len(holding) <= 1:
    return (holding[0].variables if holding else []), None
  variables: list[AbstractVariable] = []
  index: dict[int, int] = {}
  maps = []
  for part in parts:
    for v in part.variables:
      if id(v) not in index:
        index[id(v)] = len(variables)
        variables.append(v)
    maps.append(tuple(index[id(v)] for v in part.variables))
  _check_labels(variables)
  return variables, tuple(maps)


class _ArrayPart:
  """An argument that is one array."""

  __slots__ = ("arrays",)
  structure = _Structure(jax.tree_util.tree_structure(0), (_ARRAY,), (), ())
  variables: tuple[()] = ()
  owned: tuple[()] = ()

  def __init__(self, array: Any):
    self.arrays = [array]
