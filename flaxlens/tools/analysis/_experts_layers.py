"""Finding the MoE layers a site names: their experts' calls and layout, their router.

Used by `fl.experts` (`_experts.py`) and `fl.routing` (`_experts_routing.py`). An MoE
layer is any call whose own sub-calls hold its experts, read from what a converted tree
shows: calls numbered `0..n-1` of one module type (one module per expert), or a call of
a module whose parameters all lead with the expert axis (stacked weights) whose output
has that axis or that takes the group sizes; the router is the other sub-call whose
output ends in one logit per expert. No Flax internals here.
"""

from __future__ import annotations

import re
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._node import CallNode
from flaxlens.errors import SelectionError
from flaxlens.tools.analysis._head_settings import own_calls, value_spec
from flaxlens.tools.base._sites import Site, select_sites

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


def _shape(value: Any) -> tuple[int, ...] | None:
  """The shape of an abstract array; None for anything else (a tuple, nothing)."""
  return tuple(value.shape) if isinstance(value, jax.ShapeDtypeStruct) else None


def _structure(site: Site) -> tuple:
  """What calls of experts share: the module type, the output's and first argument's
  shapes, and the shapes of the parameters of every call inside, in call order (so a
  router `Dense_0` and an output projection `Dense_1` are not taken for two experts)."""
  shapes, frontier = [], [site.node]
  while frontier:
    node = frontier.pop(0)
    held = sorted(node.scope_data.parameters.items())
    shapes.append(tuple((name, np.shape(p.value)) for name, p in held))
    frontier.extend(c for c in node.submodule_calls.values() if isinstance(c, CallNode))
  values = tuple(_shape(value_spec(site, on)) for on in ("output", "input"))
  return site.node.module_type, values, tuple(shapes)


def _numbered(children: list[tuple[str, Site]], named: str | None) -> dict[str, list[Site]]:
  """Groups of calls numbered `0..n-1` (n >= 2) of the same structure (`_structure`), by
  their common prefix (`"experts"`); only the prefix `named` where one is given."""
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
    and len({_structure(m) for m in members.values()}) == 1
  }


def _expert_counts(site: Site) -> list[int]:
  """The sizes that could be the call's stacked expert axis, most likely first: the size
  every parameter of its module shares on one axis, each keeping at least one axis after
  it. That axis is the first (`[experts, ...]`); in a call whose variables a lifted
  transform slices (`nn.scan`/`nnx.scan` over layers: `[layers, experts, ...]`), the
  first holds the transform's iterations, so the axes after it, outermost first. Empty
  for no parameters or a scalar one.
  """
  shapes = [np.shape(p.value) for p in site.node.scope_data.parameters.values()]
  if not shapes or any(len(shape) < 2 for shape in shapes):
    return []
  deepest = min(len(shape) for shape in shapes) - 1
  axes = range(1, deepest) if site.node.sliced else [0]
  sizes = [{shape[axis] for shape in shapes} for axis in axes]
  return [size.pop() for size in sizes if len(size) == 1 and min(size) >= 2]


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
    (site, counts)
    for name, site in children
    if (named is None or name == named) and (counts := _expert_counts(site))
  ]
  for site, counts in reversed(stacked):  # the last call that holds them: their output
    for count in counts:
      layout = _stacked_layout(site, count)
      if layout is not None:
        return (site,), layout
  if stacked:
    site, counts = stacked[-1]
    count = counts[0]
    shape = _shape(value_spec(site, "output"))
    raise SelectionError(
      f"{layer.name}: {site.name} holds {count} stacked experts, but flaxlens cannot see"
      f" where each expert's values are: its output {shape} has not exactly one axis of"
      f" size {count}, and no positional argument is the [{count}] group sizes. Convert"
      f" with example arguments whose sizes differ from {count} (batch, length,"
      f" features), or make the call return [..., {count}, features]."
    )
  raise _refuse_unseen(layer, named, [name for name, _ in children])


def _find_router(
  layer: Site, sites: list[Site], experts: tuple[Site, ...], count: int, named: str | None
) -> Site | None:
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


def moe_layers(spec: Any, which: Any, tree: CallNode, sites: list[Site]) -> list[Layer]:
  """The MoE layers `spec.at` names (`spec`: an `fl.experts` or `fl.routing` site, whose
  `experts`/`router` name the calls where given), `which` experts of each (None: all); a
  call inside a layer already found is that layer's.

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
    which = checked_experts(which, layout.count, site.name)
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


def static_layer_site(at: Any, maker: str) -> Any:
  if isinstance(at, CallNode):
    raise SelectionError(
      f"{maker}: give the layer's path pattern ('{at.readable_path()[0]}'), a module class or"
      " a predicate: a call node is not kept by compiled runs."
    )
  return tuple(at) if isinstance(at, list) else at


def shown_site(at: Any) -> str:
  """How a site's `repr` shows the layers it names: a pattern quoted, a class or a
  function by name."""
  if isinstance(at, str):
    return repr(at)
  return at.__qualname__ if isinstance(at, type | types.FunctionType) else "…"


def expert_numbers(which: Any, maker: str) -> tuple[int, ...] | None:
  if which is None:
    return None
  items = np.asarray([which] if isinstance(which, int | np.integer) else which)
  if isinstance(which, bool) or items.size == 0 or not np.issubdtype(items.dtype, np.integer):
    raise SelectionError(
      f"{maker}: {which!r} names no experts. Give an expert number or a list of them."
    )
  return tuple(int(e) for e in items.reshape(-1))
