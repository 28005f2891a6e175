"""Isolation only Linen has: batch statistics, a Dropout called twice, Python-valued arguments.

Isolation behaviours both frameworks share are in tests/shared/test_isolate.py.
"""

from __future__ import annotations

import dataclasses
import enum

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN

import flaxlens as fl


def test_batchnorm_state_before_and_after_are_saved(cases):
  case = cases["batchnorm_train"]
  isolated = LINEN.isolate(case, "BatchNorm_0")
  _, updates = case.apply()
  final = {v.label: v.value for v in isolated.final_var_values}
  initial = {v.label: v.value for v in isolated.initial_var_values}
  assert_trees_equal(final["batch_stats:mean"], updates["batch_stats"]["BatchNorm_0"]["mean"])
  assert_trees_equal(
    initial["batch_stats:mean"], case.variables["batch_stats"]["BatchNorm_0"]["mean"]
  )


class DropoutTwice(nn.Module):
  @nn.compact
  def __call__(self, x):
    block = nn.Dropout(0.5, deterministic=False)
    return block(x) + block(x)


def test_each_call_of_a_dropout_called_twice_draws_its_own_mask():
  module, x = DropoutTwice(), jnp.ones((4, 8))
  rngs = {"dropout": jax.random.key(3)}
  tree = fl.unflaxify(module, {}, x, rngs=rngs)
  masks = []
  for key in tree.submodule_calls:
    selection = tree.select().at(lambda t, k=key: t.submodule_calls[k])
    isolated = fl.isolate(tree, x, selection, random_streams=rngs)
    assert isolated.replay()
    masks.append(isolated.saved_output)
  assert not np.array_equal(masks[0], masks[1])
  assert_trees_equal(masks[0] + masks[1], module.apply({}, x, rngs=rngs))


class Mode(enum.Enum):
  FAST = "fast"
  SLOW = "slow"


class Configurable(nn.Module):
  @nn.compact
  def __call__(self, x, *, train: bool, name_tag: str, mode: Mode, extra=None):
    y = nn.Dense(3)(x)
    if train and mode is Mode.FAST and name_tag == "a" and extra is None:
      y = y * 2.0
    return y


class Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Configurable(name="inner")(x, train=True, name_tag="a", mode=Mode.FAST)


def test_python_valued_arguments_stay_python_values_and_replay_under_jit():
  module, x = Outer(), jnp.ones((2, 4))
  variables = module.init(jax.random.key(0), x)
  tree = fl.unflaxify(module, variables, x)
  isolated = fl.isolate(tree, x, "inner")
  kwargs = isolated.saved_arg.kwargs
  assert kwargs["train"] is True and kwargs["name_tag"] == "a" and kwargs["mode"] is Mode.FAST
  assert isolated.replay(jit=True).max_abs < 1e-6


class JittedOuter(nn.Module):
  @nn.jit
  @nn.compact
  def __call__(self, x):
    return Configurable(name="inner")(x, train=True, name_tag="a", mode=Mode.FAST)


def test_python_valued_arguments_stay_python_values_under_the_default_compiled_replay():
  module, x = JittedOuter(), jnp.ones((2, 4))
  isolated = fl.isolate(fl.unflaxify(module, module.init(jax.random.key(0), x), x), x, "inner")
  kwargs = isolated.saved_arg.kwargs
  assert isolated.recorded_compiled
  assert kwargs["train"] is True and kwargs["name_tag"] == "a" and kwargs["mode"] is Mode.FAST
  assert isolated.replay()


def test_an_isolated_call_with_an_edited_setting_replays_with_it(cases):
  case = cases["mlp"]
  tree = (
    LINEN.convert(case)
    .select()
    .at_path("Dense_1")
    .apply(lambda n: dataclasses.replace(n, module=n.module.clone(dtype=jnp.bfloat16)))
  )
  isolated = fl.isolate(tree, LINEN.argument(case), "Dense_1")
  assert isolated.submodel.module.dtype == jnp.bfloat16
  assert isolated.saved_output.dtype == jnp.bfloat16
  assert isolated.replay()


def test_a_call_of_a_tree_converted_with_capture_intermediates_isolates_as_it_ran():
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
  x = jnp.ones((1, 3))
  variables = model.init(jax.random.key(0), x)
  tree = fl.unflaxify(model, variables, x, capture_intermediates=True)
  isolated = fl.isolate(tree, x, "layers_2")
  _, state = model.apply(variables, x, capture_intermediates=True)
  assert (isolated.saved_output == state["intermediates"]["layers_2"]["__call__"][0]).all()
  assert isolated.replay()


class DropoutCaller(nn.Module):
  inner: nn.Module

  def __call__(self, x):
    return self.inner(x, deterministic=False)


class HandedInSequential(nn.Module):
  """The Dropout bound here is held by an nn.Sequential that the child adopts."""

  def setup(self):
    self.drop = nn.Dropout(0.5)
    self.child = DropoutCaller(nn.Sequential([self.drop]))

  def __call__(self, x):
    return self.child(self.drop(x, deterministic=False))


class HandedThroughAHandedModule(nn.Module):
  """The child holds a caller bound here, which holds the Dropout bound here."""

  def setup(self):
    self.drop = nn.Dropout(0.5)
    self.caller = DropoutCaller(self.drop)
    self.child = Holder(self.caller)

  def __call__(self, x):
    return self.child(x) + self.caller(x)


class Holder(nn.Module):
  inner: nn.Module

  @nn.compact
  def __call__(self, x):
    return nn.Dropout(0.2, deterministic=False)(self.inner(x))


@pytest.mark.parametrize("model", [HandedInSequential(), HandedThroughAHandedModule()])
def test_a_module_handed_down_at_any_depth_draws_the_keys_it_drew_in_the_model(model):
  x, rngs = jnp.ones((4, 8)), {"dropout": jax.random.key(3)}
  _, state = model.apply({}, x, rngs=rngs, capture_intermediates=True)
  isolated = fl.isolate(fl.unflaxify(model, {}, x, rngs=rngs), x, "child", random_streams=rngs)
  assert_trees_equal(isolated.saved_output, state["intermediates"]["child"]["__call__"][0])
  assert isolated.replay()


class Sowing(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Dense(8)(x)
    self.sow("intermediates", "y", y)
    return y


class HandedSower(nn.Module):
  """A module that sows, bound here and called here and by a child."""

  def setup(self):
    self.sowing = Sowing()
    self.child = Holder(self.sowing)

  def __call__(self, x):
    return self.child(self.sowing(x))


def test_what_a_handed_module_sows_is_in_the_isolated_state_as_the_model_leaves_it():
  model, x = HandedSower(), jnp.ones((4, 8))
  variables = {"params": model.init(jax.random.key(0), x)["params"]}
  rngs = {"dropout": jax.random.key(2)}
  _, sown = model.apply(variables, x, rngs=rngs, mutable=["intermediates"])
  tree = fl.unflaxify(model, variables, x, rngs=rngs, mutable=["intermediates"])
  isolated = fl.isolate(tree, x, "child", random_streams=rngs)
  final = {v.label: v.value for v in isolated.final_var_values}
  assert len(sown["intermediates"]["sowing"]["y"]) == 2
  assert_trees_equal(final["intermediates:inner/y"], sown["intermediates"]["sowing"]["y"])
  assert isolated.replay()


class NormedInSetup(nn.Module):
  """The wrapped layers are bound here (named "dense_*"), not in the wrappers."""

  def setup(self):
    self.dense_a = nn.Dense(4)
    self.dense_b = nn.Dense(4)
    self.weight_norm = nn.WeightNorm(self.dense_a)
    self.spectral_norm = nn.SpectralNorm(self.dense_b)

  def __call__(self, x, train: bool):
    return self.spectral_norm(self.weight_norm(x), update_stats=train)


def _normed_in_setup():
  model, x = NormedInSetup(), jax.random.normal(jax.random.key(0), (2, 3))
  return model, model.init(jax.random.key(1), x, train=False), x


@pytest.mark.parametrize("path", ["weight_norm", "spectral_norm"])
def test_a_norm_wrapper_of_a_layer_bound_in_its_parent_replays_exactly(path):
  model, variables, x = _normed_in_setup()
  _, state = model.apply(
    variables, x, train=True, mutable=["batch_stats"], capture_intermediates=True
  )
  tree = fl.unflaxify(model, variables, x, train=True, mutable=["batch_stats"])
  isolated = fl.isolate(tree, fl.ArgsAndKwargs.capture(x, train=True), path)
  assert_trees_equal(isolated.saved_output, state["intermediates"][path]["__call__"][0])
  assert isolated.replay()


def test_spectral_norm_updating_its_stats_leaves_them_as_the_model_does(cases):
  case = cases["spectral_norm_train"]
  _, updates = case.apply()
  isolated = LINEN.isolate(case, "SpectralNorm_1.__call__")
  final = {v.label: v.value for v in isolated.final_var_values}
  native = updates["batch_stats"]["SpectralNorm_1"]
  assert_trees_equal(final["batch_stats:Dense_1~1kernel~1u"], native["Dense_1/kernel/u"])
  assert_trees_equal(final["batch_stats:Dense_1~1kernel~1sigma"], native["Dense_1/kernel/sigma"])
  before = case.variables["batch_stats"]["SpectralNorm_1"]["Dense_1/kernel/u"]
  assert not np.array_equal(native["Dense_1/kernel/u"], before)
  assert isolated.replay()


class FreshSpectralNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.SpectralNorm(nn.Dense(4))(x, update_stats=True)


def test_a_spectral_norm_whose_stats_the_call_creates_draws_them_as_the_model_does():
  model, x = FreshSpectralNorm(), jnp.ones((2, 3))
  params = {"params": model.init(jax.random.key(0), x)["params"]}
  rngs = {"params": jax.random.key(5)}
  _, created = model.apply(params, x, rngs=rngs, mutable=["batch_stats"])
  tree = fl.unflaxify(model, params, x, rngs=rngs, mutable=["batch_stats"])
  isolated = fl.isolate(tree, x, "SpectralNorm_0", random_streams=rngs)
  final = {v.label: v.value for v in isolated.final_var_values}
  native_u = created["batch_stats"]["SpectralNorm_0"]["Dense_0/kernel/u"]
  assert_trees_equal(final["batch_stats:Dense_0~1kernel~1u"], native_u)
  assert isolated.replay()


@pytest.mark.parametrize(
  "name, wrapper, method",
  [
    ("weight_norm", "WeightNorm_0", "_l2_normalize"),
    ("spectral_norm_train", "SpectralNorm_0", "_spectral_normalize"),
  ],
)
def test_the_helper_calls_inside_a_norm_wrapper_replay_as_they_ran(cases, name, wrapper, method):
  case = cases[name]
  seen = []

  def record(next_fun, args, kwargs, context):
    output = next_fun(*args, **kwargs)
    if context.method_name == method and context.module.path == (wrapper,):
      seen.append(output)
    return output

  with nn.intercept_methods(record):
    case.apply()
  found = LINEN.isolate(case, f"{wrapper}.{method}", every=True)
  assert len(found) == len(seen) > 0
  for isolated, output in zip(found, seen, strict=True):
    assert_trees_equal(isolated.saved_output, output)
    assert isolated.replay()


def test_the_body_of_a_transform_applied_to_a_function_is_refused_with_the_reason(cases):
  case = cases["weight_norm"]
  with pytest.raises(
    fl.UnsupportedFlaxFeatureError,
    match=r"Dense_0.layer_forward: Dense.layer_forward is not a method.*Dense_0.__call__",
  ):
    LINEN.isolate(case, "Dense_0.layer_forward")


def test_isolating_with_a_random_stream_draws_its_next_key_and_leaves_it_where_it_was():
  module, x = DropoutTwice(), jnp.ones((4, 8))
  base = jax.random.key(5)
  tree = fl.unflaxify(module, {}, x, rngs={"dropout": base})
  stream = fl.RandomStream.from_base_key(base)
  isolated = fl.isolate(tree, x, "", random_streams={"dropout": stream})
  assert int(stream.offset.value) == 0
  key = jax.random.fold_in(base, 0)  # The key a tree call draws first from the stream.
  assert_trees_equal(isolated.saved_output, module.apply({}, x, rngs={"dropout": key}))
  assert isolated.replay()


def test_a_raw_key_held_as_a_numpy_array_is_taken_as_flax_takes_it():
  module, x = DropoutTwice(), jnp.ones((4, 8))
  key = np.asarray(jax.random.PRNGKey(3))  # uint32[2], as a key read from disk.
  tree = fl.unflaxify(module, {}, x, rngs={"dropout": key})
  out = tree(fl.ArgsAndKwargs.capture(x), random_streams={"dropout": key})
  assert_trees_equal(out, module.apply({}, x, rngs={"dropout": key}))
  with pytest.raises(fl.ArgumentError, match=r"got ndarray of float32. A raw key is uint32"):
    tree(fl.ArgsAndKwargs.capture(x), random_streams={"dropout": key.astype(np.float32)})
