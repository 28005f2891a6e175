"""Folding: interventions that weights can express, turned into parameter edits.

`fold` copies a tree and rewrites each intervention as an edit of the parameters of the
call it acts on, so that the copy, run plainly, computes what the tree computes with the
interventions, and exports back to Flax (`tree.export()`). It decides nothing from class
names: each call is cut out on the example inputs (`isolate`), the edit is reduced
to arrays along the value's trailing (feature) axes, and a candidate parameter is kept
only if the call with that parameter edited reproduces the intervened call within the
tolerance; the whole folded tree is then checked against the intervened run. No Flax
internals here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.core._variables import (
  Parameter,
  scratch_copy,
  variables_in,
)
from flaxlens.errors import ExportError, FlaxlensError
from flaxlens.tools.base._calling import model_arguments, takes_model_arguments
from flaxlens.tools.base._compare import EquivalenceReport, compare_trees
from flaxlens.tools.base._index import index_text
from flaxlens.tools.base._index import split as split_index
from flaxlens.tools.base._intervention import Intervention, kind_of, non_finite, where_mask
from flaxlens.tools.base._kinds import Adds, FoldRule, MapsFeatures, Multiplies, Unfoldable
from flaxlens.tools.base._parts import get_part
from flaxlens.tools.base._probed import checked_interventions, nodes_by_name, run
from flaxlens.tools.base._site_objects import PathPatchable, SiteObject
from flaxlens.tools.base._sites import Site, select_sites, sites_of
from flaxlens.tools.isolation._isolate import isolate
from flaxlens.tools.isolation._replay import IsolatedSubmodel


@dataclasses.dataclass(frozen=True)
class _Tolerance:
  atol: float
  rtol: float

  def report(self, expected: Any, actual: Any, a: str, b: str) -> EquivalenceReport:
    return EquivalenceReport(a=a, b=b, outputs=compare_trees(expected, actual), state=())

  def close(self, expected: Any, actual: Any) -> bool:
    return self.report(expected, actual, "", "").close(self.atol, self.rtol)

  def differs(self, expected: Any, actual: Any) -> str:
    """How far apart two values are, for a refusal."""
    report = self.report(expected, actual, "", "")
    return (
      f"max abs difference {report.max_abs:.3g}, max rel {report.max_rel:.3g};"
      f" atol={self.atol}, rtol={self.rtol}"
    )


@takes_model_arguments("fl.fold(tree, x, [fl.steer('Block_1', vector, alpha=4.0)])")
def fold(
  tree: CallNode,
  args: Any,
  /,
  interventions: Sequence[Intervention],
  *,
  atol: float = 1e-5,
  rtol: float = 1e-5,
  random_streams: Any = None,
) -> CallNode:
  """A copy of `tree` whose parameters compute what `tree` computes with `interventions`.

  The copy has no interventions and no patches of its own making, so `folded.export()`
  gives a Flax model (Linen variables, an NNX module) that runs the edit natively. Each
  intervention becomes an edit of the parameters of the call it acts on:

  - `fl.steer` on a call's output adds `alpha * vector` to a parameter the output adds
    last (the bias of a Dense, Linear, Conv, DenseGeneral, a LayerNorm's bias); on a
    call's input (`on="input"`) it adds what the call makes of the vector, which folds
    into that parameter when the call is affine (the next affine layer of a value). A
    call with no parameters of its own (a residual block: its input plus what its layers
    write) moves the steering onto the call inside it that writes the output last,
    found numerically: of the calls inside it with parameters, last first, the first
    whose own steering gives the same model output on the example inputs. Steering one
    part of a structured output (`part=0` of a Hugging Face block's `(hidden_states,
    ...)`) moves alike, onto the call that writes that array last.
  - `fl.low_rank_edit` on a call's output (`h ↦ h + Rᵀ(W h + b − R h)`, affine in `h`)
    maps the parameters that end in the feature axis (an affine call's kernel and bias)
    by the edit's matrix and adds its offset to the bias; a call that is not affine in
    them (a LayerNorm) is refused by the check.
  - `fl.scale` and zero `fl.ablate` on a call's output multiply every parameter of the
    call by the factor (a linear call's kernel and bias; its output must scale with
    them); on its input they multiply the kernel entries that read the scaled inputs:
    zeroing head `h` of an attention output projection's input (`where=jnp.s_[..., h,
    :]`) zeroes the kernel rows of that head.

  A kind of your own (`InterventionKind`) folds by the rule it declares (`fold`: `Adds`,
  `Multiplies`, `MapsFeatures`, as steering, scaling and low-rank edits fold), or is
  refused with the reason it gives (`Unfoldable`).

  The value added or multiplied must be the same at every leading (batch, position)
  index: `where=` may choose features or heads, not positions. Nothing is taken from
  class names: for each call the edit is tried on the parameters whose shapes fit and
  kept only if the call, cut out on the example inputs, reproduces the intervened call.

  After folding, the folded tree is run on the example inputs and compared with
  `fl.run(tree, args, interventions=...)`: every output leaf must agree within
  `atol` absolutely or `rtol` relatively (as `fl.EquivalenceReport.close` reads them).
  Folding changes the order of floating-point operations, so the results are close, not
  bitwise equal; raise the tolerance for low-precision models (bfloat16: about 1e-2).

  Args:
    tree: a converted tree (`fl.unflaxify`); it is not modified.
    args: the model's arguments to check the folding on, as `fl.run` takes them: one
      value, a tuple of positional arguments, or `fl.ArgsAndKwargs`.
    interventions: `fl.steer`, `fl.scale`, zero `fl.ablate` and `fl.low_rank_edit`
      results (and interventions of kinds of your own with a folding rule), folded in
      order.
    atol: the largest absolute difference the check accepts per output leaf.
    rtol: the largest relative difference it accepts per output leaf.
    random_streams: as for `fl.run` (Linen rng keys).

  Returns:
    The folded tree: a copy of `tree` with edited parameters.

  Raises:
    ExportError: an intervention cannot be folded (the message lists each one and
      why: patches, mean or resample ablations, `fl.modify`, edits that vary along
      positions, operands holding nan or inf, calls with no parameter that expresses the
      edit, calls inside `nn.scan`/`nnx.scan`, head sites: the message gives the same
      edit of the call holding the heads), or the folded tree does not reproduce
      the intervened run within the tolerance (the message gives the largest differences).
    SelectionError: a site matches no call.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> tree = fl.unflaxify(model, variables, x)
    >>> steer = fl.steer("layers_0", jnp.array([1.0, 0.0, -1.0]), alpha=2.0)
    >>> folded = fl.fold(tree, x, [steer])
    >>> steered = fl.run(tree, x, interventions=[steer])
    >>> bool(jnp.allclose(model.apply(folded.export(), x), steered, atol=1e-6))
    True
  """
  check_tree(tree, "fl.fold")
  interventions = checked_interventions(interventions, "fl.fold")
  interventions, _ = nodes_by_name(tree, interventions, None)
  tolerance = _Tolerance(atol, rtol)
  streams = resolve_random_streams(random_streams, tree.where())
  argument = model_arguments(args)
  folded = scratch_copy(tree)
  parameters = {v.label: v for v in variables_in(folded) if isinstance(v, Parameter)}
  refused = []
  for number, intervention in enumerate(interventions):
    try:
      edits = _fold_one(folded, intervention, argument, streams, tolerance)
    except ExportError as e:  # why this one cannot fold: listed with the others below
      refused.append(f"[{number}] {_describe(intervention)}: {e}")
      continue
    for label, value in edits.items():
      parameters[label].value = value
  if refused:
    listed = "\n  ".join(refused)
    raise ExportError(
      f"{tree.where()}: {len(refused)} of {len(interventions)} interventions cannot be"
      f" folded into weights:\n  {listed}\nFold only steering, scaling and zero ablation"
      " of calls with parameters, constant along positions, and low-rank edits of"
      " affine calls' outputs; export the others' effect"
      " some other way, or keep running them with fl.run."
    )
  _verify(tree, folded, interventions, argument, streams, tolerance)
  return folded


def _describe(intervention: Intervention) -> str:
  kind = kind_of(intervention)
  how = f", how={kind.name!r}" if kind.maker == "fl.ablate" else ""
  at = getattr(intervention.at, "name", intervention.at)
  extra = "".join(
    f", {name}={value!r}"
    for name, value, default in (
      ("on", intervention.on, "output"),
      ("part", intervention.part, None),
    )
    if value != default
  )
  where = "" if intervention.index is None else ", where=..."
  return f"{kind.maker}({at!r}{how}{where}{extra})"


def _verify(
  tree: CallNode,
  folded: CallNode,
  interventions: tuple[Intervention, ...],
  argument: ArgsAndKwargs,
  streams: Any,
  tolerance: _Tolerance,
) -> None:
  """Refuses a folded tree whose plain run differs from the intervened run.

  Both run on copies: a run writes the state it updates (batch statistics, NNX rng
  counts, a decoding cache) into its tree, and neither tree may change."""

  def fresh() -> ArgsAndKwargs:  # an nnx.Rngs argument advances
    return jax.tree_util.tree_map(lambda x: x, argument)

  expected = run(scratch_copy(tree), fresh(), interventions=interventions, random_streams=streams)
  actual = run(scratch_copy(folded), fresh(), random_streams=streams)
  report = tolerance.report(expected, actual, "the tree with the interventions", "folded tree")
  if not report.close(tolerance.atol, tolerance.rtol):
    raise ExportError(
      f"{tree.where()}: the folded tree does not reproduce the interventions on the"
      f" example inputs ({tolerance.differs(expected, actual)}):\n{report}\n"
      "Raise atol/rtol if the model computes in low precision, or keep running these"
      " interventions with fl.run."
    )


# --- one intervention ---------------------------------------------------------------------


def _fold_one(
  root: CallNode,
  intervention: Intervention,
  argument: ArgsAndKwargs,
  streams: Any,
  tolerance: _Tolerance,
) -> dict[str, Any]:
  """`{label: new value}` of the parameters that express `intervention` in `root`."""
  rule = _fold_rule(intervention)
  if isinstance(intervention.at, SiteObject):  # fl.heads: a view of other calls' values
    raise ExportError(_site_object_refusal(root, intervention))
  unfit = non_finite(intervention)  # made under tracing, its operands were not checked
  if unfit is not None:
    raise ExportError(f"{unfit}, and fold writes only finite weights; give finite values")
  sites = sites_of(root)
  chosen = select_sites(root, intervention.at, sites)
  edits: dict[str, Any] = {}
  moved_into: set[int] = set()  # calls that steering of a call around them moved onto
  for site in chosen:
    if site.node.sliced:
      raise ExportError(
        f"{site.node.where()} runs inside nn.scan/nn.vmap (or nnx.scan/nnx.vmap), whose"
        " parameters are stacked per iteration and edited alike at every one"
      )
    if not site.node.scope_data.parameters and isinstance(rule, Adds):
      moved, into = _moved_steering(root, site, sites, intervention, argument, streams, tolerance)
      moved_into.add(id(into))
      for label, value in _fold_one(root, moved, argument, streams, tolerance).items():
        if label in edits and not tolerance.close(_leaf(edits[label]), _leaf(value)):
          raise ExportError(
            f"the calls it edits share the parameter {label!r} but need different values"
          )
        edits[label] = value
      continue
    for isolated in isolate(root, argument, site.node, every=True, random_streams=streams):
      proposed = _fold_call(site, isolated, intervention, tolerance)
      for name, value in proposed.items():
        label = site.node.scope_data.parameters[name].label
        if label in edits and not tolerance.close(_leaf(edits[label]), _leaf(value)):
          raise ExportError(
            f"the calls it edits share the parameter {label!r} but need different values"
          )
        edits[label] = value
  chosen_nodes = {id(site.node) for site in chosen} | moved_into
  for site in sites:
    held = {p.label for p in site.node.scope_data.parameters.values()}
    shared = sorted(held & edits.keys())
    if shared and id(site.node) not in chosen_nodes:
      raise ExportError(
        f"{site.node.where()} also uses {shared}, and the intervention does not edit that"
        " call (tied weights); folding would change it too"
      )
  return edits


def _site_object_refusal(root: CallNode, intervention: Intervention) -> str:
  """Why an intervention on a site object (`fl.heads`: a view of calls' values) does not
  fold, and, where the object names its units as slices of calls (`PathPatchable`), the
  intervention on the call holding them that does: the same edit, its `where=` choosing
  the units."""
  at, kind = intervention.at, kind_of(intervention)
  refusal = f"{at!r} is a site object, a view of calls' values, and fold folds edits of calls"
  if not isinstance(at, PathPatchable):
    return f"{refusal}. Fold the same edit of the call whose value it views, with where="
  units = at.path_sites(root)
  operands = "".join(f"{name}, " for name in kind.operand_names)
  wheres = [index_text(*split_index(w if isinstance(w, tuple) else (w,))) for w in units.where]
  where, each = (f"jnp.s_{wheres[0]}", "") if len(wheres) == 1 else ("W", f" for W in {wheres}")
  calls = ", ".join(repr(name) for name in units.calls)
  return (
    f"{refusal} (here the {units.on} of {calls}), not views of them. Fold the same edit of"
    f" that call's value with where= choosing the units: {kind.maker}({units.calls[0]!r},"
    f" {operands}on={units.on!r}, where={where}){each}, its operands and where= written for"
    " that value"
  )


def _moved_steering(
  root: CallNode,
  site: Site,
  sites: list[Site],
  intervention: Intervention,
  argument: ArgsAndKwargs,
  streams: Any,
  tolerance: _Tolerance,
) -> tuple[Intervention, CallNode]:
  """Steering of a call with no parameters of its own (a residual block's output: the
  sum of its input and what its layers write) moved onto the call inside it that last
  writes its output (the steered part of it, with `part=`: a Hugging Face block's hidden
  states), found numerically: of the calls made inside it, last first, the first whose
  whole output, steered alike, gives the whole model's output of the original steering
  (on the example inputs, within the tolerance) and has parameters."""
  if intervention.on != "output":
    raise ExportError(
      f"{site.node.where()} has no parameters of its own to fold into; steering its"
      " output (or a part of it, part=) can move to the call inside it that writes that"
      " array last, steering its input cannot"
    )

  def at(node: CallNode, part: Any) -> Intervention:  # by name: a copy holds other nodes
    moved = dataclasses.replace(intervention, at=node, part=part)
    return nodes_by_name(root, (moved,), None)[0][0]

  here = at(site.node, intervention.part)
  expected = run(scratch_copy(root), _fresh(argument), interventions=[here], random_streams=streams)
  path = tuple(site.node.path)
  inside = [
    s
    for s in sites
    if tuple(s.node.path)[: len(path)] == path
    and len(s.node.path) > len(path)
    and s.node.scope_data.parameters
  ]
  tried = []
  for candidate in reversed(inside):
    moved = at(candidate.node, None)  # the candidate's whole output: one array
    try:
      actual = run(
        scratch_copy(root), _fresh(argument), interventions=[moved], random_streams=streams
      )
    except FlaxlensError:
      continue  # the vector does not fit this call's output
    if tolerance.report(expected, actual, "a", "b").close(tolerance.atol, tolerance.rtol):
      return moved, candidate.node
    tried.append(candidate.name)
  listed = f" (tried, last first: {', '.join(tried[:6])})" if tried else ""
  raise ExportError(
    f"{site.node.where()} has no parameters of its own to fold into, and no call inside it"
    f" gives its output's steering when steered itself{listed}; steer the call that writes"
    " the value last (the bias of the block's last affine layer), or keep running it with"
    " fl.run"
  )


def _fresh(argument: ArgsAndKwargs) -> ArgsAndKwargs:
  return jax.tree_util.tree_map(lambda x: x, argument)  # an nnx.Rngs argument advances


def _leaf(value: Any) -> Any:
  """The array of a parameter value (a Linen box such as `nn.Partitioned` holds one)."""
  leaves = jax.tree_util.tree_leaves(value)
  return leaves[0] if len(leaves) == 1 else None


def _with_leaf(value: Any, array: Any) -> Any:
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(value), [array])


class _Call:
  """One isolated execution, run eagerly with some of its parameters replaced."""

  def __init__(self, isolated: IsolatedSubmodel):
    self.isolated = isolated
    self.layer = isolated.submodel
    self.parameters = {name: _leaf(p.value) for name, p in self.layer.scope_data.parameters.items()}

  def __call__(self, new: dict[str, Any], argument: ArgsAndKwargs | None = None) -> Any:
    frozen = self.layer.scope_data.parameters
    replaced = {
      name: dataclasses.replace(p, value=_with_leaf(p.value, new[name])) if name in new else p
      for name, p in frozen.items()
    }
    scope = dataclasses.replace(self.layer.scope_data, parameters=replaced)
    layer = dataclasses.replace(self.layer, scope_data=scope)
    saved = self.isolated.saved_arg if argument is None else argument
    fresh = jax.tree_util.tree_map(lambda x: x, saved)  # stateful arguments start as saved
    output, _ = layer.stateless_call(
      self.isolated.initial_var_values, fresh, **self.isolated.saved_side_inputs
    )
    return output


def _fold_call(
  site: Site, isolated: IsolatedSubmodel, intervention: Intervention, tolerance: _Tolerance
) -> dict[str, Any]:
  """`{parameter name: new value}` of one call that reproduce `intervention` there."""
  call = _Call(isolated)
  if not any(v is not None for v in call.parameters.values()):
    raise ExportError(f"{site.node.where()} has no parameters of its own to fold into")
  plain = call({})
  name = site.name
  rule = _fold_rule(intervention)
  if isinstance(rule, MapsFeatures):
    return _mapped_features(site, call, isolated, intervention, rule, plain, tolerance)
  if intervention.on == "output":
    expected = intervention.edit(name, isolated.saved_arg, plain)
    target = get_part(plain, intervention.part, name, "output")
    how, change = _change(intervention, name, target)
    trailing = _trailing(change, lambda a, b: bool(jnp.array_equal(a, b)))
    if how == "add":
      return _into_one(site, call, expected, _added(trailing, target.shape), tolerance)
    return _scaled_all(site, call, expected, trailing, tolerance)
  args = isolated.saved_arg.args
  if not args:
    raise ExportError(f"{site.node.where()} takes no positional argument to edit")
  edited_input = intervention.edit(name, isolated.saved_arg, args[0])
  edited = dataclasses.replace(isolated.saved_arg, args=(edited_input, *args[1:]))
  expected = call({}, edited)
  target = get_part(args[0], intervention.part, name, "input")
  how, change = _change(intervention, name, target)
  trailing = _trailing(change, lambda a, b: bool(jnp.array_equal(a, b)))
  if how == "mul":
    return _into_one(site, call, expected, _input_scaled(trailing), tolerance)
  if not isinstance(plain, jax.Array):
    raise ExportError(f"{site.node.where()} returns a {type(plain).__name__}, not one array")
  delta = expected - plain
  scale = float(jnp.max(jnp.abs(plain), initial=0.0))

  def near(a: Any, b: Any) -> bool:
    return bool(jnp.all(jnp.abs(a - b) <= tolerance.atol + tolerance.rtol * scale))

  return _into_one(site, call, expected, _added(_trailing(delta, near), plain.shape), tolerance)


def _mapped_features(
  site: Site,
  call: _Call,
  isolated: IsolatedSubmodel,
  intervention: Intervention,
  rule: MapsFeatures,
  plain: Any,
  tolerance: _Tolerance,
) -> dict[str, Any]:
  """An edit of the output `h ↦ h A + c₀` (a low-rank edit: `A = I + (W − R)ᵀR`,
  `c₀ = bR`) as the parameters ending in the feature axis times `A`, and `c₀` added to
  one shaped as that axis (a bias): exact for a call affine in them (`x K + c`)."""
  if intervention.on != "output" or intervention.index is not None:
    raise ExportError(
      "a low-rank edit folds on a call's output, everywhere (no where=), and this one"
      f" edits its {intervention.on}{' at where=...' if intervention.index else ''}"
    )
  expected = intervention.edit(site.name, isolated.saved_arg, plain)
  matrix, offset = rule.affine(intervention.operands)
  features = matrix.shape[0]
  mapped = {
    name: (p @ matrix).astype(p.dtype)
    for name, p in call.parameters.items()
    if p is not None and p.ndim and p.shape[-1] == features
  }
  shapes = {name: tuple(p.shape) for name, p in call.parameters.items() if p is not None}
  if not mapped:
    raise ExportError(
      f"no parameter of {site.node.where()} ({shapes}) ends in the edited feature axis of"
      f" size {features}, as an affine call's kernel and bias do"
    )
  tried = []
  for name in [n for n in mapped if call.parameters[n].shape == (features,)] or [None]:
    new = dict(mapped)
    if name is not None:
      new[name] = (new[name] + offset).astype(new[name].dtype)
    output = call(new)
    if tolerance.close(expected, output):
      held = site.node.scope_data.parameters
      return {n: _with_leaf(held[n].value, value) for n, value in new.items()}
    tried.append(f"bias {name!r}: {tolerance.differs(expected, output)}")
  raise ExportError(
    f"{site.node.where()} ({shapes}) with its parameters mapped by the edit misses the"
    f" edited output ({'; '.join(tried)}): the call is not affine (x K + c) in them, or"
    " the tolerance is too tight"
  )


def _fold_rule(intervention: Intervention) -> FoldRule:
  """How `intervention`'s kind folds (`Adds`, `Multiplies`, `MapsFeatures`); an ExportError
  with the reason where it does not (`Unfoldable`, or no rule)."""
  kind = kind_of(intervention)
  rule = kind.fold
  if isinstance(rule, Unfoldable):
    raise ExportError(rule.reason)
  if not isinstance(rule, Adds | Multiplies | MapsFeatures):
    raise ExportError(
      f"its kind {kind.name!r} ({type(kind).__qualname__}) has fold={rule!r}, no folding"
      " rule; give its class fold = Adds(...), Multiplies(...), MapsFeatures(...) or"
      " Unfoldable(reason) (flaxlens.tools.base._kinds)"
    )
  return rule


def _change(intervention: Intervention, site: str, target: Any) -> tuple[str, Any]:
  """The intervention as `("add", d)` (`target + d`) or `("mul", f)` (`target * f`), with
  `d` or `f` over the whole of `target`'s shape (`where=` applied)."""
  ops, rule = intervention.placed_operands(site, target), _fold_rule(intervention)
  if isinstance(rule, Adds):
    how, value, neutral = "add", rule.delta(ops, target), 0
  else:
    how, value, neutral = "mul", rule.factor(ops, target), 1
  value = jnp.broadcast_to(value, target.shape)
  if intervention.index is not None:
    value = jnp.where(
      where_mask(intervention, site, target), value, jnp.asarray(neutral, value.dtype)
    )
  return how, value


def _trailing(x: Any, same: Callable[[Any, Any], bool]) -> Any:
  """`x` as the array over its fewest trailing axes that it repeats along the others."""
  for kept in range(x.ndim):
    rows = x.reshape((-1, *x.shape[x.ndim - kept :]))
    if same(rows, jnp.broadcast_to(rows[0], rows.shape)):
      return rows[0]
  return x


_Candidate = tuple[str, Callable[[Any], Any]]


class _Candidates(NamedTuple):
  """The parameter edits that may express a change (`find(parameters)`), and what a
  parameter must be for one to exist (`need`, for the refusal)."""

  find: Callable[[dict[str, Any]], list[_Candidate]]
  need: str


def _added(trailing: Any, shape: tuple[int, ...]) -> _Candidates:
  """_Candidates for an addition: a parameter over the value's trailing axes (a bias)."""
  varies = f" (this value varies along {trailing.ndim} of them)" if trailing.ndim else ""
  need = (
    f"no parameter is shaped as the last axes of the output {tuple(shape)}{varies}, as a"
    " bias is: steer a call with a bias, by a vector that is the same at every position"
  )

  def candidates(parameters: dict[str, Any]) -> list[_Candidate]:
    found = []
    for name, p in parameters.items():
      if p is None or not trailing.ndim <= p.ndim <= len(shape):
        continue
      if tuple(p.shape) == tuple(shape[len(shape) - p.ndim :]):
        found.append((name, lambda p: (p + trailing).astype(p.dtype)))
    return found

  return _Candidates(candidates, need)


def _input_scaled(trailing: Any) -> _Candidates:
  """_Candidates for a factor on the input: parameter axes that match the input's trailing
  axes (a kernel's input axes), at each place they occur."""
  need = (
    f"the factor varies along input axes of shape {tuple(trailing.shape)}, and no"
    " parameter of the call has axes of that shape (as a kernel's input axes are): scale"
    " or ablate features or heads, the same at every position"
  )

  def candidates(parameters: dict[str, Any]) -> list[_Candidate]:
    found = []
    for name, p in parameters.items():
      if p is None:
        continue
      starts = range(p.ndim - trailing.ndim + 1) if trailing.ndim else (0,)
      for start in starts:
        if tuple(p.shape[start : start + trailing.ndim]) == tuple(trailing.shape):
          after = (1,) * (p.ndim - start - trailing.ndim)
          factor = trailing.reshape(trailing.shape + after)
          found.append((name, lambda p, f=factor: (p * f).astype(p.dtype)))
    return found

  return _Candidates(candidates, need)


def _into_one(
  site: Site,
  call: _Call,
  expected: Any,
  candidates: _Candidates,
  tolerance: _Tolerance,
) -> dict[str, Any]:
  """The first candidate edit of one parameter under which the call gives `expected`."""
  tried = candidates.find(call.parameters)
  outputs = []
  for name, edit in tried:
    new = edit(call.parameters[name])
    output = call({name: new})
    if tolerance.close(expected, output):
      return {name: _with_leaf(site.node.scope_data.parameters[name].value, new)}
    outputs.append((name, output))
  shapes = {name: tuple(p.shape) for name, p in call.parameters.items() if p is not None}
  if not tried:
    raise ExportError(f"at {site.node.where()} (parameters {shapes}), {candidates.need}")
  closest = "; ".join(f"{name!r}: {tolerance.differs(expected, out)}" for name, out in outputs)
  raise ExportError(
    f"no parameter of {site.node.where()} ({shapes}) reproduces the edit when changed"
    f" alone ({closest}): the call does not add or multiply it linearly, or the tolerance"
    " is too tight"
  )


def _scaled_all(
  site: Site, call: _Call, expected: Any, trailing: Any, tolerance: _Tolerance
) -> dict[str, Any]:
  """Every parameter multiplied by the factor: a call linear in its parameters together."""
  new = {}
  for name, p in call.parameters.items():
    if p is None:
      continue
    if trailing.ndim > p.ndim or tuple(p.shape[p.ndim - trailing.ndim :]) != trailing.shape:
      raise ExportError(
        f"the factor varies along axes {tuple(trailing.shape)} that the parameter"
        f" {name!r} {tuple(p.shape)} of {site.node.where()} does not end with"
      )
    new[name] = (p * trailing).astype(p.dtype)
  output = call(new)
  if not tolerance.close(expected, output):
    raise ExportError(
      f"{site.node.where()} with every parameter multiplied by the factor misses the"
      f" scaled output ({tolerance.differs(expected, output)}): the call is not linear"
      " in its parameters (scale a linear call), or the tolerance is too tight"
    )
  held = site.node.scope_data.parameters
  return {name: _with_leaf(held[name].value, value) for name, value in new.items()}
