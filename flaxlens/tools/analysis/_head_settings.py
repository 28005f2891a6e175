"""Where a call's heads are, read from the tree: the head count in the settings of the
call's module or the nearest enclosing one (`num_heads`, `n_head`, `num_attention_heads`,
also under `config`), the checks that those settings are this call's (`head_dim`,
key/value head counts), the abstract value conversion saw, and the calls a module makes
inside itself (an attention module's `query`, `out`). Used by `fl.heads` and
`fl.attention_pattern` (`_heads.py`). No Flax internals here.
"""

from __future__ import annotations

from typing import Any

import jax

from flaxlens.core._node import CallNode
from flaxlens.errors import HeadsError
from flaxlens.tools.base._sites import Site

HEAD_COUNTS = ("num_heads", "n_head", "num_attention_heads")
KV_HEAD_COUNTS = ("num_kv_heads", "num_key_value_heads", "n_kv_heads", "n_kv_head", "num_kv_head")
HEAD_DIM_SETTINGS = ("head_dim", "head_size", "d_head")


def value_spec(site: Site, on: str) -> Any:
  """The abstract value (`jax.ShapeDtypeStruct`) of a call's output or first argument."""
  signature = site.output if on == "output" else site.inputs
  if signature is None:
    return None
  value = jax.tree_util.tree_unflatten(*signature)
  if on == "input":
    args = value[0]
    return args[0] if args else None
  return value


def own_calls(node: CallNode) -> list[CallNode]:
  """`node` and the calls of its own module nested in it (a subclass's `__call__` calling
  `super().__call__`, `nn.SelfAttention`), outermost first."""
  found, frontier = [], [node]
  while frontier:
    current = frontier.pop(0)
    found.append(current)
    frontier.extend(
      layer
      for layer in current.submodule_calls.values()
      if isinstance(layer, CallNode) and tuple(layer.path) == tuple(node.path)
    )
  return found


def call_making(sites: list[Site], site: Site, name: str) -> tuple[Site, Site] | None:
  """`(holder, child)`: the call of `site`'s module (`site` itself, or a call of the same
  module nested in it) that makes the call `name.__call__`, and that call; or None."""
  for node in own_calls(site.node):
    for key, layer in node.submodule_calls.items():
      if key[1] == f"{name}.__call__":
        holder = next((s for s in sites if s.node is node), None)
        child = next((s for s in sites if s.node is layer), None)
        return None if holder is None or child is None else (holder, child)
  return None


def child_call(sites: list[Site], site: Site, name: str) -> Site | None:
  """The site of the call `name.__call__` that `site`'s module makes in this call, or None."""
  found = call_making(sites, site, name)
  return None if found is None else found[1]


def setting_of(holder: Any, keys: tuple[str, ...]) -> tuple[str, int] | None:
  """The first of `keys` that `holder` (a settings dict or a config object) sets to an
  int, with its value."""
  for key in keys:
    value = holder.get(key) if isinstance(holder, dict) else getattr(holder, key, None)
    if isinstance(value, int) and not isinstance(value, bool):
      return key, value
  return None


def count_holder(sites: list[Site], site: Site) -> tuple[Site, Any, tuple[str, int]] | None:
  """The call of `site`'s module or of the nearest enclosing one whose settings (a dict,
  or a config object under `config`) set a head count: that call, the settings holding
  it, and `(key, count)`."""
  path = tuple(site.node.path)
  enclosing = [s for s in sites if tuple(s.node.path) == path[: len(s.node.path)]]
  for outer in sorted(enclosing, key=lambda s: -len(s.node.path)):
    settings = outer.node.settings()
    for holder in (settings, settings.get("config")):
      found = setting_of(holder, HEAD_COUNTS)
      if found is not None:
        return outer, holder, found
  return None


def settings_with_count(sites: list[Site], site: Site) -> tuple[int, Any] | None:
  """The head count in the settings of `site`'s module or the nearest enclosing one, and
  the settings (a dict or a config object) that hold it."""
  found = count_holder(sites, site)
  return None if found is None else (found[2][1], found[1])


def count_from_settings(sites: list[Site], site: Site) -> int | None:
  """The head count in the settings of `site`'s module or the nearest enclosing one."""
  found = settings_with_count(sites, site)
  return None if found is None else found[0]


def check_settings_count(site: Site, on: str, features: int, count: int, holder: Any) -> None:
  """Refuses a head count read from the settings around a call that they show is not
  this call's: a `head_dim` setting whose product with it is not the call's features, or
  a key/value head count besides it (grouped-query attention: a key or value projection
  holds fewer heads than `num_heads`), where which count applies is not known.

  Raises:
    HeadsError: naming the settings and the `heads=` to give.
  """
  head_dim = setting_of(holder, HEAD_DIM_SETTINGS)
  kv = setting_of(holder, KV_HEAD_COUNTS)
  kv = kv if kv is not None and kv[1] != count else None
  if head_dim is not None and features != count * head_dim[1]:
    fits = kv is not None and features == kv[1] * head_dim[1]
    raise HeadsError(
      f"{site.name}: the settings around this call say {count} heads of {head_dim[0]}"
      f" {head_dim[1]} ({count * head_dim[1]} features), but its {on} has {features}"
      + (
        f": {kv[1]} key/value heads ({kv[0]}={kv[1]}). Pass heads={kv[1]} to fl.heads."
        if fits
        else f". Pass the call's head count to fl.heads (heads=n, n * head_dim = {features})."
      )
    )
  if kv is not None and head_dim is None:
    raise HeadsError(
      f"{site.name}: the settings around this call give two head counts, {count} heads"
      f" and {kv[0]}={kv[1]} (grouped-query attention), and which one this call's"
      f" {features} features hold is not known. Pass it to fl.heads: heads={count} for a"
      f" query projection, heads={kv[1]} for a key or value projection."
    )
