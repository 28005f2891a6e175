"""JSON encoding of the Python values an isolated call needs, with arrays kept aside.

`Encoder.encode(value)` turns a value into JSON-compatible data: plain data as itself,
containers, arrays and keys (by name in an array table) by a tag, functions and classes
by import reference, and every other object through a registered `ValueCodec` (enums,
NamedTuples, mappings, dataclasses and Flax modules, `functools.partial`, dtypes, Hugging
Face configs; `register_value_codec` adds more) as `{"object": codec, "class": ref, "data":
value}`, as the `values` schema of `schemas/` states. Loading is in two steps: once the
schema has accepted the JSON, `collect` lists each reference with the role it plays and
checks each object's codec, without importing anything; `Decoder` then rebuilds values
from references the loading policy (`_policy`) has already imported and checked. No Flax
internals here; Flax modules are dataclasses like any other.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens._compat import pytrees
from flaxlens.errors import ArtifactError
from flaxlens.tools.files._policy import (
  LoadPolicy,
  package_of,
  reference,
  resolve_imported,
  unsafe,
)
from flaxlens.tools.files._schemas import schema

# Array dtypes an artifact may hold, by numpy name (no object, void or structured dtypes).
DTYPES = frozenset(schema("values")["$defs"]["dtype"]["enum"])
# PRNG implementations a saved key may use (the schema's `key_impl`), with the shape of one
# key's data.
KEY_IMPLS = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}


@dataclasses.dataclass(frozen=True)
class ValueCodec:
  """How objects of one kind are saved as data and rebuilt; see `register_value_codec`.

  `role` names the loading-policy check a saved class must pass after import and before
  `from_data` runs ("subclass": a subclass of `base`; None: the codec has one fixed type
  and saves no class). `base` is a class or a `"module:qualname"` string, so that a codec
  for an optional library does not import it.
  """

  name: str
  matches: Callable[[Any], bool]
  to_data: Callable[[Any], Any]
  from_data: Callable[[Any, Any], Any]
  role: str | None = "subclass"
  base: type | str | None = None


_CODECS: list[ValueCodec] = []


def register_value_codec(
  name: str,
  base: type | str,
  to_data: Callable[[Any], Any],
  from_data: Callable[[type, Any], Any],
) -> None:
  """Lets artifacts hold objects of `base` (and its subclasses) as plain data.

  Saving records the object's class by import reference and `to_data(obj)`, which must be
  savable itself (numbers, strings, lists, dicts, arrays, or objects another codec
  saves). Loading imports the class only if its package is allowed
  (`load_isolated(..., allow=[...])`), checks that it subclasses `base`, and calls
  `from_data(cls, data)`. Codecs registered later are tried first; a name registered again
  replaces the earlier codec. Register the codec in the loading process too.

  Args:
    name: stored in the artifact as the object's codec; choose a unique, stable name.
    base: the class (or `"module:qualname"`, imported only when needed) the codec handles.
    to_data: object -> data.
    from_data: (class, data) -> object.

  Example:
    >>> import fractions, tempfile, flax.linen as nn, jax, jax.numpy as jnp
    >>> import flaxlens as fl
    >>> fl.register_value_codec(
    ...   "fraction", fractions.Fraction,
    ...   to_data=lambda f: [f.numerator, f.denominator],
    ...   from_data=lambda cls, data: cls(*data))
    >>> model = nn.Dropout(fractions.Fraction(1, 4), deterministic=False)
    >>> x, rngs = jnp.ones((2, 3)), {"dropout": jax.random.key(1)}
    >>> tree = fl.unflaxify(model, {}, x, rngs=rngs)
    >>> isolated = fl.isolate(tree, x, "", random_streams=rngs)
    >>> path = tempfile.mkdtemp() + "/dropout"
    >>> fl.save_isolated(isolated, path)
    >>> loaded = fl.load_isolated(path, allow=["fractions"])
    >>> loaded.submodel.module.rate, bool(loaded.replay())
    (Fraction(1, 4), True)
  """
  if not isinstance(name, str) or not name or name in _BUILTIN_NAMES:
    raise ArtifactError(f"A value codec needs a new, non-empty name; {name!r} is taken.")
  _CODECS[:] = [c for c in _CODECS if c.name != name]
  _CODECS.insert(
    0,
    ValueCodec(
      name,
      matches=lambda value: _isinstance_lazy(value, base),
      to_data=to_data,
      from_data=from_data,
      base=base,
    ),
  )


def _isinstance_lazy(value: Any, base: type | str) -> bool:
  """isinstance for a base given by reference: False while its package is not imported."""
  if isinstance(base, str):
    if package_of(base) not in sys.modules:
      return False
    base = resolve_imported(base)
  return isinstance(value, base)


def _is_namedtuple_value(value: Any) -> bool:
  return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _namedtuple(cls: type, items: Any) -> Any:
  if not isinstance(items, list) or len(items) != len(cls._fields):
    raise ArtifactError(f"{cls.__name__} has {len(cls._fields)} fields, not {len(items)}.")
  return tuple.__new__(cls, items)  # No user code runs, unlike a custom __new__.


def _dtype(_: Any, name: Any) -> Any:
  if not (isinstance(name, str) and name in DTYPES):
    raise ArtifactError(f"{name!r} is not a dtype an artifact may hold ({sorted(DTYPES)}).")
  return jnp.dtype(name).type


def _partial(_: Any, data: Any) -> Any:
  if not (isinstance(data, list) and len(data) == 3 and callable(data[0])):
    raise ArtifactError("a partial's data must be [function, args, kwargs].")
  func, args, kwargs = data
  return functools.partial(func, *args, **kwargs)


def _hf_config_to_data(config: Any) -> Any:
  return config.to_dict()


def _hf_config_from_data(cls: Any, data: Any) -> Any:
  return cls.from_dict(data)


def _dataclass_fields(value: Any) -> dict[str, Any]:
  """Init fields that differ from their defaults (a Linen module's `parent` left out).

  An initializer field (`*_init`) holding a closure is left out too: Flax calls it only for
  variables that do not exist yet, and a replay reports any difference it makes.
  """
  fields = {}
  for field in dataclasses.fields(value):
    if not field.init or field.name == "parent":
      continue
    current = getattr(value, field.name)
    if _is_default(field, current):
      continue
    if field.name.endswith("_init") and callable(current) and reference(current) is None:
      continue
    fields[field.name] = current
  return fields


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


def _construct(cls: Any, fields: Any) -> Any:
  if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
    raise ArtifactError("a dataclass's data must map field names to values.")
  return cls(**fields)


_BUILTIN = [
  ValueCodec(
    "hf_config",
    matches=lambda v: _isinstance_lazy(v, "transformers:PretrainedConfig"),
    to_data=_hf_config_to_data,
    from_data=_hf_config_from_data,
    base="transformers:PretrainedConfig",
  ),
  ValueCodec(
    "enum",
    matches=lambda v: isinstance(v, enum.Enum),
    to_data=lambda v: v.name,
    from_data=lambda cls, name: cls.__members__[name],
    role="enum",
  ),
  ValueCodec(
    "namedtuple",
    matches=_is_namedtuple_value,
    to_data=list,
    from_data=_namedtuple,
    role="namedtuple",
  ),
  ValueCodec(
    "partial",
    matches=lambda v: type(v) is functools.partial,
    to_data=lambda v: [v.func, tuple(v.args), dict(v.keywords)],
    from_data=_partial,
    role=None,
  ),
  ValueCodec(
    "dtype",
    matches=lambda v: (
      isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic))
    ),
    to_data=lambda v: np.dtype(v).name,
    from_data=_dtype,
    role=None,
  ),
  ValueCodec(
    "mapping",
    matches=lambda v: isinstance(v, Mapping) and type(v) is not dict,
    to_data=dict,
    from_data=lambda cls, items: cls(items),
    role="mapping",
  ),
  ValueCodec(
    "dataclass",
    matches=lambda v: dataclasses.is_dataclass(v) and not isinstance(v, type),
    to_data=_dataclass_fields,
    from_data=_construct,
    role="dataclass",
  ),
]
_BUILTIN_NAMES = frozenset(c.name for c in _BUILTIN)


def _codecs() -> list[ValueCodec]:
  return [*_CODECS, *_BUILTIN]


def _codec(name: str) -> ValueCodec | None:
  return next((c for c in _codecs() if c.name == name), None)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_nnx_object(x: Any) -> bool:
  """An NNX graph object (a module, an `nnx.Rngs`, a variable): not savable as a value."""
  return _isinstance_lazy(x, "flax.nnx:Pytree") or _isinstance_lazy(x, "flax.nnx:Variable")


class Encoder:
  """Encodes values; collects the arrays it meets in `self.arrays`."""

  def __init__(self) -> None:
    self.arrays: dict[str, np.ndarray] = {}

  def operand_array(self, value: Any) -> str:
    name = f"a{len(self.arrays)}"
    self.arrays[name] = np.asarray(value)
    return name

  def encode(self, value: Any, where: str = "") -> Any:
    if value is None or isinstance(value, bool | str):
      return value
    if isinstance(value, int) and not isinstance(value, enum.Enum):
      return value
    if isinstance(value, float):
      return value if math.isfinite(value) else {"float": repr(value)}
    if _is_key(value):
      impl = str(jax.random.key_impl(value))
      return {"key": self.operand_array(jax.random.key_data(value)), "impl": impl}
    if isinstance(value, jax.Array | np.ndarray | np.generic):
      return {"array": self.operand_array(value)}
    if type(value) in (tuple, list):
      tag = "tuple" if isinstance(value, tuple) else "list"
      return {tag: [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if type(value) is dict:
      return {"dict": self._pairs(value, where)}
    if isinstance(value, jax.tree_util.PyTreeDef):
      return {"treedef": self._treedef(value, where)}
    if value is type(None):
      return {"none_type": True}
    for codec in _codecs():
      if codec.matches(value):
        return self._object(codec, value, where)
    if _is_nnx_object(value):
      raise ArtifactError(
        f"Cannot save {where or 'a value'}: it is an NNX object ({type(value).__name__}),"
        " which an artifact holds only as the isolated model's own state, not as a value."
        " Isolate a call that receives arrays or JAX keys instead: keep the nnx.Rngs (or"
        " module) in the model, whose keys and counts are saved with it, or pass keys"
        " (rngs.dropout())."
      )
    if callable(value):
      return {"ref": self._ref(value, where)}
    raise ArtifactError(
      f"Cannot save {where or 'a value'}: a {type(value).__name__} is neither data, an"
      " array, nor importable code. Register how to save it with fl.register_value_codec."
    )

  def _pairs(self, value: Mapping, where: str) -> list:
    return [
      [self.encode(k, f"{where} key"), self.encode(v, f"{where}[{k!r}]")] for k, v in value.items()
    ]

  def _object(self, codec: ValueCodec, value: Any, where: str) -> dict:
    data = codec.to_data(value)
    if codec.name == "dataclass":  # Field by field, so errors name the field.
      encoded_data = {"dict": [[k, self.encode(v, f"{where}.{k}")] for k, v in data.items()]}
    else:
      encoded_data = self.encode(data, where)
    if codec.role is None:
      return {"object": codec.name, "data": encoded_data}
    return {"object": codec.name, "class": self._ref(type(value), where), "data": encoded_data}

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
    why = unsafe(ref)
    if why is not None:
      raise ArtifactError(
        f"Cannot save {where or 'a value'}: {obj!r} is {ref!r}, and {why}, so loading never"
        f" accepts a reference into {package_of(ref)}. Use a function of jax.numpy or"
        " jax.nn (jnp.abs for abs), or define one in a module of your own."
      )
    return ref


@dataclasses.dataclass
class Found:
  """What `collect` found in a value: references with their roles, and array names."""

  references: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
  arrays: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> "array"|impl


def _malformed(where: str, what: str) -> ArtifactError:
  return ArtifactError(f"Malformed artifact at {where}: {what}.")


def _tag(data: dict) -> str:
  """The tag of an encoded value the schema accepted (`key` goes with `impl`, `object`
  with `class` and `data`, in any order)."""
  return next(tag for tag in _TAGS if tag in data)


_TAGS = ("tuple", "list", "dict", "float", "array", "key", "treedef", "none_type", "ref", "object")


def collect(data: Any, where: str, found: Found) -> None:
  """Lists the references and arrays of an encoded value that the `values` schema accepted,
  and checks what the schema cannot: each object's codec is registered and has a class
  exactly if it saves one. Imports nothing."""
  if not isinstance(data, dict):
    return
  tag = _tag(data)
  if tag in ("tuple", "list"):
    for i, item in enumerate(data[tag]):
      collect(item, f"{where}[{i}]", found)
  elif tag == "dict":
    for key, value in data["dict"]:
      collect(value, f"{where}[{key!r}]", found)
  elif tag in ("array", "key"):
    found.arrays[data[tag]] = data.get("impl", "array")
  elif tag == "ref":
    found.references.append((data["ref"], "value", where))
  elif tag == "treedef":
    _collect_treedef(data["treedef"], where, found)
  elif tag == "object":
    _collect_object(data, where, found)


def _collect_treedef(data: Any, where: str, found: Found) -> None:
  if data is None:
    return
  collect(data["type"], where, found)
  collect(data["aux"], where, found)
  for child in data["children"]:
    _collect_treedef(child, where, found)


def _collect_object(data: dict, where: str, found: Found) -> None:
  codec = _codec(data["object"])
  if codec is None:
    raise _malformed(
      where,
      f"no value codec named {data['object']!r} (one registered with"
      " fl.register_value_codec must be registered before loading too)",
    )
  if ("class" in data) != (codec.role is not None):
    saves = "saves" if codec.role is not None else "saves no"
    raise _malformed(
      where, f"the {codec.name!r} codec {saves} class, but the object disagrees; it is corrupted"
    )
  if codec.role is not None:
    if isinstance(codec.base, str):
      found.references.append((codec.base, "value", f"{where} (base of {codec.name})"))
    found.references.append((data["class"], f"codec:{codec.name}", where))
  collect(data["data"], f"{where}.data", found)


class Decoder:
  """Rebuilds values that `collect` accepted, from checked references and read arrays."""

  def __init__(self, arrays: Mapping[str, np.ndarray], resolved: Mapping[str, Any]):
    self.arrays = arrays
    self.resolved = resolved

  def decode(self, data: Any, where: str = "") -> Any:
    if data is None or isinstance(data, bool | str | int | float):
      return data
    tag = _tag(data)
    if tag == "tuple":
      return tuple(self.decode(v, where) for v in data["tuple"])
    if tag == "list":
      return [self.decode(v, where) for v in data["list"]]
    if tag == "dict":
      return {_hashable(k): self.decode(v, where) for k, v in data["dict"]}
    if tag == "float":
      return float(data["float"])
    if tag == "array":
      return jnp.asarray(self.arrays[data["array"]])
    if tag == "key":
      return jax.random.wrap_key_data(jnp.asarray(self.arrays[data["key"]]), impl=data["impl"])
    if tag == "none_type":
      return type(None)
    if tag == "ref":
      return self.resolved[data["ref"]]
    if tag == "treedef":
      return self._treedef(data["treedef"], where)
    codec = _codec(data["object"])
    cls = None if codec.role is None else self.resolved[data["class"]]
    value = self.decode(data["data"], where)
    try:
      return codec.from_data(cls, value)
    except ArtifactError as e:
      raise ArtifactError(f"Malformed artifact at {where}: {e}") from None
    except KeyboardInterrupt:
      raise
    except BaseException as e:  # An allowed class's constructor that exits, too.
      raise ArtifactError(
        f"The artifact's {codec.name} object at {where} cannot be rebuilt from its data"
        f" ({type(e).__name__}: {e}); it is corrupted or was written for another version."
      ) from None

  def _treedef(self, data: Any, where: str) -> Any:
    if data is None:
      return jax.tree_util.tree_structure(0)
    children = [self._treedef(c, where) for c in data["children"]]
    node = (self.decode(data["type"], where), self.decode(data["aux"], where))
    try:
      return pytrees.FROM_NODE_DATA_AND_CHILDREN()(jax.tree_util.default_registry, node, children)
    except (TypeError, ValueError) as e:
      raise ArtifactError(
        f"Malformed artifact at {where}: not a pytree definition ({e})."
      ) from None


def _hashable(key: Any) -> Any:
  if isinstance(key, dict):
    return tuple(_hashable(k) for k in key["tuple"])
  return key


def resolve_references(
  policy: LoadPolicy, references: list[tuple[str, str, str]]
) -> dict[str, Any]:
  """Imports every reference (packages already checked) and checks its role; those into
  allowed packages are imported first (`LoadPolicy.import_allowed`)."""
  policy.import_allowed(references)
  resolved: dict[str, Any] = {}
  for ref, role, where in references:
    if role.startswith("codec:"):
      codec = _codec(role.partition(":")[2])
      if codec.role == "subclass":
        base = codec.base if isinstance(codec.base, type) else resolved[codec.base]
        obj = policy.resolve(ref, "subclass", where, base=base)
      else:
        obj = policy.resolve(ref, codec.role, where)
    else:
      obj = policy.resolve(ref, role, where)
    resolved[ref] = obj
  return resolved
