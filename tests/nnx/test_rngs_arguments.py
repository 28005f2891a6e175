"""An `nnx.Rngs` given to the model's call, under flaxlens's jitted calls.

A call advances the `Rngs` it is given (its `RngCount` variables), so two calls with the
same `Rngs` draw different dropout masks, and the caller's `Rngs` has counted both.
`fl.run`, `fl.capture` and `fl.variable_jit` jit the call, and must do what the model's
own call does (as `nnx.jit` does): the reference is the NNX model called twice with an
`Rngs` made alike.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl


class Dropping(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 16, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs):
    return self.drop(self.lin(x), rngs=rngs)


X = jnp.linspace(-1.0, 1.0, 24).reshape(3, 8)

RUNS = {
  "fl.run": lambda tree, rngs: fl.run(tree, (X, rngs)),
  "fl.capture": lambda tree, rngs: fl.capture(tree, (X, rngs), at="drop")[0],
  "fl.variable_jit": lambda tree, rngs: fl.variable_jit(
    lambda t, x, r: t(fl.ArgsAndKwargs.capture(x, r))
  )(tree, X, rngs),
  "fl.run(jit=False)": lambda tree, rngs: fl.run(tree, (X, rngs), jit=False),
}


@pytest.mark.parametrize("run", RUNS)
def test_each_call_advances_the_rngs_it_is_given_as_the_model_call_does(run):
  model = Dropping(nnx.Rngs(0))
  tree = fl.unflaxify(model, X, nnx.Rngs(dropout=1))
  native_rngs, ours_rngs = nnx.Rngs(dropout=1), nnx.Rngs(dropout=1)
  natives = [model(X, native_rngs) for _ in range(2)]
  assert not bool((natives[0] == natives[1]).all())  # the reference draws two masks
  for native in natives:
    assert_trees_equal(RUNS[run](tree, ours_rngs), native)
  assert_trees_equal(nnx.state(ours_rngs), nnx.state(native_rngs))


def test_a_new_rngs_each_call_reuses_the_compiled_program():
  model = Dropping(nnx.Rngs(0))
  tree = fl.unflaxify(model, X, nnx.Rngs(dropout=1))
  fl.run(tree, (X, nnx.Rngs(dropout=1)))
  with fl.count_compiles() as count:
    outs = [fl.run(tree, (X, nnx.Rngs(dropout=seed))) for seed in (2, 3)]
  assert count.traces == 0
  for seed, out in zip((2, 3), outs, strict=True):
    assert_trees_equal(out, model(X, nnx.Rngs(dropout=seed)))
