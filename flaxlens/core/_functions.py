"""Functions given to compiled tools, keyed by what they compute instead of their identity.

`jax.jit` keys a function argument on the function object, so a metric written as a new
`lambda` at every call (in a loop, in a helper) traces and compiles again although it
computes the same thing. `traced_function(fn, ...)` makes a pytree of `fn` whose
static part is its code, its module's globals (by identity), the values of the globals
it reads, and the values it closes over and has as defaults, and whose leaves are the
arrays among those values: two functions with equal code and equal closed-over values
share one compiled program, and closing over a new array of the same shape and dtype is
a new input, not a new program. Python numbers
and strings are compared by value (they are baked into the program); any other object
(a list, a module, a model) by identity, as `jax.jit` compares it. When a function with
the code of one traced before is traced again for another value, `MetricRetraceWarning`
says once, per code and tool, which value made the difference. No Flax internals here.
"""

from __future__ import annotations

import collections
import dis
import functools
import hashlib
import inspect
import os
import sys
import sysconfig
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from flaxlens.core._jit import variable_jit
from flaxlens.errors import FlaxlensError, MetricRetraceWarning

_ARRAY = ("array",)
_ARRAYS = (jax.Array, np.ndarray, np.generic)
_VALUES = (int, str, bytes, bool, type(None))
_MAX_DEPTH = 8  # Values read through values: deeper ones by identity.
_MAX_ITEMS = 64  # A global list or dict with more items is compared by identity.


class _Same:
  """An object compared by identity (and kept alive while its key is)."""

  __slots__ = ("obj",)

  def __init__(self, obj: Any):
    self.obj = obj

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Same) and self.obj is other.obj

  def __hash__(self) -> int:
    return id(self.obj)

  def __repr__(self) -> str:
    return f"the object {_short(self.obj)}"


def _short(obj: Any) -> str:
  text = repr(obj)
  return text if len(text) <= 60 else text[:57] + "..."


def _float_key(x: float) -> Any:
  return (type(x), x.hex())  # -0.0 and nan compare as themselves.


@functools.lru_cache(maxsize=1024)
def _writes_cells(code: types.CodeType) -> bool:
  """Whether `code` (or code nested in it) assigns a closed-over name (`nonlocal`)."""
  for instruction in dis.get_instructions(code):
    if instruction.opname in ("STORE_DEREF", "DELETE_DEREF") and instruction.argval in (
      code.co_freevars
    ):
      return True
  return any(_writes_cells(c) for c in code.co_consts if isinstance(c, types.CodeType))


def _describe(value: Any, leaves: list[Any] | None, depth: int) -> Any:
  """The static key of `value`; its arrays are appended to `leaves` (None: arrays are
  compared by identity, their values baked into the program)."""
  if isinstance(value, _ARRAYS):
    if leaves is None:
      return _Same(value)
    leaves.append(value)
    return _ARRAY
  kind = type(value)
  if kind in _VALUES:
    return (kind, value)
  if kind is float:
    return _float_key(value)
  if kind is complex:
    return ("complex", _float_key(value.real), _float_key(value.imag))
  if depth < _MAX_DEPTH:
    if kind is tuple:
      return ("tuple", tuple(_describe(v, leaves, depth + 1) for v in value))
    if kind is types.FunctionType:
      return _describe_function(value, leaves, depth)
    if kind is types.MethodType:
      return ("method", _Same(value.__self__), _describe(value.__func__, leaves, depth + 1))
    if kind is functools.partial and not value.__dict__:
      return (
        "partial",
        _describe(value.func, leaves, depth + 1),
        tuple(_describe(v, leaves, depth + 1) for v in value.args),
        tuple((k, _describe(v, leaves, depth + 1)) for k, v in value.keywords.items()),
      )
  return _Same(value)


def _describe_function(fn: types.FunctionType, leaves: list[Any] | None, depth: int) -> Any:
  code = fn.__code__
  if fn.__dict__ or _writes_cells(code):
    return _Same(fn)
  try:
    reads = function_reads(fn)
  except ValueError:  # An empty cell (a name not assigned yet): the function as it is.
    return _Same(fn)
  parts: list[tuple[str, Any]] = []
  for name, value in reads.closure:
    parts.append((f"closure variable {name!r}", _describe(value, leaves, depth + 1)))
  for name, default in (*reads.defaults, *reads.keyword_defaults):
    parts.append((f"default of {name!r}", _describe(default, leaves, depth + 1)))
  # The globals it reads, by value: a lambda in a loop at a module's top level reads the
  # loop variable as a global, and the program bakes in what it read when traced.
  for name, value in reads.globals:
    parts.append((f"global {name!r}", _describe_global(value, depth + 1)))
  return ("function", code, _Same(fn.__globals__), tuple(parts))


class FunctionReads(NamedTuple):
  """What a function computes with besides its arguments, each value by its name, in the
  order both fingerprints of a function (`traced_function`'s key, `StableText`) read it.

  Attributes:
    closure: the values it closes over, by variable, in `co_freevars` order.
    defaults: its positional parameters' defaults, in order.
    keyword_defaults: its keyword-only parameters' defaults, sorted by name.
    globals: the globals it may read (`global_names`) that its module holds, sorted.
  """

  closure: tuple[tuple[str, Any], ...]
  defaults: tuple[tuple[str, Any], ...]
  keyword_defaults: tuple[tuple[str, Any], ...]
  globals: tuple[tuple[str, Any], ...]


def function_reads(fn: types.FunctionType) -> FunctionReads:
  """The one walk over what `fn` reads (see `FunctionReads`).

  Raises:
    ValueError: `fn` closes over a variable not assigned yet (an empty cell).
  """
  code = fn.__code__
  closure = tuple(
    (name, cell.cell_contents)
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True)
  )
  positional = code.co_varnames[: code.co_argcount]
  defaults = fn.__defaults__ or ()
  named_defaults = tuple(zip(positional[len(positional) - len(defaults) :], defaults, strict=True))
  keyword_defaults = tuple(sorted((fn.__kwdefaults__ or {}).items()))
  namespace = fn.__globals__
  read = tuple((name, namespace[name]) for name in global_names(code) if name in namespace)
  return FunctionReads(closure, named_defaults, keyword_defaults, read)


@functools.lru_cache(maxsize=1024)
def global_names(code: types.CodeType) -> tuple[str, ...]:
  """The names `code` (or code nested in it) may read as globals, sorted. `co_names`
  holds attribute names too: a global that shares an attribute's name is keyed as well,
  which costs a retrace at most, never a wrong result."""
  names = set(code.co_names)
  for constant in code.co_consts:
    if isinstance(constant, types.CodeType):
      names.update(global_names(constant))
  return tuple(sorted(names))


def _describe_global(value: Any, depth: int) -> Any:
  """The key of a global a function reads: as `_describe` with arrays by identity (their
  values are baked into the program, as `jax.jit` bakes a global array), and small lists
  and dicts by their items (a global read at trace time is not an input of the program,
  so a container changed in place must give a new key)."""
  kind = type(value)
  if kind in (list, dict) and len(value) <= _MAX_ITEMS and depth < _MAX_DEPTH:
    items = value.items() if kind is dict else enumerate(value)
    return (
      kind.__name__,
      tuple((_describe(k, None, depth + 1), _describe_global(v, depth + 1)) for k, v in items),
    )
  return _describe(value, None, depth)


def _has_arrays(key: Any) -> bool:
  if key is _ARRAY:
    return True
  if isinstance(key, tuple):
    return any(_has_arrays(k) for k in key)
  return False


def _rebuild(value: Any, key: Any, leaves: Any) -> Any:
  """`value` with the arrays its key counted replaced by the next of `leaves`."""
  if key is _ARRAY:
    return next(leaves)
  if not _has_arrays(key):
    return value
  kind = key[0]
  if kind == "tuple":
    return tuple(_rebuild(v, k, leaves) for v, k in zip(value, key[1], strict=True))
  if kind == "method":
    return types.MethodType(_rebuild(value.__func__, key[2], leaves), value.__self__)
  if kind == "partial":
    func = _rebuild(value.func, key[1], leaves)
    args = [_rebuild(v, k, leaves) for v, k in zip(value.args, key[2], strict=True)]
    keywords = {n: _rebuild(value.keywords[n], k, leaves) for n, k in key[3]}
    return functools.partial(func, *args, **keywords)
  fn: types.FunctionType = value
  parts = iter(key[3])
  cells = tuple(
    types.CellType(_rebuild(cell.cell_contents, k, leaves)) if _has_arrays(k) else cell
    for cell, (_, k) in zip(fn.__closure__ or (), parts, strict=False)
  )
  defaults = tuple(_rebuild(d, next(parts)[1], leaves) for d in fn.__defaults__ or ())
  kwdefaults = {
    name: _rebuild(fn.__kwdefaults__[name], next(parts)[1], leaves)
    for name in sorted(fn.__kwdefaults__ or {})
  }
  out = types.FunctionType(
    fn.__code__, fn.__globals__, fn.__name__, defaults or None, cells or None
  )
  out.__kwdefaults__ = kwdefaults or None
  out.__qualname__ = fn.__qualname__
  return out


class _Key:
  """The static part of a `TracedFunction`: compared by its key; holds the function."""

  __slots__ = ("key", "fn", "argument", "tool", "_hash")

  def __init__(self, key: Any, fn: Callable, argument: str, tool: str):
    self.key, self.fn, self.argument, self.tool = key, fn, argument, tool
    self._hash = hash((key, argument, tool))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    return (
      isinstance(other, _Key)
      and self._hash == other._hash
      and self.argument == other.argument
      and self.tool == other.tool
      and self.key == other.key
    )


class TracedFunction:
  """A function as a pytree: its arrays are leaves, the rest of it is static.

  Calling it calls the function; under a trace, with the arrays it closes over replaced
  by the traced leaves. Made by `traced_function`.
  """

  __slots__ = ("static", "leaves", "_fn")

  def __init__(self, static: _Key, leaves: list[Any]):
    self.static = static
    self.leaves = leaves
    self._fn: Callable | None = None

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if self._fn is None:
      static = self.static
      self._fn = _rebuild(static.fn, static.key, iter(self.leaves))
      _note_trace(static)
    return self._fn(*args, **kwargs)


jax.tree_util.register_pytree_node(
  TracedFunction,
  lambda f: (f.leaves, f.static),
  lambda static, leaves: TracedFunction(static, list(leaves)),
)


def traced_function(
  fn: Callable, argument: str, tool: str, *, arrays_as_inputs: bool = True
) -> TracedFunction:
  """`fn` as a pytree keyed by its code and the values it closes over (see the module).

  Args:
    fn: the function (a metric, say).
    argument: the name of the argument it was given as (`"metric"`), for the warning.
    tool: the public function it was given to (`"fl.sweep"`), for the warning.
    arrays_as_inputs: whether the arrays it closes over are leaves (inputs of the
      program) or, for a function that needs their values while traced, compared by
      identity and baked in.
  """
  leaves: list[Any] | None = [] if arrays_as_inputs else None
  key = _describe(fn, leaves, 0)
  return TracedFunction(_Key(key, fn, argument, tool), leaves or [])


def jit_keyed_on_function(fn: Callable, parameter: str, tool: str, argument: str = "metric") -> Any:
  """`fl.variable_jit(fn)`, with the function passed as `fn`'s `parameter` keyed by what it
  computes (`traced_function`) instead of its identity, through `call_with_function`.

  Args:
    fn: the function to compile; its `parameter` takes a function (a metric).
    parameter: the name of that parameter in `fn`'s signature.
    tool: the public function that calls it (`"fl.sweep"`), for the warning.
    argument: the name users give that function as (`"metric"`), for the warning.
  """
  jitted = variable_jit(fn)
  position = list(inspect.signature(fn).parameters).index(parameter)

  @functools.wraps(fn)
  def wrapper(*args: Any) -> Any:
    def call(traced: TracedFunction) -> Any:
      return jitted(*args[:position], traced, *args[position + 1 :])

    return call_with_function(args[position], argument, tool, call)

  return wrapper


def call_with_function(fn: Callable, argument: str, tool: str, call: Callable) -> Any:
  """`call(traced_function(fn, ...))`; where tracing needs the value of an array `fn`
  closes over (JAX raises a `ConcretizationTypeError`, or an `IndexError` or `TypeError`
  for a traced slice bound or shape), called again with those arrays baked in, and so
  from then on for functions of that code."""
  code = getattr(fn, "__code__", None)
  if code not in _needs_values:
    traced = traced_function(fn, argument, tool)
    if not traced.leaves:
      return call(traced)
    site = (tool, argument, _site(traced.static.key))
    with _lock:
      last = _last.get(site)
    try:
      return call(traced)
    except FlaxlensError:
      raise
    except _NEEDS_VALUE:
      with _lock:  # The failed trace is not one to compare with.
        _last.pop(site, None)
        if last is not None:
          _last[site] = last
      out = call(traced_function(fn, argument, tool, arrays_as_inputs=False))
      if code is not None:
        _needs_values.add(code)
      return out
  return call(traced_function(fn, argument, tool, arrays_as_inputs=False))


_NEEDS_VALUE = (jax.errors.ConcretizationTypeError, IndexError, TypeError)
_needs_values: set[Any] = set()  # Codes that read the value of an array they close over.
_lock = threading.Lock()
_last: collections.OrderedDict[Any, Any] = collections.OrderedDict()  # site -> last key
_warned: set[Any] = set()
_MAX_SITES = 256


def _site(key: Any) -> Any:
  """What keys of "the same function" share: its code (a callable object: its class)."""
  if isinstance(key, _Same):
    return type(key.obj)
  if key[0] == "function":
    return key[1]
  return (key[0], _site(key[2] if key[0] == "method" else key[1]))


def _note_trace(static: _Key) -> None:
  """Warns once per code and tool when a function of known code is traced for new values."""
  key = static.key
  site = (static.tool, static.argument, _site(key))
  with _lock:
    before = _last.get(site)
    _last[site] = key
    _last.move_to_end(site)
    while len(_last) > _MAX_SITES:
      _last.popitem(last=False)
    if before is None or before == key or site in _warned:
      return
    _warned.add(site)
  warnings.warn(
    MetricRetraceWarning(
      f"{static.tool}: {static.argument}= is traced and compiled again: it has the code"
      f" of the {static.argument} of an earlier call, but {_difference(before, key)}."
      f" {_FIX}"
    ),
    stacklevel=_caller_level(),
  )


@functools.cache
def _library_folders() -> tuple[str, ...]:
  """The folders of flaxlens, JAX and the standard library (each ending in a separator)."""
  flaxlens = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  folders = (flaxlens, os.path.dirname(jax.__file__), sysconfig.get_paths()["stdlib"])
  return tuple(os.path.join(os.path.realpath(f), "") for f in folders)


def _caller_level() -> int:
  """The `stacklevel` of the first frame outside flaxlens, JAX and the standard library."""
  skipped = _library_folders()
  frame, level = sys._getframe(1), 1
  while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(skipped):
    frame, level = frame.f_back, level + 1
  return level


_FIX = (
  "Arrays a function closes over are inputs of the compiled program, Python numbers and"
  " strings (closed over or read as globals) are baked into it, other objects are compared"
  " by identity: close over jnp.asarray(value) for a number that changes, and reuse the"
  " same objects."
)


def _difference(before: Any, after: Any) -> str:
  """What differs between two keys of the same site, in words."""
  if isinstance(before, _Same) or isinstance(after, _Same):
    return "it is another object (compared by identity)"
  kind = before[0]
  if kind == "method":
    if before[1] != after[1]:
      return "it is a method of another object (compared by identity)"
    return _difference(before[2], after[2])
  if kind == "partial":
    if before[1] != after[1]:
      return _difference(before[1], after[1])
    return "its partial's arguments differ"
  if before[2] != after[2]:
    return "it was defined in another module (its globals differ)"
  for (label, old), (_, new) in zip(before[3], after[3], strict=True):
    if old == new:
      continue
    if _is_function(old) and _is_function(new):
      if old[1] != new[1]:
        return f"its {label} is a function of other code"
      return f"its {label} is a function whose {_difference(old, new).removeprefix('its ')}"
    return f"its {label} differs ({_shown(old)}, now {_shown(new)})"
  return "it differs"


def _is_function(key: Any) -> bool:
  return isinstance(key, tuple) and key[0] == "function"


def _shown(key: Any) -> str:
  if isinstance(key, _Same):
    return repr(key)
  if key is _ARRAY:
    return "an array"
  if len(key) == 2 and isinstance(key[0], type):
    kind, value = key
    return repr(float.fromhex(value) if kind is float else value)
  return f"a {key[0]}"


class StableText:
  """Functions and values as text that is the same in every process and every run for the
  same computation (where `traced_function`'s key compares objects by identity, within
  one process): a function by its qualified name, the hash of its code and the values it
  reads (`function_reads`); a `functools.partial` by its function and arguments, a method
  by its function and its object's attributes, an object with `__call__` by its class's
  `__call__` and its attributes. Numbers, strings and None by value, arrays by
  `array_text`, tuples, lists and dicts of at most 64 items by their items, functions in
  turn, modules by name, anything else by type (not its module's name, which differs
  between a script and its import).

  Example:
    >>> from flaxlens.core._functions import StableText
    >>> text = StableText(lambda array: f"array{array.shape}")
    >>> def scaled(scale):
    ...   return lambda x: x * scale
    >>> same, other = text.function(scaled(2.0)), text.function(scaled(3.0))
    >>> same == text.function(scaled(2.0)), other == same
    (True, False)
    >>> text.values([1, "a", None, (2.5,)])
    "1,'a',None,[2.5]"
  """

  def __init__(self, array_text: Callable[[Any], str]):
    self.array_text = array_text

  def function(self, fn: Any, depth: int = 0) -> str:
    """`fn` as text (see the class)."""
    if depth > _MAX_TEXT_DEPTH:
      return type(fn).__qualname__
    if isinstance(fn, functools.partial):
      arguments = self.values([*fn.args, *sorted(fn.keywords.items())], depth + 1)
      return f"partial({self.function(fn.func, depth + 1)};{arguments})"
    if isinstance(fn, types.MethodType):
      owner = fn.__self__
      return f"{self.function(fn.__func__, depth + 1)} of {self._object(owner, depth + 1)}"
    if not isinstance(fn, types.FunctionType):
      call = inspect.getattr_static(type(fn), "__call__", None)
      if isinstance(call, types.FunctionType):  # an object with __call__: its method, its state
        return f"{self.function(call, depth + 1)} of {self._object(fn, depth + 1)}"
      return getattr(fn, "__qualname__", type(fn).__name__)
    reads = function_reads(fn)
    values = [value for _, value in (*reads.closure, *reads.defaults)]
    values += [*reads.keyword_defaults, *reads.globals]
    text = f"{_code_text(fn.__code__)}|{self.values(values, depth)}"
    return f"{fn.__qualname__}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"

  def values(self, values: list[Any], depth: int = 0) -> str:
    """`values` as text, joined by commas (see the class)."""
    parts = []
    for value in values:
      if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        parts.append(repr(value))
      elif isinstance(value, _ARRAYS):
        parts.append(self.array_text(value))
      elif isinstance(value, tuple | list) and len(value) <= _MAX_ITEMS:
        parts.append(f"[{self.values(list(value), depth)}]")
      elif isinstance(value, dict) and len(value) <= _MAX_ITEMS:
        items = sorted(value.items(), key=lambda item: repr(item[0]))
        parts.append(f"{{{self.values(items, depth)}}}")
      elif isinstance(value, types.ModuleType):
        parts.append(f"module {value.__name__}")
      elif isinstance(value, types.FunctionType | functools.partial | types.MethodType):
        parts.append(self.function(value, depth + 1))
      else:
        parts.append(type(value).__qualname__)
    return ",".join(parts)

  def _object(self, owner: Any, depth: int) -> str:
    attributes = sorted(getattr(owner, "__dict__", {}).items())
    return f"{type(owner).__qualname__}({self.values(attributes, depth)})"


_MAX_TEXT_DEPTH = 6  # Functions read through functions: deeper ones by their type alone.


@functools.lru_cache(maxsize=1024)
def _code_text(code: types.CodeType) -> str:
  """`code` as text without addresses (a nested code object's `repr` holds one)."""
  consts = [_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
  return f"{code.co_code.hex()}|{consts}|{code.co_names!r}"
