"""Experts and routers of mixture-of-experts layers as sites: `fl.experts`, `fl.routing`.

An MoE layer is any call whose own sub-calls hold its experts, found from what a
converted tree shows (calls, their values, their parameters), never from class names.
The experts are one of three layouts: one call per expert (sub-calls of one module
type numbered `0..n-1`: `experts_3`, `experts/3`); one call of a module whose parameters
all lead with the expert axis (`[experts, ...]`, the last such call: stacked weights),
whose output holds the experts on the one axis of that size (dense `einsum` dispatch,
or a capacity buffer `[experts, capacity, features]`); or such a call whose output has
no expert axis and whose positional arguments include the group sizes `[experts]`
(`jax.lax.ragged_dot`): expert `e` is the rows `[start_e, end_e)` of its output. The
router is the other sub-call whose output ends in the expert axis. Experts computed in
the layer's own code (an einsum on the layer's own stacked parameters) are a value no
edit reaches: they are refused, naming the layer and how to make them a call.
Every edit is the one edit concept (`core/_edit.py`), made where the experts are; a
`fl.experts` site has every capability but path patching, `fl.routing` is captured and
intervened on (its interventions edit the router's logits). No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._edit import Edit
from flaxlens.core._functions import jit_keyed_on_function
from flaxlens.core._node import CallNode
from flaxlens.core._probes import active_probing
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import SelectionError
from flaxlens.tools.analysis._head_settings import own_calls, setting_of, value_spec
from flaxlens.tools.analysis._sweeps import (
  SitePatch,
  indexed_run,
  row_labels,
  scan_iteration,
  sweep_forwards,
)
from flaxlens.tools.base._intervention import Intervention, make_intervention
from flaxlens.tools.base._probed import Copies
from flaxlens.tools.base._site_objects import SweepOptions, SweptUnits
from flaxlens.tools.base._sites import Site, select_sites, sites_of

TOP_K_SETTINGS = (
  "num_experts_per_tok",
  "num_experts_per_token",
  "num_selected_experts",
  "experts_per_token",
  "top_k",
  "k",
)
_NUMBERED = re.compile(r"^(.*?)[_/.](\d+)$")
_MAKE_A_CALL = (
  "Compute the experts in a submodule of their own: one module per expert, or one module"
  " holding the stacked weights [experts, ...] whose output has an expert axis (dense"
  " einsum dispatch, a capacity buffer) or that takes the group sizes (ragged_dot)."
)

# --- finding an MoE layer's experts and router --------------------------------------------


class Layout(NamedTuple):
  """How a layer's experts are held.

  Attributes:
    kind: "modules" (one call per expert), "axis" (one call's output has an expert
      axis) or "grouped" (one call's output rows are grouped by expert, their sizes an
      argument of the call).
    count: the number of experts.
    axis: for "axis", the expert axis counted from the end (negative); else None.
    sizes: for "grouped", which positional argument holds the group sizes; else None.
  """

  kind: str
  count: int
  axis: int | None = None
  sizes: int | None = None


class Layer(NamedTuple):
  """One MoE layer as a site of experts (and its router).

  Attributes:
    name: the layer's site name (`"block_0/moe"`): captures and rows are named after it.
    experts: the calls holding the experts: one per expert ("modules"), else one.
    layout: how they hold them.
    router: the router call, or None where none was found.
    which: the experts named, in order.
  """

  name: str
  experts: tuple[Site, ...]
  layout: Layout
  router: Site | None
  which: tuple[int, ...]


def _children(sites: list[Site], layer: Site) -> list[tuple[str, Site]]:
  """The calls the layer's module makes (in its own calls), as `(name, site)`."""
  by_node = {id(s.node): s for s in sites}
  out = []
  for node in own_calls(layer.node):
    for key, child in node.submodule_calls.items():
      if isinstance(child, CallNode) and tuple(child.path) != tuple(layer.node.path):
        if id(child) in by_node:
          out.append((key[1].rsplit(".", 1)[0], by_node[id(child)]))
  return out


def _numbered(children: list[tuple[str, Site]], named: str | None) -> dict[str, list[Site]]:
  """Groups of calls of one module type numbered `0..n-1` (n >= 2), by their common
  prefix (`"experts"`); only the prefix `named` where one is given."""
  groups: dict[str, dict[int, Site]] = {}
  for name, site in children:
    found = _NUMBERED.match(name)
    if found is not None and (named is None or found[1] == named):
      groups.setdefault(found[1], {})[int(found[2])] = site
  return {
    prefix: [members[i] for i in range(len(members))]
    for prefix, members in groups.items()
    if len(members) >= 2
    and sorted(members) == list(range(len(members)))
    and len({m.node.module_type for m in members.values()}) == 1
  }


def _leading(site: Site) -> int | None:
  """The leading size every parameter of the call's module shares (its stacked expert
  axis), or None (no parameters, a scalar one, or differing sizes)."""
  shapes = [np.shape(p.value) for p in site.node.scope_data.parameters.values()]
  if not shapes or any(len(s) < 2 for s in shapes) or len({s[0] for s in shapes}) != 1:
    return None
  return shapes[0][0] if shapes[0][0] >= 2 else None


def _stacked_layout(site: Site, count: int) -> Layout | None:
  """The layout of a stacked-weights call: "axis" where its output has one axis of size
  `count`, "grouped" where it has none and a positional argument is `[count]` integers;
  None where neither (or several axes could be the expert axis)."""
  output = value_spec(site, "output")
  if not isinstance(output, jax.ShapeDtypeStruct):
    return None
  axes = [a - len(output.shape) for a, n in enumerate(output.shape) if n == count]
  if len(axes) == 1:
    return Layout("axis", count, axis=axes[0])
  if axes or site.inputs is None:
    return None
  args = jax.tree_util.tree_unflatten(*site.inputs)[0]
  sizes = [
    n
    for n, a in enumerate(args)
    if isinstance(a, jax.ShapeDtypeStruct)
    and a.shape == (count,)
    and jnp.issubdtype(a.dtype, jnp.integer)
  ]
  return Layout("grouped", count, sizes=sizes[0]) if len(sizes) == 1 else None


def _refuse_unseen(layer: Site, named: str | None, names: list[str]) -> SelectionError:
  own = {k: np.shape(p.value) for k, p in layer.node.scope_data.parameters.items()}
  held = (
    f" Its own parameters {own} are used in its own code, where no edit reaches." if own else ""
  )
  looked = f"no call named {named!r}_<n> or {named!r}" if named else "no calls"
  return SelectionError(
    f"{layer.name}: flaxlens cannot see into this layer's expert dispatch: it makes"
    f" {looked} of one module numbered 0..n-1, and no call of a module whose parameters all"
    f" lead with an expert axis and whose output has that axis or that takes the group"
    f" sizes (its calls: {names[:8]}).{held} {_MAKE_A_CALL} Or name the call holding the"
    " experts: fl.experts(at, experts='name')."
  )


def _find_experts(
  layer: Site, sites: list[Site], named: str | None
) -> tuple[tuple[Site, ...], Layout]:
  """The calls holding the layer's experts and their layout (see the module docstring).

  Raises:
    SelectionError: no experts found, or several groups that could be them.
  """
  children = _children(sites, layer)
  groups = _numbered(children, named)
  if len(groups) > 1:
    raise SelectionError(
      f"{layer.name}: several groups of numbered calls could be its experts"
      f" ({sorted(groups)}). Name the group: fl.experts(at, experts='{sorted(groups)[0]}')."
    )
  if groups:
    members = next(iter(groups.values()))
    return tuple(members), Layout("modules", len(members))
  stacked = [
    (s, _leading(s)) for name, s in children if (named is None or name == named) and _leading(s)
  ]
  if stacked:
    site, count = stacked[-1]
    layout = _stacked_layout(site, count)
    if layout is not None:
      return (site,), layout
    output = value_spec(site, "output")
    shape = tuple(output.shape) if isinstance(output, jax.ShapeDtypeStruct) else output
    raise SelectionError(
      f"{layer.name}: {site.name} holds {count} stacked experts, but flaxlens cannot see"
      f" where each expert's values are: its output {shape} has not exactly one axis of"
      f" size {count}, and no positional argument is the [{count}] group sizes. Convert"
      f" with example arguments whose sizes differ from {count} (batch, length,"
      f" features), or make the call return [..., {count}, features]."
    )
  raise _refuse_unseen(layer, named, [name for name, _ in children])


def _find_router(layer: Site, sites: list[Site], experts: tuple[Site, ...], count: int, named):
  """The layer's router: the other call it makes whose output ends in `count` logits
  (the call named `named` where given), or None."""
  held = {id(s.node) for s in experts}
  found = []
  for name, site in _children(sites, layer):
    if id(site.node) in held or (named is not None and name != named):
      continue
    output = value_spec(site, "output")
    if isinstance(output, jax.ShapeDtypeStruct) and output.shape[-1:] == (count,):
      found.append(site)
  if len(found) > 1:
    raise SelectionError(
      f"{layer.name}: several calls could be its router (outputs ending in {count}"
      f" logits: {[s.name for s in found]}). Name it: router='{found[0].name.rsplit('/', 1)[-1]}'."
    )
  return found[0] if found else None


def _layers(spec: Experts | Routing, tree: CallNode, sites: list[Site]) -> list[Layer]:
  """The MoE layers `spec.at` names (a call inside a layer already found is that layer's).

  Raises:
    SelectionError: nothing named, a call without experts found, an expert out of range.
  """
  matched = select_sites(tree, spec.at, sites)
  if not matched:
    raise SelectionError(
      f"{spec!r}: the pattern names no call of this tree. Name the MoE layers' calls"
      " ('block_*/moe'); fl.summary(tree) lists them."
    )
  found: list[Layer] = []
  paths: list[tuple] = []
  for site in matched:
    path = tuple(site.node.path)
    if any(len(path) > len(p) and path[: len(p)] == p for p in paths):
      continue
    experts, layout = _find_experts(site, sites, spec.experts)
    router = _find_router(site, sites, experts, layout.count, spec.router)
    which = checked_experts(
      spec.which if isinstance(spec, Experts) else None, layout.count, site.name
    )
    found.append(Layer(site.name, experts, layout, router, which))
    paths.append(path)
  return found


def checked_experts(which: tuple[int, ...] | None, count: int, name: str) -> tuple[int, ...]:
  """The experts named, made non-negative; every expert where None.

  Raises:
    SelectionError: an expert out of range, or one named twice.
  """
  if which is None:
    return tuple(range(count))
  outside = [e for e in which if not -count <= e < count]
  if outside:
    raise SelectionError(
      f"{name}: experts {outside} are out of range; this layer has {count} experts. Give"
      f" expert numbers from 0 to {count - 1} (negative ones count from the end)."
    )
  out = tuple(e % count for e in which)
  if len(set(out)) < len(out):
    raise SelectionError(f"{name}: which={list(which)} names an expert twice. Name each once.")
  return out


def _static_site(at: Any, maker: str) -> Any:
  if isinstance(at, CallNode):
    raise SelectionError(
      f"{maker}: give the layer's path pattern ('{at.readable_path()[0]}'), a module class or"
      " a predicate: a call node is not kept by compiled runs."
    )
  return tuple(at) if isinstance(at, list) else at


def _expert_numbers(which: Any, maker: str) -> tuple[int, ...] | None:
  if which is None:
    return None
  items = np.asarray([which] if isinstance(which, int | np.integer) else which)
  if isinstance(which, bool) or items.size == 0 or not np.issubdtype(items.dtype, np.integer):
    raise SelectionError(
      f"{maker}: {which!r} names no experts. Give an expert number or a list of them."
    )
  return tuple(int(e) for e in items.reshape(-1))


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
    shown = [repr(self.at) if isinstance(self.at, str) else getattr(self.at, "__name__", "…")]
    if self.which is not None:
      shown.append(repr(list(self.which)))
    shown += [f"{k}={v!r}" for k, v in (("experts", self.experts), ("router", self.router)) if v]
    return f"fl.experts({', '.join(shown)})"

  def layers(self, tree: CallNode, sites: list[Site] | None = None) -> list[Layer]:
    """The MoE layers named, each with its experts' calls, layout and router."""
    return _layers(self, tree, sites_of(tree) if sites is None else sites)

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
  return Experts(_static_site(at, maker), _expert_numbers(which, maker), experts, router)


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


# --- routing --------------------------------------------------------------------------------


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
    shown = [repr(self.at) if isinstance(self.at, str) else getattr(self.at, "__name__", "…")]
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
    for layer in _layers(self, tree, sites):
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
    named = _expert_numbers(experts, f"{self!r}.{how}")
    edit = RouteEdit(named, ()) if how == "force" else RouteEdit((), named)
    return make_intervention("modify", self, (), None, "output", None, fn=edit)

  def load(self, tree: CallNode, values: Any) -> np.ndarray:
    """Tokens routed to each expert of one layer: from its captured `"<layer>:chosen"`
    (integers) or router logits (`"<layer>:router_logits"`, or a harvest's rows of the
    router call, `fl.open_harvest(path)["block_0/moe/router"]`), read in blocks.

    Returns:
      The count per expert (`int64`, `[experts]`); divide by its sum for the fractions.
    """
    layers = _layers(self, tree, sites_of(tree))
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
  return Routing(_static_site(at, maker), k, experts, router)
