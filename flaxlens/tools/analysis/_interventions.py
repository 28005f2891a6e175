"""Interventions and captures: edit and read the calls of a tree in one compiled run.

An `Intervention` is data: where it applies (`at`, a site pattern), what it does
(`kind`), which part of the call it acts on (`on`, `part`, `where`): all static, and
the arrays it uses (`operands`, the arrays of `where`): all dynamic. Python numbers
become arrays when an intervention is made, so one compiled program serves every
value. `fl.run` resolves the sites of the interventions and captures against the
tree, attaches a probe per call (`core/_probes.py`), and runs the tree once, compiled
by default. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import check_items, refuse
from flaxlens.core._edit import EditedCall
from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._probes import Probing
from flaxlens.core._runtime import resolve_random_streams, run_tree
from flaxlens.core._selectors import path_matches
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._variables import StateVariable, bind_variables, unbind_variables, variables_in
from flaxlens.core._walk import Relation, calls
from flaxlens.errors import (
  ArgumentError,
  BudgetError,
  FlaxlensError,
  SelectionError,
  error_text,
  model_call_error,
)
from flaxlens.tools.analysis import _budget
from flaxlens.tools.analysis._calling import model_arguments, takes_model_arguments
from flaxlens.tools.analysis._index import MASK, bounded, checked, is_array
from flaxlens.tools.analysis._index import split as _split_index
from flaxlens.tools.analysis._parts import checked_part, one_array, set_part

# --- sites --------------------------------------------------------------------------------


class Site(NamedTuple):
  """One call of a tree that can be probed.

  Attributes:
    name: how results name it: the module path (`"Block_0/Dense_0"`), with
      `.method` for methods other than `__call__`, `#k` for the k-th further call of the
      same module and method; the root (and a module applied on its own inside the
      model, whose path is empty) by its class and method.
    node: the call node.
    output: `(treedef, leaf summaries)` of the output conversion saw, or None.
    inputs: `(treedef, leaf summaries)` of `(args, kwargs)` conversion saw, or None.
    nested: whether the call is one of a tree nested in a replaced call (a spliced
      module): path patterns match it by its name only, not its module's own path.
  """

  name: str
  node: CallNode
  output: Any
  inputs: Any
  nested: bool = False


def sites_of(root: CallNode) -> list[Site]:
  """Every call a run of `root` makes through its own nodes, in call order.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.tools.analysis._interventions import sites_of
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> [site.name for site in sites_of(tree)]
    ['Sequential.__call__', 'layers_0', 'layers_2']
  """
  return _sites(root, None, {})


def _sites(root: CallNode, prefix: str | None, seen: dict[str, int]) -> list[Site]:
  """`sites_of(root)`; with `prefix`, the sites of a tree nested in a replaced call (a
  spliced module), named under it: `prefix` for its root, `prefix.method` for its other
  methods, `prefix/path` for its submodules."""
  sites: list[Site] = []
  replaced: dict[tuple[int, Any], tuple[Any, str]] = {}
  for call in calls(root):
    node, spec = call.layer, call.spec
    if call.relation is Relation.REPLACED:  # named as conversion saw it, until continued
      path = "/".join(map(str, spec.path)) if spec is not None else call.key[1]
      method = spec.method_name if spec is not None else "__call__"
      where = path if method == "__call__" else f"{path}.{method}"
      replaced[id(call.parent), call.key] = (node, where)
      continue
    if call.relation is Relation.NESTED:
      layer, outer = replaced[id(call.parent), call.key]
      sites += _sites(node, f"{outer}/{_nested_name(layer, node)}", seen)
      continue
    path, method = node.readable_path()
    if prefix is not None:
      name = prefix + (f"/{path}" if path and node is not root else "")
      name += "" if method == "__call__" else f".{method}"
    elif node is root or not path:  # The root, or a module applied on its own inside.
      name = f"{node.module_type.__name__}.{method}"
    else:
      name = path if method == "__call__" else f"{path}.{method}"
    count = seen.get(name, 0)
    seen[name] = count + 1
    if count:
      name = f"{name}#{count}"
    if call.relation is Relation.CONTINUED:  # trees nested in its replacement go under it
      replaced[id(call.parent), call.key] = (replaced[id(call.parent), call.key][0], name)
    output = spec.output if spec is not None else None
    inputs = spec.inputs if spec is not None else None
    sites.append(Site(name, node, output, inputs, prefix is not None))
  return sites


def _nested_name(layer: Any, node: CallNode) -> str:
  """How the sites of a tree nested in a replacement are named under the replaced call:
  the name of the edit holding it (`fl.splice`'s `name=`), else its module's class."""
  for edit in getattr(layer, "edits", ()):
    if getattr(edit, "module", None) is node:
      return edit.name
  return node.module_type.__name__


@dataclasses.dataclass(frozen=True)
class _Called:
  """A site given as a call node, named by its site name: `fl.run` compiles the tree as a
  pytree, so inside the compiled run the node is another object than the one given."""

  name: str


def _matches(at: Any, site: Site, root: CallNode) -> bool:
  if isinstance(at, _Called):
    return site.name == at.name
  if isinstance(at, str):
    if at in ("all", "**"):
      return True
    path, method = site.node.readable_path()
    return (
      at == site.name
      or path_matches(at, site.name)
      or (
        site.node is not root
        and not site.nested
        and (path_matches(at, path) or path_matches(at, f"{path}.{method}"))
      )
    )
  if isinstance(at, CallNode):
    return site.node is at
  if isinstance(at, type):
    return issubclass(site.node.module_type, at)
  if callable(at):
    return bool(at(site.node))
  raise ArgumentError(
    f"A site is a path pattern (str), a Flax module class, a CallNode or a predicate"
    f" on call nodes, got {type(at).__name__}."
  )


def select_sites(root: CallNode, at: Any, sites: list[Site] | None = None) -> list[Site]:
  """The sites of `root` that `at` names (a pattern, class, node, predicate or a list), in
  call order.

  Raises:
    SelectionError: if `at`, or one element of a list, matches no call; the message
      lists the closest site names.
  """
  sites = sites_of(root) if sites is None else sites
  options = list(at) if isinstance(at, list | tuple) else [at]
  if not options:
    raise SelectionError(f"An empty list of sites selects no call of {root.where()}.")
  chosen: set[int] = set()
  for option in options:
    matched = [id(s) for s in sites if _matches(option, s, root)]
    if not matched:
      raise SelectionError(_no_match(root, option, sites))
    chosen.update(matched)
  return [s for s in sites if id(s) in chosen]


def _no_match(root: CallNode, at: Any, sites: list[Site]) -> str:
  names = [s.name for s in sites]
  listed = f"{names[:12]}{' ...' if len(names) > 12 else ''}"
  where = root.where()
  if isinstance(at, str):
    close = difflib.get_close_matches(at, names, n=5, cutoff=0.3)
    return (
      f"No call of {where} matches the site {at!r}."
      + (f" Closest: {close}." if close else f" Its calls: {listed}.")
      + " Give a call's name or a glob over names ('**/Dense_0', 'Block_*')."
    )
  if isinstance(at, type):
    classes = sorted({s.node.module_type.__name__ for s in sites})
    return (
      f"No call of {where} is a call of a {at.__qualname__} (or a subclass); it calls"
      f" {classes}. Give one of these classes, or a path pattern."
    )
  if isinstance(at, CallNode):
    return (
      f"The call node {at.where()} is not a call of {where}. Give a node of this tree"
      " (tree.select().at_path(...).get()) or its path pattern."
    )
  return (
    f"The predicate {getattr(at, '__qualname__', at)!r} matches no call of {where}; its"
    f" calls: {listed}. Check the predicate, or give a path pattern."
  )


# --- interventions ------------------------------------------------------------------------

KINDS = (
  "zero",
  "patch",
  "mean",
  "resample",
  "steer",
  "scale",
  "modify",
  "low_rank",
  "interchange",
)
# The operands a kind learns when trained (`fl.train_interventions`), by position; every
# operand of "modify". The others are data: alpha, references, an interchange's source
# values and the mask of its swapped coordinates.
LEARNED = {"patch": (0,), "steer": (0,), "scale": (0,), "low_rank": (0, 1, 2), "interchange": (0,)}


class Intervention(Struct):
  """One edit of a call's input or output, applied wherever the call runs.

  Make one with `fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify`,
  `fl.low_rank_edit` or `fl.interchange`; pass a list of them to `fl.run`. Static
  fields (in the treedef, so a change recompiles): `at`, `kind`, `on`, `part`, `index`,
  `fn`. Arrays (`operands`, `where_arrays`) are pytree leaves: under `jax.jit` or
  `fl.run`, new values reuse the compiled program.

  Attributes:
    at: the site pattern, class, node or predicate (see `fl.run`).
    kind: one of "zero", "patch", "mean", "resample", "steer", "scale", "modify",
      "low_rank", "interchange".
    operands: the arrays the edit uses (a patch's values, a steering vector and alpha, a
      low-rank edit's projection, weight and bias, an interchange's rotation, source and
      swapped coordinates).
    where_arrays: the arrays of `where` (a mask, or the integer arrays of an index).
    on: "output" or "input" (the call's first positional argument).
    part: which part of a structured output or input to edit (an index or key), or None.
    index: the static structure of `where` (None: everywhere), with the range of each
      integer array's values, recorded when the intervention is made: an index is
      checked against the value's shape when the run is traced (docs/interventions.md,
      index rules).
    fn: for "modify", the function `fn(argument, value, *operands) -> value`.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> edit = fl.steer("Block_0", jnp.ones(4), alpha=2.0)
    >>> edit.kind, [x.tolist() for x in edit.operands]
    ('steer', [[1.0, 1.0, 1.0, 1.0], 2.0])
  """

  operands: tuple[Any, ...]
  where_arrays: tuple[Any, ...]
  at: Any = static_field()
  kind: str = static_field()
  on: str = static_field(default="output")
  part: Any = static_field(default=None)
  index: Any = static_field(default=None)
  fn: Any = static_field(default=None)

  def __post_init__(self) -> None:
    maker = _maker(self.kind, self.at)
    if self.kind not in KINDS:
      raise ArgumentError(
        f"{maker}: unknown intervention kind {self.kind!r}; one of {KINDS}. Make"
        " interventions with fl.ablate, fl.patch, fl.steer, fl.scale, fl.modify,"
        " fl.low_rank_edit or fl.interchange."
      )
    if self.on not in ("output", "input"):
      raise ArgumentError(
        f"{maker}: on= is 'output' or 'input' (the call's first positional argument), got"
        f" {self.on!r}. Pass one of these."
      )
    object.__setattr__(self, "part", checked_part(self.part, maker))
    index = bounded(self.index, self.where_arrays, f"{maker}: where=")
    object.__setattr__(self, "index", index)  # the ranges of the arrays given

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    """`value` (the call's output or first argument) with this intervention applied."""
    target = one_array(value, self.part, site, self.on)
    new = self._compute(site, argument, target, self.placed_operands(site, target))
    if self.index is not None:
      mask = where_mask(self, site, target)
      new = jnp.where(mask, new, target)
    return set_part(value, self.part, new.astype(target.dtype))

  def placed_operands(self, site: str, target: Any) -> tuple[Any, ...]:
    """The operands for editing `target` (the array edited at `site`): a patched value or
    steering vector of the shape of the region an index `where=` selects placed into
    that region of `target`'s shape (`_into_region`), the others as given."""
    ops = self.operands
    if self.index is not None and self.index != MASK and self.kind in _REGION_KINDS:
      n = _REGION_KINDS[self.kind][0]
      ops = (*ops[:n], _into_region(self, site, target, ops[n]), *ops[n + 1 :])
    return ops

  def _compute(self, site: str, argument: ArgsAndKwargs, target: Any, ops: tuple) -> Any:
    kind, on = self.kind, self.on
    if kind == "zero":
      return jnp.zeros_like(target)
    if kind in ("patch", "mean", "resample"):
      what = {
        "patch": "the patched value",
        "mean": "the mean of the reference",
        "resample": "the resampled reference",
      }[kind]
      _check_fits(site, ops[0], target, what, on)
      return jnp.broadcast_to(ops[0], target.shape)
    if kind == "steer":
      _check_fits(site, ops[0], target, "the steering vector", on)
      _check_fits(site, ops[1], target, "alpha", on)
      return target + ops[1] * ops[0]
    if kind == "scale":
      _check_fits(site, ops[0], target, "the factor", on)
      return target * ops[0]
    if kind == "low_rank":
      rows = _checked_rows(site, ops[0], target, "the projection", on)
      _check_shape(site, ops[1], rows.shape, "the weight", "the projection's")
      _check_shape(site, ops[2], rows.shape[:1], "the bias", "(rank,), the projection's rank")
      x = target.astype(rows.dtype)
      return x + (x @ ops[1].T + ops[2] - x @ rows.T) @ rows
    if kind == "interchange":
      rotation = _checked_rows(site, ops[0], target, "the rotation", on)
      if rotation.shape[0] != rotation.shape[1]:
        raise ArgumentError(
          f"{site}: the rotation of fl.interchange has shape {tuple(ops[0].shape)}, not square."
          f" Give a ({rotation.shape[1]}, {rotation.shape[1]}) matrix."
        )
      _check_fits(site, ops[1], target, "the source", on)
      _check_shape(site, ops[2], rotation.shape[:1], "the swapped mask", "(features,)")
      base = target.astype(rotation.dtype) @ rotation.T
      source = jnp.broadcast_to(ops[1], target.shape).astype(rotation.dtype) @ rotation.T
      return jnp.where(ops[2], source, base) @ rotation
    try:
      out = self.fn(argument, target, *ops)
    except FlaxlensError:
      raise
    except Exception as e:
      # Also an instance of the original's class (`except ValueError` still catches it),
      # as a model's own errors are; the message blames the function, not the model.
      raise model_call_error(
        type(e),
        f"{site}: the function given to fl.modify, {_function_name(self.fn)}, raised"
        f" {error_text(e)} (the original error is this"
        f" one's cause). It was called as fn(argument, value, *operands) with the {on},"
        f" {target.dtype}{list(target.shape)}, and {len(ops)} operand(s), traced under"
        " jax.jit unless the run has jit=False. Fix the function (run with jit=False to"
        " debug it eagerly).",
      ) from e
    if getattr(out, "shape", None) != target.shape:
      raise ArgumentError(
        f"{site}: the function of fl.modify returned"
        f" {getattr(out, 'shape', type(out).__name__)}, where the {self.on} has shape"
        f" {tuple(target.shape)}. Return an array of the same shape."
      )
    return out


# How the makers name the operands of each kind, by position ("modify": "operand n").
OPERAND_NAMES = {
  "patch": ("value",),
  "mean": ("reference",),
  "resample": ("reference",),
  "steer": ("vector", "alpha"),
  "scale": ("factor",),
  "low_rank": ("projection", "weight", "bias"),
  "interchange": ("rotation", "source", "swapped"),
}


def non_finite(intervention: Intervention) -> str | None:
  """What of `intervention`'s operands holds nan or inf (`"its factor holds nan or
  inf"`), or None; for an intervention not made by its maker here (made under tracing,
  loaded from a file), as `fl.fold` checks it. See `holds_non_finite`."""
  names = OPERAND_NAMES.get(intervention.kind, ())
  for n, operand in enumerate(intervention.operands):
    if holds_non_finite(operand):
      return f"its {names[n] if n < len(names) else f'operand {n}'} holds nan or inf"
  return None


def holds_non_finite(x: Any) -> bool:
  """Whether `x`, a concrete floating array or number, holds nan or inf: the one check of
  the operands users give, run by every maker on each operand (`_array`) and by
  `non_finite`.

  Only concrete values are checked, by one reduction on their device: a traced value (an
  intervention made inside `jax.jit`, `jax.vmap` or `jax.grad`) has no values yet, so it
  is not checked and nothing waits for it; nor are abstract values
  (`jax.ShapeDtypeStruct`) and operands left out (None).
  """
  if isinstance(x, jax.core.Tracer) or not isinstance(
    x, jax.Array | np.ndarray | np.generic | float | complex
  ):
    return False
  with jax.ensure_compile_time_eval():  # a concrete array inside a trace stays concrete
    x = jnp.asarray(x)
    return jnp.issubdtype(x.dtype, jnp.inexact) and not bool(jnp.isfinite(x).all())


def _function_name(fn: Any) -> str:
  name = getattr(fn, "__qualname__", None) or type(fn).__name__
  module = getattr(fn, "__module__", None)
  return f"{module}.{name}" if module and module != "__main__" else name


def orthonormal_rows(matrix: Any) -> Any:
  """The rows of `matrix` (rank × features, rank <= features) made orthonormal: the
  Q factor of `matrix.T`'s QR decomposition, each column's sign chosen so that R's
  diagonal is positive (then rows that are orthonormal already come back unchanged, to
  rounding, and the map is differentiable where `matrix` has full rank). A matrix of
  a floating dtype narrower than float32 (bfloat16, float16), which QR does not take, is
  decomposed in float32 and the rows come back in its own dtype."""
  dtype = matrix.dtype
  if jnp.finfo(dtype).bits < 32:
    matrix = matrix.astype(jnp.float32)
  q, r = jnp.linalg.qr(matrix.T)
  signs = jnp.where(jnp.diagonal(r) < 0, -1, 1).astype(q.dtype)
  return (q * signs).T.astype(dtype)


def _checked_rows(site: str, matrix: Any, target: Any, what: str, on: str) -> Any:
  """`orthonormal_rows(matrix)` after checking it is (rank, features) of the target."""
  shape, features = tuple(np.shape(matrix)), target.shape[-1] if target.ndim else None
  if len(shape) != 2 or shape[1] != features or shape[0] > shape[1]:
    raise ArgumentError(
      f"{site}: {what} has shape {shape}; it acts on the {on}'s last axis of size"
      f" {features}, so it must be (rank, {features}) with rank <= {features}. Give a matrix"
      " of that shape."
    )
  if not jnp.issubdtype(matrix.dtype, jnp.floating):
    raise ArgumentError(f"{site}: {what} has dtype {matrix.dtype}; give a floating-point matrix.")
  return orthonormal_rows(matrix)


def _check_shape(site: str, operand: Any, shape: tuple[int, ...], what: str, like: str) -> None:
  if tuple(np.shape(operand)) != tuple(shape):
    raise ArgumentError(
      f"{site}: {what} has shape {tuple(np.shape(operand))}, where it must be"
      f" {tuple(shape)} ({like}). Give an array of that shape."
    )


def where_mask(intervention: Intervention, site: str, target: Any) -> Any:
  """The boolean mask of `intervention`'s `where=` over `target`, after checking it fits
  (index rules); `site` names the call in messages."""
  shape = tuple(target.shape)
  if intervention.index == MASK:
    mask = intervention.where_arrays[0]
    if mask.ndim > target.ndim:
      raise ArgumentError(
        f"{site}: the mask of where= has rank {mask.ndim} (shape {tuple(mask.shape)}), more"
        f" than the {intervention.on}'s rank {target.ndim} (shape {shape}). Give a"
        f" boolean mask that broadcasts to {shape}."
      )
    _check_fits(site, mask, target, "the mask of where=", intervention.on)
    if not math.prod(shape):
      raise ArgumentError(
        f"{site}: the {intervention.on} of shape {shape} is empty, so where= selects nothing."
        " There is nothing to edit; leave the intervention out."
      )
    return mask
  index = checked(
    intervention.index, intervention.where_arrays, shape, f"{site}: where=", intervention.on
  )
  return jnp.zeros(shape, bool).at[index].set(True)


# Kinds whose value (patched value, steering vector, interchange source) may be given
# shaped like the region an index `where=` selects, as `fl.capture(index=)` gives it: its
# position among the operands, and its name.
_REGION_KINDS = {
  "patch": (0, "the patched value"),
  "steer": (0, "the steering vector"),
  "interchange": (1, "the source"),
}


def _into_region(intervention: Intervention, site: str, target: Any, operand: Any) -> Any:
  """`operand` placed in the region of `target` that the intervention's index `where=`
  selects, where it has that region's shape (a value captured with the same index, say);
  otherwise `operand` as given, to broadcast to the whole `target`. A value of the
  region's shape is read as the region's even where it would also broadcast to the whole
  (a batch as long as the sequence): that is what the region's shape means."""
  shape = tuple(target.shape)
  if tuple(np.shape(operand)) == shape:
    return operand
  index = checked(
    intervention.index, intervention.where_arrays, shape, f"{site}: where=", intervention.on
  )
  region = jax.eval_shape(lambda t: t[index], jax.ShapeDtypeStruct(shape, target.dtype)).shape
  what = _REGION_KINDS[intervention.kind][1]
  if tuple(np.shape(operand)) != tuple(region) or not is_array(operand):
    _check_fits(site, operand, target, what, intervention.on, region=tuple(region))
    return operand
  if intervention.kind == "interchange" and not _keeps_last_axis(intervention.index, len(shape)):
    raise ArgumentError(
      f"{site}: {what} has the shape {tuple(region)} of the region where= selects, and"
      " where= selects part of the last (feature) axis, which the rotation mixes: the"
      " source of the features left out is not known. Give the source of the whole"
      f" {intervention.on}, {shape}, or a where= that keeps the last axis whole"
      " (jnp.s_[:, 3] picks positions)."
    )
  return jnp.zeros(shape, operand.dtype).at[index].set(operand)


def _keeps_last_axis(index: Any, ndim: int) -> bool:
  """Whether an index (its static structure, `_index.split`) takes the last axis whole."""
  entries = [e for e in index[1:] if e[0] != "newaxis"]
  kinds = [e[0] for e in entries]
  after = entries[kinds.index("ellipsis") + 1 :] if "ellipsis" in kinds else None
  if after is None:
    axes = [e for e in entries if e[0] in ("int", "slice", "array")]
    last = axes[-1] if len(axes) == ndim else None
  else:
    last = after[-1] if after else None
  return last is None or last == ("slice", None, None, None)


def _check_fits(
  site: str, operand: Any, target: Any, what: str, on: str, region: tuple | None = None
) -> None:
  """Refuses an operand that does not broadcast to the target or cast to its dtype;
  `region`, the shape of the region an index `where=` selects, is named among the shapes
  to give where the operand may also have it."""
  shape, expected = tuple(np.shape(operand)), tuple(target.shape)
  try:
    fits = np.broadcast_shapes(shape, expected) == expected
  except ValueError:
    fits = False
  if not fits:
    raise ArgumentError(
      f"{site}: {what} has shape {shape}, which does not broadcast to the {on}'s shape"
      f" {expected}. Give an array of shape {expected}, or of its trailing axes"
      f" ({expected[-1:]}: the same value at every position)"
      + (f", or of the region where= selects, {region}." if region is not None else ".")
    )
  dtype = getattr(operand, "dtype", None)
  if dtype is not None and not jnp.can_cast(dtype, target.dtype, casting="same_kind"):
    if not (np.dtype(dtype) == np.bool_ and what.startswith("the mask")):
      raise ArgumentError(
        f"{site}: {what} has dtype {dtype}, which does not cast to the {on}'s dtype"
        f" {target.dtype}. Give an array of dtype {target.dtype} (or of its kind)."
      )


def _array(x: Any, name: str, maker: str) -> Any:
  """`x` as a strongly typed JAX array; Python numbers get their default dtype. Refuses
  values that are no array or number, that JAX's dtype would change, or that hold nan or
  inf (`holds_non_finite`).

  A Python float, a weakly typed `jnp.array(2.0)` and a float32 array then trace alike
  (changing one for another does not recompile) and save alike (`fl.save_interventions`).
  `maker` (`"fl.steer('Block_0')"`) and `name` (`"alpha"`) start a refusal.
  """
  if isinstance(x, bool | int | float | complex):
    _check_representable(np.asarray(x), jax.dtypes.canonicalize_dtype(type(x)), name, maker)
    x = jnp.asarray(x, dtype=jax.dtypes.canonicalize_dtype(type(x)))
  if isinstance(x, np.generic | np.ndarray) and x.dtype.kind in "iuf":
    _check_representable(np.asarray(x), jax.dtypes.canonicalize_dtype(x.dtype), name, maker)
  if isinstance(x, np.generic) or is_array(x):
    try:
      x = jnp.asarray(x)
    except TypeError:
      raise ArgumentError(
        f"{maker}: {name} is an array of dtype {x.dtype}, which JAX does not compute with."
        f" Give {name} as a number or a numeric array."
      ) from None
    x = jnp.asarray(x, dtype=x.dtype) if x.weak_type else x
    if holds_non_finite(x):
      raise ArgumentError(
        f"{maker}: {name} holds nan or inf. Give finite values (jnp.isfinite(x) shows"
        " where they are not; a nan usually comes from where the array was computed: a"
        " division by zero, a log of 0, an overflow)."
      )
    return x
  shown = repr(x) if len(repr(x)) <= 40 else f"{repr(x)[:37]}..."
  raise ArgumentError(
    f"{maker}: {name}={shown} is a {type(x).__name__}, not an array or a number. Give {name}"
    " as a number or an array (jnp.asarray(...)) that broadcasts to the site's value."
  )


def _check_representable(x: np.ndarray, dtype: Any, name: str, maker: str) -> None:
  """Refuses host values that JAX's dtype (`dtype`, 32-bit unless `jax_enable_x64`) would
  change beyond rounding: integers outside its range (wrapped around, or an
  `OverflowError`), finite floats beyond its range (made inf)."""
  dtype = np.dtype(dtype)
  if x.dtype == dtype or x.size == 0:
    return
  if x.dtype == object or dtype.kind in "iu":
    limits = np.iinfo(dtype)
    try:
      low, high = int(np.min(x)), int(np.max(x))
    except (TypeError, ValueError):
      return
    if limits.min <= low and high <= limits.max:
      return
    beyond = high if high > limits.max else low
    raise ArgumentError(
      f"{maker}: {_holding(name, x, beyond)} outside the range of {dtype.name}, the dtype JAX"
      f" computes it in ({limits.min} to {limits.max}; 64-bit types are off unless"
      f" jax_enable_x64 is set). Give {name} as a float"
      f" ({f'{name}={float(beyond)!r}' if x.ndim == 0 else 'np.asarray(..., np.float32)'}),"
      " or values within that range."
    )
  if dtype.kind == "f" and x.dtype.kind in "iuf":
    large = np.abs(x[np.isfinite(x)])
    if (large > np.finfo(dtype).max).any():
      raise ArgumentError(
        f"{maker}: {_holding(name, x, large.max().item())} beyond the range of {dtype.name},"
        f" the dtype JAX computes it in (up to {float(np.finfo(dtype).max):.4g}; 64-bit types"
        " are off unless jax_enable_x64 is set), where it would become inf. Give values"
        " within that range."
      )


def _holding(name: str, x: np.ndarray, value: Any) -> str:
  """`factor=1e+300 is` or `factor (an array float64[3]) holds 1e+300,`."""
  if x.ndim == 0:
    return f"{name}={x.item()!r} is"
  return f"{name} (an array {x.dtype.name}{list(x.shape)}) holds {value!r},"


_MAKERS = {
  "zero": "ablate",
  "mean": "ablate",
  "resample": "ablate",
  "low_rank": "low_rank_edit",
}


def maker_name(kind: str) -> str:
  """The name of the `fl.` function that makes interventions of `kind` (`ablate` for a
  zero ablation)."""
  return _MAKERS.get(kind, kind)


def _maker(kind: str, at: Any) -> str:
  """How refusals name an intervention being made: `fl.steer('Block_0')`."""
  return f"fl.{maker_name(kind)}({_site_text(at)})"


def _site_text(at: Any) -> str:
  if isinstance(at, list | tuple):
    return f"[{', '.join(map(_site_text, at))}]"
  if isinstance(at, str):
    return repr(at)
  if isinstance(at, _Called):
    return repr(at.name)
  if isinstance(at, CallNode):
    return at.where()
  return getattr(at, "__qualname__", repr(at))


def _static_at(at: Any) -> Any:
  return tuple(at) if isinstance(at, list) else at


def _make(kind: str, at: Any, operands: tuple, where: Any, on: str, part: Any, fn=None):
  index, where_arrays = _split_index(where, f"{_maker(kind, at)}: where=")
  return Intervention(
    operands=operands,
    where_arrays=where_arrays,
    at=_static_at(at),
    kind=kind,
    on=on,
    part=part,
    index=index,
    fn=fn,
  )


def ablate(
  at: Any,
  how: str = "zero",
  reference: Any = None,
  *,
  key: Any = None,
  where: Any = None,
  on: str = "output",
  part: Any = None,
) -> Intervention:
  """Ablates a call's output (or input): zero, mean or resample ablation.

  Args:
    at: the site(s): a path pattern such as `"Block_3/Attention_0"` or `"**/mlp"`, a
      Flax module class, a call node, a predicate on call nodes, or a list of these.
    how: "zero" (set to 0), "mean" (set to the mean of `reference` over its first axis,
      `reference` being the site's values on other inputs, for example from `fl.capture`)
      or "resample" (set to `reference` with its first axis shuffled by `key`: each
      example gets another example's value).
    reference: the site's values to take the mean of, or to resample from.
    key: a JAX key, for "resample".
    where: restrict the edit: a boolean mask that broadcasts to the value, or an index
      (`jnp.s_[:, 3]`: position 3; `jnp.s_[..., 2, :]`: head 2 of `(..., heads, dim)`).
    on: "output" (default) or "input" (the call's first positional argument).
    part: for a structured value (a tuple, dict or dataclass), which part to edit: an
      int (`part=0`: a Hugging Face block's hidden states) or a str
      (docs/interventions.md, "Structured values: part=").

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> out = fl.run(tree, x, interventions=[fl.ablate("layers_0")])
    >>> bool((out == tree.select().at_path("layers_2").get().export()["params"]["bias"]).all())
    True
  """
  maker = _maker("zero", at)
  if not (isinstance(how, str) and how in ("zero", "mean", "resample")):
    raise ArgumentError(
      f"{maker}: how= is 'zero', 'mean' or 'resample', got {how!r}. Pass one of these."
    )
  if how == "zero":
    return _make("zero", at, (), where, on, part)
  if reference is None:
    raise ArgumentError(
      f"{maker}: how={how!r} needs the site's values on other inputs, stacked along a first"
      " axis. Pass them as reference= (from fl.capture, say)."
    )
  if isinstance(reference, list | tuple):
    reference = np.asarray(reference)
  reference = _array(reference, "reference", maker)
  if reference.ndim == 0:
    raise ArgumentError(
      f"{maker}: reference= is a scalar; how={how!r} takes the site's values stacked along"
      " a first axis (one entry per example). Give an array with that axis."
    )
  if how == "mean":
    return _make("mean", at, (reference.mean(axis=0),), where, on, part)
  if key is None:
    raise ArgumentError(
      f"{maker}: how='resample' needs a JAX key to shuffle with. Pass key=jax.random.key(seed)."
    )
  try:
    shuffled = jax.random.permutation(key, reference, axis=0)
  except (TypeError, ValueError):
    raise ArgumentError(
      f"{maker}: key={key!r} is not a JAX random key. Give one made by jax.random.key(seed)."
    ) from None
  return _make("resample", at, (shuffled,), where, on, part)


def patch(
  at: Any, value: Any, *, where: Any = None, on: str = "output", part: Any = None
) -> Intervention:
  """Sets a call's output (or input) to `value` (activation patching).

  `value` broadcasts to the call's value; typically another run's capture of the site.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> fl.patch("Block_0/mlp", jnp.zeros((2, 8, 16)), where=jnp.s_[:, 3]).kind
    'patch'
  """
  return _make("patch", at, (_array(value, "value", _maker("patch", at)),), where, on, part)


def steer(
  at: Any,
  vector: Any,
  alpha: Any = 1.0,
  *,
  where: Any = None,
  on: str = "output",
  part: Any = None,
) -> Intervention:
  """Adds `alpha * vector` to a call's output (or input): activation steering.

  `vector` and `alpha` broadcast to the call's value and are arrays of the compiled
  program, so new values never recompile.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> fl.steer("**/Block_1", jnp.ones(16), alpha=4.0).operands[1].shape
    ()
  """
  maker = _maker("steer", at)
  operands = (_array(vector, "vector", maker), _array(alpha, "alpha", maker))
  return _make("steer", at, operands, where, on, part)


def scale(
  at: Any, factor: Any, *, where: Any = None, on: str = "output", part: Any = None
) -> Intervention:
  """Multiplies a call's output (or input) by `factor`.

  Example:
    >>> import flaxlens as fl
    >>> fl.scale("Block_0", 0.5).kind
    'scale'
  """
  return _make("scale", at, (_array(factor, "factor", _maker("scale", at)),), where, on, part)


def modify(
  at: Any,
  fn: Callable[..., Any],
  *operands: Any,
  where: Any = None,
  on: str = "output",
  part: Any = None,
) -> Intervention:
  """Replaces a call's output (or input) by `fn(argument, value, *operands)`.

  `argument` is the call's `fl.ArgsAndKwargs`; `fn` must return an array of the value's
  shape. `fn` is static (a new function recompiles), `operands` are arrays.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> clip = fl.modify("Block_0", lambda argument, y, bound: jnp.clip(y, -bound, bound), 1.0)
    >>> clip.kind
    'modify'
  """
  maker = _maker("modify", at)
  if not callable(fn):
    raise ArgumentError(
      f"{maker}: fn={fn!r} is not callable. Give a function fn(argument, value, *operands)"
      " that returns the new value."
    )
  ops = tuple(_array(x, f"operand {n}", maker) for n, x in enumerate(operands))
  return _make("modify", at, ops, where, on, part, fn=fn)


def low_rank_edit(
  at: Any,
  projection: Any,
  weight: Any = None,
  bias: Any = None,
  *,
  where: Any = None,
  on: str = "output",
  part: Any = None,
) -> Intervention:
  """A low-rank edit of a call's output (or input), as ReFT's LoReFT: `h ↦ h + Rᵀ(W h + b − R h)`.

  The edit acts on the value's last (feature) axis of size `d`: it replaces the value's
  coordinates in the `rank`-dimensional subspace spanned by the rows of `R` by `W h + b`.
  `R` is the rows of `projection` (`(rank, d)`) made orthonormal (QR, signs fixed:
  `projection` with orthonormal rows is `R` itself, to rounding), so training
  `projection` freely (`fl.train_interventions`) keeps `R` orthonormal. `weight`
  (`(rank, d)`, default `R`) and `bias` (`(rank,)`, default zeros) start the edit as the
  identity. An edit of an affine call's output folds into its kernel and bias
  (`fl.fold`).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)]), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> edit = fl.low_rank_edit("layers_0", jax.random.normal(jax.random.key(1), (2, 4)))
    >>> bool(jnp.allclose(fl.run(tree, x, interventions=[edit]), fl.run(tree, x), atol=1e-6))
    True
  """
  maker = _maker("low_rank", at)
  projection = _array(projection, "projection", maker)
  shape = tuple(projection.shape)
  if len(shape) != 2 or shape[0] > shape[1] or not jnp.issubdtype(projection.dtype, jnp.floating):
    raise ArgumentError(
      f"{maker}: projection has shape {shape} and dtype {projection.dtype}; give a"
      " floating-point (rank, features) matrix with rank <= features."
    )
  if weight is None:
    weight = orthonormal_rows(projection)
  if bias is None:
    bias = jnp.zeros(projection.shape[:1], projection.dtype)
  operands = (projection, _array(weight, "weight", maker), _array(bias, "bias", maker))
  return _make("low_rank", at, operands, where, on, part)


def interchange(
  at: Any,
  rotation: Any,
  source: Any,
  swapped: Any,
  *,
  where: Any = None,
  on: str = "output",
  part: Any = None,
) -> Intervention:
  """An interchange intervention in a rotated basis (distributed alignment search).

  The call's value `h` (the base run's) and `source` (the same call's value in another
  run, for example from `fl.capture`) are rotated into the basis of the rows of `Q`,
  the coordinates `swapped` picks are taken from the source, the others kept, and the
  result rotated back: `h ↦ Qᵀ(m ⊙ Q s + (1 − m) ⊙ Q h)`. `Q` is `rotation` (a
  `(d, d)` matrix on the last axis, size `d`) made orthogonal (QR, signs fixed: an
  orthogonal `rotation` is `Q` itself, to rounding), so training `rotation` freely
  (`fl.train_interventions`) keeps `Q` orthogonal. `swapped` is an int `k` (the first
  `k` coordinates) or a boolean mask of shape `(d,)`. With an index `where=`, `source`
  may also have the shape of the region it selects (a capture made with the same
  `index=`), where that region keeps the last axis whole.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)]), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> _, cache = fl.capture(tree, 2 * x, "layers_0")
    >>> swap_all = fl.interchange("layers_0", jnp.eye(4), cache["layers_0"], 4)
    >>> bool(jnp.allclose(fl.run(tree, x, interventions=[swap_all]), fl.run(tree, 2 * x)))
    True
  """
  maker = _maker("interchange", at)
  rotation = _array(rotation, "rotation", maker)
  if rotation.ndim != 2 or rotation.shape[0] != rotation.shape[1]:
    raise ArgumentError(
      f"{maker}: rotation has shape {tuple(rotation.shape)}; give a square (features,"
      " features) matrix."
    )
  features = rotation.shape[0]
  if isinstance(swapped, int) and not isinstance(swapped, bool):
    if not 0 <= swapped <= features:
      raise ArgumentError(
        f"{maker}: swapped={swapped} coordinates, of {features}. Give an int from 0 to"
        f" {features}, or a boolean mask of shape ({features},)."
      )
    swapped = jnp.arange(features) < swapped
  mask = _array(swapped, "swapped", maker)
  if mask.dtype != jnp.bool_ or mask.shape != (features,):
    raise ArgumentError(
      f"{maker}: swapped is {mask.dtype}{list(mask.shape)}; give an int k (the first k"
      f" coordinates) or a boolean mask of shape ({features},)."
    )
  operands = (rotation, _array(source, "source", maker), mask)
  return _make("interchange", at, operands, where, on, part)


# --- running ------------------------------------------------------------------------------


def checked_interventions(interventions: Any, where: str) -> tuple[Intervention, ...]:
  """`interventions` as a tuple of `Intervention`s (one alone counts as a list of one);
  anything else refused naming `where` (`"fl.run"`)."""
  if isinstance(interventions, Intervention):
    return (interventions,)
  expected = (
    "a list of interventions (fl.ablate, fl.patch, fl.steer, fl.scale, fl.modify,"
    " fl.low_rank_edit or fl.interchange results)"
  )
  fix = "Pass [] for none, or fl.load_interventions(path) for a saved set."
  if not isinstance(interventions, list | tuple):
    raise refuse(where, "interventions", interventions, expected, fix)
  return check_items(interventions, Intervention, where, "interventions", expected, fix)


def _probes_for(
  tree: CallNode,
  interventions: Sequence[Intervention],
  capture: Any,
  inputs: bool,
  shape: Callable[[Any], Any] | None,
  unreached: str = "raise",
) -> dict[int, EditedCall]:
  """The `EditedCall` each probed call runs through, by `id` of its node;
  `unreached="raise"` requires the run to make every call a site names, save where the
  site is every call (`capture=True`, `"all"`, `"**"`)."""
  sites = sites_of(tree)
  found: dict[int, dict[str, Any]] = {}

  def probe(site: Site) -> dict[str, Any]:
    fields = found.get(id(site.node))
    if fields is None:
      fields = found[id(site.node)] = {"node": site.node, "site": site.name, "edits": []}
    return fields

  for intervention in interventions:
    required = unreached == "raise" and not _every_call(intervention.at)
    for site, edit in _edits_of(tree, intervention, sites):
      check_part(site, edit.part, edit.on, intervention.at, sites)
      fields = probe(site)
      fields["edits"].append(edit)
      fields["required"] = fields.get("required", False) or required
  if capture is not None and capture is not False:
    options = capture if isinstance(capture, tuple) else (capture,)
    # A site that captures through edits of its own (`fl.heads`) says where they go.
    recording = [o for o in options if hasattr(o, "capture_edits")]
    plain = tuple(o for o in options if not hasattr(o, "capture_edits"))
    # An empty list names no site: refused (`select_sites`), as a patch at no site is.
    chosen = (
      sites
      if capture is True
      else select_sites(tree, plain, sites)
      if plain or not recording
      else []
    )
    required = unreached == "raise" and not _every_call(capture)
    for site in chosen:
      fields = probe(site)
      fields.update(output=True, input=inputs)
      fields["shape"] = None if shape is None else functools.partial(shape, site.name)
      fields["required"] = fields.get("required", False) or required
    for option in recording:
      for site, edit in option.capture_edits(tree, sites, shape):
        fields = probe(site)
        fields["edits"].append(edit)
        fields["required"] = fields.get("required", False) or unreached == "raise"
  return {
    key: EditedCall(**{**fields, "edits": tuple(fields["edits"])}) for key, fields in found.items()
  }


def _edits_of(
  tree: CallNode, intervention: Intervention, sites: list[Site]
) -> list[tuple[Site, Any]]:
  """The calls `intervention` edits and the edit each runs: itself at each site its `at`
  names, or what a site object that resolves itself (`fl.heads`: `edits_of`) says."""
  resolve = getattr(intervention.at, "edits_of", None)
  if resolve is not None:
    return resolve(tree, sites, intervention)
  return [(site, intervention) for site in select_sites(tree, intervention.at, sites)]


def _every_call(at: Any) -> bool:
  """Whether a site is every call (what the run calls, then, not what conversion saw)."""
  return at is True or (isinstance(at, str) and at in ("all", "**"))


def check_part(site: Site, part: Any, on: str, at: Any = None, sites: Sequence[Site] = ()) -> Any:
  """The array `part` picks from the `on` ("output" or "input") of `site` as conversion
  saw it (a `jax.ShapeDtypeStruct`), or None where conversion did not see it; refused,
  before anything runs, where that is not one array (the `part=` rule, `_parts.py`).
  Where `at`, the site pattern that chose the call, names a module path without a method
  and so every method of that module that ran (`sites`), the refusal says so and gives
  the pattern that names one method."""
  signature = site.output if on == "output" else site.inputs
  if signature is None:
    return None
  value = jax.tree_util.tree_unflatten(*signature)
  if on == "input":
    args = value[0]
    if not args:
      raise ArgumentError(
        f"{site.name}: on='input' is the first positional argument, and this call takes"
        " none (only keyword arguments). Use the output of the call that computes its"
        " argument instead."
      )
    value = args[0]
  try:
    return one_array(value, part, site.name, on)
  except ArgumentError as e:
    note = several_methods(at, site, sites)
    if not note:
      raise
    raise ArgumentError(f"{e} {note}") from None


def several_methods(at: Any, site: Site, sites: Sequence[Site]) -> str:
  """Where the path pattern `at` names `site`'s module path, without a method, and so
  every method of that module that ran (`attn.__call__` and `attn._split_heads`), a
  sentence saying so and giving the pattern of one method; else "".

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.tools.analysis._interventions import several_methods, sites_of
    >>> class Twice(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return self.half(x) * 2
    ...   def half(self, x):
    ...     return x / 2
    >>> model, x = nn.Sequential([Twice(), nn.relu]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> sites = sites_of(tree)
    >>> several_methods("layers_0", sites[1], sites).split("ran: ")[1]
    "['layers_0', 'layers_0.half']. Give 'layers_0.__call__' to name its call alone."
  """
  path, _ = site.node.readable_path()
  if not isinstance(at, str) or _every_call(at) or site.nested or not path_matches(at, path):
    return ""
  methods: dict[str, str] = {}  # method: the site name of its first call
  for s in sites:
    if not s.nested and s.node.readable_path()[0] == path:
      methods.setdefault(s.node.readable_path()[1], s.name)
  if len(methods) < 2:
    return ""
  method = "__call__" if "__call__" in methods else next(iter(methods))
  alone = "its call alone" if method == "__call__" else "one method alone"
  return (
    f"The site {at!r} is a module path without a method, so it names every method of that"
    f" module that ran: {list(methods.values())}. Give {at + '.' + method!r} to name"
    f" {alone}."
  )


def _check_dtype(dtype: Any) -> None:
  """Refuses a capture `dtype=` that is no numeric or boolean dtype, before anything runs."""
  if dtype is None:
    return
  try:
    numeric = jnp.issubdtype(jnp.dtype(dtype), jnp.number) or jnp.dtype(dtype) == jnp.bool_
  except (TypeError, ValueError):
    numeric = False
  if not numeric:
    raise ArgumentError(
      f"fl.run/fl.capture: dtype={dtype!r} is not a dtype JAX computes with. Give the dtype"
      " to cast every captured array to (jnp.float16, 'bfloat16'), or leave dtype= out."
    )


def _shaper(index: Any, dtype: Any) -> Callable[[str, Any], Any] | None:
  """Slicing and casting of a site's captured arrays, `shape(site name, array)`; `index`
  as `_split_index` returns it, checked against each array (index rules)."""
  if index is None and dtype is None:
    return None

  def shape(site: str, x: Any) -> Any:
    if x is None:
      return None
    if index is not None:
      x = x[checked(*index, tuple(x.shape), f"{site}: index=", "captured value")]
    return x if dtype is None else x.astype(dtype)

  return shape


def _run_once(
  tree: CallNode,
  argument: ArgsAndKwargs,
  interventions: tuple[Intervention, ...],
  capture: Any,
  inputs: bool,
  index: Any,
  dtype: Any,
  random_streams: Any,
  unreached: str,
) -> Any:
  probes = _probes_for(tree, interventions, capture, inputs, _shaper(index, dtype), unreached)
  every_call = unreached == "raise" and (
    _every_call(capture) or any(_every_call(i.at) for i in interventions)
  )
  probing = Probing(probes, unreached_fix=_UNREACHED_FIX, every_call=every_call)
  key = (interventions, capture, inputs, index, dtype)
  output = run_tree(tree, argument, random_streams, {}, probing=probing, probing_key=key)
  return output, probing.captured


_UNREACHED_FIX = (
  "Convert with example arguments that take this branch, or, to edit or capture these"
  " calls only where a run makes them, pass unreached='ignore' to fl.run or fl.capture."
)


@variable_jit
def _run_compiled(
  tree, argument, interventions, capture, inputs, index, dtype, random_streams, unreached
):
  return _run_once(
    tree, argument, interventions, capture, inputs, index, dtype, random_streams, unreached
  )


@variable_jit
def _run_chunk(
  tree, argument, indices, interventions, capture, inputs, index, dtype, streams, unreached
):
  """`_run_once` on the examples of `argument` at `indices` (traced: one program a size)."""
  return _run_once(
    tree,
    _budget.take(argument, indices),
    interventions,
    capture,
    inputs,
    index,
    dtype,
    streams,
    unreached,
  )


def _abstract_run(tree: CallNode, argument: ArgsAndKwargs, rest: tuple) -> tuple[Any, list[str]]:
  """The abstract `(output, captured)` of a run on `argument` (its arrays may be
  `jax.ShapeDtypeStruct`s) and the labels of the state variables the run would update.
  Runs a copy of the tree under `jax.eval_shape`: no FLOPs, the tree left alone."""
  slots, values = unbind_variables(tree, freeze=True)
  updated: list[str] = []

  def run_copy(arg: ArgsAndKwargs) -> Any:
    copy = bind_variables(slots, values)
    variables = variables_in(copy)
    before = [v.value for v in variables]
    result = _run_once(copy, arg, *rest)
    updated[:] = [
      v.label
      for v, old in zip(variables, before, strict=True)
      if isinstance(v, StateVariable) and v.value is not old
    ]
    return result

  return _budget.abstractly(run_copy, argument), updated


def _site_key(path: Any) -> str:
  return str(path[0].key)


def _output_key(path: Any) -> str:
  return f"the output{jax.tree_util.keystr(path)}"


def _run_budgeted(tree: CallNode, argument: ArgsAndKwargs, rest: tuple, budget: int) -> Any:
  """`(output, captured)` of a run on `argument`, on the host, the captures of each compiled
  call taking at most `budget` bytes: the batch split into equal chunks where needed,
  refused where splitting cannot give the result of the whole batch."""
  where = f"{tree.where()} with budget={budget:,} bytes"
  whole, updated = _abstract_run(tree, argument, rest)
  if _budget.nbytes(whole[1]) <= budget:
    return jax.device_get(_run_compiled(tree, argument, *rest))
  batch = _budget.batch_size(argument, where)
  if updated:
    raise BudgetError(
      f"{where}: the captures exceed the budget, and a run updates the state variables"
      f" {updated[:6]}{' ...' if len(updated) > 6 else ''}: chunks of the batch would each"
      " update them, in turn, where the whole batch updates them once (batch statistics"
      " over the batch, a counter, NNX random counts). Run the model in a mode that updates"
      " no state (train=False, model.eval()), or capture less (fewer sites, index=, dtype=)."
    )
  if rest[5] is not None:
    raise BudgetError(
      f"{where}: the captures exceed the budget, and the run is given random_streams:"
      " every chunk of the batch would draw the same random numbers (a dropout mask made"
      " for a chunk's rows), where the whole batch draws them once for all its rows. Run"
      " without random_streams (a deterministic mode: train=False), or capture less"
      " (fewer sites, index=, dtype=)."
    )
  picking = [_maker(i.kind, i.at) for i in rest[0] if _budget.picks_examples(i.index)]
  if picking:
    raise BudgetError(
      f"{where}: the captures exceed the budget, and the where= of {', '.join(picking)}"
      " selects along the leading (batch) axis: applied to each chunk of the batch, it"
      " would select its examples in every chunk. Edit every example alike (where="
      " starting with ':' or '...'), or capture less (fewer sites, index=, dtype=) and run"
      " without splitting."
    )
  if batch == 1:
    sizes = {key: _budget.nbytes(value) for key, value in whole[1].items()}
    _budget.examples_per_chunk(_budget.nbytes(whole[1]), 0, sizes, budget, 1, where)
  try:
    one, _ = _abstract_run(tree, _budget.shrunk(argument, 1), rest)
  except FlaxlensError as e:
    raise BudgetError(
      f"{where}: the captures exceed the budget, so the batch of {batch} would be split"
      f" into chunks, and a run on one example fails: {e} An intervention whose arrays"
      " hold the whole batch (a patch of every example, resampling, a mask or index over"
      " the batch axis) cannot apply to a chunk. Give arrays that broadcast over the batch,"
      " or capture less (fewer sites, index=, dtype=) and run without splitting."
    ) from e
  outputs = _budget.layout(whole[0], one[0], batch, where, _output_key)
  captures = _budget.layout(whole[1], one[1], batch, where, _site_key)
  size = _budget.examples_per_chunk(
    captures.per_example, captures.fixed, captures.sizes(one[1]), budget, batch, where
  )
  argument = jax.tree_util.tree_map(lambda x: jnp.asarray(x) if is_array(x) else x, argument)
  done: dict[tuple[int, int, bool], Any] = {}

  def chunk(indices: tuple[int, ...], captured: bool = True) -> Any:
    """The host `(output, captured)` of the examples at `indices`; run once."""
    if (indices, captured) not in done:
      interventions, capture, *options = rest
      ran = _run_chunk(
        tree,
        argument,
        np.asarray(indices, np.int32),
        interventions,
        capture if captured else None,
        *options,
      )
      # Copied out, so the device's buffers go now: on CPU a NumPy view of an array would
      # keep its buffer alive, and the chunks would together hold the whole batch's bytes.
      done[indices, captured] = jax.tree_util.tree_map(lambda x: np.array(x, copy=True), ran)
      del ran
    return done[indices, captured]

  # Where the budget holds one example, the check's chunks of two capture nothing and
  # their outputs are compared. The message names the first site that differs.
  captured = size > 1
  order = [(site.name, tuple(site.node.path)) for site in sites_of(tree)]
  _budget.check_independent(
    lambda indices: chunk(indices, captured)[: 1 + captured],
    (outputs, captures)[: 1 + captured],
    size,
    batch,
    where,
    exceeding="the captures",
    fix=(
      "Capture less (fewer sites, index=, dtype=) and run without splitting, or give a"
      " larger budget."
    ),
    named=lambda found: _innermost(found, order),
  )
  chunk_starts = _budget.starts(batch, size)
  ran = [chunk(tuple(_budget.examples(start, size, batch).tolist())) for start in chunk_starts]
  varying = _budget.varying([r[1] for r in ran], captures)
  if varying is not None:
    raise BudgetError(
      f"{where}: the capture {varying} has the same shape for any number of examples (it"
      " holds no batch axis: index= dropped it, or it reduces over the batch), yet differs"
      " between chunks of the batch, so no chunk gives the whole batch's value. Keep the"
      " batch axis in what you capture (index=jnp.s_[:, ...]), or capture less and run"
      " without splitting."
    )
  return (
    _budget.joined([r[0] for r in ran], chunk_starts, size, outputs),
    _budget.joined([r[1] for r in ran], chunk_starts, size, captures),
  )


def _innermost(found: list[str], order: list[tuple[str, tuple]]) -> str:
  """Of the captures that differ, the first in call order (`order`: each site's name and
  module path) that encloses no other one: where a difference starts, not a call around
  it; the output where no site differs."""
  paths = {name: path for name, path in order}
  sites = [name for name, _ in order if name in found or f"{name}:input" in found]
  inner = [
    name
    for name in sites
    if not any(o != name and paths[o][: len(paths[name])] == paths[name] for o in sites)
  ]
  return inner[0] if inner else found[0]


@takes_model_arguments("fl.run(tree, fl.ArgsAndKwargs.capture(x, train=False), capture='**')")
def run(
  tree: CallNode,
  args: Any,
  /,
  *,
  interventions: Sequence[Intervention] = (),
  capture: Any = None,
  inputs: bool = False,
  index: Any = None,
  dtype: Any = None,
  random_streams: Any = None,
  jit: bool = True,
  unreached: str = "raise",
  budget: int | None = None,
) -> Any:
  """Runs a converted tree on `args` with interventions, capturing calls.

  The tree runs once, natively (every call not intervened on is Flax's own), compiled
  with `jax.jit` by default: the tree's variables, the arguments' arrays and the
  interventions' arrays are inputs of the compiled program, so new values (a steering
  strength, a patch, edited weights) reuse it; sites, kinds and Python values of the
  arguments are compiled in. Called inside your own `jax.jit`, `jax.vmap` or `jax.grad`,
  pass `jit=False`.

  Sites (for `interventions` and `capture`) are path patterns as
  `tree.select().at_path` takes them (`"Block_3/Dense_0"`, `"**/mlp"`, `".method"`
  suffixes), Flax module classes (subclasses included), call nodes, predicates on call
  nodes, or lists of these (each element must match a call); `capture=True` (or
  `"all"`) captures every call. A call inside `nn.scan`/`nnx.scan` (or `vmap`) is one
  site, edited at every iteration and captured stacked along a new leading axis (outer
  transforms first). Sites, parts and values are checked while the run is traced,
  before anything is compiled; `fl.save_interventions` saves a list of interventions.
  Every call a site names must be made by the run (a run that takes another branch
  than conversion raises), unless `unreached="ignore"`.

  Args:
    tree: a converted tree (`fl.unflaxify`).
    args: the model's arguments: one value (its only positional argument), a tuple of
      positional arguments, or `fl.ArgsAndKwargs.capture(*args, **kwargs)` for keyword
      arguments too. Every other parameter is an option of `fl.run`, keyword-only, so
      none can be mistaken for an argument of the model.
    interventions: `fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify` results,
      applied in order (input edits before the call, output edits after it).
    capture: the sites whose outputs to return, or None.
    inputs: also capture each captured call's positional arguments, as
      `"site:input"` (one argument as itself, several as a tuple).
    index: keep only `value[index]` of every captured array (memory control).
    dtype: cast every captured array to this dtype.
    random_streams: as for a tree call (Linen: `{"dropout": key}`).
    jit: compile the run (default) or run it eagerly.
    unreached: "raise" (default): a call that an intervention or capture names and this
      run does not make (it takes another branch than conversion) is an error;
      "ignore": such edits are not applied and such captures are left out of the
      result (for sites that a run may skip). Capturing every call (`capture=True`)
      captures the calls the run makes.
    budget: the most bytes the captured values of one compiled run may take on the
      device, or None. Where the batch's captures exceed it, the batch is split along
      the leading axis of the model's array arguments into equal chunks that fit, run
      one after the other by one compiled program, each chunk's values moved to the
      host before the next; see docs/interventions.md (budgets) for what is refused.
      With a budget, the output and captures come back as NumPy arrays.

  Returns:
    The output, or `(output, {site: value})` when `capture` is given.

  Raises:
    SelectionError: a site matches no call (the closest names are listed).
    ArgumentError: a value cannot apply to its site (the site and shapes are named), or
      the call spreads the model's arguments over `fl.run`'s own.
    CallStructureError: the run did not make a call a site names (`unreached="raise"`).
    UnsupportedFlaxFeatureError: a captured site runs where values cannot leave.
    BudgetError: the captures of one example exceed `budget`, or the batch cannot be
      split exactly (the message says why).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> tree = fl.unflaxify(model, variables, x)
    >>> out, cache = fl.run(tree, x, capture="layers_*")
    >>> sorted(cache), bool((out == model.apply(variables, x)).all())
    (['layers_0', 'layers_2'], True)
  """
  check_tree(tree, "fl.run")
  if unreached not in ("raise", "ignore"):
    raise ArgumentError(f"fl.run: unreached= is 'raise' or 'ignore', got {unreached!r}.")
  interventions = checked_interventions(interventions, "fl.run")
  capture = _static_at(capture)
  if isinstance(capture, str) and capture == "all":
    capture = True
  interventions, capture = nodes_by_name(tree, interventions, capture)
  argument = model_arguments(args)
  random_streams = resolve_random_streams(random_streams, tree.where())
  if index is not None:
    index = _split_index(index if isinstance(index, tuple) else (index,))
  _check_dtype(dtype)
  budget = _budget.checked_budget(budget, "fl.run")
  if budget is not None:
    if capture is None or capture is False or not jit:
      raise BudgetError(
        f"fl.run: budget= bounds what a compiled run captures, and this run"
        f" {'captures nothing' if jit else 'is not compiled (jit=False)'}. Pass capture=..."
        " with jit=True (the default), or leave budget= out."
      )
    rest = (interventions, capture, inputs, index, dtype, random_streams, unreached)
    return _run_budgeted(tree, argument, rest, budget)
  runner = _run_compiled if jit else _run_once
  output, captured = runner(
    tree, argument, interventions, capture, inputs, index, dtype, random_streams, unreached
  )
  return output if capture is None or capture is False else (output, captured)


def place(tree: CallNode, interventions: Any, /) -> CallNode:
  """The tree with each intervention placed as a layer wrapping the call it edits.

  Each edited call's node is replaced by an `EditedCall` layer holding the node and
  the interventions of that call: the same layer `fl.run` runs a call through, kept in
  the tree. Calling the placed tree (or `fl.run`, `fl.capture` and `fl.variable_jit`
  of it) applies the edits wherever their calls run, inside `nn.scan`/`nnx.scan` at
  every iteration; the interventions' arrays are leaves of the tree, so
  `fl.variable_jit` reuses one compiled program for new values. As with any replaced
  call, a run that skips an edited call raises, and export refuses the tree (fold the
  interventions into weights with `fl.fold` instead). `tree` is not modified.

  Args:
    tree: a converted tree.
    interventions: `fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify`
      results (one, or a list), applied in order where several edit one call.

  Returns:
    The tree with the edited calls wrapped.

  Raises:
    SelectionError: a site matches no call.
    ArgumentError: an intervention cannot apply to its site, or edits the root call
      (which has no caller to hand it to a layer: pass it to `fl.run`).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> steered = fl.place(tree, fl.steer("layers_0", jnp.ones(3), alpha=2.0))
    >>> run = fl.variable_jit(lambda t, v: t(fl.ArgsAndKwargs.capture(v)))
    >>> run(steered, x).shape
    (1, 2)
  """
  check_tree(tree, "fl.place")
  interventions = checked_interventions(interventions, "fl.place")
  return placed(tree, interventions, "fl.place")


def placed(tree: CallNode, edits: tuple[Any, ...], where: str) -> CallNode:
  """`tree` with an `EditedCall` holding `edits` (objects with `at`, `on`, `part` and
  `edit`: interventions, `fl.splice`'s edit) wrapping each call they edit."""
  edits, _ = nodes_by_name(tree, edits, None)
  layers = _probes_for(tree, edits, None, False, None)
  if id(tree) in layers:
    raise ArgumentError(
      f"{where}: an intervention edits the root call {layers[id(tree)].site}, which has no"
      " caller in the tree to hand it to a layer. Pass that intervention to fl.run"
      " (interventions=[...]), or edit a call inside the model."
    )

  def rebuilt(x: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(
      x, is_leaf=lambda y: y is not x and isinstance(y, Struct)
    )
    new = [rebuilt(leaf) if isinstance(leaf, Struct) else leaf for leaf in leaves]
    if any(a is not b for a, b in zip(new, leaves, strict=True)):
      x_new = jax.tree_util.tree_unflatten(treedef, new)
    else:
      x_new = x
    layer = layers.get(id(x))
    if layer is None:
      return x_new
    return dataclasses.replace(layer, node=x_new, required=False)

  return rebuilt(tree)


def nodes_by_name(
  tree: CallNode, interventions: tuple[Any, ...], capture: Any
) -> tuple[tuple[Any, ...], Any]:
  """The interventions and captured sites with every call node given as a site replaced
  by its site's name (see `_Called`), so that sites resolve alike inside a compiled run."""
  sites: list[Site] = []

  def by_name(at: Any) -> Any:
    if isinstance(at, tuple):
      return tuple(by_name(a) for a in at)
    if not isinstance(at, CallNode):
      return at
    sites[:] = sites or sites_of(tree)
    site = next((s for s in sites if s.node is at), None)
    if site is None:
      raise SelectionError(_no_match(tree, at, sites))
    return _Called(site.name)

  edited = []
  for intervention in interventions:
    at = by_name(intervention.at) if isinstance(intervention, Intervention) else None
    changed = at is not None and at != intervention.at
    edited.append(dataclasses.replace(intervention, at=at) if changed else intervention)
  return tuple(edited), by_name(capture)


@takes_model_arguments("fl.capture(tree, fl.ArgsAndKwargs.capture(x, train=False), 'Block_*')")
def capture(
  tree: CallNode,
  args: Any,
  /,
  at: Any = True,
  *,
  inputs: bool = False,
  index: Any = None,
  dtype: Any = None,
  interventions: Sequence[Intervention] = (),
  random_streams: Any = None,
  jit: bool = True,
  unreached: str = "raise",
  budget: int | None = None,
) -> tuple[Any, dict[str, Any]]:
  """Runs a tree and returns `(output, {site: value})`: every call's output by default.

  `fl.capture(tree, x, "**/mlp")` is `fl.run(tree, x, capture="**/mlp")`; see
  `fl.run` for the model's arguments (one value: `x`, a tuple, or `fl.ArgsAndKwargs`),
  sites, options and compilation. `budget=` (bytes) bounds what one compiled run
  captures, splitting the batch into chunks where needed (see `fl.run`).

  Example:
    >>> import flaxlens as fl
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.relu)
    >>> tree = fl.unflaxify(model, jnp.ones((1, 4)))
    >>> out, cache = fl.capture(tree, jnp.ones((1, 4)))
    >>> sorted(cache)
    ['Sequential.__call__', 'layers/0']
  """
  check_tree(tree, "fl.capture")
  return run(
    tree,
    args,
    interventions=checked_interventions(interventions, "fl.capture"),
    capture=at,
    inputs=inputs,
    index=index,
    dtype=dtype,
    random_streams=random_streams,
    jit=jit,
    unreached=unreached,
    budget=budget,
  )
