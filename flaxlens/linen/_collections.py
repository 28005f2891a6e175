"""Linen variables dicts, nested (as Flax takes them) and flat (by `(collection, path)` key).

The runtime addresses a Linen variable by the key `(collection, path)`; Flax takes and
returns nested dicts. No Flax internals here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
