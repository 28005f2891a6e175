"""Path patching: the effect of a sender on the output through chosen receivers only.

`fl.path_patch` runs the three runs of path patching (Wang et al. 2022, "Interpretability
in the wild") in one compiled program. (1) A clean and a corrupted run keep the values
of the senders, the receivers and the frozen calls. (2) For each sender, a clean run
with that sender's value replaced by its corrupted value and every frozen call's value
replaced by its clean value records the receivers' values. (3) A clean run with the
receivers' values replaced by those recorded gives the metric. Runs (2) and (3) of every
sender run batched with `jax.vmap`, as `fl.sweep` batches its patched forwards: every
edited call holds one edit whose choice (corrupted, clean, or the value the run computes)
is read from a table by the forward's number, so the forwards are one program.

Which calls are frozen: every call that the senders' or the receivers' sites match (the
components the question is about) and every call `freeze=` names, except, in the
forward of one sender, the calls that contain that sender or that it contains (freezing
them would cut the path itself or undo the sender's edit). A receiver's value is
recorded before its own edit, and after recording it takes the role it has as a
component: receivers never feed each other, so a set of receivers records what each
receiver alone records. The order of calls (which receiver a sender can reach) is the
tree's call order (`core/_walk.py`). No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._edit import EditedCall
from flaxlens.core._functions import jit_keyed_on_function
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._probes import active_probing
from flaxlens.core._walk import Relation, calls
from flaxlens.errors import ArgumentError, SelectionError, UnsupportedFlaxFeatureError
from flaxlens.tools.analysis import _statistics
from flaxlens.tools.analysis._sweep_result import SweepResult
from flaxlens.tools.analysis._sweeps import UNREACHED_IN_PAIRED_RUNS, metric_value, paired_runs
from flaxlens.tools.base._calling import (
  check_callable,
  takes_model_arguments,
)
from flaxlens.tools.base._index import MASK, index_text
from flaxlens.tools.base._intervention import Intervention, make_intervention, where_mask
from flaxlens.tools.base._parts import get_part, set_part
from flaxlens.tools.base._probed import Copies, edited_calls, probed_run
from flaxlens.tools.base._site_objects import PathPatchable, SiteObject, refuse_site_object
from flaxlens.tools.base._sites import Site, check_part, select_sites, sites_of

# --- what the user names ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sites:
  """Calls narrowed to one side and to slices of their value: the senders or receivers of
  `fl.path_patch`.

  Attributes:
    at: the calls, as `fl.run` names sites: a path pattern (`"Block_*/attn"`), a Flax
      module class, a call node, a predicate on call nodes, or a list of these.
    on: "output" (default) or "input" (the call's first positional argument).
    where: None (the whole value), one index or boolean mask (`jnp.s_[..., 2, :]`: head 2
      of a `(..., heads, head_dim)` value), or a list of them: each call then counts once
      per entry (one sender per head, say), in the list's order.
    part: for a call whose value is a tuple, dict or dataclass, which part (an index or
      key; `part=0` for a Hugging Face attention module's call, named
      `"transformer/h/2/attn.__call__"`; docs/interventions.md, "Structured values: part=").

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> slices = [jnp.s_[..., h, :] for h in range(4)]  # heads of (..., heads, head_dim)
    >>> heads = fl.Sites("**/attention/out", on="input", where=slices)
    >>> len(heads.where)
    4
  """

  at: Any
  on: str = "output"
  where: Any = None
  part: Any = None

  def __post_init__(self) -> None:
    if self.on not in ("output", "input"):
      raise ArgumentError(
        f"fl.Sites({self.at!r}): on= is 'output' or 'input' (the call's first positional"
        f" argument), got {self.on!r}. Pass one of these."
      )
    if isinstance(self.where, list) and not self.where:
      raise ArgumentError(
        f"fl.Sites({self.at!r}): where= is an empty list, which selects nothing. Give one"
        " index per slice (where=[jnp.s_[..., h, :] for h in range(heads)]), or leave it out."
      )

  def slices(self) -> tuple[Any, ...]:
    """The `where=` of each unit: one entry per element of a list, else `(where,)`."""
    return tuple(self.where) if isinstance(self.where, list) else (self.where,)


_Heads = dict[str, list[tuple[str, int]]]  # {call: [(site, head), ...]}, one per slice


def _as_sites(value: Any, tree: CallNode) -> tuple[tuple[Sites, _Heads], ...]:
  """`value` as a tuple of `(Sites, heads)` pairs: the heads are those its slices are
  (empty but for `fl.heads`; a site object that knows its slices says them). A list
  holding `fl.Sites` or such objects is one pair per element, in the list's order (each
  may name other calls, sides and slices); any other value, a plain list of sites
  included, is one pair."""

  def one(element: Any) -> tuple[Sites, _Heads]:
    if isinstance(element, PathPatchable):
      found = element.path_sites(tree)
      return Sites(found.calls, on=found.on, where=found.where), found.heads
    if isinstance(element, SiteObject):
      raise refuse_site_object(element, PathPatchable, "fl.path_patch")
    return (element if isinstance(element, Sites) else Sites(element)), {}

  if isinstance(value, list | tuple) and any(isinstance(e, Sites | SiteObject) for e in value):
    return tuple(one(e) for e in value)
  return (one(value),)


class _Unit(NamedTuple):
  """One sender or receiver: a call, and the edit that carries its `where=` (or None)."""

  site: int  # index among sites_of(tree)
  where: Intervention | None
  name: str  # the row's label: `"block_0/attn head 2"` for a head, else the call and slice
  on: str  # the side of the call: "output" or "input"
  part: Any
  head: tuple[str, int] | None  # the (site, head) of a head named by `fl.heads`


class _Plan(NamedTuple):
  """Everything a path patch decides before running (static but the `where=` arrays)."""

  senders: tuple[_Unit, ...]
  receivers: tuple[_Unit, ...]
  sides: tuple[tuple[int, str, Any], ...]  # every component: (site, on, part) it is frozen on
  frozen: tuple[tuple[bool, ...], ...]  # [sender][component]: frozen in that sender's forward
  each_receiver: bool


# --- call order ---------------------------------------------------------------------------


class _Order(NamedTuple):
  """When each call starts (`enter`, its input) and ends (`exit`, its output), as steps of
  one depth-first walk of the tree's calls."""

  enter: tuple[int, ...]
  exit: tuple[int, ...]

  def time(self, site: int, on: str) -> int:
    return self.enter[site] if on == "input" else self.exit[site]

  def nested(self, a: int, b: int) -> bool:
    """Whether one of the calls `a` and `b` contains the other (or they are one call)."""
    inside = self.enter[a] <= self.enter[b] and self.exit[b] <= self.exit[a]
    return inside or (self.enter[b] <= self.enter[a] and self.exit[a] <= self.exit[b])


def _order(tree: CallNode) -> _Order:
  own = [c for c in calls(tree) if c.relation is not Relation.REPLACED]
  index = {id(c.layer): i for i, c in enumerate(own)}
  enter, exit_, stack, step = [0] * len(own), [0] * len(own), [], 0
  for i, call in enumerate(own):
    parent = index.get(id(call.parent)) if call.parent is not None else None
    while stack and stack[-1] != parent:
      exit_[stack.pop()] = step
      step += 1
    enter[i] = step
    step += 1
    stack.append(i)
  while stack:
    exit_[stack.pop()] = step
    step += 1
  return _Order(tuple(enter), tuple(exit_))


# --- planning -----------------------------------------------------------------------------


def _units(
  tree: CallNode, sites: list[Site], specs: tuple[tuple[Sites, _Heads], ...], role: str
) -> tuple[_Unit, ...]:
  """The units of `specs` (`_as_sites`), in their order (each one's calls in call order);
  refuses a call that two of them name on different sides or parts."""
  units = []
  for spec, heads in specs:
    try:
      chosen = select_sites(tree, spec.at, sites)
    except SelectionError as e:
      raise SelectionError(f"fl.path_patch {role}: {e}") from None
    for site in chosen:
      for number, where in enumerate(spec.slices()):
        edit = make_intervention("zero", site.name, (), where, spec.on, spec.part)
        check_part(site, edit.part, spec.on, spec.at, sites)
        head = heads[site.name][number] if site.name in heads else None
        label = _label(site, spec, edit, head)
        where_edit = None if where is None else edit
        units.append(_Unit(sites.index(site), where_edit, label, spec.on, spec.part, head))
  for unit in units:
    other = next(
      (u for u in units if u.site == unit.site and (u.on, u.part) != (unit.on, unit.part)), None
    )
    if other is not None:
      raise SelectionError(
        f"fl.path_patch {role}: {sites[unit.site].name} is named on two sides or parts"
        f" ({unit.name}, on={unit.on!r}, part={unit.part!r}; {other.name}, on={other.on!r},"
        f" part={other.part!r}), and a call takes one role on one side. Name each call's"
        f" {role} on one side and part (a list of slices in one fl.Sites)."
      )
  return tuple(units)


def _label(site: Site, spec: Sites, edit: Intervention, head: tuple[str, int] | None) -> str:
  """A row's (or column's) label: as `fl.sweep` names a head (`"block_0/attn head 2"`),
  else the call, its side and its slice (`"block_0/attn/out:input[..., 2, :]"`)."""
  if head is not None:
    return f"{head[0]} head {head[1]}"
  name = site.name + (":input" if spec.on == "input" else "")
  if edit.index == MASK:
    return name + "[mask]"
  if edit.index is not None:
    return name + index_text(edit.index, edit.where_arrays)
  return name


def _listed(names: list[str]) -> str:
  return f"{names[:6]}{' ...' if len(names) > 6 else ''}"


def _check_reach(senders, receivers, order, each_receiver) -> None:
  """Refuses a receiver that is a sender, and senders that reach no receiver (and, with
  `each_receiver`, receivers that no sender reaches), by call order."""
  for s in senders:
    for r in receivers:
      if s.site == r.site and s.on == r.on:
        raise SelectionError(
          f"fl.path_patch: the receiver {r.name} is the sender {s.name}'s own call and side:"
          " a path from a value to itself is activation patching. Use fl.sweep for that, or"
          " give the receivers on the other side of the call (fl.Sites(..., on='input'))."
        )

  def reaches(s: _Unit, r: _Unit) -> bool:
    return order.time(r.site, r.on) > order.time(s.site, s.on)

  fix = (
    " Choose senders that run before the receivers (a list of the earlier layers'"
    " sites, say), or receivers that run after the senders; with on='input', a"
    " receiver's value is read when its call starts."
  )
  lone = [s.name for s in senders if not any(reaches(s, r) for r in receivers)]
  if lone:
    raise SelectionError(
      f"fl.path_patch: the sender(s) {_listed(lone)} run after every receiver"
      f" {_listed([r.name for r in receivers])} (in the tree's call order), so no path"
      f" leads from them to a receiver.{fix}"
    )
  if each_receiver:
    unreached = [r.name for r in receivers if not any(reaches(s, r) for s in senders)]
    if unreached:
      raise SelectionError(
        f"fl.path_patch: no sender reaches the receiver(s) {_listed(unreached)}: they run"
        f" before every sender {_listed([s.name for s in senders])} (in the tree's call"
        f" order).{fix}"
      )


def _plan(tree, senders: tuple, receivers: tuple, freeze: Any, each_receiver: bool) -> _Plan:
  """The plan of a path patch; `senders` and `receivers` as `_as_sites` gives them."""
  sites = sites_of(tree)
  sending = _units(tree, sites, senders, "senders")
  receiving = _units(tree, sites, receivers, "receivers")
  order = _order(tree)
  _check_reach(sending, receiving, order, each_receiver)
  sides: dict[int, tuple[str, Any]] = {}
  for unit in (*sending, *receiving):
    sides.setdefault(unit.site, (unit.on, unit.part))
  if freeze is not None:
    try:
      frozen_sites = select_sites(tree, freeze, sites)
    except SelectionError as e:
      raise SelectionError(f"fl.path_patch freeze: {e}") from None
    for site in frozen_sites:
      sides.setdefault(sites.index(site), ("output", None))
  components = tuple((k, on, part) for k, (on, part) in sorted(sides.items()))
  frozen = tuple(
    tuple(not order.nested(k, unit.site) or k == unit.site for k, _, _ in components)
    for unit in sending
  )
  return _Plan(sending, receiving, components, frozen, each_receiver)


# --- running ------------------------------------------------------------------------------


class _SideEdit:
  """An edit of one side of a call, as `EditedCall` applies edits: `fn(value) -> value`;
  it may record values (`_record`: the receivers' values)."""

  records = True
  part = None

  def __init__(self, on: str, fn: Callable[[Any], Any]):
    self.on = on
    self.fn = fn

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    del site, argument
    return self.fn(value)


def _first_argument_count(site: Site) -> int:
  if site.inputs is None:
    return 1
  treedef, leaves = site.inputs
  args, _ = jax.tree_util.tree_unflatten(treedef, leaves)
  return len(args)


def _side(cache: dict[str, Any], site: Site, on: str) -> Any:
  """A site's value on side `on` in a capture made with `inputs=True`."""
  if on == "output":
    return cache[site.name]
  value = cache[f"{site.name}:input"]
  return value[0] if _first_argument_count(site) > 1 else value


def _check_unstacked(site: Site, value: Any) -> None:
  """Refuses a call inside an `nn.scan`/`nnx.scan` or `vmap` body (captured stacked)."""
  if site.output is None:
    return
  treedef, leaves = site.output
  once = [leaf for leaf in leaves if hasattr(leaf, "shape")]
  seen = [leaf for leaf in jax.tree_util.tree_leaves(value) if hasattr(leaf, "shape")]
  if once and seen and seen[0].ndim > len(once[0].shape):
    raise UnsupportedFlaxFeatureError(
      f"fl.path_patch: {site.name} runs inside an nn.scan/nnx.scan (or vmap) body, whose"
      " iterations are one call; path patching does not yet tell them apart. Choose calls"
      " outside the body (the scan itself), or sweep its iterations with fl.sweep."
    )


class _Run:
  """The runs of path patching, each on a fresh copy of the tree (`Copies`)."""

  def __init__(self, tree: CallNode, streams: Any):
    self.copies = Copies(tree)
    self.streams = streams

  def capture(self, argument: ArgsAndKwargs, indices: list[int]) -> tuple[list[Site], dict, Any]:
    """The sites at `indices`: their outputs and inputs in a run on `argument`, and the
    run's output."""
    tree, sites = self.copies.fresh()
    nodes = tuple(sites[k].node for k in indices)
    probes = edited_calls(tree, (), nodes, True, None)
    output, captured = probed_run(
      tree, argument, probes, self.streams, nodes, UNREACHED_IN_PAIRED_RUNS
    )
    return sites, captured, output

  def edited(self, argument: ArgsAndKwargs, edits: Callable[[list[Site]], dict]) -> tuple:
    """`(output, recorded)` of a run on `argument` with `edits(sites)`: `{site index:
    [_SideEdit, ...]}`; the edits record values with `_record`."""
    tree, sites = self.copies.fresh()
    by_site = edits(sites)
    probes = {
      id(sites[k].node): EditedCall(
        node=sites[k].node, edits=tuple(e), site=sites[k].name, required=True
      )
      for k, e in by_site.items()
    }
    key = tuple(e for es in by_site.values() for e in es)
    return probed_run(
      tree, argument, probes, self.streams, key, UNREACHED_IN_PAIRED_RUNS, indexed=True
    )


def _record(name: str, value: Any) -> None:
  """Keeps `value` as `name` in the current run's captures (out of staged bodies too)."""
  probing = active_probing()
  probing.record(name, value)


def _on_part(fn: Callable[[Any], Any], part: Any, name: str, on: str) -> Callable[[Any], Any]:
  """`fn` applied to the `part` of a value (the whole value for None)."""
  if part is None:
    return fn

  def apply(value: Any) -> Any:
    return set_part(value, part, fn(get_part(value, part, name, on)))

  return apply


def _mask(units: list[tuple[int, _Unit]], number: Any, name: str, target: Any) -> Any:
  """Where the unit numbered `number` (traced), if it is one of `units`, selects `target`."""
  mask = jnp.zeros((), bool)
  for i, unit in units:
    chosen = number == i
    if unit.where is not None:
      chosen = chosen & where_mask(unit.where, name, target)
    mask = mask | chosen
  return mask


def _forward_edits(
  plan: _Plan, clean: dict, clean_outputs: dict, corrupted: dict, sender: Any
) -> Callable:
  """The edits of run (2) for the sender numbered `sender` (traced): the sender corrupted,
  the frozen components clean, each receiver recorded before its own edit."""
  receiving = {u.site: (u.on, u.part) for u in plan.receivers}
  table = jnp.asarray(np.asarray(plan.frozen, bool).reshape(len(plan.senders), -1))

  def edits(sites: list[Site]) -> dict[int, list[_SideEdit]]:
    out: dict[int, list[_SideEdit]] = {}
    for column, (k, on, part) in enumerate(plan.sides):
      name = sites[k].name
      frozen = table[sender, column]
      units = [(i, u) for i, u in enumerate(plan.senders) if u.site == k]

      def role(value: Any, units=units, name=name, frozen=frozen, k=k, c=clean[k, on]) -> Any:
        new = jax.tree_util.tree_map(lambda a, b: jnp.where(frozen, a, b), c, value)
        if units:
          new = jnp.where(_mask(units, sender, name, value), corrupted[k], new)
        return new

      role = _on_part(role, part, name, on)
      if k not in receiving:
        out.setdefault(k, []).append(_SideEdit(on, role))
        continue
      receiver_on, receiver_part = receiving[k]
      record = _on_part(lambda v, name=name: _record(name, v) or v, receiver_part, name, "")
      if receiver_on == on:
        out.setdefault(k, []).append(_SideEdit(on, lambda v, role=role, rec=record: role(rec(v))))
      elif receiver_on == "input":  # the component is frozen on its output
        out.setdefault(k, []).append(_SideEdit("input", record))
        out[k].append(_SideEdit("output", role))
      else:  # the receiver's output, the component's input: only the sender edits the input
        if units:
          sent = _on_part(
            lambda v, units=units, name=name, k=k: jnp.where(
              _mask(units, sender, name, v), corrupted[k], v
            ),
            part,
            name,
            on,
          )
          out.setdefault(k, []).append(_SideEdit("input", sent))
        clean_output = clean_outputs[k]
        out.setdefault(k, []).append(
          _SideEdit(
            "output",
            lambda v, rec=record, frozen=frozen, c=clean_output: jax.tree_util.tree_map(
              lambda a, b: jnp.where(frozen, a, b), c, rec(v)
            ),
          )
        )
    return out

  return edits


def _receiver_edits(plan: _Plan, recorded: dict, column: Any) -> Callable:
  """The edits of run (3): the receivers' values set to those recorded (with
  `each_receiver`, only the receiver numbered `column`)."""

  def edits(sites: list[Site]) -> dict[int, list[_SideEdit]]:
    out = {}
    for k in dict.fromkeys(u.site for u in plan.receivers):
      name = sites[k].name
      units = [(i, u) for i, u in enumerate(plan.receivers) if u.site == k]
      on, part = units[0][1].on, units[0][1].part

      def patch(value: Any, units=units, name=name) -> Any:
        if plan.each_receiver:
          mask = _mask(units, column, name, value)
        else:
          mask = _mask([(0, u) for _, u in units], 0, name, value)
        return jnp.where(mask, recorded[name], value)

      out[k] = [_SideEdit(on, _on_part(patch, part, name, on))]
    return out

  return edits


def _path_patch(tree, clean, corrupted, plan: _Plan, metric, streams):
  runs = _Run(tree, streams)
  components = [k for k, _, _ in plan.sides]
  sites, clean_cache, clean_output = runs.capture(clean, components)
  for k in components:
    _check_unstacked(sites[k], clean_cache[sites[k].name])
  clean_values, clean_outputs = {}, {}
  for k, on, part in plan.sides:
    value = _side(clean_cache, sites[k], on)
    clean_values[k, on] = value if part is None else get_part(value, part, sites[k].name, on)
    clean_outputs[k] = clean_cache[sites[k].name]
  sending = {u.site: (u.on, u.part) for u in plan.senders}
  _, corrupted_cache, corrupted_output = runs.capture(corrupted, list(sending))
  corrupted_values = {
    k: get_part(_side(corrupted_cache, sites[k], on), part, sites[k].name, on)
    for k, (on, part) in sending.items()
  }

  def per_sender(sender: Any) -> Any:
    edits = _forward_edits(plan, clean_values, clean_outputs, corrupted_values, sender)
    _, recorded = runs.edited(clean, edits)

    def per_receiver(column: Any) -> Any:
      output, _ = runs.edited(clean, _receiver_edits(plan, recorded, column))
      return output

    if plan.each_receiver:
      return jax.vmap(per_receiver)(jnp.arange(len(plan.receivers)))
    return per_receiver(0)

  outputs = jax.vmap(per_sender)(jnp.arange(len(plan.senders)))
  # Every patched output and the clean and corrupted runs' go through the metric as one
  # batch, so it is traced once.
  shape = (len(plan.senders), len(plan.receivers)) if plan.each_receiver else (len(plan.senders),)
  grid = math.prod(shape)
  both = jax.tree_util.tree_map(
    lambda patched, c, o: jnp.concatenate(
      [patched.reshape(grid, *patched.shape[len(shape) :]), jnp.stack([c, o])]
    ),
    outputs,
    clean_output,
    corrupted_output,
  )
  values = jax.vmap(lambda out: metric_value(metric, out, scalar=False))(both)
  return values[:grid].reshape(*shape, *values.shape[1:]), (values[grid], values[grid + 1])


_path_patch_compiled = jit_keyed_on_function(_path_patch, "metric", "fl.path_patch")


@takes_model_arguments("fl.path_patch(tree, clean, corrupted, 'Block_*/attn', 'ln_f', metric)")
def path_patch(
  tree: CallNode,
  clean: Any,
  corrupted: Any,
  /,
  senders: Any,
  receivers: Any,
  metric: Callable[[Any], Any],
  *,
  freeze: Any = None,
  each_receiver: bool = False,
  per_example: bool = False,
  random_streams: Any = None,
  jit: bool = True,
) -> SweepResult:
  """Path patching: each sender's effect on the metric through the receivers alone.

  For each sender (one row), three runs as Wang et al. (2022) define them: (1) a clean
  and a corrupted run; (2) a clean run with the sender's value set to its corrupted
  value and every frozen call's value to its clean value, recording the receivers'
  values (the receivers recompute); (3) a clean run with the receivers' values set to
  those recorded, whose `metric(output)` is the row's value. Runs (2) and (3) of every
  sender run batched in one program, compiled once per shapes, sites and metric.

  Frozen calls (set to their clean values in run 2): every call the senders' or the
  receivers' sites match (the components the question is about: all attention modules
  when the senders are attention modules) and every call `freeze=` names; not, in one
  sender's forward, a call that contains that sender or that it contains. Other calls
  (layer norms, MLPs, the blocks carrying the residual stream) recompute, so a path runs
  through them; name them in `freeze=` to cut it there. Choose as senders and receivers
  calls that write into the residual stream (attention, MLPs), not the blocks that carry
  it: freezing a block would cut every path through it. A receiver's value is recorded
  before its own edit and the receiver then takes its role as a component, so receivers
  never feed one another. With `on="input"` (see `fl.Sites`) a receiver's value is its
  call's first argument (a query projection's input, say).

  Args:
    tree: a converted tree (`fl.unflaxify`).
    clean: the clean run's model arguments, as `fl.run` takes them: one value, a tuple of
      positional arguments, or `fl.ArgsAndKwargs`.
    corrupted: the corrupted run's arguments, alike.
    senders: the senders: sites as `fl.run` takes them (one sender per call), an
      `fl.Sites` (a side, slices: one sender per call and slice), an `fl.heads` (one
      sender per head), or a list mixing these (each element's senders in the list's
      order, each with its own side, part and slices; one call takes one side and part).
    receivers: the receivers, alike: all patched together in run (3), or one at a time
      with `each_receiver=True`.
    metric: a function of the model's output returning an array.
    freeze: more calls to freeze (sites as `fl.run` takes them, frozen on their output),
      or None.
    each_receiver: a column per receiver (a senders × receivers grid) instead of all
      receivers at once. Run (2) is shared by a sender's columns. A cell whose receiver
      runs before its sender holds the clean metric (the path patch changes nothing).
    per_example: the metric returns one value per example (its leading axis); the result
      keeps every example's value for `SweepResult.bootstrap` and `.p_values`, and
      `values` is their mean (as `fl.sweep(per_example=True)`).
    random_streams: as for a tree call, used by every run.
    jit: compile (default); pass False inside your own `jax.jit`.

  Returns:
    A `SweepResult` with `measure="path"`: `values` (the metric of run 3) of shape
    `(senders, *metric shape)`, or `(senders, receivers, *metric shape)` with
    `each_receiver`; `sites` names the senders (`"Block_0/attn head 2"` for `fl.heads`,
    `"Block_0/attn/out:input[..., 2, :]"` for an `fl.Sites` slice), `receivers` the
    receivers; `clean` and `corrupted` hold the unpatched runs' metrics. Run 3 starts
    from the clean run, so a sender with no effect leaves the clean metric:
    `normalised()` is `(clean - patched) / (clean - corrupted)`, 0 for no effect and 1
    where the path carries the whole effect (the corrupted metric); `p_values` test
    `patched - clean`; the plot shows the same normalised effect.

  Raises:
    SelectionError: a site matches no call (closest names listed), a list names one
      call on two sides or parts for one role, a receiver is a sender's own call and
      side, a sender runs after every receiver (or, with `each_receiver`, a receiver
      before every sender).
    ArgumentError: a part, slice or metric does not fit its value, or the clean and
      corrupted arguments differ in structure or shapes.
    UnsupportedFlaxFeatureError: a component runs inside an `nn.scan`/`nnx.scan` body.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> class Residual(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     for i in range(3):
    ...       x = x + nn.Dense(4, name=f"write_{i}")(x)
    ...     return nn.Dense(2, name="readout")(x)
    >>> model, clean = Residual(), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), clean), clean)
    >>> result = fl.path_patch(tree, clean, -clean, "write_*", "readout",
    ...                        lambda out: out[0, 0])
    >>> result.sites, result.values.shape
    (('write_0', 'write_1', 'write_2'), (3,))
    >>> clean_metric = model.apply(tree.export(), clean)[0, 0]
    >>> effect = result.normalised()  # (clean - patched) / (clean - corrupted)
    >>> bool(effect[0] == (clean_metric - result.values[0]) / (result.clean - result.corrupted))
    True
  """
  check_tree(tree, "fl.path_patch")
  check_callable(metric, "metric", "fl.path_patch")
  if not isinstance(each_receiver, bool):
    raise ArgumentError(f"fl.path_patch: each_receiver= is True or False, got {each_receiver!r}.")
  senders, receivers = _as_sites(senders, tree), _as_sites(receivers, tree)
  plan = _plan(tree, senders, receivers, freeze, each_receiver)
  runs = paired_runs(tree, clean, corrupted, random_streams, "fl.path_patch", _MATCHING, False)
  run = _path_patch_compiled if jit else _path_patch
  values, baselines = run(tree, runs.clean, runs.corrupted, plan, metric, runs.random_streams)
  heads = tuple(u.head for u in plan.senders)
  result = SweepResult(
    values,
    tuple(u.name for u in plan.senders),
    receivers=tuple(u.name for u in plan.receivers),
    measure="path",
    heads=None if None in heads else heads,
  )
  return _statistics.with_runs(
    result, *baselines, per_example=per_example, where="fl.path_patch", arguments=runs.arguments
  )


_MATCHING = (
  "fl.path_patch patches the senders' values from the corrupted run into the clean run,"
  " so both runs' values must have the same shapes."
)
