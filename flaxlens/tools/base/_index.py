"""Indices of `where=` and `index=`: their static form, and the checks that refuse an index
that reaches outside a value or selects nothing of it.

An index (`jnp.s_[:, 3]`, `jnp.s_[..., jnp.array([0, 2])]`) is split, when an
intervention or a capture is made, into a static structure (ints, slices, `...`, `None`,
and for each integer array the smallest and largest of its values) and its arrays; a
boolean mask is one array. When a run is traced the value's shape is known, and the index
is checked against it as NumPy reads it: what NumPy refuses (a position outside an axis)
and what selects nothing (an empty slice) is refused, where JAX would clamp a read or drop
a write without a word. No Flax internals here.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.errors import ArgumentError

MASK = ("mask",)
_AXIS = ("int", "slice", "array")  # The entries that consume an axis of the value.
_FORMS = (
  "ints, slices, ..., None and integer arrays, as jnp.s_[...] writes them, or one boolean"
  " mask that broadcasts to the value"
)


def is_array(x: Any) -> bool:
  """Whether `x` is an array (anything with a shape and a dtype that is not a class)."""
  return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def _concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def split(value: Any, owner: str = "fl.run/fl.capture: index=") -> tuple[Any, tuple[Any, ...]]:
  """`(static structure, arrays)` of a `where=` or `index=` value; None for None.

  The structure is `("mask",)` with the mask as the one array, or `("index", *entries)`:
  `("int", i)`, `("slice", start, stop, step)`, `("ellipsis",)`, `("newaxis",)`, and
  `("array", lowest, highest)` for each integer array (its values' range, None where the
  array is traced). `owner` starts each refusal (`"fl.ablate('Block_0'): where="`).

  Raises:
    ArgumentError: the value is not an index: a float, a bool, a boolean array inside a
      tuple, two `...`, a slice with a step of 0 or bounds that are not ints, an empty
      or non-integer array, an all-False mask.
  """
  if value is None:
    return None, ()
  if isinstance(value, list):
    value = _numpy(value, owner)
  if is_array(value) and _dtype(value) == np.bool_:
    mask = jnp.asarray(value)
    _check_mask(mask, owner)
    return MASK, (mask,)
  entries = value if isinstance(value, tuple) else (value,)
  static: list[tuple[Any, ...]] = []
  arrays: list[Any] = []
  for entry in entries:
    if isinstance(entry, list | tuple):
      entry = _numpy(entry, owner)
    if isinstance(entry, bool | np.bool_):
      raise ArgumentError(
        f"{owner} holds the bool {entry!r}, which is not a position. Give {_FORMS};"
        " None (the default) selects everything."
      )
    if isinstance(entry, int | np.integer):
      static.append(("int", int(entry)))
    elif isinstance(entry, slice):
      static.append(("slice", *_slice_bounds(entry, owner)))
    elif entry is Ellipsis:
      if ("ellipsis",) in static:
        raise ArgumentError(f"{owner} holds more than one '...'. Give at most one.")
      static.append(("ellipsis",))
    elif entry is None:
      static.append(("newaxis",))
    elif is_array(entry):
      arrays.append(_integer_array(entry, owner))
      static.append(("array", *_range(arrays[-1])))
    else:
      raise ArgumentError(
        f"{owner} holds {entry!r} (a {type(entry).__name__}), which is not part of an"
        f" index. Give {_FORMS}."
      )
  return ("index", *static), tuple(arrays)


def _numpy(value: list | tuple, owner: str) -> np.ndarray:
  try:
    array = np.asarray(value)
  except (ValueError, OverflowError):
    array = None
  if array is None or array.dtype.kind not in "biu":
    raise ArgumentError(
      f"{owner} holds {value!r}, which is not a list of integer positions (or of"
      f" booleans). Give {_FORMS}."
    )
  return array


def _dtype(x: Any) -> Any:
  try:
    return np.dtype(x.dtype)
  except TypeError:  # a key array, whose dtype NumPy does not know
    return None


def _slice_bounds(entry: slice, owner: str) -> tuple[Any, Any, Any]:
  bounds = []
  for bound in (entry.start, entry.stop, entry.step):
    if bound is None:
      bounds.append(None)
      continue
    try:
      if isinstance(bound, bool | np.bool_):
        raise TypeError
      bounds.append(operator.index(bound))
    except TypeError:
      raise ArgumentError(
        f"{owner} holds the slice {_slice_text(entry)}, whose bound {bound!r} is not an"
        " integer. Give Python ints (or nothing) as the bounds of a slice."
      ) from None
  if bounds[2] == 0:
    raise ArgumentError(f"{owner} holds a slice with step 0. Give a step other than 0.")
  return bounds[0], bounds[1], bounds[2]


def _integer_array(entry: Any, owner: str) -> Any:
  dtype = _dtype(entry)
  if dtype == np.bool_:
    raise ArgumentError(
      f"{owner} holds a boolean array inside an index. Give its positions as integers"
      " (jnp.nonzero(mask)), or, as where=, the mask alone (it broadcasts to the value)."
    )
  if dtype is None or dtype.kind not in "iu":
    raise ArgumentError(
      f"{owner} holds an array of dtype {entry.dtype}; the arrays of an index hold integer"
      " positions. Give an integer array (or a boolean mask alone)."
    )
  if math.prod(entry.shape) == 0:
    raise ArgumentError(
      f"{owner} holds an empty array of positions, which selects nothing. Give at least"
      " one position."
    )
  array = jnp.asarray(entry)
  if _concrete(entry) and not np.array_equal(np.asarray(array), np.asarray(entry)):
    raise ArgumentError(
      f"{owner} holds positions up to {int(np.max(np.abs(np.asarray(entry))))}, too large"
      f" for an index of dtype {array.dtype}; no axis is that long. Give positions within"
      " the value's axes."
    )
  return array


def _range(array: Any) -> tuple[Any, Any]:
  """The smallest and largest of an integer array's values; None for a traced array."""
  if not _concrete(array):
    return None, None
  values = np.asarray(array)
  return int(values.min()), int(values.max())


def _check_mask(mask: Any, owner: str) -> None:
  if _concrete(mask) and not np.any(np.asarray(mask)):
    raise ArgumentError(
      f"{owner} is a mask that is False everywhere, so the edit would change nothing."
      " Give a mask with at least one True, or leave the intervention out."
    )


def bounded(static: Any, arrays: tuple[Any, ...], owner: str) -> Any:
  """`static` checked as `split` checks a value, with the range of each concrete array
  recomputed from its values (a traced array keeps the range `static` gives).

  For a structure made some other way than by `split` (a saved set, `fl.Intervention`
  built by hand, `dataclasses.replace` with new arrays).

  Raises:
    ArgumentError: as `split`, or the structure is malformed.
  """
  if static is None:
    return None
  if static == MASK and len(arrays) == 1:
    _check_mask(arrays[0], owner)
    return MASK
  fresh, _ = split(_rebuild(static, arrays, owner), owner)
  given = iter(e for e in static[1:] if e[0] == "array")
  entries = []
  for entry in fresh[1:]:
    if entry[0] == "array":
      old = next(given)
      entry = tuple(old) if entry[1] is None and len(old) == 3 else entry
    entries.append(entry)
  return ("index", *entries)


def _rebuild(static: Any, arrays: tuple[Any, ...], owner: str) -> tuple[Any, ...]:
  """The index value a structure and its arrays stand for."""
  shapes = {"int": 2, "slice": 4, "ellipsis": 1, "newaxis": 1}
  entries = static[1:] if isinstance(static, tuple) and static[:1] == ("index",) else None
  fits = entries is not None and all(
    isinstance(e, tuple) and e and (len(e) == shapes.get(e[0]) or e[0] == "array") for e in entries
  )
  if not fits or sum(e[0] == "array" for e in entries) != len(arrays):
    raise ArgumentError(
      f"{owner} has the structure {static!r} and {len(arrays)} arrays, which is no index."
      " Make interventions with fl.ablate/patch/steer/scale/modify, which split where=."
    )
  out, it = [], iter(arrays)
  for entry in entries:
    tag = entry[0]
    if tag == "int":
      out.append(entry[1])
    elif tag == "slice":
      out.append(slice(*entry[1:]))
    elif tag == "ellipsis":
      out.append(Ellipsis)
    elif tag == "newaxis":
      out.append(None)
    else:
      out.append(next(it))
  return tuple(out)


def checked(
  static: Any, arrays: tuple[Any, ...], shape: tuple[int, ...], owner: str, what: str
) -> tuple[Any, ...]:
  """The index as JAX takes it, after checking it against a value of `shape`.

  Every position must lie on its axis (`-size <= i < size`, as NumPy requires), and the
  index must select at least one element. Slices come back with their bounds resolved
  for the axis. Integer arrays traced when the index was made are checked for shape
  only: their values are known when the program runs.

  Raises:
    ArgumentError: the index reaches outside the value (`owner`, then which axis, its
      size and the positions it allows), uses more axes than the value has, or selects
      nothing; `what` names the value ("output", "input", "captured value").
  """
  entries = static[1:]
  text = index_text(static, arrays)
  ndim = len(shape)
  used = sum(e[0] in _AXIS for e in entries)
  head = f"{owner}{text} on the {what} of shape {tuple(shape)}"
  if used > ndim:
    raise ArgumentError(
      f"{head} indexes {used} axes, and the {what} has {ndim}. Give an index of at most"
      f" {ndim} axes (jnp.s_[..., k] picks position k of the last one)."
    )
  ellipsis = next((n for n, e in enumerate(entries) if e[0] == "ellipsis"), len(entries))
  out, shapes, covered, it, axis = [], [], set(), iter(arrays), 0
  for n, entry in enumerate(entries):
    tag = entry[0]
    if n == ellipsis:
      axis = ndim - sum(e[0] in _AXIS for e in entries[n + 1 :])
      out.append(Ellipsis)
      continue
    if tag == "newaxis":
      out.append(None)
      continue
    size = shape[axis]
    allowed = (
      f"Give positions from {-size} to {size - 1} on that axis."
      if size
      else "The axis is empty: there is nothing to select."
    )
    if tag == "int":
      if not -size <= entry[1] < size:
        raise ArgumentError(
          f"{head} reaches outside it: position {entry[1]} on axis {axis}, of size {size}."
          f" {allowed}"
        )
      out.append(entry[1])
    elif tag == "slice":
      chosen = range(*slice(*entry[1:]).indices(size))
      if not chosen:
        keep = f"keeps at least one of positions 0 to {size - 1}" if size else "is not empty"
        raise ArgumentError(
          f"{head} selects nothing: the slice {_slice_text(slice(*entry[1:]))} is empty on"
          f" axis {axis}, of size {size}. Give a slice that {keep}, or no where=/index= to"
          " take the whole value."
        )
      stop = chosen.stop if chosen.stop >= 0 else None
      out.append(slice(chosen.start, stop, chosen.step))
    else:
      array = next(it)
      lowest, highest = entry[1], entry[2]
      if lowest is not None and not (-size <= lowest and highest < size):
        raise ArgumentError(
          f"{head} reaches outside it: the array on axis {axis}, of size {size}, holds"
          f" positions from {lowest} to {highest}."
          f" {allowed}"
        )
      shapes.append(tuple(array.shape))
      out.append(array)
    covered.add(axis)
    axis += 1
  try:
    np.broadcast_shapes(*shapes)
  except ValueError:
    raise ArgumentError(
      f"{head}: its integer arrays, of shapes {shapes}, do not broadcast together. Give"
      " arrays of one shape (or of shapes that broadcast)."
    ) from None
  empty = [k for k, size in enumerate(shape) if size == 0 and k not in covered]
  if empty:
    raise ArgumentError(
      f"{head} selects nothing: the {what} is empty along axis {empty[0]}. There is nothing"
      " to select; leave the index out."
    )
  return tuple(out)


def index_text(static: Any, arrays: tuple[Any, ...]) -> str:
  """The index as a reader writes it: `[:, 7]`, `[..., 64:80]`, `[int32[2] array, 0]`."""
  parts, it = [], iter(arrays)
  for entry in static[1:]:
    tag = entry[0]
    if tag == "int":
      parts.append(str(entry[1]))
    elif tag == "slice":
      parts.append(_slice_text(slice(*entry[1:])))
    elif tag == "ellipsis":
      parts.append("...")
    elif tag == "newaxis":
      parts.append("None")
    else:
      array = next(it)
      parts.append(f"{array.dtype}{list(array.shape)} array")
  return f"[{', '.join(parts)}]"


def _slice_text(s: slice) -> str:
  text = ":".join("" if b is None else str(b) for b in (s.start, s.stop))
  return text if s.step is None else f"{text}:{s.step}"
