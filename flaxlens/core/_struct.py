"""Struct: the frozen dataclass pytree that every flaxlens tree is built from.

Subclassing `Struct` turns the class into a frozen dataclass and registers it with JAX
as a keyed pytree, so `jax.tree_util` paths read `.field_name`. Fields are pytree
children unless declared with `static_field()`, in which case they travel in the
treedef (and must therefore be hashable, as jit caches on them). No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, ClassVar, Self

import jax

from flaxlens.core._cache import Derived, without_kept
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
  attributes `treescope_hidden_fields` (fields left out) and `treescope_short_fields`
  (fields shown in one line: a class by its name, a Linen module as
  `Dense(name='Dense_0')`); assign them without a type annotation, or they become fields.

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
  # frame): a tree passed to a plain `jax.jit` function is flattened at every call.
  _flaxlens_flat = Derived(
    "flat",
    lambda self: (tuple(getattr(self, n) for n in self._struct_fields[0]), self._flaxlens_aux),
  )

  def tree_flatten(self) -> tuple[list[Any], tuple[Any, ...]]:
    children, aux = self._flaxlens_flat
    return list(children), aux

  def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
    keyed = [(self.key_for_field(n), getattr(self, n)) for n in self._struct_fields[0]]
    return keyed, self._flaxlens_aux

  def __getstate__(self) -> dict[str, Any]:
    """The fields, without the values kept on this object (`core/_cache.py`)."""
    return without_kept(self.__dict__)

  @classmethod
  def tree_unflatten(cls, aux_data: tuple[Any, ...], children: Any) -> Self:
    child_names, static_names = cls._struct_fields
    children = tuple(children)
    values = dict(zip(child_names, children, strict=True))
    values.update(
      (n, v.value if type(v) is _StaticEntry else v)
      for n, v in zip(static_names, aux_data, strict=True)
    )
    obj = cls.from_attributes(**values)
    Struct._flaxlens_aux.seed(obj, aux_data)
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


def _static_entry(value: Any) -> Any:
  return value if type(value) in _PLAIN_STATIC else _StaticEntry(value)
