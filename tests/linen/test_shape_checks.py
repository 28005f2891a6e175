"""Flax's parameter shape checks during Linen conversion, against `module.apply`.

Conversion checks each distinct initializer once
(`flaxlens._compat.linen_apply.param_checks_once`); these tests hold it to Flax's own
check: the same `ScopeParamShapeError` for any mismatch, no mismatch hidden by an earlier
check, and Flax's `Scope.param` untouched outside the converting thread and after a
conversion that raises.
"""

from __future__ import annotations

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from flax.core import scope as flax_scope
from flax.errors import ScopeParamShapeError

import flaxlens as fl
from linen.corpus import MLP, Partitioned, Scanned

FLAX_PARAM = vars(flax_scope.Scope)["param"]
SHARED_INIT = nn.initializers.normal(0.1)


def _like(key, template, scale=1.0):
  """An initializer taking an array (unhashable) as its argument."""
  return scale * jax.random.normal(key, template.shape)


class Params(nn.Module):
  """One parameter per entry of `shapes`, all made by the same initializer object."""

  shapes: tuple

  @nn.compact
  def __call__(self, x):
    for i, shape in enumerate(self.shapes):
      x = x + self.param(f"p{i}", SHARED_INIT, shape).sum()
    return x


class ArrayInit(nn.Module):
  width: int
  keyword: bool = False

  @nn.compact
  def __call__(self, x):
    template = jnp.zeros((x.shape[-1], self.width))
    if self.keyword:
      kernel = self.param("kernel", _like, template=template, scale=0.5)
    else:
      kernel = self.param("kernel", _like, template)
    return x @ kernel


def _native_error(module, variables, *args):
  with pytest.raises(ScopeParamShapeError) as native:
    module.apply(variables, *args)
  return str(native.value)


def _assert_same_error(module, variables, *args):
  expected = _native_error(module, variables, *args)
  with pytest.raises(ScopeParamShapeError) as ours:
    fl.unflaxify(module, variables, *args)
  # Raised as a ModelCallError naming the call, from Flax's own error.
  assert isinstance(ours.value, fl.ModelCallError)
  assert str(ours.value.__cause__) == expected
  assert " ".join(expected.split()) in " ".join(str(ours.value).split())


X = jnp.ones((2, 8))

# (module the variables come from, module converted, arguments): each mismatches.
MISMATCHES = {
  "features": (MLP((16, 4)), MLP((16, 5)), (X,)),
  "input_width": (MLP((16, 4)), MLP((16, 4)), (jnp.ones((2, 6)),)),
  "boxed": (Partitioned(), Partitioned(), (jnp.ones((2, 6)),)),
  "scan_body": (Scanned(), Scanned(), (jnp.ones((2, 6)),)),
  "array_argument": (ArrayInit(4), ArrayInit(5), (X,)),
  "array_keyword": (ArrayInit(4, True), ArrayInit(5, True), (X,)),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_a_mismatching_parameter_raises_flaxs_shape_error_as_apply_does(name):
  initialized, converted, args = MISMATCHES[name]
  variables = initialized.init(jax.random.key(0), X)
  _assert_same_error(converted, variables, *args)


def test_a_mismatch_is_found_after_a_check_of_the_same_initializer_that_passed():
  variables = Params(((2,), (2,))).init(jax.random.key(0), X)
  _assert_same_error(Params(((2,), (3,))), variables, X)


def test_initializer_arguments_equal_in_value_but_not_in_type_are_checked_apart():
  variables = Params(((2,), (2,))).init(jax.random.key(0), X)
  module = Params(((2,), (np.float32(2.0),)))
  with pytest.raises(TypeError) as native:
    module.apply(variables, X)
  with pytest.raises(TypeError) as ours:
    fl.unflaxify(module, variables, X)
  assert str(ours.value.__cause__) == str(native.value)  # Raised from the native error.


@pytest.mark.parametrize("keyword", [False, True])
def test_an_initializer_taking_arrays_converts_and_matches_apply(keyword):
  module = ArrayInit(4, keyword)
  variables = module.init(jax.random.key(0), X)
  tree = fl.unflaxify(module, variables, X)
  assert_trees_equal(tree(fl.ArgsAndKwargs.capture(X)), module.apply(variables, X))


class Failing(nn.Module):
  @nn.compact
  def __call__(self, x):
    nn.Dense(2, kernel_init=SHARED_INIT)(x)
    raise RuntimeError("failed mid-conversion")


@pytest.mark.parametrize("failure", ["shape_error", "model_raises"])
def test_flaxs_scope_param_is_restored_after_a_conversion_that_raises(failure):
  variables = Params(((2,), (2,))).init(jax.random.key(0), X)
  if failure == "shape_error":
    with pytest.raises(ScopeParamShapeError):
      fl.unflaxify(Params(((2,), (3,))), variables, X)
  else:
    dense = nn.Dense(2, kernel_init=SHARED_INIT).init(jax.random.key(0), X)["params"]
    with pytest.raises(RuntimeError, match="failed mid-conversion"):
      fl.unflaxify(Failing(), {"params": {"Dense_0": dense}}, X)
  assert vars(flax_scope.Scope)["param"] is FLAX_PARAM
  _native_error(Params(((2,), (3,))), variables, X)


class Waiting(nn.Module):
  """Holds its conversion open until told to go on."""

  started: threading.Event
  go_on: threading.Event

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, kernel_init=SHARED_INIT)(x)
    self.started.set()
    assert self.go_on.wait(60)
    return nn.Dense(4, kernel_init=SHARED_INIT)(x)


class CountingInit:
  """An initializer that counts its calls (Flax's check calls it at every apply)."""

  def __init__(self):
    self.shapes = []

  def __call__(self, key, shape):
    self.shapes.append(shape)
    return SHARED_INIT(key, shape)


class Counted(nn.Module):
  init_fn: CountingInit

  @nn.compact
  def __call__(self, x):
    return x + self.param("p", self.init_fn, (2,)).sum()


def test_a_native_apply_in_another_thread_checks_shapes_while_a_conversion_runs():
  started, go_on, done = threading.Event(), threading.Event(), threading.Event()
  done.set()
  variables = Waiting(threading.Event(), done).init(jax.random.key(0), X)
  outcome = []
  thread = threading.Thread(
    target=lambda: outcome.append(fl.unflaxify(Waiting(started, go_on), variables, X))
  )
  thread.start()
  try:
    assert started.wait(60)
    assert vars(flax_scope.Scope)["param"] is not FLAX_PARAM  # The conversion's wrapper.
    init_fn = CountingInit()
    counted = Counted(init_fn)
    counted_variables = counted.init(jax.random.key(0), X)
    counted.apply(counted_variables, X)
    counted.apply(counted_variables, X)
    assert init_fn.shapes == [(2,), (2,), (2,)]  # At init, then once per apply.
    mismatching = Params(((2,), (2,))).init(jax.random.key(0), X)
    _native_error(Params(((2,), (3,))), mismatching, X)
  finally:
    go_on.set()
    thread.join(60)
  assert len(outcome) == 1
  assert vars(flax_scope.Scope)["param"] is FLAX_PARAM
