"""Intervention kinds: what an `fl.Intervention` does to the value it edits, one class a kind.

A kind is an object implementing the `InterventionKind` protocol: its computation (the
edited value from the value and the operands, with its checks), how its operands are
named, which of them `fl.train_interventions` learns, which one `where=` may place into
the region it selects, which one a training batch's source run fills, and its folding
rule (how `fl.fold` turns it into weights, or why it cannot). The built-in kinds (zero,
patch, mean, resample, steer, scale, modify, low_rank, interchange) are classes here,
registered by name in `BUILT_IN_KINDS`; a user's own kind is a class in their code, given
to `fl.Intervention(kind=MyKind(), ...)`. No Flax internals here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.errors import ArgumentError, FlaxlensError, error_text, model_call_error

# --- what a kind is given, and declares ---------------------------------------------------


class Edited(NamedTuple):
  """The value an intervention edits, and where: what `InterventionKind.compute` is given.

  Attributes:
    site: the call's name (`Block_0/mlp.__call__`), to start messages with.
    argument: the call's arguments (`fl.ArgsAndKwargs`).
    value: the array edited (the call's output or first argument, or its `part=`).
    on: "output" or "input".
    fn: the intervention's function (`fl.modify`), or None.
  """

  site: str
  argument: ArgsAndKwargs
  value: Any
  on: str
  fn: Any


class Region(NamedTuple):
  """The operand that an index `where=` may place into the region it selects: given the
  region's shape (a value captured with the same `index=`), it is put there.

  Attributes:
    operand: its position among the operands.
    what: how messages name it ("the steering vector").
    whole_last_axis: whether the kind mixes the last (feature) axis, so that a
      region-shaped operand needs a `where=` that keeps that axis whole.
  """

  operand: int
  what: str
  whole_last_axis: bool = False


class Adds(NamedTuple):
  """Folding rule: the kind adds `delta(operands, value)` (an array that broadcasts to the
  value) to the value, which `fl.fold` writes into a bias-shaped parameter (or, for an
  input, the call's parameters that reproduce it)."""

  delta: Callable[[tuple, Any], Any]


class Multiplies(NamedTuple):
  """Folding rule: the kind multiplies the value by `factor(operands, value)` (an array
  that broadcasts to the value), which `fl.fold` writes into the parameters that scale
  the call's output (or its input's features)."""

  factor: Callable[[tuple, Any], Any]


class MapsFeatures(NamedTuple):
  """Folding rule: the kind maps the value's last axis affinely, `h ↦ h A + c`, with
  `(A, c) = affine(operands)`; `fl.fold` maps an affine call's parameters ending in that
  axis by `A` and adds `c` to its bias (on an output, everywhere: no `where=`)."""

  affine: Callable[[tuple], tuple[Any, Any]]


class Unfoldable(NamedTuple):
  """Folding rule: weights cannot express the kind; `reason` says why (`fl.fold` refuses
  with it: "it runs an arbitrary function, which weights cannot express")."""

  reason: str


FoldRule = Adds | Multiplies | MapsFeatures | Unfoldable


@runtime_checkable
class InterventionKind(Protocol):
  """What an intervention does: implement it to add a kind of your own.

  A kind object is static in the intervention (in its treedef, as `at` is): it must be
  hashable, and a new object that is not equal to the last recompiles the run (a plain
  class compares by identity: make its object once). Its operands are the arrays.
  `fl.run`, `fl.place` and `fl.capture` apply it through `compute`;
  `fl.train_interventions` learns the operands `learned` names; `fl.fold` follows
  `fold`; `fl.save_interventions` refuses it (a saved set holds the built-in kinds only).

  Attributes:
    name: the kind's name (`Intervention.kind` of the built-ins is this name).
    maker: how messages name what makes it (`"fl.steer"`; `"my_edits.clamp"`).
    operand_names: how messages name the operands, by position (an operand past them is
      "operand n").
    region: the operand an index `where=` may place into the region it selects, or None.
    source: the operand a training batch's source run fills (`fl.train_interventions`
      with `(args, data, source_args)` batches), or None.
    fold: how `fl.fold` turns it into weights (`Adds`, `Multiplies`, `MapsFeatures`),
      or `Unfoldable(reason)`.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.extend import Unfoldable, check_fits
    >>> class Clamp:
    ...   name, maker, operand_names = "clamp", "Clamp", ("bound",)
    ...   region, source, fold = None, None, Unfoldable("it clips the value")
    ...   def learned(self, count):
    ...     return (0,)
    ...   def compute(self, edited, operands):
    ...     check_fits(edited.site, operands[0], edited.value, "the bound", edited.on)
    ...     return jnp.clip(edited.value, -operands[0], operands[0])
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> clamp = fl.Intervention(operands=(jnp.array(0.1),), where_arrays=(), at="layers_0",
    ...                         kind=Clamp())
    >>> _, cache = fl.capture(tree, x, "layers_0", interventions=[clamp])
    >>> bool((jnp.abs(cache["layers_0"]) <= 0.1).all())
    True
  """

  name: str
  maker: str
  operand_names: tuple[str, ...]
  region: Region | None
  source: int | None
  fold: FoldRule

  def learned(self, count: int) -> tuple[int, ...]:
    """The positions of the operands `fl.train_interventions` learns, of `count`
    operands; empty: the kind does not train."""
    ...

  def compute(self, edited: Edited, operands: tuple[Any, ...]) -> Any:
    """The edited value: an array of `edited.value`'s shape (cast to its dtype after);
    `operands` as placed (`Region`). Refuse operands that do not fit with an
    `ArgumentError` that starts with `edited.site` and says what to give."""
    ...


def operand_name(kind: InterventionKind, position: int) -> str:
  """How messages name operand `position` of `kind` ("vector", "operand 3")."""
  names = kind.operand_names
  return names[position] if position < len(names) else f"operand {position}"


# --- the built-in kinds -------------------------------------------------------------------


class SavedForm(NamedTuple):
  """How `fl.save_interventions` saves a built-in kind: how many operands (None: any), since
  which format version, and whether it holds a function (`fl.modify`'s)."""

  operands: int | None
  since: int = 2
  function: bool = False


class _BuiltIn:
  """What the built-in kinds share: their defaults, how they are saved (`saved`), and
  equality by class (every instance of one is the same kind). Each sets `name`, `maker`
  and `fold`."""

  operand_names: tuple[str, ...] = ()
  region: Region | None = None
  source: int | None = None
  saved = SavedForm(0)
  learns: tuple[int, ...] = ()

  def learned(self, count: int) -> tuple[int, ...]:
    return self.learns

  def __eq__(self, other: object) -> bool:
    return type(other) is type(self)

  def __hash__(self) -> int:
    return hash(type(self))

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"


class Zero(_BuiltIn):
  """`fl.ablate(how="zero")`: the value set to zeros."""

  name, maker = "zero", "fl.ablate"
  fold = Multiplies(lambda operands, value: jnp.zeros((), value.dtype))

  def compute(self, edited: Edited, operands: tuple[Any, ...]) -> Any:
    return jnp.zeros_like(edited.value)


class _SetTo(_BuiltIn):
  """A kind that sets the value to its one operand, broadcast."""

  what = ""
  saved = SavedForm(1)

  def compute(self, edited: Edited, operands: tuple[Any, ...]) -> Any:
    check_fits(edited.site, operands[0], edited.value, self.what, edited.on)
    return jnp.broadcast_to(operands[0], edited.value.shape)


class Patch(_SetTo):
  """`fl.patch`: the value set to given values."""

  name, maker, what, operand_names = "patch", "fl.patch", "the patched value", ("value",)
  region, learns = Region(0, "the patched value"), (0,)
  fold = Unfoldable("it sets the value to given activations, which depend on other inputs")


class Mean(_SetTo):
  """`fl.ablate(how="mean")`: the value set to the mean of a reference."""

  name, maker, what = "mean", "fl.ablate", "the mean of the reference"
  operand_names = ("reference",)
  fold = Unfoldable("it sets the value to the mean of other activations, which no weight holds")


class Resample(_SetTo):
  """`fl.ablate(how="resample")`: the value set to a shuffled reference."""

  name, maker, what = "resample", "fl.ablate", "the resampled reference"
  operand_names = ("reference",)
  fold = Unfoldable("it sets the value to other examples' activations")


class Steer(_BuiltIn):
  """`fl.steer`: `alpha * vector` added to the value."""

  name, maker, operand_names = "steer", "fl.steer", ("vector", "alpha")
  region, learns, saved = Region(0, "the steering vector"), (0,), SavedForm(2)
  fold = Adds(lambda operands, value: operands[1] * operands[0])

  def compute(self, edited: Edited, operands: tuple[Any, ...]) -> Any:
    check_fits(edited.site, operands[0], edited.value, "the steering vector", edited.on)
    check_fits(edited.site, operands[1], edited.value, "alpha", edited.on)
    return edited.value + operands[1] * operands[0]


class Scale(_BuiltIn):
  """`fl.scale`: the value multiplied by a factor."""

  name, maker, operand_names = "scale", "fl.scale", ("factor",)
  learns, saved = (0,), SavedForm(1)
  fold = Multiplies(lambda operands, value: operands[0])

  def compute(self, edited: Edited, operands: tuple[Any, ...]) -> Any:
    check_fits(edited.site, operands[0], edited.value, "the factor", edited.on)
    return edited.value * operands[0]


class Modify(_BuiltIn):
  """`fl.modify`: the value replaced by `fn(argument, value, *operands)`."""

  name, maker, saved = "modify", "fl.modify", SavedForm(None, function=True)
  fold = Unfoldable("it runs an arbitrary function, which weights cannot express")

  def learned(self, count: int) -> tuple[int, ...]:
    return tuple(range(count))

  def compute(self, edited: Edited, operands: tuple[Any, ...]) -> Any:
    site, target, on = edited.site, edited.value, edited.on
    try:
      out = edited.fn(edited.argument, target, *operands)
    except FlaxlensError:
      raise
    except Exception as e:
      # Also an instance of the original's class (`except ValueError` still catches it),
      # as a model's own errors are; the message blames the function, not the model.
      raise model_call_error(
        type(e),
        f"{site}: the function given to fl.modify, {_function_name(edited.fn)}, raised"
        f" {error_text(e)} (the original error is this"
        f" one's cause). It was called as fn(argument, value, *operands) with the {on},"
        f" {target.dtype}{list(target.shape)}, and {len(operands)} operand(s), traced under"
        " jax.jit unless the run has jit=False. Fix the function (run with jit=False to"
        " debug it eagerly).",
      ) from e
    if getattr(out, "shape", None) != target.shape:
      raise ArgumentError(
        f"{site}: the function of fl.modify returned"
        f" {getattr(out, 'shape', type(out).__name__)}, where the {on} has shape"
        f" {tuple(target.shape)}. Return an array of the same shape."
      )
    return out


def _low_rank_affine(operands: tuple) -> tuple[Any, Any]:
  """`(A, c)` of a low-rank edit `h ↦ h A + c`: `A = I + (W − R)ᵀR`, `c = bR`."""
  projection, weight, bias = operands
  rows = orthonormal_rows(projection)
  matrix = jnp.eye(rows.shape[1], dtype=rows.dtype) + (weight - rows).T @ rows
  return matrix, bias @ rows


class LowRank(_BuiltIn):
  """`fl.low_rank_edit`: `h ↦ h + Rᵀ(W h + b − R h)` (LoReFT)."""

  name, maker, operand_names = "low_rank", "fl.low_rank_edit", ("projection", "weight", "bias")
  learns, saved, fold = (0, 1, 2), SavedForm(3, since=3), MapsFeatures(_low_rank_affine)

  def compute(self, edited: Edited, operands: tuple[Any, ...]) -> Any:
    site, target = edited.site, edited.value
    rows = _checked_rows(site, operands[0], target, "the projection", edited.on)
    _check_shape(site, operands[1], rows.shape, "the weight", "the projection's")
    _check_shape(site, operands[2], rows.shape[:1], "the bias", "(rank,), the projection's rank")
    x = target.astype(rows.dtype)
    return x + (x @ operands[1].T + operands[2] - x @ rows.T) @ rows


class Interchange(_BuiltIn):
  """`fl.interchange`: coordinates swapped with a source's in a rotated basis (DAS)."""

  name, maker, operand_names = "interchange", "fl.interchange", ("rotation", "source", "swapped")
  region = Region(1, "the source", whole_last_axis=True)
  learns, source, saved = (0,), 1, SavedForm(3, since=3)
  fold = Unfoldable("it sets coordinates of the value to another run's activations")

  def compute(self, edited: Edited, operands: tuple[Any, ...]) -> Any:
    site, target = edited.site, edited.value
    rotation = _checked_rows(site, operands[0], target, "the rotation", edited.on)
    if rotation.shape[0] != rotation.shape[1]:
      raise ArgumentError(
        f"{site}: the rotation of fl.interchange has shape {tuple(operands[0].shape)}, not"
        f" square. Give a ({rotation.shape[1]}, {rotation.shape[1]}) matrix."
      )
    check_fits(site, operands[1], target, "the source", edited.on)
    _check_shape(site, operands[2], rotation.shape[:1], "the swapped mask", "(features,)")
    base = target.astype(rotation.dtype) @ rotation.T
    source = jnp.broadcast_to(operands[1], target.shape).astype(rotation.dtype) @ rotation.T
    return jnp.where(operands[2], source, base) @ rotation


# The built-in kinds by name, in the order `Intervention`'s refusal lists them.
BUILT_IN_KINDS: dict[str, _BuiltIn] = {
  kind.name: kind
  for kind in (
    Zero(),
    Patch(),
    Mean(),
    Resample(),
    Steer(),
    Scale(),
    Modify(),
    LowRank(),
    Interchange(),
  )
}


# --- checks the kinds share ---------------------------------------------------------------


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


def check_fits(
  site: str, operand: Any, target: Any, what: str, on: str, region: tuple | None = None
) -> None:
  """Refuses an operand that does not broadcast to the target or cast to its dtype;
  `region`, the shape of the region an index `where=` selects, is named among the shapes
  to give where the operand may also have it. The check of an operand that broadcasts,
  for kinds of your own as for the built-ins."""
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
