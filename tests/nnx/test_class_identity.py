"""NNX instrumentation is invisible to the model: `type()` checks, class hooks, classes.

Inside a tree call every module is an instance of the user's own class, no class is
created (so `__init_subclass__` hooks never run), and the classes whose methods are
wrapped while a call runs are exactly as before afterwards, even when the call raises.
"""

from __future__ import annotations

import jax
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from replacements import PlusOne

import flaxlens as fl

from .corpus import FLAX_RELEASE

X = jax.random.normal(jax.random.key(0), (3, 4))


class Branchy(nnx.Module):
  """Returns another answer when `type(self.sub) is nnx.Linear` is False."""

  def __init__(self, rngs):
    self.sub = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    y = self.sub(x)
    return y if type(self.sub) is nnx.Linear else -y


class ScannedBranchy(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Branchy(rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, layer):
      return layer(h)

    return body(x, self.layers)


class VmappedBranchy(nnx.Module):
  def __init__(self, rngs):
    self.inner = Branchy(rngs)

  def __call__(self, x):
    return nnx.vmap(lambda m, row: m(row), in_axes=(None, 0))(self.inner, x)


MODELS = {"plain": Branchy, "nnx_scan": ScannedBranchy, "nnx_vmap": VmappedBranchy}


@pytest.mark.parametrize("name", list(MODELS))
def test_type_checks_inside_a_tree_call_see_the_users_class(name):
  model = MODELS[name](nnx.Rngs(0))
  tree = fl.unflaxify(model, X)
  assert_trees_equal(tree(fl.ArgsAndKwargs.capture(X)), model(X))


REGISTRY: dict[str, type] = {}


class Registered(nnx.Module):
  """A base class whose subclasses register by name and refuse duplicates."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.__name__ in REGISTRY:
      raise TypeError(f"duplicate layer name {cls.__name__}")
    REGISTRY[cls.__name__] = cls


class MyLayer(Registered):
  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.linear(x) * 2.0


def test_conversion_and_calls_run_no_class_hooks():
  before = dict(REGISTRY)
  model = MyLayer(nnx.Rngs(0))
  tree = fl.unflaxify(model, X)
  patched = tree.select().at_path("linear").apply(PlusOne)
  assert_trees_equal(patched(fl.ArgsAndKwargs.capture(X)), (model.linear(X) + 1.0) * 2.0)
  assert REGISTRY == before


def _methods(classes):
  return {(c, name): value for c in classes for name, value in vars(c).items()}


class Boom(fl.Layer):
  def __call__(self, argument, /, **side_inputs):
    raise RuntimeError("boom")


def test_classes_are_exactly_restored_after_a_call_that_raises():
  from flax.core import lift
  from flax.linen import transforms
  from flax.nnx.transforms import compilation

  classes = [MyLayer, Registered, nnx.Linear, compilation.JitWrapped]
  if FLAX_RELEASE >= (0, 12, 6):  # nnx.jit's second wrapper class
    classes.append(compilation.SimpleJitWrapped)
  before = _methods(classes)
  globals_before = (transforms._HashableProxy, lift._restore_rng_counters)
  model = MyLayer(nnx.Rngs(0))
  tree = fl.unflaxify(model, X).select().at_path("linear").apply(lambda _: Boom())
  with pytest.raises(RuntimeError, match="boom"):
    tree(fl.ArgsAndKwargs.capture(X))
  after = _methods(classes)
  assert after.keys() == before.keys()
  assert all(after[k] is before[k] for k in before)
  assert (transforms._HashableProxy, lift._restore_rng_counters) == globals_before


def test_a_model_called_natively_during_a_tree_call_is_not_reported():
  model = MyLayer(nnx.Rngs(0))
  other = MyLayer(nnx.Rngs(1))

  class CallOther(fl.Layer):
    inner: object

    def __call__(self, argument, /, **side_inputs):
      return self.inner(argument, **side_inputs) + other.linear(argument.args[0])

  tree = fl.unflaxify(model, X)
  patched = tree.select().at_path("linear").apply(CallOther)
  expected = (model.linear(X) + other.linear(X)) * 2.0
  assert_trees_equal(patched(fl.ArgsAndKwargs.capture(X)), expected)
