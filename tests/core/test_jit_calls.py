"""Inner `nn.jit` / `nnx.jit`: every application is its own call, and no trace goes stale.

Each model applies a jitted block twice (weight tying) or holds replacement data that an
inner jit bakes into its trace; every result is compared with native Flax.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import FRAMEWORKS

import flaxlens as fl

X = jax.random.normal(jax.random.key(0), (2, 8))
TRACES = {"linen": 0, "nnx": 0}


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    TRACES["linen"] += 1
    return nn.relu(nn.Dense(8)(x))


JitLinenBlock = nn.jit(LinenBlock)


class LinenTied(nn.Module):
  @nn.compact
  def __call__(self, x):
    block = JitLinenBlock()
    return block(block(x))


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  @nnx.jit
  def __call__(self, x):
    TRACES["nnx"] += 1
    return nnx.relu(self.lin(x))


class NNXTied(nnx.Module):
  def __init__(self, rngs):
    self.block = NNXBlock(rngs)

  def __call__(self, x):
    return self.block(self.block(x))


class Framework:
  """One tied model per framework, its tree and the native pieces to compare with."""

  def __init__(self, name):
    self.name = name
    if name == "linen":
      self.model = LinenTied()
      self.variables = self.model.init(jax.random.key(1), X)
      self.params = self.variables["params"]["JitLinenBlock_0"]["Dense_0"]
      self.inner_path = "JitLinenBlock_0/Dense_0"
    else:
      self.model = NNXTied(nnx.Rngs(1))
      self.inner_path = "block/lin"

  def convert(self):
    if self.name == "linen":
      return fl.unflaxify(self.model, self.variables, X)
    return fl.unflaxify(self.model, X)

  def native(self, x=X):
    if self.name == "linen":
      return self.model.apply(self.variables, x)
    return self.model(x)

  def inner(self, x, kernel_delta=0.0):
    """The tied block's inner linear layer, natively."""
    if self.name == "linen":
      params = {"kernel": self.params["kernel"] + kernel_delta, "bias": self.params["bias"]}
      return nn.Dense(8).apply({"params": params}, x)
    lin = nnx.clone(self.model.block.lin)
    lin.kernel[...] = lin.kernel[...] + kernel_delta
    return lin(x)


@pytest.fixture(params=["linen", "nnx"])
def fw(request):
  return Framework(request.param)


class AddArray(fl.Layer):
  """Runs the call it wraps and adds an array it holds (a constant of any trace)."""

  inner: object
  delta: object

  def __call__(self, argument, /, **side_inputs):
    return self.inner(argument, **side_inputs) + self.delta


class AddSideInput(fl.Layer):
  inner: object

  def __call__(self, argument, /, **side_inputs):
    return self.inner(argument, **side_inputs) + side_inputs["shift"]


def _call(tree, x=X, **side_inputs):
  return tree(fl.ArgsAndKwargs.capture(x), **side_inputs)


def _first_only(tree, path, make):
  """`tree` with the first execution of the call at `path` replaced by `make(node)`."""
  selection = tree.select().at_path(path)
  assert selection.count() == 2
  return tree.select().at_keypaths(selection.keypaths[:1]).apply(make)


def test_each_application_of_a_tied_jitted_block_is_its_own_call(fw):
  tree = fw.convert()
  calls = list(tree.submodule_calls.values())
  assert len(calls) == 2
  assert [len(c.submodule_calls) for c in calls] == [1, 1]
  assert_trees_equal(_call(tree), fw.native())


def test_a_patch_in_the_first_tied_application_leaves_the_second_native(fw):
  tree = _first_only(fw.convert(), fw.inner_path, lambda n: AddArray(n, jnp.ones(8)))
  hidden = jax.nn.relu(fw.inner(X) + 1.0)
  expected = jax.nn.relu(fw.inner(hidden))
  for _ in range(2):
    assert_trees_equal(_call(tree), expected)


def test_a_changed_replacement_array_gives_a_new_result(fw):
  tree = fw.convert()
  for delta in (1.0, 2.0, 1.0):
    patched = _first_only(tree, fw.inner_path, lambda n, d=delta: AddArray(n, jnp.full(8, d)))
    expected = jax.nn.relu(fw.inner(jax.nn.relu(fw.inner(X) + delta)))
    assert_trees_equal(_call(patched), expected)


def test_a_changed_side_input_gives_a_new_result(fw):
  tree = _first_only(fw.convert(), fw.inner_path, AddSideInput)
  for shift in (jnp.ones(8), 2.0 * jnp.ones(8), 3.0):
    expected = jax.nn.relu(fw.inner(jax.nn.relu(fw.inner(X) + shift)))
    assert_trees_equal(_call(tree, shift=shift), expected)


def _warm(tree):
  # Flax's nn.jit keys a tied application on the rng counters left by the one before;
  # those settle after one call that replays the first application from the cache.
  for _ in range(2):
    _call(tree)


def test_an_edited_parameter_gives_a_new_result_without_retracing(fw):
  tree = fw.convert()
  _warm(tree)
  traces = TRACES[fw.name]
  node = tree.select().at_path(fw.inner_path).get_sequence()[0]
  parameters = FRAMEWORKS[fw.name].parameters(node)
  parameters["kernel"].value = parameters["kernel"].value + 0.5
  expected = jax.nn.relu(fw.inner(jax.nn.relu(fw.inner(X, 0.5)), 0.5))
  for _ in range(3):
    assert_trees_equal(_call(tree), expected)
  assert TRACES[fw.name] == traces


def test_repeated_eager_calls_of_an_unchanged_tree_do_not_retrace(fw):
  tree = fw.convert()
  expected = fw.native()
  _warm(tree)
  traces = TRACES[fw.name]
  for _ in range(5):
    assert_trees_equal(_call(tree), expected)
  assert TRACES[fw.name] == traces


def test_isolating_after_plain_runs_records_the_call(fw):
  tree = fw.convert()
  for _ in range(2):
    _call(tree)
  selection = tree.select().at_path(fw.inner_path)
  second = tree.select().at_keypaths(selection.keypaths[1:])
  isolated = fl.isolate(tree, X, second)
  hidden = jax.nn.relu(fw.inner(X))
  assert_trees_equal(isolated.saved_output, fw.inner(hidden))
  assert isolated.replay()


class LinenTwoInstances(nn.Module):
  @nn.compact
  def __call__(self, x):
    return JitLinenBlock()(JitLinenBlock()(x))


def test_two_instances_of_one_nn_jit_class_are_two_calls_with_their_own_parameters():
  model = LinenTwoInstances()
  variables = model.init(jax.random.key(2), X)
  tree = fl.unflaxify(model, variables, X)
  paths = [c.path for c in tree.submodule_calls.values()]
  assert paths == [("JitLinenBlock_1",), ("JitLinenBlock_0",)]
  assert tree.scope_data.parameters == {}
  inner = tree.select().at_path("JitLinenBlock_0/Dense_0").get()
  assert (
    inner.scope_data.parameters["kernel"].value
    is (variables["params"]["JitLinenBlock_0"]["Dense_0"]["kernel"])
  )
  patched = (
    tree.select().at_path("JitLinenBlock_0/Dense_0").apply(lambda n: AddArray(n, jnp.ones(8)))
  )
  params = variables["params"]
  hidden = JitLinenBlock().apply({"params": params["JitLinenBlock_1"]}, X)
  dense = nn.Dense(8).apply({"params": params["JitLinenBlock_0"]["Dense_0"]}, hidden)
  assert_trees_equal(_call(patched), jax.nn.relu(dense + 1.0))


class TiedBody(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    block = JitLinenBlock()
    return block(block(x)), None


class ScanOfTied(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(TiedBody, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
    return scan()(x, None)[0]


def test_tied_nn_jit_inside_nn_scan_is_two_calls_patched_apart():
  model = ScanOfTied()
  variables = model.init(jax.random.key(3), X)
  tree = fl.unflaxify(model, variables, X)
  body = tree.select().at_path("ScanTiedBody_0").get()
  assert len(body.submodule_calls) == 2
  assert_trees_equal(_call(tree), model.apply(variables, X))
  patched = _first_only(tree, "ScanTiedBody_0/JitLinenBlock_0/Dense_0", lambda n: AddArray(n, 1.0))
  dense = variables["params"]["ScanTiedBody_0"]["JitLinenBlock_0"]["Dense_0"]
  h = X
  for i in range(3):
    layer = {"params": jax.tree_util.tree_map(lambda a, i=i: a[i], dense)}
    h = jax.nn.relu(nn.Dense(8).apply(layer, jax.nn.relu(nn.Dense(8).apply(layer, h) + 1.0)))
  assert_trees_equal(_call(patched), h)


MEMORY_SCRIPT = textwrap.dedent(
  """
  import os, sys
  import flax.linen as nn, jax, jax.numpy as jnp
  from flax import nnx
  import flaxlens as fl
  from core.test_jit_calls import LinenTied, NNXTied, X

  def rss():
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

  model = LinenTied()
  linen_tree = fl.unflaxify(model, model.init(jax.random.key(0), X), X)
  nnx_tree = fl.unflaxify(NNXTied(nnx.Rngs(0)), X)
  argument = fl.ArgsAndKwargs.capture(X)
  for tree in (linen_tree, nnx_tree):
    for _ in range(20):
      tree(argument).block_until_ready()
  before = rss()
  for tree in (linen_tree, nnx_tree):
    for _ in range(200):
      tree(argument).block_until_ready()
  print((rss() - before) / 2**20)
  """
)


def test_repeated_eager_calls_with_an_inner_jit_keep_memory_bounded():
  done = subprocess.run(
    [sys.executable, "-c", MEMORY_SCRIPT],
    capture_output=True,
    text=True,
    check=True,
    cwd=pathlib.Path(__file__).parents[1],  # tests/, so the script imports this module
  )
  growth_mb = float(done.stdout.strip().splitlines()[-1])
  assert growth_mb < 50, growth_mb
