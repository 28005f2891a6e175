"""Eager calls of an NNX tree reuse one private copy of the model, and it never shows.

After an eager call whose copy came out as its merge made it (only values changed), the
root node keeps the copy, emptied, and the next eager call refills it instead of
rebuilding it with `nnx.merge`. Each test compares a sequence of tree calls with the
same sequence of native calls, bit for bit, in the cases where keeping the copy could
leak: state carried between calls, edits between calls, outputs holding the copy's
objects, calls that change the copy, jit in between, threads, copies of the tree.
"""

from __future__ import annotations

import copy as copy_module
import gc
import pickle
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import raw_value

import flaxlens as fl

from .corpus import FLAX_RELEASE


class Stateful(nnx.Module):
  """Dropout (rng state), BatchNorm (batch statistics) and a counter: state every call."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(3, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

  def __call__(self, x, bump: bool = False, retag: bool = False):
    self.calls[...] += 1
    # Doubled once a call has set the attribute or the metadata (natively, for good).
    doubled = hasattr(self.linear, "note") or "tag" in self.linear.kernel.get_metadata()
    y = self.linear(x) * (2.0 if doubled else 1.0)
    if bump:
      self.linear.note = "bumped"  # A static attribute set by this call only.
    if retag:
      self.linear.kernel.set_metadata(tag="retagged")
    return self.drop(self.norm(y))


def _pair():
  """The same model twice: one to convert, one to call natively."""
  return Stateful(nnx.Rngs(0, dropout=1)), Stateful(nnx.Rngs(0, dropout=1))


def _call(tree, *args, **kwargs):
  return tree(fl.ArgsAndKwargs.capture(*args, **kwargs))


def _kept(tree) -> int:
  idle = tree.__dict__.get("_flaxlens_idle_copies")
  return 0 if idle is None else len(idle._copies)


def _kernel(tree) -> fl.Parameter:
  return tree.select().at_path("linear").get().scope_data.parameters["kernel"]


def _state_of(tree) -> dict:
  return {v.label: v.value for v in fl.variables_in(tree)}


def _native_state(model) -> dict:
  return {
    f"{type(v).__name__}:{'/'.join(map(str, p))}": raw_value(v)
    for p, v in nnx.to_flat_state(nnx.state(model))
  }


def _x(seed: int) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (5, 3))


def test_repeated_eager_calls_reuse_one_copy_and_match_native():
  model, native = _pair()
  tree = fl.unflaxify(model, _x(0))
  for seed in range(4):
    assert_trees_equal(_call(tree, _x(seed)), native(_x(seed)))
    assert _kept(tree) == 1  # The mechanism is on: the copy was kept for the next call.
  assert_trees_equal(_state_of(tree), _native_state(native))


def test_a_kept_copy_holds_no_arrays():
  model, _ = _pair()
  tree = fl.unflaxify(model, _x(0))
  kernel = _kernel(tree)
  kernel.value = kernel.value + 0.0  # An array only the tree holds (not the model's).
  _call(tree, _x(0))
  assert _kept(tree) == 1
  old = kernel.value
  gone = weakref.ref(old)
  kernel.value = old * 2.0
  del old
  gc.collect()
  assert gone() is None  # Nothing but the tree held it: the idle copy was emptied.


def test_a_kept_copy_holds_no_side_inputs():
  model, _ = _pair()
  tree = fl.unflaxify(model, _x(0))
  side = jnp.arange(7.0)
  gone = weakref.ref(side)
  tree(fl.ArgsAndKwargs.capture(_x(0)), extra=side)
  assert _kept(tree) == 1
  del side
  gc.collect()
  assert gone() is None


def test_edits_between_reused_calls_are_seen():
  model, native = _pair()
  tree = fl.unflaxify(model, _x(0))
  _call(tree, _x(0))
  native(_x(0))
  kernel = _kernel(tree)
  kernel.value = kernel.value + 1.0
  native.linear.kernel[...] = native.linear.kernel[...] + 1.0
  assert_trees_equal(_call(tree, _x(1)), native(_x(1)))
  assert_trees_equal(_state_of(tree), _native_state(native))


def test_numpy_values_stay_private_across_reused_calls():
  model, native = _pair()
  tree = fl.unflaxify(model, _x(0))
  _call(tree, _x(0))
  native(_x(0))
  kernel = _kernel(tree)
  buffer = np.asarray(kernel.value).copy()
  kernel.value = buffer
  native.linear.kernel[...] = jnp.asarray(buffer)
  assert_trees_equal(_call(tree, _x(1)), native(_x(1)))
  assert_trees_equal(_call(tree, _x(2)), native(_x(2)))
  assert np.array_equal(buffer, np.asarray(native.linear.kernel[...]))


def test_an_output_holding_a_variable_of_the_copy_is_not_reused():
  class Counter(nnx.Module):
    def __init__(self):
      self.count = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
      self.count[...] += 1
      return x * self.count[...], self.count

  x = jnp.ones((2,))
  tree = fl.unflaxify(Counter(), x)
  _, first = _call(tree, x)
  assert _kept(tree) == 0
  _, second = _call(tree, x)
  assert float(first[...]) == 1.0 and float(second[...]) == 2.0
  assert second is not first


@pytest.mark.parametrize("change", ["bump", "retag"])
def test_a_call_that_changes_the_copy_does_not_leak_into_the_next(change):
  """A call taking a branch conversion did not see sets a static attribute (or a
  variable's metadata) on the copy; the tree replays every call from the conversion's,
  so the next call runs as a twin model's that never took the branch."""
  model, twin = _pair()
  tree = fl.unflaxify(model, _x(0))
  assert_trees_equal(_call(tree, _x(0), **{change: True}), twin(_x(0)))
  assert _kept(tree) == 0
  assert_trees_equal(_call(tree, _x(1)), twin(_x(1)))
  assert _kept(tree) == 1
  assert_trees_equal(_call(tree, _x(2)), twin(_x(2)))
  assert_trees_equal(_state_of(tree), _native_state(twin))


def test_conversion_refuses_a_call_that_changes_metadata():
  model, _ = _pair()
  expected = "metadata of the variable 'linear/kernel'"
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match=expected):
    fl.unflaxify(model, _x(0), retag=True)
  assert "tag" not in model.linear.kernel.get_metadata()


def test_eager_jit_eager_matches_native():
  model, native = _pair()
  tree = fl.unflaxify(model, _x(0))
  jitted = fl.variable_jit(_call)
  native_jitted = nnx.jit(lambda model, x: model(x))
  assert_trees_equal(_call(tree, _x(0)), native(_x(0)))
  assert_trees_equal(jitted(tree, _x(1)), native_jitted(native, _x(1)))
  assert_trees_equal(_call(tree, _x(2)), native(_x(2)))
  assert_trees_equal(_state_of(tree), _native_state(native))


def test_calls_under_a_transform_do_not_take_the_kept_copy():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tree = fl.unflaxify(model, _x(0))
  _call(tree, _x(0))
  assert _kept(tree) == 1
  grads = jax.grad(lambda x: _call(tree, x).sum())(_x(1))
  assert_trees_equal(grads, jax.grad(lambda x: model(x).sum())(_x(1)))
  assert _kept(tree) == 1
  batched = jax.vmap(lambda x: _call(tree, x))(_x(2))
  assert_trees_equal(batched, jax.vmap(model)(_x(2)))


def test_an_exception_inside_a_call_leaves_the_next_call_exact():
  class Fails(nnx.Module):
    def __init__(self):
      self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def __call__(self, x, fail: bool = False):
      y = self.linear(x)
      if fail:
        raise ValueError("boom")
      return y

  model = Fails()
  tree = fl.unflaxify(model, _x(0))
  _call(tree, _x(0))
  with pytest.raises(ValueError, match="boom"):
    _call(tree, _x(1), fail=True)
  assert _kept(tree) == 0
  assert_trees_equal(_call(tree, _x(2)), model(_x(2)))
  assert _kept(tree) == 1


def test_threads_calling_one_tree_each_get_their_own_copy():
  model = nnx.Sequential(
    nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1))
  )
  tree = fl.unflaxify(model, _x(0))
  inputs = [_x(seed) for seed in range(8)]
  expected = [model(x) for x in inputs]
  results: dict[int, list] = {i: [] for i in range(4)}

  def work(worker: int) -> None:
    for _ in range(5):
      results[worker].append([_call(tree, x) for x in inputs])

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  for runs in results.values():
    assert len(runs) == 5
    for outputs in runs:
      assert_trees_equal(outputs, expected)


def test_a_replacement_calling_its_own_tree_gets_a_fresh_copy():
  model, native = _pair()
  tree = fl.unflaxify(model, _x(0)).eval()
  reference = Stateful(nnx.Rngs(0, dropout=1))
  reference.eval()

  class CallsTheTree(fl.Layer):
    def __call__(self, argument, /, **side_inputs):
      return _call(tree, _x(3)).sum() + argument.args[0]

  patched = tree.select().at_path("norm").apply(lambda node: CallsTheTree())
  inner = reference(_x(3)).sum()
  expected = reference.drop(reference.linear(_x(1)) + inner)
  assert_trees_equal(_call(patched, _x(1)), expected)


def test_copies_of_a_tree_after_eager_calls_run_as_native():
  model, native = _pair()
  tree = fl.unflaxify(model, _x(0))
  _call(tree, _x(0))
  native(_x(0))
  assert _kept(tree) == 1
  deep = copy_module.deepcopy(tree)
  assert _kept(deep) == 0  # The kept copy is not copied along.
  copies = [deep]
  if FLAX_RELEASE >= (0, 12, 1):  # flax 0.12.0's `nnx.Linear` keeps its initializer, a closure
    pickled = pickle.loads(pickle.dumps(tree))
    assert _kept(pickled) == 0
    copies.append(pickled)
  expected = native(_x(1))
  for other in copies:
    assert_trees_equal(_call(other, _x(1)), expected)
  assert_trees_equal(_call(tree, _x(1)), expected)


def test_a_stateful_tree_under_jax_jit_gets_flaxlens_error_after_eager_calls():
  """A kept copy is made outside any trace; a traced call builds its own, so the
  closure case still gets the tree's own refusal, not NNX's trace-level error."""
  model, _ = _pair()
  tree = fl.unflaxify(model, _x(0))
  _call(tree, _x(0))
  assert _kept(tree) == 1
  with pytest.raises(fl.VariableError, match="storing a traced value"):
    jax.jit(lambda x: _call(tree, x))(_x(1))


class Applier(nnx.Module):
  def __call__(self, x, layer):
    return layer(x)


class PassesALayer(nnx.Module):
  def __init__(self):
    self.inner = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    self.applier = Applier()

  def __call__(self, x):
    return self.applier(self.inner(x), self.inner)


def test_modules_a_replacement_layer_receives_stay_as_they_were():
  model = PassesALayer()
  stashed = []

  class Stashes(fl.Layer):
    def __call__(self, argument, /, **side_inputs):
      x, layer = argument.args
      stashed.append(layer)
      return x @ layer.kernel[...] + layer.bias[...]

  tree = fl.unflaxify(model, _x(0)).select().at_path("applier").apply(lambda node: Stashes())
  kernel, bias = model.inner.kernel[...], model.inner.bias[...]
  for seed in range(3):
    assert_trees_equal(_call(tree, _x(seed)), model.inner(_x(seed)) @ kernel + bias)
  assert len(stashed) == 3
  for layer in stashed:  # Never emptied nor refilled by a later call.
    assert_trees_equal(layer.kernel[...], model.inner.kernel[...])
