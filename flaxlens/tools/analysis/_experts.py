"""Experts of mixture-of-experts layers as sites: capture, edit and sweep one expert.

`fl.experts(at, which)` names experts of the MoE layers `at` names, found as
`_experts_layers.py` finds them: one call per expert, one call whose output has an
expert axis (stacked weights, dense `einsum` or capacity dispatch), or one call whose
output rows are grouped by expert (`jax.lax.ragged_dot`, the group sizes an argument).
Every edit is the one edit concept (`core/_edit.py`), made on the calls holding the
experts, each named expert's values edited on their own; captures are edits that record
them (`records`). An `Experts` site has every site-object capability but path patching
(`tools/base/_site_objects.py`); its sweeps run as `fl.sweep` does, one compiled
program. The routers are `_experts_routing.py`'s. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._edit import Edit
from flaxlens.core._functions import jit_keyed_on_function
from flaxlens.core._node import CallNode
from flaxlens.core._probes import active_probing
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import SelectionError
from flaxlens.tools.analysis._experts_layers import (
  Layer,
  Layout,
  expert_numbers,
  moe_layers,
  shown_site,
  static_layer_site,
)
from flaxlens.tools.analysis._head_settings import value_spec
from flaxlens.tools.analysis._sweeps import (
  SitePatch,
  indexed_run,
  row_labels,
  scan_iteration,
  sweep_forwards,
)
from flaxlens.tools.base._intervention import Intervention
from flaxlens.tools.base._probed import Copies
from flaxlens.tools.base._site_objects import SweepOptions, SweptUnits
from flaxlens.tools.base._sites import Site, sites_of

# --- the edits -----------------------------------------------------------------------------


def _expert_index(layout: Layout, expert: int) -> tuple:
  """The index of expert `expert` on a value with an expert axis (`layout.axis`)."""
  return (Ellipsis, expert) + (slice(None),) * (-layout.axis - 1)


def _group_rows(layout: Layout, argument: ArgsAndKwargs, value: Any, expert: int) -> Any:
  """Whether each row of `value` is expert `expert`'s, from the call's group sizes,
  shaped to broadcast against `value`."""
  sizes = argument.args[layout.sizes]
  ends = jnp.cumsum(sizes)
  rows = jnp.arange(value.shape[0])
  mine = (rows >= ends[expert] - sizes[expert]) & (rows < ends[expert])
  return mine.reshape((-1,) + (1,) * (value.ndim - 1))


class ExpertEdit(Struct):
  """An intervention applied to some experts of a stacked call's output, each expert's
  values edited on their own (`[..., e, :]` on the expert axis, or the expert's rows of
  a grouped output), the others kept.

  Attributes:
    intervention: the edit, applied to each expert's values.
    layout: how the output holds the experts ("axis" or "grouped").
    which: the experts edited.
  """

  intervention: Intervention
  layout: Layout = static_field()
  which: tuple[int, ...] = static_field()
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    for expert in self.which:
      if self.layout.kind == "axis":
        index = _expert_index(self.layout, expert)
        value = value.at[index].set(self.intervention.edit(site, argument, value[index]))
      else:
        mine = _group_rows(self.layout, argument, value, expert)
        value = jnp.where(mine, self.intervention.edit(site, argument, value), value)
    return value


class ExpertCapture(Struct):
  """Records each named expert's values of a call's output as `"<layer>:expert <e>"`
  (the call's whole output for a call per expert; `[..., e, :]` on the expert axis; a
  grouped output with the other experts' rows zero) and changes nothing."""

  records = True
  on = "output"
  part = None
  layout: Layout = static_field()
  keys: tuple[tuple[int, str], ...] = static_field()
  shape: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    probing = active_probing()
    if probing is None:
      return value
    for expert, key in self.keys:
      shape = None if self.shape is None else (lambda x, key=key: self.shape(key, x))
      if self.layout.kind == "modules":
        probing.record(key, value, shape)
      elif self.layout.kind == "axis":
        probing.record(key, value[_expert_index(self.layout, expert)], shape)
      else:
        mine = _group_rows(self.layout, argument, value, expert)
        probing.record(key, jnp.where(mine, value, 0), shape)
    return value


# --- expert sites ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Experts:
  """An expert site: some experts of the MoE layers `at` names (made by `fl.experts`).

  Interventions (`fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify`) take it
  as their site and edit each named expert's output on its own; `fl.run`/`fl.capture`
  capture each as `"<layer>:expert <e>"`; `fl.sweep` patches one (layer, expert) at a
  time.

  Attributes:
    at: the MoE layers: a path pattern, a module class or a predicate.
    which: the experts named (None: every expert).
    experts: the name of the call (or numbered calls) holding the experts, or None.
    router: the name of the router call, or None.

  Example:
    >>> import flaxlens as fl
    >>> fl.experts("block_*/moe", [0, 3])
    fl.experts('block_*/moe', [0, 3])
  """

  at: Any
  which: tuple[int, ...] | None = None
  experts: str | None = None
  router: str | None = None

  def __repr__(self) -> str:
    shown = [shown_site(self.at)]
    if self.which is not None:
      shown.append(repr(list(self.which)))
    shown += [f"{k}={v!r}" for k, v in (("experts", self.experts), ("router", self.router)) if v]
    return f"fl.experts({', '.join(shown)})"

  def layers(self, tree: CallNode, sites: list[Site] | None = None) -> list[Layer]:
    """The MoE layers named, each with its experts' calls, layout and router."""
    return moe_layers(self, self.which, tree, sites_of(tree) if sites is None else sites)

  def edits_of(
    self, tree: CallNode, sites: list[Site], intervention: Intervention
  ) -> list[tuple[Site, Edit]]:
    """The calls holding the named experts and the edit each runs (`fl.run`)."""
    if intervention.on != "output" or intervention.part is not None:
      raise SelectionError(
        f"{intervention.at!r}: an expert site edits the experts' outputs; on= and part="
        " would name another value. Leave them out of the intervention."
      )
    out = []
    for layer in self.layers(tree, sites):
      if layer.layout.kind == "modules":
        out.extend((layer.experts[e], intervention) for e in layer.which)
      else:
        out.append((layer.experts[0], ExpertEdit(intervention, layer.layout, layer.which)))
    return out

  def capture_edits(
    self, tree: CallNode, sites: list[Site], shape: Callable[[str, Any], Any] | None
  ) -> list[tuple[Site, Edit]]:
    """The edits recording each named expert as `"<layer>:expert <e>"` (`fl.run`)."""
    out = []
    for layer in self.layers(tree, sites):
      keys = tuple((e, f"{layer.name}:expert {e}") for e in layer.which)
      if layer.layout.kind == "modules":
        out.extend(
          (layer.experts[e], ExpertCapture(layer.layout, ((e, key),), shape)) for e, key in keys
        )
      else:
        out.append((layer.experts[0], ExpertCapture(layer.layout, keys, shape)))
    return out

  def sweep_units(
    self, tree: CallNode, clean: Any, corrupted: Any, metric: Any, options: SweepOptions
  ) -> SweptUnits:
    """`fl.sweep` over these experts: one row per (layer, expert), named
    `"block_0/moe expert 3"`, the clean expert's output patched into the corrupted run."""
    if options.positions is not None or options.part is not None:
      raise SelectionError(
        f"{self!r}: an experts sweep patches each expert's whole output; positions= and"
        " part= are not taken. Leave them out, or sweep the layer's calls by site pattern."
      )
    layers = self.layers(tree)
    grouped = [layer.name for layer in layers if layer.layout.kind == "grouped"]
    if grouped:
      raise SelectionError(
        f"{grouped[0]}: its experts' rows are grouped by the run's own routing, so a clean"
        " run's rows of an expert are other tokens than a corrupted run's: they cannot be"
        " patched across. Sweep by ablation: fl.run with fl.ablate(fl.experts(at, e)) per e."
      )
    run = _sweep_compiled if options.jit else _sweep_experts
    values, rows, (clean_metric, corrupted_metric) = run(
      tree, clean, corrupted, self, metric, options.chunk_size, options.random_streams
    )
    names = []
    for layer, row in zip(layers, rows, strict=True):
      for index in np.ndindex(*row.shape):
        label = layer.name + (f"[{','.join(map(str, index))}]" if index else "")
        names.extend(f"{label} expert {e}" for e in layer.which)
    return SweptUnits(values, tuple(names), None, clean_metric, corrupted_metric)


def experts(
  at: Any, which: Any = None, *, experts: str | None = None, router: str | None = None
) -> Experts:
  """Names experts of mixture-of-experts layers as a site: capture, edit and sweep them.

  `at` names MoE layers: calls whose own sub-calls hold the experts, in one of the ways
  JAX libraries write them: one module per expert (calls numbered `0..n-1`:
  `experts_3`, `experts/3`); one module holding stacked weights `[experts, ...]` whose
  output has the expert axis (dense `einsum` dispatch, `[..., experts, features]`, or a
  capacity buffer `[experts, capacity, features]`); or one such module that takes the
  group sizes `[experts]` as a positional argument (`jax.lax.ragged_dot`): expert `e`
  is the rows its group size gives. An intervention on an expert site edits each named
  expert's output on its own (an ablated expert contributes nothing to the layer's
  output); `fl.capture` returns each as `"<layer>:expert <e>"` (a grouped output with
  the other experts' rows zero), which patches the same site of another run; `fl.sweep`
  patches one (layer, expert) at a time, every forward in one compiled program.
  The router's logits and the chosen experts are `fl.routing`'s.

  Args:
    at: the MoE layers: a path pattern (`"block_*/moe"`), a module class or a predicate.
    which: an expert number or a list of them (negative count from the end); None: all.
    experts: the name (in the layer) of the call holding the experts, or the prefix of
      the numbered calls, where more than one could be.
    router: the name of the router call, where more than one could be.

  Returns:
    A `fl.experts` site (an `Experts`).

  Raises:
    SelectionError: (when the run is traced) a call whose experts flaxlens cannot see
      (computed in the layer's own code), an expert out of range.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> class Moe(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     gates = jax.nn.softmax(nn.Dense(2, name="router")(x))
    ...     out = jnp.stack([nn.Dense(3, name=f"experts_{e}")(x) for e in range(2)], -2)
    ...     return jnp.einsum("be,bed->bd", gates, out)
    >>> x = jnp.ones((1, 3))
    >>> tree = fl.unflaxify(Moe(), Moe().init(jax.random.key(0), x), x)
    >>> _, cache = fl.capture(tree, x, at=fl.experts("Moe.__call__", 1))
    >>> list(cache)
    ['Moe.__call__:expert 1']
    >>> out = fl.run(tree, x, interventions=[fl.ablate(fl.experts("Moe.__call__", 0))])
  """
  maker = f"fl.experts({at!r})"
  for name, value in (("experts", experts), ("router", router)):
    if value is not None and not isinstance(value, str):
      raise SelectionError(f"{maker}: {name}={value!r} is no call name. Give a str or None.")
  return Experts(static_layer_site(at, maker), expert_numbers(which, maker), experts, router)


# --- sweeps over experts --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ExpertPatcher:
  """The edit of one expert call in every patched forward: the clean value of the
  expert the forward's unit names (where this call holds it), the corrupted elsewhere.

  Attributes:
    name: the call's site name.
    base: the first unit of this call's layer.
    lead: the scan axes the call's values are stacked on.
    layout: how the call holds its experts.
    which: the experts swept, in unit order.
    own: for one call per expert, which position in `which` this call is; else None.
  """

  name: str
  base: int
  lead: tuple[int, ...]
  layout: Layout
  which: tuple[int, ...]
  own: int | None

  def __call__(self, argument: Any, value: Any, clean: Any, unit: Any, at: Any) -> Any:
    del argument, at
    found = scan_iteration(self.name, self.lead)
    if found is None:
      return value
    iterations, number = found
    if iterations:
      clean = clean[tuple(iterations)]
    n = len(self.which)
    relative = unit - self.base - number * n
    if self.own is not None:
      return jnp.where(relative == self.own, clean, value)
    expert = jnp.asarray(self.which)[jnp.clip(relative, 0, n - 1)]
    chosen = (relative >= 0) & (relative < n) & (jnp.arange(self.layout.count) == expert)
    return jnp.where(chosen.reshape((-1,) + (1,) * (-self.layout.axis - 1)), clean, value)


def _sweep_experts(tree, clean, corrupted, spec, metric, chunk_size, streams):
  sites = sites_of(tree)
  layers = spec.layers(tree, sites)
  calls = [(layer, k, site) for layer in layers for k, site in enumerate(layer.experts)]
  chosen = tuple(sites.index(site) for _, _, site in calls)
  copies = Copies(tree, chosen)
  copy, copied = copies.fresh()
  clean_output, cache = indexed_run(copy, clean, (), tuple(s.node for s in copied), streams)
  patches, leads, base = [], [], 0
  for layer in layers:
    members = [(k, site) for owner, k, site in calls if owner is layer]
    first = cache[members[0][1].name]
    lead = tuple(first.shape[: first.ndim - len(value_spec(members[0][1], "output").shape)])
    for k, site in members:
      own = layer.which.index(k) if layer.layout.kind == "modules" and k in layer.which else None
      if layer.layout.kind == "modules" and own is None:
        own = -1  # an expert not swept: no unit is its own
      patcher = _ExpertPatcher(site.name, base, lead, layer.layout, layer.which, own)
      patches.append(SitePatch("output", None, cache[site.name], patcher))
    leads.append(lead)
    base += math.prod(lead) * len(layer.which)
  values, baselines = sweep_forwards(
    copies, clean_output, patches, base, corrupted, metric, None, chunk_size, streams
  )
  return values, row_labels(leads), baselines


_sweep_compiled = jit_keyed_on_function(_sweep_experts, "metric", "fl.sweep")
