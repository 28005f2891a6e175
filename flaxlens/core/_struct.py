"""Struct: the frozen dataclass pytree that every flaxlens tree is built from.

Subclassing `Struct` turns the class into a frozen dataclass and registers it with JAX
as a keyed pytree, so `jax.tree_util` paths read `.field_name`. Fields are pytree
children unless declared with `static_field()`, in which case they travel in the
treedef (and must therefore be hashable, as jit caches on them). A child field holding
None or an empty read-only dict has no leaves: it is left out of the children and noted
in the treedef, and unflattening puts it back. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, ClassVar, Self

import jax

from flaxlens.core._cache import Derived, without_kept
from flaxlens.core._readonly import ReadOnlyDict
from flaxlens.core._selectors import select
from flaxlens.errors import ArgumentError


def static_field(**kwargs: Any) -> Any:
  """Declares a `Struct` field that is metadata, not a pytree child.

  Example:
    >>> import flaxlens as fl
    >>> class Scale(fl.Struct):
    ...   factor: float
    ...   name: str = fl.static_field(default="scale")
    >>> jax.tree_util.tree_leaves(Scale(2.0))
    [2.0]
  """
  metadata = dict(kwargs.pop("metadata", None) or {})
  metadata["static"] = True
  return dataclasses.field(metadata=metadata, **kwargs)


class Struct:
  """Base class for frozen dataclass pytrees.

  Every subclass is a frozen dataclass (identity equality, so arrays never get
  compared elementwise) and a JAX pytree whose children are its non-static fields.
  How treescope shows it is declared, not coded: `treescope_color()`, and the class
  attributes `treescope_hidden_fields` (fields left out), `treescope_short_fields`
  (fields shown in one line: a class by its name, a Linen module as
  `Dense(name='Dense_0')`) and `treescope_expanded_fields` (containers shown unfolded,
  one item per line, such as a call's `submodule_calls`); assign them without a type
  annotation, or they become fields.

  Example:
    >>> import flaxlens as fl, jax
    >>> class Pair(fl.Struct):
    ...   left: object
    ...   right: object
    >>> jax.tree_util.tree_map(lambda x: x + 1, Pair(1, 2))
    Pair(left=2, right=3)
  """

  treescope_hidden_fields: ClassVar[tuple[str, ...]] = ()
  treescope_short_fields: ClassVar[tuple[str, ...]] = ()
  treescope_expanded_fields: ClassVar[tuple[str, ...]] = ()

  # A subclass whose static fields hold only hashable values, whose `__init__` takes every
  # field and which keeps `key_for_field` may set this: JAX then flattens it in C++ (as a
  # registered dataclass) instead of calling `tree_flatten`, which matters for pytrees
  # flattened at every jitted call (frozen variable values).
  _flaxlens_flat_in_cpp: ClassVar[bool] = False

  # `(children, static)`: the names of the fields that are pytree children and of the
  # static ones, set on each subclass when it is made (flattening reads them every time).
  _struct_fields: ClassVar[tuple[tuple[str, ...], tuple[str, ...]]] = ((), ())

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    dataclasses.dataclass(frozen=True, eq=False)(cls)
    fields = dataclasses.fields(cls)
    cls._struct_fields = (
      tuple(f.name for f in fields if not f.metadata.get("static")),
      tuple(f.name for f in fields if f.metadata.get("static")),
    )
    if cls._flaxlens_flat_in_cpp:
      jax.tree_util.register_dataclass(cls)
      return
    flatten = cls.tree_flatten
    if flatten is Struct.tree_flatten:  # not overridden: JAX reads the kept pair in C
      flatten = operator.attrgetter("_flaxlens_flat")
    jax.tree_util.register_pytree_with_keys(
      cls, cls.tree_flatten_with_keys, cls.tree_unflatten, flatten
    )

  def attributes_dict(self) -> dict[str, Any]:
    """Returns the fields of this struct as a dict, in declaration order."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def from_attributes(cls, **field_values: Any) -> Self:
    """Builds an instance directly from its fields, without running `__init__`.

    Raises:
      ArgumentError: if a field is missing or an unknown one is given.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    if set(field_values) != names:
      missing = sorted(names - set(field_values))
      extra = sorted(set(field_values) - names)
      raise ArgumentError(
        f"{cls.__name__}.from_attributes needs exactly the fields {sorted(names)};"
        f" missing {missing}, unexpected {extra}. Pass every field by name, and only those."
      )
    obj = object.__new__(cls)
    for name, value in field_values.items():
      object.__setattr__(obj, name, value)
    return obj

  @classmethod
  def key_for_field(cls, name: str) -> jax.tree_util.GetAttrKey:
    """Returns the JAX path key under which the field `name` appears."""
    return jax.tree_util.GetAttrKey(name)

  def select(self):
    """Starts a selection whose only selected node is this whole struct."""
    return select(self)

  # The treedef entries of the static fields: they never change, so the entries (and
  # their hashes) are made once per instance, as jit hashes every treedef on every call.
  _flaxlens_aux = Derived(
    "aux", lambda self: tuple(_static_entry(getattr(self, n)) for n in self._struct_fields[1])
  )

  # `(children, aux)`, what flattening returns. A struct's fields never change, so the pair
  # is made once per instance, and JAX reads it with `operator.attrgetter` (C, no Python
  # frame): a tree passed to a plain `jax.jit` function is flattened at every call, at a
  # cost per node. A child field holding None or an empty read-only dict (no leaves) is
  # left out of the children and noted at the end of the aux instead (`_leafless`).
  _flaxlens_flat = Derived("flat", lambda self: self._flat_pair())

  def _flat_pair(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    children, leafless = [], []
    for i, name in enumerate(self._struct_fields[0]):
      value = getattr(self, name)
      kind = _leafless_kind(value)
      if kind is None:
        children.append(value)
      else:
        leafless.append((i, kind))
    aux = self._flaxlens_aux
    if leafless:
      aux = (*aux, (_LEAFLESS_TAG, *leafless))
    return tuple(children), aux

  def _kept_fields(self) -> list[str]:
    return [n for n in self._struct_fields[0] if _leafless_kind(getattr(self, n)) is None]

  def tree_flatten(self) -> tuple[list[Any], tuple[Any, ...]]:
    children, aux = self._flaxlens_flat
    return list(children), aux

  def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
    keyed = [(self.key_for_field(n), getattr(self, n)) for n in self._kept_fields()]
    return keyed, self._flaxlens_flat[1]

  def flaxlens_fields_level(self) -> tuple[list[tuple[Any, Any]], Any]:
    """Every child field as `(key, value)` pairs, those JAX skips (None, an empty dict)
    included, and a function rebuilding the struct from new values in the same order."""
    names = self._struct_fields[0]
    pairs = [(self.key_for_field(n), getattr(self, n)) for n in names]

    def rebuild(values: list[Any]) -> Any:
      fields = {n: getattr(self, n) for n in self._struct_fields[1]}
      fields.update(zip(names, values, strict=True))
      return type(self).from_attributes(**fields)

    return pairs, rebuild

  def __getstate__(self) -> dict[str, Any]:
    """The fields, without the values kept on this object (`core/_cache.py`)."""
    return without_kept(self.__dict__)

  @classmethod
  def tree_unflatten(cls, aux_data: tuple[Any, ...], children: Any) -> Self:
    child_names, static_names = cls._struct_fields
    children = tuple(children)
    static = aux_data
    leafless: dict[int, int] = {}
    if len(aux_data) > len(static_names):  # the note of the left-out children
      static = aux_data[: len(static_names)]
      leafless = dict(aux_data[-1][1:])
    given = iter(children)
    values = {
      n: _LEAFLESS_VALUES[leafless[i]]() if i in leafless else next(given)
      for i, n in enumerate(child_names)
    }
    if next(given, _END) is not _END:
      raise ValueError(f"{cls.__name__}: too many children to unflatten")
    values.update(
      (n, v.value if type(v) is _StaticEntry else v)
      for n, v in zip(static_names, static, strict=True)
    )
    obj = cls.from_attributes(**values)
    Struct._flaxlens_aux.seed(obj, static)
    if not any(_leafless_kind(c) is not None for c in children):  # else made when read
      Struct._flaxlens_flat.seed(obj, (children, aux_data))
    return obj

  def treescope_color(self) -> str | None:
    """The background color treescope uses for this node (None: no color)."""
    return None


class _StaticEntry:
  """Treedef entry for a static value, with its hash computed once.

  A hashable value compares by equality; an unhashable one (a Flax module holding a
  list, say) only to itself, so jit caches on the object rather than failing.
  """

  __slots__ = ("value", "_hash", "_hashable")

  def __init__(self, value: Any):
    self.value = value
    try:
      self._hash, self._hashable = hash(value), True
    except TypeError:
      self._hash, self._hashable = id(value), False

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    if type(other) is not _StaticEntry:
      return False
    if other.value is self.value:
      return True
    if not (self._hashable and other._hashable) or self._hash != other._hash:
      return False
    try:
      return bool(self.value == other.value)
    except Exception:
      return False


_PLAIN_STATIC = (str, int, float, bool, type(None))

# The aux of a struct with child fields left out ends with `(_LEAFLESS_TAG, (index, kind),
# ...)`: a plain tuple, which no static entry is (`_static_entry` wraps tuples), of the
# field's index among the children and what it held (`_LEAFLESS_VALUES`).
_LEAFLESS_TAG = "flaxlens.leafless"
_LEAFLESS_VALUES = (lambda: None, lambda: ReadOnlyDict())
_END = object()


def _leafless_kind(value: Any) -> int | None:
  """0 for None, 1 for an empty read-only dict: child values with no leaves (and no
  nodes a JAX function could act on) that flattening leaves out; None otherwise."""
  if value is None:
    return 0
  if type(value) is ReadOnlyDict and not value:
    return 1
  return None


def _static_entry(value: Any) -> Any:
  return value if type(value) in _PLAIN_STATIC else _StaticEntry(value)
