"""Replays reproduce the recording bit for bit, and the report compares bits, not values.

A call that ran as compiled code when it was recorded (inside `nn.jit`/`nnx.jit`, or in
an `nn.scan`/`nnx.scan` body) replays under jit by default; one that contains an
`nn.scan` (`nn.RNN`) isolates and replays too. Linen and NNX share these behaviours.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl
from flaxlens import cli

X = jax.random.normal(jax.random.key(1), (3, 16))
XS = jax.random.normal(jax.random.key(2), (3, 5, 16))
SEQ = jax.random.normal(jax.random.key(3), (2, 7, 16))

# Artifacts of models defined here must be allowed to import this test module.
THIS_PACKAGE = __name__.split(".")[0]


# --- Linen models ------------------------------------------------------------------------


class Block(nn.Module):
  """LayerNorm, softmax attention and a gelu MLP: values XLA rounds differently when fused."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.SelfAttention(num_heads=2)(nn.LayerNorm()(x))
    return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


class JitTwoBlocks(nn.Module):
  @nn.jit
  @nn.compact
  def __call__(self, x):
    return Block(name="b1")(Block(name="b0")(x))


class ScanBlock(nn.Module):
  dropout: float = 0.0
  batch_norm: bool = False

  @nn.compact
  def __call__(self, carry, _):
    h = nn.BatchNorm(use_running_average=False)(carry) if self.batch_norm else carry
    h = nn.Dense(carry.shape[-1])(nn.gelu(nn.Dense(32)(nn.LayerNorm()(h))))
    if self.dropout:
      h = nn.Dropout(self.dropout, deterministic=False)(h)
    return carry + h, None


class ScannedStack(nn.Module):
  """`nn.scan` over stacked blocks, the activation as carry."""

  block: dict
  scan: dict

  @nn.compact
  def __call__(self, x):
    y, _ = nn.scan(ScanBlock, length=4, **self.scan)(**self.block, name="layers")(x, None)
    return y


class OverTime(nn.Module):
  """`nn.scan` over a time axis with no carry, one block's parameters broadcast."""

  @nn.compact
  def __call__(self, xs):
    def step(block, carry, x):
      return carry, block(x, None)[0]

    scan = nn.scan(
      step, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1
    )
    return scan(ScanBlock(name="layers"), None, xs)[1]


STACKED = {"variable_axes": {"params": 0}, "split_rngs": {"params": True}}


def _linen(module, x, path, rngs=None, mutable=False):
  init_rngs = {"params": jax.random.key(0), "dropout": jax.random.key(5)}
  variables = module.init(init_rngs, x)
  tree = fl.unflaxify(module, variables, x, rngs=rngs, mutable=mutable)
  return fl.isolate(tree, x, path, every=True, random_streams=rngs)


# --- NNX models --------------------------------------------------------------------------


class NNXBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 16, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(self.down(nnx.gelu(self.up(self.norm(x)))))


class NNXStack(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return NNXBlock(rngs, dropout)

    self.blocks = create(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return forward(x, self.blocks)


class NNXOverTime(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.blocks = NNXBlock(rngs)

  def __call__(self, xs):
    @nnx.scan(in_axes=(None, 1), out_axes=1)
    def step(block, x):
      return block(x)

    return step(self.blocks, xs)


class NNXJitTwoBlocks(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.b0, self.b1 = NNXBlock(rngs), NNXBlock(rngs)

  @nnx.jit
  def __call__(self, x):
    return self.b1(self.b0(x))


def _nnx(model, x, path):
  tree = fl.unflaxify(model, x)
  return fl.isolate(tree, x, path, every=True)


# (name, builder of the isolated executions, how many there are)
COMPILED = [
  ("linen nn.jit", lambda: _linen(JitTwoBlocks(), SEQ, "b1"), 1),
  ("linen scanned stack", lambda: _linen(ScannedStack({}, STACKED), X, "layers"), 4),
  (
    "linen scan, broadcast params",
    lambda: _linen(
      ScannedStack({}, {"variable_broadcast": "params", "split_rngs": {"params": False}}),
      X,
      "layers",
    ),
    4,
  ),
  ("linen scan over time, no carry", lambda: _linen(OverTime(), XS, "layers.__call__"), 5),
  (
    "linen scan with dropout",
    lambda: _linen(
      ScannedStack({"dropout": 0.3}, {**STACKED, "split_rngs": {"params": True, "dropout": True}}),
      X,
      "layers",
      rngs={"dropout": jax.random.key(7)},
    ),
    4,
  ),
  (
    "linen scan with batch stats",
    lambda: _linen(
      ScannedStack(
        {"batch_norm": True}, {**STACKED, "variable_axes": {"params": 0, "batch_stats": 0}}
      ),
      X,
      "layers",
      mutable=["batch_stats"],
    ),
    4,
  ),
  ("nnx.jit", lambda: _nnx(NNXJitTwoBlocks(nnx.Rngs(0)), X, "b1"), 1),
  ("nnx scanned stack", lambda: _nnx(NNXStack(nnx.Rngs(0)), X, "blocks"), 4),
  (
    "nnx scan with dropout",
    lambda: _nnx(NNXStack(nnx.Rngs(0, dropout=1), dropout=0.3), X, "blocks"),
    4,
  ),
  ("nnx scan over time, no carry", lambda: _nnx(NNXOverTime(nnx.Rngs(0)), XS, "blocks"), 5),
]


@pytest.mark.parametrize("name, build, count", COMPILED, ids=[c[0] for c in COMPILED])
def test_a_call_recorded_in_compiled_code_replays_bit_for_bit_by_default(name, build, count):
  found = build()
  assert len(found) == count
  assert all(i.recorded_compiled for i in found)
  for isolated in found:
    report = isolated.replay()
    assert report, f"{name}, execution {isolated.call_number}:\n{report}"


def test_the_saved_output_under_nn_jit_is_what_the_jitted_model_computed():
  module, x = JitTwoBlocks(), SEQ
  variables = module.init(jax.random.key(0), x)
  (isolated,) = _linen(module, x, "b1")
  assert_trees_equal(isolated.saved_output, module.apply(variables, x))


def test_the_last_iteration_of_a_scanned_stack_returns_the_model_output():
  module = ScannedStack({}, STACKED)
  variables = module.init(jax.random.key(0), X)
  found = _linen(module, X, "layers")
  assert_trees_equal(found[-1].saved_output[0], module.apply(variables, X))


def test_an_eager_call_is_recorded_as_eager_and_replays_eagerly():
  module = nn.Sequential([nn.LayerNorm(), nn.Dense(8), nn.gelu, nn.Dense(4)])
  variables = module.init(jax.random.key(0), X)
  isolated = fl.isolate(fl.unflaxify(module, variables, X), X, "layers_3")
  assert not isolated.recorded_compiled
  assert isolated.replay()


def test_replaying_in_the_other_mode_says_why_it_may_differ():
  (isolated,) = _linen(JitTwoBlocks(), SEQ, "b1")
  report = isolated.replay(jit=False)
  assert "recorded in compiled code" in report.note
  assert isolated.replay().note == ""


# --- the report compares bits ------------------------------------------------------------


def _isolated_dense(x):
  module = nn.Sequential([nn.Dense(4), nn.Dense(4)])
  variables = jax.tree_util.tree_map(jnp.zeros_like, module.init(jax.random.key(0), x))
  return fl.isolate(fl.unflaxify(module, variables, x), x, "layers_1")


def test_a_signed_zero_differs_from_the_saved_zero():
  isolated = _isolated_dense(jnp.ones((2, 3)))
  assert isolated.replay()  # the saved output is +0.0 everywhere
  flipped = isolated.select().at(lambda i: i.saved_output).apply(lambda y: jnp.full_like(y, -0.0))
  report = flipped.replay()
  assert not report
  assert report.max_abs == 0.0
  assert "bits only" in str(report)


def test_a_nan_with_another_payload_differs_from_the_saved_nan():
  isolated = _isolated_dense(jnp.full((2, 3), jnp.nan))
  assert isolated.replay()
  saved = np.asarray(isolated.saved_output)
  assert np.isnan(saved).all()
  other = jax.lax.bitcast_convert_type(
    jax.lax.bitcast_convert_type(saved, jnp.uint32) ^ jnp.uint32(1), jnp.float32
  )
  assert np.isnan(other).all()
  report = isolated.select().at(lambda i: i.saved_output).set(other).replay()
  assert not report
  assert report.max_abs == 0.0


@pytest.mark.parametrize(
  "a, b",
  [
    (jnp.array([0.0], jnp.bfloat16), jnp.array([-0.0], jnp.bfloat16)),
    (jnp.array([1, 2], jnp.int8), jnp.array([1, 3], jnp.int8)),
    (jnp.array([True]), jnp.array([False])),
    (jax.random.key(0), jax.random.key(1)),
    (jnp.array([1.0], jnp.float32), jnp.array([1.0], jnp.float16)),
  ],
  ids=["bfloat16 signed zero", "int8", "bool", "prng key", "dtype"],
)
def test_leaves_of_every_dtype_compare_by_bits(a, b):
  assert fl.EquivalenceReport.compare(a, a)
  assert not fl.EquivalenceReport.compare(a, b)


# --- calls that contain an nn.scan: nn.RNN -----------------------------------------------


def _rnn_model(cell):
  class WithRNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(nn.RNN(cell(4), name="rnn")(x))

  module, xs = WithRNN(), XS[..., :3]
  return module, module.init(jax.random.key(0), xs), xs


CELLS = [nn.LSTMCell, nn.GRUCell, nn.OptimizedLSTMCell]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.__name__)
def test_a_call_containing_nn_rnn_isolates_and_replays_bit_for_bit(cell):
  module, variables, xs = _rnn_model(cell)
  isolated = fl.isolate(fl.unflaxify(module, variables, xs), xs, "rnn")
  _, sown = module.apply(variables, xs, capture_intermediates=True, mutable=["intermediates"])
  assert_trees_equal(isolated.saved_output, sown["intermediates"]["rnn"]["__call__"][0])
  assert isolated.replay()


@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell], ids=lambda c: c.__name__)
def test_an_isolated_nn_rnn_replays_bit_for_bit_after_save_and_load(cell, tmp_path):
  module, variables, xs = _rnn_model(cell)
  fl.save_isolated(fl.isolate(fl.unflaxify(module, variables, xs), xs, "rnn"), tmp_path / "rnn")
  assert fl.load_isolated(tmp_path / "rnn").replay()


def test_each_iteration_of_the_cell_inside_nn_rnn_replays_bit_for_bit():
  module, variables, xs = _rnn_model(nn.LSTMCell)
  tree = fl.unflaxify(module, variables, xs)
  found = fl.isolate(tree, xs, "LSTMCell_0.__call__", every=True)
  assert len(found) == xs.shape[1]
  assert all(i.recorded_compiled and i.replay() for i in found)


class Holder(nn.Module):
  inner: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.inner(x) * 2.0


class HandsOver(nn.Module):
  """A module created here and handed to a child as an attribute (it lives here)."""

  @nn.compact
  def __call__(self, x):
    return Holder(nn.Dense(4), name="holder")(x)


def test_a_call_using_a_module_passed_in_from_outside_replays_with_its_variables():
  module = HandsOver()
  variables = module.init(jax.random.key(0), X)
  isolated = fl.isolate(fl.unflaxify(module, variables, X), X, "holder")
  assert_trees_equal(isolated.saved_output, module.apply(variables, X))
  assert isolated.replay()


# --- artifacts carry the mode ------------------------------------------------------------


def test_a_loaded_artifact_replays_in_the_recorded_mode(tmp_path):
  (isolated,) = _linen(JitTwoBlocks(), SEQ, "b1")
  fl.save_isolated(isolated, tmp_path / "b1")
  loaded = fl.load_isolated(tmp_path / "b1", allow=[THIS_PACKAGE])
  assert loaded.recorded_compiled
  assert loaded.replay()


def test_the_replay_command_replays_in_the_recorded_mode(tmp_path, capsys):
  (isolated,) = _linen(JitTwoBlocks(), SEQ, "b1")
  fl.save_isolated(isolated, tmp_path / "b1")
  assert cli.main(["replay", str(tmp_path / "b1"), "--allow", THIS_PACKAGE]) == 0
  assert "exact replay" in capsys.readouterr().out
