"""Bodies of one Linen lifted transform that share a name: `nn.switch`, `nn.cond` and
`nn.while_loop` given lambdas (Flax's own `nn.switch` docstring makes its branches with a
closure factory, `lambda mdl, x: mdl.heads[i](x)`). Each body is a call of its own, with
the calls it makes, as named functions are; a body traced again (`nn.scan` traces its
body twice) stays one call. The reference is the model's own `apply`, edited with
`nn.intercept_methods`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal

import flaxlens as fl


class Switch(nn.Module):
  @nn.compact
  def __call__(self, x, index):
    heads = [nn.Dense(4, name=f"head{k}") for k in range(3)]
    if self.is_initializing():
      for head in heads:
        head(x)

    def branch(k):
      return lambda mdl, x: heads[k](x) * (k + 1)

    return nn.switch(index, [branch(k) for k in range(3)], self, x)


class Cond(nn.Module):
  @nn.compact
  def __call__(self, x, flag):
    a, b = nn.Dense(4, name="a"), nn.Dense(4, name="b")
    if self.is_initializing():
      a(x), b(x)
    return nn.cond(flag, lambda mdl, x: a(x), lambda mdl, x: 2 * b(x), self, x)


class While(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(4, name="d")
    if self.is_initializing():
      dense(x)
    _, out = nn.while_loop(
      lambda mdl, c: c[0] < 3, lambda mdl, c: (c[0] + 1, jnp.tanh(dense(c[1]))), self, (0, x)
    )
    return out


def _zeroing(names):
  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return jnp.zeros_like(out) if context.module.name in names else out

  return interceptor


X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
CASES = {
  "switch": (Switch(), (X, jnp.array(0)), [(X, jnp.array(k)) for k in range(3)], "head1"),
  "cond": (Cond(), (X, jnp.array(True)), [(X, jnp.array(f)) for f in (True, False)], "b"),
  "while": (While(), (X,), [(X,)], "d"),
}


@pytest.mark.parametrize("name", CASES)
def test_every_body_is_a_call_with_the_calls_it_makes(name):
  model, example, runs, edited = CASES[name]
  variables = model.init(jax.random.key(0), *example)
  tree = fl.unflaxify(model, variables, *example)
  bodies = [key for key in tree.submodule_calls if key[1] == "self.<lambda>"]
  assert len(bodies) == {"switch": 3, "cond": 2, "while": 2}[name]
  assert tree.scope_data.parameters == {}  # every Dense is a call of its own body
  for args in runs:
    assert_trees_equal(fl.run(tree, args), model.apply(variables, *args))
    with nn.intercept_methods(_zeroing({edited})):
      native = model.apply(variables, *args)
    assert_trees_equal(fl.run(tree, args, interventions=[fl.ablate(edited)]), native)


def test_an_edit_of_a_later_branch_applies_where_that_branch_is_taken():
  model, example, _, _ = CASES["switch"]
  variables = model.init(jax.random.key(0), *example)
  tree = fl.unflaxify(model, variables, *example)  # converted on branch 0
  bias = tree.select().at_path("head2").get().scope_data.parameters["bias"]
  bias.value = bias.value + 1.0
  params = {**variables["params"], "head2": {**variables["params"]["head2"]}}
  params["head2"]["bias"] = params["head2"]["bias"] + 1.0
  for k in range(3):
    ours = fl.run(tree, (X, jnp.array(k)))
    assert_trees_equal(ours, model.apply({"params": params}, X, jnp.array(k)))
