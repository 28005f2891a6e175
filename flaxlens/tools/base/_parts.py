"""The `part=` rule: which array of a call's structured value a tool reads or edits.

A call's value (its output, or its first positional argument) may be one array or a
structure: a tuple (a Hugging Face block returns `(hidden_states, ...)`), a dict, a
dataclass. Every tool that takes a site takes `part=`: None (the default) is the whole
value, which must then be one array where the tool needs one; an int or a str picks one
entry (a tuple's index, a dict's key, a named tuple's or dataclass's field), edited in
place and the rest of the value kept. These functions are that rule and its one set of
refusals (docs/interventions.md, "Structured values: part="); the checks before a run,
which know the site, are `check_part` in `_interventions.py`. No Flax internals here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from flaxlens.errors import ArgumentError
from flaxlens.tools.base._index import is_array

# Where a refusal sends the reader: the rule, written once.
RULE = 'docs/interventions.md, "Structured values: part="'


def checked_part(part: Any, maker: str) -> Any:
  """`part` as a tool keeps it (a NumPy integer as an int), after refusing what names no
  part; `maker` (`"fl.steer('Block_0')"`) starts the refusal."""
  if isinstance(part, np.integer) and not isinstance(part, np.bool_):
    return int(part)
  if part is None or (isinstance(part, int | str) and not isinstance(part, bool)):
    return part
  raise ArgumentError(
    f"{maker}: part={part!r} names no part; a part is an int (a tuple's index) or a str (a"
    f" key, a field), and a {type(part).__name__} would pick whatever entry it equals. Give"
    " an int or a str, or leave part= out for the whole value."
  )


def get_part(value: Any, part: Any, site: str, on: str) -> Any:
  """The `part` of `value` (the `on` of the call `site`): the whole value for None."""
  if part is None:
    return value
  try:
    if isinstance(part, int) or isinstance(value, Mapping):
      return value[part]
    return getattr(value, part)
  except (IndexError, KeyError, AttributeError, TypeError):
    pass
  parts = _parts(value)
  if parts is None:
    raise ArgumentError(
      f"{site}: part={part!r}, but the {on} is {describe(value)}, which has no parts. Leave"
      " part= out to use it whole."
    )
  raise ArgumentError(
    f"{site}: part={part!r}, but the {on} is {describe(value)}, whose parts are {parts}."
    " Pass one of them as part=."
  )


def one_array(value: Any, part: Any, site: str, on: str) -> Any:
  """The array `part` picks from `value` (the `on` of the call `site`), refused where it
  is not one array: the one refusal every tool gives for a structured value."""
  target = get_part(value, part, site, on)
  if is_array(target):
    return target
  picked = "" if part is None else f"'s part {part!r}"
  raise ArgumentError(
    f"{site}: the {on}{picked} is {describe(target)}, not one array. Pass part= to choose"
    f" the array{part_hint(target)}; fl.path_patch takes it as fl.Sites(at, part=...)"
    f" ({RULE})."
  )


def set_part(value: Any, part: Any, new: Any) -> Any:
  """`value` with its `part` replaced by `new` (`new` itself for None)."""
  if part is None:
    return new
  if isinstance(value, tuple):
    items = list(value)
    items[value._fields.index(part) if isinstance(part, str) else part] = new
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
  if isinstance(value, list):
    return [new if i == part else v for i, v in enumerate(value)]
  if isinstance(value, Mapping):
    copied = copy.copy(value)
    copied[part] = new
    return copied
  return dataclasses.replace(value, **{part: new})


def _parts(value: Any) -> list[Any] | None:
  """The parts `part=` may pick from `value` (keys, indices, fields), or None for a leaf."""
  if isinstance(value, Mapping):
    return list(value)
  if isinstance(value, tuple | list):
    return [*range(len(value)), *getattr(value, "_fields", ())]
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return [f.name for f in dataclasses.fields(value)]
  return None


def describe(value: Any) -> str:
  """`value` in a few words: `one array (float32[2, 8, 32])`, `a tuple (float32[2, 8, 32])`."""
  if is_array(value):
    return f"one array ({short(value)})"
  if isinstance(value, tuple | list) and len(value) <= 8:
    return f"a {type(value).__name__} ({', '.join(short(x) for x in value)})"
  if isinstance(value, dict) and len(value) <= 8:
    return f"a dict ({', '.join(f'{k!r}: {short(x)}' for k, x in value.items())})"
  return f"a {type(value).__name__} of {len(jax.tree_util.tree_leaves(value))} leaves"


def short(value: Any) -> str:
  """An array as `float32[2, 8]`; anything else by its type's name."""
  if is_array(value):
    return f"{np.dtype(value.dtype).name}{list(value.shape)}"
  return type(value).__name__


def part_hint(value: Any) -> str:
  """How to choose a part of `value`, as an example."""
  if isinstance(value, tuple | list) and value:
    return " (part=0: the first entry, as Hugging Face blocks return (hidden_states, ...))"
  if isinstance(value, Mapping) and value:
    return f" (a key: part={next(iter(value))!r})"
  if dataclasses.is_dataclass(value) and dataclasses.fields(value):
    return f" (a field: part={dataclasses.fields(value)[0].name!r})"
  return ""
