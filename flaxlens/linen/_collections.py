"""Linen variables dicts, nested (as Flax takes them) and flat (by `(collection, path)` key).

The runtime addresses a Linen variable by the key `(collection, path)`; Flax takes and
returns nested dicts. Variables given as `FrozenDict`s are remembered by the levels at
which they were (`frozen_levels`), so that an export has the pytree structure of what was
converted (`refreeze`). No Flax internals here (`FrozenDict` is public).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax.core import FrozenDict

Path = tuple[Any, ...]


def flatten_collections(collections: Mapping[str, Any]) -> dict[tuple[str, Path], Any]:
  """`{collection: nested dict}` -> `{(collection, path): leaf}`; mappings are nodes.

  Example:
    >>> from flaxlens.linen._collections import flatten_collections
    >>> flatten_collections({"params": {"Dense_0": {"bias": 0.0}}})
    {('params', ('Dense_0', 'bias')): 0.0}
  """
  flat: dict[tuple[str, Path], Any] = {}

  def walk(collection: str, value: Any, path: Path) -> None:
    if isinstance(value, Mapping):
      for name, child in value.items():
        walk(collection, child, path + (name,))
    else:
      flat[(collection, path)] = value

  for collection, tree in collections.items():
    walk(collection, tree, ())
  return flat


def nest_collections(flat: Mapping[tuple[str, Path], Any]) -> dict[str, dict[str, Any]]:
  """`{(collection, path): leaf}` -> `{collection: nested dict}`, as Flax takes variables.

  Example:
    >>> from flaxlens.linen._collections import nest_collections
    >>> nest_collections({("params", ("Dense_0", "bias")): 0.0})
    {'params': {'Dense_0': {'bias': 0.0}}}
  """
  nested: dict[str, dict[str, Any]] = {}
  for (collection, path), value in flat.items():
    target = nested.setdefault(collection, {})
    for name in path[:-1]:
      target = target.setdefault(name, {})
    target[path[-1]] = value
  return nested


def frozen_levels(variables: Mapping[str, Any]) -> tuple[Path, ...]:
  """The paths (`()` the whole dict, `(collection, *path)` below) of the `FrozenDict`s in
  `variables`, outermost only: a `FrozenDict` holds plain dicts as its pytree children.

  Example:
    >>> from flax.core import freeze
    >>> from flaxlens.linen._collections import frozen_levels
    >>> frozen_levels({"params": freeze({"Dense_0": {"bias": 0.0}})})
    (('params',),)
  """
  levels: list[Path] = []

  def walk(value: Any, path: Path) -> None:
    if isinstance(value, FrozenDict):
      levels.append(path)
    elif isinstance(value, Mapping):
      for name, child in value.items():
        walk(child, path + (name,))

  walk(variables, ())
  return tuple(levels)


def refreeze(nested: dict[str, Any], levels: tuple[Path, ...]) -> Any:
  """`nested` with a `FrozenDict` at each of `levels` that it holds (`frozen_levels`'s inverse).

  Example:
    >>> from flaxlens.linen._collections import refreeze
    >>> type(refreeze({"params": {"bias": 0.0}}, ((),))).__name__
    'FrozenDict'
  """

  def build(value: Any, path: Path) -> Any:
    if not isinstance(value, dict):
      return value
    value = {name: build(child, path + (name,)) for name, child in value.items()}
    return FrozenDict(value) if path in levels else value

  return build(nested, ())
