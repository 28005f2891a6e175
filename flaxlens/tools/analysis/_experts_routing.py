"""The routers of mixture-of-experts layers as sites: `fl.routing`.

A routing site resolves to each named MoE layer's router call (`_experts_layers.py`):
captured, it records the router's logits and the top-k experts chosen from them; an
intervention on it edits the logits (`force`/`forbid` make the ones that route every
token to an expert, or none); `load` counts the tokens each expert gets, over a capture
or a harvest's rows of the router call. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._edit import Edit
from flaxlens.core._node import CallNode
from flaxlens.core._probes import active_probing
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import SelectionError
from flaxlens.tools.analysis._experts_layers import (
  TOP_K_SETTINGS,
  Layer,
  checked_experts,
  expert_numbers,
  moe_layers,
  shown_site,
  static_layer_site,
)
from flaxlens.tools.analysis._head_settings import setting_of
from flaxlens.tools.base._intervention import Intervention, make_intervention
from flaxlens.tools.base._sites import Site, sites_of


@dataclasses.dataclass(frozen=True)
class RouteEdit:
  """The `fl.modify` function of `Routing.force`/`Routing.forbid`: the forbidden
  experts' logits set to `-inf`, the forced ones' to just above the row's largest logit
  (so they are chosen first, and weighted as the top choice was)."""

  force: tuple[int, ...]
  forbid: tuple[int, ...]

  def __call__(self, argument: Any, logits: Any) -> Any:
    del argument
    if self.forbid:
      logits = logits.at[..., list(self.forbid)].set(-jnp.inf)
    if self.force:
      top = jnp.max(logits, axis=-1, keepdims=True)
      logits = logits.at[..., list(self.force)].set(jnp.nextafter(top, jnp.inf))
    return logits


class RoutingCapture(Struct):
  """Records a router call's output as `"<layer>:router_logits"` and its top `k`
  experts as `"<layer>:chosen"`, changing nothing."""

  records = True
  on = "output"
  part = None
  layer: str = static_field()
  k: int = static_field()
  shape: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    del site, argument
    probing = active_probing()
    if probing is not None:
      for key, x in (("router_logits", value), ("chosen", jax.lax.top_k(value, self.k)[1])):
        name = f"{self.layer}:{key}"
        shape = None if self.shape is None else (lambda y, name=name: self.shape(name, y))
        probing.record(name, x, shape)
    return value


@dataclasses.dataclass(frozen=True)
class Routing:
  """The routers of the MoE layers `at` names (made by `fl.routing`).

  Captured, it records each router's logits (`"<layer>:router_logits"`) and its top-k
  experts (`"<layer>:chosen"`); interventions (`fl.ablate`, `fl.steer`, ...) on it
  edit the logits, and `force`/`forbid` make the interventions that force or forbid
  routes; `load` counts the tokens routed to each expert.

  Attributes:
    at: the MoE layers: a path pattern, a module class or a predicate.
    k: the experts chosen per token, or None (read from the layer's settings).
    experts: the name of the call (or numbered calls) holding the experts, or None.
    router: the name of the router call, or None.

  Example:
    >>> import flaxlens as fl
    >>> fl.routing("block_*/moe", k=2).forbid(3).kind
    'modify'
  """

  at: Any
  k: int | None = None
  experts: str | None = None
  router: str | None = None

  def __repr__(self) -> str:
    shown = [shown_site(self.at)]
    shown += [
      f"{k}={v!r}"
      for k, v in (("k", self.k), ("experts", self.experts), ("router", self.router))
      if v is not None
    ]
    return f"fl.routing({', '.join(shown)})"

  def routers(self, tree: CallNode, sites: list[Site]) -> list[tuple[Layer, Site]]:
    """Each layer named and its router call.

    Raises:
      SelectionError: a layer whose router cannot be found.
    """
    out = []
    for layer in moe_layers(self, None, tree, sites):
      if layer.router is None:
        raise SelectionError(
          f"{layer.name}: no router found: none of the other calls this layer makes"
          f" returns [..., {layer.layout.count}] logits (one per expert). Name the call"
          " that computes the routing logits: fl.routing(at, router='name'); a router"
          " computed in the layer's own code must be made a submodule call (a Dense)."
        )
      out.append((layer, layer.router))
    return out

  def top_k(self, tree: CallNode, layer: Layer) -> int:
    """The experts chosen per token: `k=`, else the layer's settings (`top_k`,
    `num_experts_per_tok`, ...), also under `config`."""
    if self.k is not None:
      return self.k
    site = next(s for s in sites_of(tree) if s.name == layer.name)
    settings = site.node.settings()
    for holder in (settings, settings.get("config")):
      found = setting_of(holder, TOP_K_SETTINGS) if holder is not None else None
      if found is not None:
        return found[1]
    raise SelectionError(
      f"{layer.name}: how many experts each token is routed to is not known (its module has"
      f" no {' / '.join(TOP_K_SETTINGS[:4])} setting). Give it: fl.routing(at, k=n)."
    )

  def capture_edits(
    self, tree: CallNode, sites: list[Site], shape: Callable[[str, Any], Any] | None
  ) -> list[tuple[Site, Edit]]:
    """The edits recording each router's logits and top-k experts (`fl.run`)."""
    return [
      (router, RoutingCapture(layer.name, self.top_k(tree, layer), shape))
      for layer, router in self.routers(tree, sites)
    ]

  def edits_of(
    self, tree: CallNode, sites: list[Site], intervention: Intervention
  ) -> list[tuple[Site, Edit]]:
    """The router calls and the intervention each runs on its logits (`fl.run`)."""
    out = []
    for layer, router in self.routers(tree, sites):
      if isinstance(intervention.fn, RouteEdit):
        checked_experts(
          intervention.fn.force + intervention.fn.forbid, layer.layout.count, layer.name
        )
      out.append((router, intervention))
    return out

  def force(self, experts: Any) -> Intervention:
    """The intervention routing every token to `experts` (each chosen first)."""
    return self._route(experts, "force")

  def forbid(self, experts: Any) -> Intervention:
    """The intervention routing no token to `experts` (their logits `-inf`)."""
    return self._route(experts, "forbid")

  def _route(self, experts: Any, how: str) -> Intervention:
    named = expert_numbers(experts, f"{self!r}.{how}")
    edit = RouteEdit(named, ()) if how == "force" else RouteEdit((), named)
    return make_intervention("modify", self, (), None, "output", None, fn=edit)

  def load(self, tree: CallNode, values: Any) -> np.ndarray:
    """Tokens routed to each expert of one layer: from its captured `"<layer>:chosen"`
    (integers) or router logits (`"<layer>:router_logits"`, or a harvest's rows of the
    router call, `fl.open_harvest(path)["block_0/moe/router"]`), read in blocks.

    Returns:
      The count per expert (`int64`, `[experts]`); divide by its sum for the fractions.
    """
    layers = moe_layers(self, None, tree, sites_of(tree))
    if len(layers) != 1:
      raise SelectionError(
        f"{self!r}.load: the load is one layer's, and this names {len(layers)}. Name one layer."
      )
    layer = layers[0]
    counts = np.zeros(layer.layout.count, np.int64)
    step = 1 << 16
    for start in range(0, len(values), step):
      block = np.asarray(values[start : start + step])
      if not np.issubdtype(block.dtype, np.integer):
        if block.shape[-1:] != (layer.layout.count,):
          raise SelectionError(
            f"{layer.name}: load() takes the chosen experts or router logits [...,"
            f" {layer.layout.count}], got rows of shape {block.shape[1:]}. Give them."
          )
        block = np.asarray(jax.lax.top_k(jnp.asarray(block), self.top_k(tree, layer))[1])
      counts += np.bincount(block.reshape(-1), minlength=layer.layout.count)[: layer.layout.count]
    return counts


def routing(
  at: Any, *, k: int | None = None, experts: str | None = None, router: str | None = None
) -> Routing:
  """Names the routers of mixture-of-experts layers: capture, force, forbid, count.

  The router of an MoE layer (found as `fl.experts` finds its experts) is the other
  call the layer makes whose output ends in one logit per expert. `fl.capture` of a
  routing site records `"<layer>:router_logits"` and `"<layer>:chosen"`, the top `k`
  experts per token (the router's choice: tokens a capacity limit then drops are
  counted); interventions on it edit the logits; `.force(e)` and `.forbid(e)` make the
  interventions that route every token to, or none to, experts `e`; `.load(tree,
  values)` counts the tokens each expert gets, over a capture or a harvest.

  Args:
    at: the MoE layers: a path pattern (`"block_*/moe"`), a module class or a predicate.
    k: the experts chosen per token, where the layer's settings do not say it.
    experts: the name of the call holding the experts, where more than one could be.
    router: the name of the router call, where more than one could be.

  Returns:
    A `fl.routing` site (a `Routing`).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> class Moe(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     gates = jax.nn.softmax(nn.Dense(2, name="router")(x))
    ...     out = jnp.stack([nn.Dense(3, name=f"experts_{e}")(x) for e in range(2)], -2)
    ...     return jnp.einsum("be,bed->bd", gates, out)
    >>> x = jnp.ones((4, 3))
    >>> tree = fl.unflaxify(Moe(), Moe().init(jax.random.key(0), x), x)
    >>> site = fl.routing("Moe.__call__", k=1)
    >>> _, cache = fl.capture(tree, x, at=site, interventions=[site.force(1)])
    >>> cache["Moe.__call__:chosen"][:, 0].tolist(), site.load(tree, cache["Moe.__call__:chosen"])
    ([1, 1, 1, 1], array([0, 4]))
  """
  maker = f"fl.routing({at!r})"
  if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
    raise SelectionError(f"{maker}: k={k!r} is no expert count. Give a positive int.")
  for name, value in (("experts", experts), ("router", router)):
    if value is not None and not isinstance(value, str):
      raise SelectionError(f"{maker}: {name}={value!r} is no call name. Give a str or None.")
  return Routing(static_layer_site(at, maker), k, experts, router)
