"""The `Intervention`: one edit of a call's input or output, as data.

Where it applies (`at`, a site pattern), what it does (`kind`), which part of the call it
acts on (`on`, `part`, `where`): all static; the arrays it uses (`operands`, the arrays of
`where`): all dynamic. Python numbers become arrays when an intervention is made, so one
compiled program serves every value. No Flax internals here."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import ArgumentError
from flaxlens.tools.base._index import MASK, bounded, checked, is_array
from flaxlens.tools.base._index import split as _split_index
from flaxlens.tools.base._kinds import (
  BUILT_IN_KINDS,
  Edited,
  InterventionKind,
  Region,
  check_fits,
  operand_name,
)
from flaxlens.tools.base._parts import checked_part, one_array, set_part
from flaxlens.tools.base._sites import Called

# --- interventions ------------------------------------------------------------------------

# The names of the built-in kinds, in the order refusals list them.
KINDS = tuple(BUILT_IN_KINDS)


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
      "low_rank", "interchange" (the built-in kinds, by name), or an object implementing
      `InterventionKind` (a kind of your own; `tools/base/_kinds.py`).
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
  kind: str | InterventionKind = static_field()
  on: str = static_field(default="output")
  part: Any = static_field(default=None)
  index: Any = static_field(default=None)
  fn: Any = static_field(default=None)

  def __post_init__(self) -> None:
    maker = maker_label(self.kind, self.at)
    if isinstance(self.kind, str) and self.kind not in KINDS:
      raise ArgumentError(
        f"{maker}: unknown intervention kind {self.kind!r}; one of {KINDS}. Make"
        " interventions with fl.ablate, fl.patch, fl.steer, fl.scale, fl.modify,"
        " fl.low_rank_edit or fl.interchange."
      )
    if isinstance(self.kind, type):
      raise ArgumentError(
        f"{maker}: kind={self.kind.__qualname__} is a class; an intervention takes an"
        f" object of it. Give kind={self.kind.__qualname__}()."
      )
    if not isinstance(self.kind, str | InterventionKind):
      raise ArgumentError(
        f"{maker}: kind={self.kind!r} is neither a built-in kind's name ({KINDS}) nor an"
        " object implementing the InterventionKind protocol. Give one of these."
      )
    if not isinstance(self.kind, str) and BUILT_IN_KINDS.get(self.kind.name) == self.kind:
      object.__setattr__(self, "kind", self.kind.name)  # a built-in is known by its name
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
    edited = Edited(site, argument, target, self.on, self.fn)
    new = kind_of(self).compute(edited, self.placed_operands(site, target))
    if self.index is not None:
      mask = where_mask(self, site, target)
      new = jnp.where(mask, new, target)
    return set_part(value, self.part, new.astype(target.dtype))

  def placed_operands(self, site: str, target: Any) -> tuple[Any, ...]:
    """The operands for editing `target` (the array edited at `site`): the operand the
    kind's `region` names (a patched value, a steering vector), of the shape of the
    region an index `where=` selects, placed into that region of `target`'s shape
    (`_into_region`); the others as given."""
    ops, region = self.operands, kind_of(self).region
    if self.index is not None and self.index != MASK and region is not None:
      n = region.operand
      ops = (*ops[:n], _into_region(self, site, target, ops[n], region), *ops[n + 1 :])
    return ops


def kind_of(intervention: Intervention) -> InterventionKind:
  """The kind object of `intervention` (its `kind` field holds a built-in's name or an
  object implementing `InterventionKind`)."""
  kind = intervention.kind
  return BUILT_IN_KINDS[kind] if isinstance(kind, str) else kind


def non_finite(intervention: Intervention) -> str | None:
  """What of `intervention`'s operands holds nan or inf (`"its factor holds nan or
  inf"`), or None; for an intervention not made by its maker here (made under tracing,
  loaded from a file), as `fl.fold` checks it. See `holds_non_finite`."""
  for n, operand in enumerate(intervention.operands):
    if holds_non_finite(operand):
      return f"its {operand_name(kind_of(intervention), n)} holds nan or inf"
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
    check_fits(site, mask, target, "the mask of where=", intervention.on)
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


def _into_region(
  intervention: Intervention, site: str, target: Any, operand: Any, region_operand: Region
) -> Any:
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
  what = region_operand.what
  if tuple(np.shape(operand)) != tuple(region) or not is_array(operand):
    check_fits(site, operand, target, what, intervention.on, region=tuple(region))
    return operand
  if region_operand.whole_last_axis and not _keeps_last_axis(intervention.index, len(shape)):
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


def operand_array(x: Any, name: str, maker: str) -> Any:
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


def maker_label(kind: str | InterventionKind, at: Any) -> str:
  """How refusals name an intervention being made: `fl.steer('Block_0')`; `kind` is a
  built-in's name (an unknown name is shown as `fl.name`) or a kind object."""
  if isinstance(kind, str):
    maker = BUILT_IN_KINDS[kind].maker if kind in BUILT_IN_KINDS else f"fl.{kind}"
  elif isinstance(kind, InterventionKind):
    maker = kind.maker
  else:
    maker = "fl.Intervention"
  return f"{maker}({_site_text(at)})"


def _site_text(at: Any) -> str:
  if isinstance(at, list | tuple):
    return f"[{', '.join(map(_site_text, at))}]"
  if isinstance(at, str):
    return repr(at)
  if isinstance(at, Called):
    return repr(at.name)
  if isinstance(at, CallNode):
    return at.where()
  return getattr(at, "__qualname__", repr(at))


def static_at(at: Any) -> Any:
  return tuple(at) if isinstance(at, list) else at


def make_intervention(
  kind: str | InterventionKind, at: Any, operands: tuple, where: Any, on: str, part: Any, fn=None
):
  index, where_arrays = _split_index(where, f"{maker_label(kind, at)}: where=")
  return Intervention(
    operands=operands,
    where_arrays=where_arrays,
    at=static_at(at),
    kind=kind,
    on=on,
    part=part,
    index=index,
    fn=fn,
  )
