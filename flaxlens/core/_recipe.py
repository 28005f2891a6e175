"""Recipes: an isolated call described as data, and the call rebuilt from its description.

A recipe names the Flax API that made the call (`kind`) and holds what that API's
`FrameworkAdapter.describe` records (the module, its variables, the rng state); values
go through the caller's `encode`/`decode`, so the artifact format decides how they are
stored. Rebuilding converts the module on its own again, as isolation did. No Flax
internals here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flaxlens.core._adapter import adapter_named, adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode
from flaxlens.core._variables import bind_variables
from flaxlens.errors import FlaxlensError


def recipe_of(
  submodel: CallNode, initial: tuple[Any, ...], encode: Callable[[Any, str], Any]
) -> dict[str, Any]:
  """The recipe of a standalone submodel whose state starts at `initial`."""
  adapter = adapter_of(submodel)
  return {"kind": adapter.name, **adapter.describe(bind_variables(submodel, initial), encode)}


def submodel_from(
  recipe: dict[str, Any],
  decode: Callable[[Any, str], Any],
  argument: ArgsAndKwargs,
  side_inputs: dict[str, Any],
) -> tuple[CallNode, tuple[Any, ...]]:
  """The standalone submodel a recipe describes, and its initial state.

  Raises:
    FlaxlensError: for a recipe of an API no adapter handles.
    TypeError: for a recipe that describes something else than a module of its API.
  """
  adapter = adapter_named(recipe["kind"])
  if adapter is None:
    raise FlaxlensError(f"No Flax API called {recipe['kind']!r} rebuilds recipes.")
  return adapter.rebuild(recipe, decode, argument, side_inputs)
