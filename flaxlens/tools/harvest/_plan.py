"""`fl.harvest`'s plan: the sites it captures and, for each, the rows it keeps (`positions=`),
the dtype it stores them in (`dtype=`) and the part of a structured output (`part=`),
from one value for every site or a dict of them by site pattern, each checked before
anything runs. The plan is static (hashable): the compiled step takes it as such. No Flax
internals here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from flaxlens.core._node import CallNode
from flaxlens.core._selectors import path_matches
from flaxlens.errors import ArgumentError
from flaxlens.tools.base._parts import checked_part
from flaxlens.tools.base._probed import nodes_by_name
from flaxlens.tools.base._sites import check_part, select_sites, sites_of

_RULES = ("all", "last", None)


@dataclasses.dataclass(frozen=True)
class SitePlan:
  """What `fl.harvest` keeps of one site."""

  name: str
  rule: Any  # "all", "last", None, or a function of the batch giving a (batch, positions) mask
  dtype: Any  # the stored dtype, or None to keep the captured one
  part: Any = None  # which part of a structured output is stored (the `part=` rule)
  # For a call inside `nn.scan`/`nnx.scan` (or vmap) bodies (a sliced call): the dimensions
  # of one run of its output (its `part`) as conversion saw it. A capture stacks such a
  # call's values along leading axes, one per enclosing body, which the step moves behind
  # the example and positions. None for any other call.
  once_ndim: int | None = None


@dataclasses.dataclass(frozen=True)
class HarvestPlan:
  """What the compiled step does; static (hashable) so one program serves every batch of a
  shape."""

  capture: Any
  sites: tuple[SitePlan, ...]
  ids: Callable[[Any], Any] | None


def _per_site(value: Any, names: list[str], what: str, check: Callable[[Any], Any]) -> list[Any]:
  """`value` for each site name: one value for all, or `{pattern: value}` (first match)."""
  if not isinstance(value, dict):
    return [check(value)] * len(names)
  chosen = []
  for name in names:
    key = next((k for k in value if k == name or path_matches(str(k), name)), _MISSING)
    if key is _MISSING:
      raise ArgumentError(
        f"fl.harvest: {what}= gives no value for the site {name!r} (its keys:"
        f" {list(value)}). Add a key matching it, or '**' for every other site."
      )
    chosen.append(check(value[key]))
  return chosen


_MISSING = object()


def _checked_rule(rule: Any) -> Any:
  if callable(rule) or (isinstance(rule, str | type(None)) and rule in _RULES):
    return rule
  raise ArgumentError(
    f"fl.harvest: positions= is 'all', 'last', None (no position axis) or a function of"
    f" the batch giving a boolean (batch, positions) mask, got {rule!r}. Give one of these,"
    " or a dict of them by site."
  )


def _checked_store_dtype(dtype: Any) -> Any:
  if dtype is None:
    return None
  try:
    return np.dtype(jnp.dtype(dtype))
  except TypeError as error:
    raise ArgumentError(
      f"fl.harvest: dtype={dtype!r} is no dtype. Give one (jnp.bfloat16, 'float32') or"
      " None to store what the site computes."
    ) from error


def plan_harvest(
  tree: CallNode, at: Any, positions: Any, dtype: Any, ids: Any, part: Any
) -> HarvestPlan:
  """The plan of `fl.harvest(tree, batches, at, ...)` with those options, each checked."""
  if isinstance(at, list):
    at = tuple(at)
  sites = sites_of(tree)
  chosen = select_sites(tree, at, sites)
  names = [site.name for site in chosen]
  _, capture = nodes_by_name(tree, (), at)
  rules = _per_site(positions, names, "positions", _checked_rule)
  dtypes = _per_site(dtype, names, "dtype", _checked_store_dtype)
  parts = _per_site(part, names, "part", lambda p: checked_part(p, "fl.harvest"))
  once = [check_part(site, p, "output", at, sites) for site, p in zip(chosen, parts, strict=True)]
  if ids is not None and not callable(ids):
    raise ArgumentError(
      f"fl.harvest: ids= must be a function of the batch giving an integer array of shape"
      f" (batch,) or (batch, positions), got {type(ids).__name__}. For token ids:"
      " ids=lambda tokens: tokens."
    )
  ndims = [
    value.ndim if value is not None and site.node.sliced else None
    for site, value in zip(chosen, once, strict=True)
  ]
  planned = zip(names, rules, dtypes, parts, ndims, strict=True)
  return HarvestPlan(capture, tuple(SitePlan(*site) for site in planned), ids)
