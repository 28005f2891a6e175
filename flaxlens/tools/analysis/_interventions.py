"""The makers of interventions: `fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`,
`fl.modify`, `fl.low_rank_edit` and `fl.interchange`, each checking what it is given and
returning an `Intervention` (`tools/base/_intervention.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.errors import (
  ArgumentError,
)
from flaxlens.tools.base._intervention import (
  Intervention,
  make_intervention,
  maker_label,
  operand_array,
)
from flaxlens.tools.base._kinds import orthonormal_rows


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
  maker = maker_label("zero", at)
  if not (isinstance(how, str) and how in ("zero", "mean", "resample")):
    raise ArgumentError(
      f"{maker}: how= is 'zero', 'mean' or 'resample', got {how!r}. Pass one of these."
    )
  if how == "zero":
    return make_intervention("zero", at, (), where, on, part)
  if reference is None:
    raise ArgumentError(
      f"{maker}: how={how!r} needs the site's values on other inputs, stacked along a first"
      " axis. Pass them as reference= (from fl.capture, say)."
    )
  if isinstance(reference, list | tuple):
    reference = np.asarray(reference)
  reference = operand_array(reference, "reference", maker)
  if reference.ndim == 0:
    raise ArgumentError(
      f"{maker}: reference= is a scalar; how={how!r} takes the site's values stacked along"
      " a first axis (one entry per example). Give an array with that axis."
    )
  if how == "mean":
    return make_intervention("mean", at, (reference.mean(axis=0),), where, on, part)
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
  return make_intervention("resample", at, (shuffled,), where, on, part)


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
  return make_intervention(
    "patch", at, (operand_array(value, "value", maker_label("patch", at)),), where, on, part
  )


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
  maker = maker_label("steer", at)
  operands = (operand_array(vector, "vector", maker), operand_array(alpha, "alpha", maker))
  return make_intervention("steer", at, operands, where, on, part)


def scale(
  at: Any, factor: Any, *, where: Any = None, on: str = "output", part: Any = None
) -> Intervention:
  """Multiplies a call's output (or input) by `factor`.

  Example:
    >>> import flaxlens as fl
    >>> fl.scale("Block_0", 0.5).kind
    'scale'
  """
  return make_intervention(
    "scale", at, (operand_array(factor, "factor", maker_label("scale", at)),), where, on, part
  )


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
  maker = maker_label("modify", at)
  if not callable(fn):
    raise ArgumentError(
      f"{maker}: fn={fn!r} is not callable. Give a function fn(argument, value, *operands)"
      " that returns the new value."
    )
  ops = tuple(operand_array(x, f"operand {n}", maker) for n, x in enumerate(operands))
  return make_intervention("modify", at, ops, where, on, part, fn=fn)


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
  maker = maker_label("low_rank", at)
  projection = operand_array(projection, "projection", maker)
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
  operands = (
    projection,
    operand_array(weight, "weight", maker),
    operand_array(bias, "bias", maker),
  )
  return make_intervention("low_rank", at, operands, where, on, part)


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
  maker = maker_label("interchange", at)
  rotation = operand_array(rotation, "rotation", maker)
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
  mask = operand_array(swapped, "swapped", maker)
  if mask.dtype != jnp.bool_ or mask.shape != (features,):
    raise ArgumentError(
      f"{maker}: swapped is {mask.dtype}{list(mask.shape)}; give an int k (the first k"
      f" coordinates) or a boolean mask of shape ({features},)."
    )
  operands = (rotation, operand_array(source, "source", maker), mask)
  return make_intervention("interchange", at, operands, where, on, part)
