"""Checking the arguments of public functions: one refusal for each kind of wrong value.

A public function checks each argument it would otherwise hand to code that fails deep
inside with a bare `TypeError` or `AttributeError` (a path given as None, a tree that is
not one, a list that is a single item). Each check raises `ArgumentError` naming the
function, the argument, what it must be, what it got, and what to pass instead. Checks
only refuse values that cannot work; they cost one `isinstance`. No Flax internals here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from flaxlens.errors import ArgumentError


def shown(value: Any) -> str:
  """`value` as a message shows it: its repr if short, an array by its dtype and shape,
  anything else by its type.

  Example:
    >>> import numpy as np
    >>> from flaxlens.core._checks import shown
    >>> shown(None), shown(3), shown(np.zeros((2, 3))), shown(object())
    ('None', '3', 'an array float64[2, 3]', 'an object')
  """
  if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type):
    return f"an array {value.dtype}{list(value.shape)}"
  try:
    text = repr(value)
  except Exception:
    text = ""
  if text and len(text) <= 60 and "\n" not in text and " object at 0x" not in text:
    return text
  name = type(value).__name__
  return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def refuse(where: str, name: str, value: Any, expected: str, fix: str) -> ArgumentError:
  """The error for argument `name` of `where` holding `value` instead of `expected`.

  Example:
    >>> from flaxlens.core._checks import refuse
    >>> print(refuse("fl.summary", "tree", None, "a converted tree", "Convert it first."))
    fl.summary: tree must be a converted tree, got None. Convert it first.
  """
  return ArgumentError(f"{where}: {name} must be {expected}, got {shown(value)}. {fix}")


def check_path(value: Any, where: str, fix: str, name: str = "path") -> str:
  """`value` as a path string; refuses anything but a non-empty str or `os.PathLike`.

  Example:
    >>> import pathlib
    >>> from flaxlens.core._checks import check_path
    >>> check_path(pathlib.Path("a/b"), "fl.load_isolated", "Pass a directory.")
    'a/b'
  """
  path = os.fspath(value) if isinstance(value, str | os.PathLike) else None
  if not isinstance(path, str) or not path:
    raise refuse(where, name, value, "a file path (a str or pathlib.Path)", fix)
  return path


def check_type(
  value: Any, types: type | tuple[type, ...], where: str, name: str, expected: str, fix: str
) -> Any:
  """Refuses a `value` that is not an instance of `types`."""
  if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
    raise refuse(where, name, value, expected, fix)
  return value


def check_optional(
  value: Any, types: type | tuple[type, ...], where: str, name: str, expected: str, fix: str
) -> Any:
  """`check_type`, None allowed."""
  return None if value is None else check_type(value, types, where, name, expected, fix)


def check_items(
  value: Any, item: type | Callable[[Any], bool], where: str, name: str, expected: str, fix: str
) -> tuple[Any, ...]:
  """`value`, a list or tuple whose elements are instances of `item` (or pass it), as a tuple.

  Example:
    >>> from flaxlens.core._checks import check_items
    >>> check_items(["a"], str, "f", "names", "a list of str", "Pass names.")
    ('a',)
  """
  if not isinstance(value, list | tuple):
    raise refuse(where, name, value, expected, fix)
  accepts = item if not isinstance(item, type) else (lambda x: isinstance(x, item))
  for number, element in enumerate(value):
    if not accepts(element):
      raise ArgumentError(
        f"{where}: {name} must be {expected}; element {number} is {shown(element)}. {fix}"
      )
  return tuple(value)


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
  return types if isinstance(types, tuple) else (types,)
