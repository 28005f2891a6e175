"""JSON encoding of the Python values an isolated call needs, with arrays kept aside.

`Encoder.encode(value)` turns a value into JSON-compatible data; arrays (and JAX keys)
are replaced by references into an array table, and code is referenced by import path
(`"package.module:Qualified.name"`), never pickled. `Decoder.decode` reverses it, importing
only the referenced classes and functions. What cannot be referenced (a closure, an
object of an unknown type) raises `ArtifactError` at save time naming where it sits.
No Flax internals here; Flax modules are dataclasses like any other.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens._errors import FlaxlensError


class ArtifactError(FlaxlensError):
  """An artifact could not be written or read; the message says what and where."""


def reference(obj: Any) -> str | None:
  """`"module:qualname"` under which `obj` can be imported again, or None."""
  module = getattr(obj, "__module__", None)
  qualname = getattr(obj, "__qualname__", None)
  if not module or not qualname or "<" in qualname:
    return None
  try:
    found = resolve(f"{module}:{qualname}")
  except ArtifactError:
    return None
  return f"{module}:{qualname}" if found is obj else None


def resolve(ref: str) -> Any:
  """Imports the object named by a `"module:qualname"` reference."""
  module_name, _, qualname = ref.partition(":")
  try:
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
      obj = getattr(obj, part)
  except (ImportError, AttributeError) as e:
    raise ArtifactError(
      f"Cannot import {ref!r} named by the artifact ({e}). Install the package that"
      " defines it (at a compatible version) where you load the artifact."
    ) from None
  return obj


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class Encoder:
  """Encodes values; collects the arrays it meets in `self.arrays`."""

  def __init__(self) -> None:
    self.arrays: dict[str, np.ndarray] = {}

  def _array(self, value: Any) -> str:
    name = f"a{len(self.arrays)}"
    self.arrays[name] = np.asarray(value)
    return name

  def encode(self, value: Any, where: str = "") -> Any:
    if value is None or isinstance(value, bool | str):
      return value
    if isinstance(value, enum.Enum):
      return {"enum": self._ref(type(value), where), "name": value.name}
    if isinstance(value, int):
      return value
    if isinstance(value, float):
      return value if math.isfinite(value) else {"float": repr(value)}
    if _is_key(value):
      impl = str(jax.random.key_impl(value))
      return {"key": self._array(jax.random.key_data(value)), "impl": impl}
    if isinstance(value, jax.Array | np.ndarray | np.generic):
      return {"array": self._array(value)}
    if isinstance(value, type) and issubclass(value, np.generic):
      return {"dtype": np.dtype(value).name}
    if isinstance(value, np.dtype):
      return {"dtype": value.name}
    if isinstance(value, tuple | list):
      items = [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
      if type(value) in (tuple, list):
        return {"tuple": items} if isinstance(value, tuple) else {"list": items}
      if hasattr(type(value), "_fields"):  # A NamedTuple.
        return {"namedtuple": self._ref(type(value), where), "tuple": items}
      raise ArtifactError(f"Cannot save {where}: a {type(value).__name__} sequence.")
    if isinstance(value, Mapping):
      encoded = {
        "dict": [
          [self.encode(k, f"{where} key"), self.encode(v, f"{where}[{k!r}]")]
          for k, v in value.items()
        ]
      }
      if type(value) is not dict:  # FrozenDict, NNX's HashableMapping, ...
        encoded["mapping"] = self._ref(type(value), where)
      return encoded
    if isinstance(value, jax.tree_util.PyTreeDef):
      return {"treedef": self._treedef(value, where)}
    if value is type(None):
      return {"none_type": True}
    if isinstance(value, functools.partial):
      return {
        "partial": self.encode(value.func, where),
        "args": self.encode(tuple(value.args), where),
        "kwargs": self.encode(dict(value.keywords), where),
      }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      return self._dataclass(value, where)
    if callable(value):
      return {"ref": self._ref(value, where)}
    raise ArtifactError(
      f"Cannot save {where or 'a value'}: a {type(value).__name__} is neither data, an"
      " array, nor importable code."
    )

  def _treedef(self, treedef: Any, where: str) -> Any:
    """A PyTreeDef as its node type, auxiliary data and children (None for a leaf)."""
    data = treedef.node_data()
    if data is None:
      return None
    node_type, aux = data
    return {
      "type": self.encode(node_type, where),
      "aux": self.encode(aux, where),
      "children": [self._treedef(c, where) for c in treedef.children()],
    }

  def _ref(self, obj: Any, where: str) -> str:
    ref = reference(obj)
    if ref is None:
      raise ArtifactError(
        f"Cannot save {where or 'a value'}: {obj!r} cannot be referenced by import (it is"
        " a closure or defined in a function). Define it at module level."
      )
    return ref

  def _dataclass(self, value: Any, where: str) -> Any:
    """Dataclasses (Flax modules included) by class and non-default init fields.

    A field still holding its default is left out and comes back from the class. An
    initializer field (`*_init`) holding a closure is left out too: Flax calls it only
    for variables that do not exist yet, and a replay reports any difference it makes.
    """
    cls = type(value)
    fields = {}
    for field in dataclasses.fields(value):
      if not field.init or field.name == "parent":
        continue
      current = getattr(value, field.name)
      if _is_default(field, current):
        continue
      if field.name.endswith("_init") and callable(current) and reference(current) is None:
        continue
      fields[field.name] = self.encode(current, f"{where}.{field.name}")
    return {"dataclass": self._ref(cls, where), "fields": fields}


def _is_default(field: dataclasses.Field, current: Any) -> bool:
  if field.default is not dataclasses.MISSING:
    default = field.default
  elif field.default_factory is not dataclasses.MISSING:
    default = field.default_factory()
  else:
    return False
  if current is default:
    return True
  try:
    return bool(type(current) is type(default) and current == default)
  except Exception:
    return False


class Decoder:
  """Decodes what `Encoder` produced, reading arrays from a table."""

  def __init__(self, arrays: Mapping[str, np.ndarray]):
    self.arrays = arrays

  def _array(self, name: str) -> np.ndarray:
    if name not in self.arrays:
      raise ArtifactError(f"The artifact refers to array {name!r}, which it does not hold.")
    return self.arrays[name]

  def decode(self, data: Any) -> Any:
    if data is None or isinstance(data, bool | str | int | float):
      return data
    if isinstance(data, list):
      raise ArtifactError("Malformed artifact: a bare list where a tagged value belongs.")
    (tag, _), *_ = data.items()
    if "array" in data:
      return jnp.asarray(self._array(data["array"]))
    if "key" in data:
      return jax.random.wrap_key_data(jnp.asarray(self._array(data["key"])), impl=data["impl"])
    if "namedtuple" in data:
      cls = resolve(data["namedtuple"])
      if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
        raise ArtifactError(f"{data['namedtuple']!r} named as a NamedTuple is not one.")
      return cls(*(self.decode(v) for v in data["tuple"]))
    if "tuple" in data:
      return tuple(self.decode(v) for v in data["tuple"])
    if "list" in data:
      return [self.decode(v) for v in data["list"]]
    if "dict" in data:
      items = {_hashable(self.decode(k)): self.decode(v) for k, v in data["dict"]}
      if "mapping" in data:
        cls = resolve(data["mapping"])
        if not (isinstance(cls, type) and issubclass(cls, Mapping)):
          raise ArtifactError(f"{data['mapping']!r} named as a mapping is not one.")
        return cls(items)
      return items
    if "float" in data:
      return float(data["float"])
    if "dtype" in data:
      return jnp.dtype(data["dtype"]).type
    if "enum" in data:
      cls = resolve(data["enum"])
      if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise ArtifactError(f"{data['enum']!r} named as an enum is not one.")
      return cls[data["name"]]
    if "treedef" in data:
      return self._treedef(data["treedef"])
    if "none_type" in data:
      return type(None)
    if "partial" in data:
      return functools.partial(
        self.decode(data["partial"]), *self.decode(data["args"]), **self.decode(data["kwargs"])
      )
    if "ref" in data:
      obj = resolve(data["ref"])
      if not callable(obj):
        raise ArtifactError(f"{data['ref']!r} named as a function is not callable.")
      return obj
    if "dataclass" in data:
      cls = resolve(data["dataclass"])
      if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ArtifactError(f"{data['dataclass']!r} named as a dataclass is not one.")
      return cls(**{k: self.decode(v) for k, v in data["fields"].items()})
    raise ArtifactError(f"Malformed artifact: unknown value tag {tag!r}.")

  def _treedef(self, data: Any) -> Any:
    if data is None:
      return jax.tree_util.tree_structure(0)
    children = [self._treedef(c) for c in data["children"]]
    node = (self.decode(data["type"]), self.decode(data["aux"]))
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
      jax.tree_util.default_registry, node, children
    )


def _hashable(key: Any) -> Any:
  return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
