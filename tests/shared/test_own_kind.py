"""A kind of intervention of one's own: a class implementing `InterventionKind`, defined
here only, used as the built-in kinds are.

`Clamp` clips a call's output to `[lo, hi]` and learns both bounds; `Shift` adds a vector
and declares that it folds as an addition. Each use (`fl.run`, `fl.place`, `fl.capture`,
`fl.train_interventions`, `fl.fold`) must equal the same edit written by hand in the
model's own `__call__`, in Linen and in NNX; `fl.fold` refuses `Clamp`, which declares no
way to fold, and `fl.save_interventions` refuses a kind of one's own.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl
from flaxlens.extend import Adds, Edited, InterventionKind, Unfoldable, check_fits

LO, HI, SHIFT = -0.3, 0.2, jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)


class Clamp:
  """The value clipped to `[lo, hi]`; both bounds are learned; it does not fold."""

  name, maker, operand_names = "clamp", "Clamp", ("lo", "hi")
  region, source, fold = None, None, Unfoldable("it clips the value, which weights cannot do")

  def learned(self, count: int) -> tuple[int, ...]:
    return (0, 1)

  def compute(self, edited: Edited, operands: tuple) -> jax.Array:
    for name, bound in zip(self.operand_names, operands, strict=True):
      check_fits(edited.site, bound, edited.value, f"the bound {name}", edited.on)
    return jnp.clip(edited.value, operands[0], operands[1])


class Shift:
  """The value plus a vector, which folds into a bias (an addition)."""

  name, maker, operand_names = "shift", "Shift", ("shift",)
  region, source, fold = None, None, Adds(lambda operands, value: operands[0])

  def learned(self, count: int) -> tuple[int, ...]:
    return (0,)

  def compute(self, edited: Edited, operands: tuple) -> jax.Array:
    return edited.value + operands[0]


def _bounds(lo=LO, hi=HI):
  return (jnp.asarray(lo, jnp.float32), jnp.asarray(hi, jnp.float32))


def _clamp(lo=LO, hi=HI) -> fl.Intervention:
  return fl.Intervention(operands=_bounds(lo, hi), where_arrays=(), at="hidden", kind=Clamp())


# --- the models, with the edits written by hand -------------------------------------------


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x, clamp=None):
    h = nn.Dense(8, name="hidden")(x)
    if clamp is not None:
      h = jnp.clip(h, clamp[0], clamp[1])
    return nn.Dense(3, name="out")(nn.relu(h))


class NNXMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x, clamp=None):
    h = self.hidden(x)
    if clamp is not None:
      h = jnp.clip(h, clamp[0], clamp[1])
    return self.out(nnx.relu(h))


X = jax.random.normal(jax.random.key(1), (5, 4))


def _linen():
  """`(tree, native(x, clamp), hidden(x))` of the Linen model."""
  model = LinenMLP()
  variables = model.init(jax.random.key(0), X)
  tree = fl.unflaxify(model, variables, X)

  def hidden(x):
    return nn.Dense(8).apply({"params": variables["params"]["hidden"]}, x)

  return tree, lambda x, clamp=None: model.apply(variables, x, clamp), hidden


def _nnx():
  model = NNXMLP(nnx.Rngs(0))
  tree = fl.unflaxify(model, X)
  return tree, lambda x, clamp=None: model(x, clamp), model.hidden


MODELS = pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen", "nnx"])


# --- using it -----------------------------------------------------------------------------


@MODELS
def test_a_run_with_an_own_kind_equals_the_edit_written_in_the_model(make):
  tree, native, _ = make()
  expected = native(X, _bounds())
  assert_trees_equal(fl.run(tree, X, interventions=[_clamp()], jit=False), expected)
  assert_trees_equal(fl.run(tree, X, interventions=[_clamp()]), jax.jit(native)(X, _bounds()))
  assert not np.array_equal(np.asarray(expected), np.asarray(native(X)))


@MODELS
def test_a_placed_own_kind_equals_the_edit_written_in_the_model(make):
  tree, native, _ = make()
  placed = fl.place(tree, _clamp())
  assert_trees_equal(placed(fl.ArgsAndKwargs.capture(X)), native(X, _bounds()))


@MODELS
def test_a_capture_alongside_an_own_kind_sees_the_edited_value(make):
  tree, native, hidden = make()
  output, cache = fl.capture(tree, X, "hidden", interventions=[_clamp()], jit=False)
  assert_trees_equal(output, native(X, _bounds()))
  assert_trees_equal(cache["hidden"], jnp.clip(hidden(X), *_bounds()))


@MODELS
def test_training_an_own_kind_learns_what_it_declares_as_native_gradient_steps_do(make):
  tree, native, _ = make()
  target = jnp.zeros((5, 3))

  def loss(output, target):
    return jnp.mean((output - target) ** 2)

  optimizer = optax.sgd(0.5)
  (trained,), losses = fl.train_interventions(tree, [_clamp()], [(X, target)] * 3, loss, optimizer)

  @jax.jit  # one compiled step, as fl.train_interventions compiles its step
  def step(bounds, state):
    value, grads = jax.value_and_grad(lambda b: loss(native(X, b), target))(bounds)
    updates, state = optimizer.update(grads, state, bounds)
    return optax.apply_updates(bounds, updates), state, value

  bounds, state = _bounds(), optimizer.init(_bounds())
  expected_losses = []
  for _ in range(3):
    bounds, state, value = step(bounds, state)
    expected_losses.append(value)
  assert_trees_equal(losses, np.asarray(expected_losses, np.float32))
  assert_trees_equal(trained.operands, bounds)
  assert isinstance(trained.kind, Clamp)
  assert not np.allclose(np.asarray(trained.operands), np.asarray(_bounds()))


@MODELS
def test_fold_refuses_an_own_kind_that_does_not_fold_with_its_reason(make):
  tree, _, _ = make()
  with pytest.raises(fl.ExportError, match=r"Clamp\('hidden'\): it clips the value"):
    fl.fold(tree, X, [_clamp()])


def test_an_own_kind_that_folds_as_an_addition_folds_into_the_bias_as_written_by_hand():
  model = LinenMLP()
  variables = model.init(jax.random.key(0), X)
  tree = fl.unflaxify(model, variables, X)
  shift = fl.Intervention(operands=(SHIFT,), where_arrays=(), at="hidden", kind=Shift())
  folded = fl.fold(tree, X, [shift]).export()
  expected = jax.tree_util.tree_map(lambda x: x, variables)
  bias = variables["params"]["hidden"]["bias"]
  expected["params"]["hidden"]["bias"] = (bias + SHIFT).astype(bias.dtype)
  assert_trees_equal(folded, expected)


def test_saving_an_own_kind_is_refused_naming_it_and_the_fix(tmp_path):
  edits = [fl.steer("hidden", SHIFT), _clamp()]
  with pytest.raises(
    fl.FlaxlensError, match=r"intervention 1 \(clamp\).*Clamp, a kind of your own"
  ):
    fl.save_interventions(edits, tmp_path / "set")
  assert not (tmp_path / "set").exists()


def test_the_kinds_here_implement_the_protocol():
  assert isinstance(Clamp(), InterventionKind) and isinstance(Shift(), InterventionKind)


def test_a_kind_that_is_neither_a_name_nor_a_kind_object_is_refused():
  with pytest.raises(fl.ArgumentError, match="InterventionKind protocol"):
    fl.Intervention(operands=(), where_arrays=(), at="hidden", kind=object())


def test_a_kind_class_given_for_its_object_is_refused_naming_the_fix():
  with pytest.raises(fl.ArgumentError, match=r"Give kind=Clamp\(\)"):
    fl.Intervention(operands=_bounds(), where_arrays=(), at="hidden", kind=Clamp)
