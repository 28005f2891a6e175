"""`nnx.fori_loop` traces its body twice (under `jax.eval_shape` for the carry's
structure, then in `jax.lax.fori_loop`): each module call in the body is one call of the
tree, and an edit of it reaches the loop the model runs. References: the NNX model's own
call, and the loop unrolled by hand.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl


class Looping(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    def body(i, carry):
      m, h = carry
      return m, jnp.tanh(m.lin(h))

    return nnx.fori_loop(0, 3, body, (self, x))[1]


X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


def _unrolled(model, x, edit=lambda out: out):
  outs, h = [], x
  for _ in range(3):
    out = edit(model.lin(h))
    outs.append(out)
    h = jnp.tanh(out)
  return h, jnp.stack(outs)


def test_a_call_in_the_body_is_one_call_whose_edit_reaches_every_iteration():
  model = Looping(nnx.Rngs(0))
  tree = fl.unflaxify(model, X)
  assert list(tree.submodule_calls) == [(0, "lin.__call__")]
  assert_trees_equal(fl.run(tree, X), model(X))
  native, _ = _unrolled(model, X)
  np.testing.assert_allclose(fl.run(tree, X), native, rtol=1e-6, atol=1e-6)
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match=r"\['lin'\] run inside a body"):
    fl.capture(tree, X, at="lin")  # documented (docs/limits.md): no values out of a loop
  node = tree.select().at_path("lin").get()
  steered = fl.run(tree, X, interventions=[fl.steer(node, jnp.ones(4))])
  np.testing.assert_allclose(
    steered, _unrolled(model, X, lambda o: o + 1.0)[0], rtol=1e-6, atol=1e-6
  )


def test_the_models_call_traced_again_under_jit_keeps_one_call():
  model = Looping(nnx.Rngs(0))
  tree = fl.unflaxify(model, X)
  jitted = fl.variable_jit(lambda t, x: t(fl.ArgsAndKwargs.capture(x)))
  assert_trees_equal(jitted(tree, X), nnx.jit(lambda m, x: m(x))(model, X))
