"""A Python branch on an array's value cannot be converted; the error names the call."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import flaxlens as fl

X = jnp.ones((2, 4))

BRANCHES = {
  "float": lambda h: float(h.mean()) > 0,
  "bool": lambda h: h.mean() > 0,
  "int": lambda h: [1, 2][int(h.sum() > 0)] == 2,
}


def _linen(branch):
  class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(4)(x)
      return h if branch(h) else -h

  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.relu(Inner(name="inner")(x))

  variables = Outer().init(jax.random.key(0), X)
  return lambda: fl.unflaxify(Outer(), variables, X)


def _nnx(branch):
  class Inner(nnx.Module):
    def __init__(self):
      self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
      h = self.linear(x)
      return h if branch(h) else -h

  class Outer(nnx.Module):
    def __init__(self):
      self.inner = Inner()

    def __call__(self, x):
      return nnx.relu(self.inner(x))

  model = Outer()
  return lambda: fl.unflaxify(model, X)


@pytest.mark.parametrize("branch", list(BRANCHES))
@pytest.mark.parametrize("framework", [_linen, _nnx], ids=["linen", "nnx"])
def test_a_value_dependent_branch_is_refused_naming_the_innermost_call(framework, branch):
  convert = framework(BRANCHES[branch])
  with pytest.raises(fl.FlaxlensError, match=r"^inner\.__call__: .* jnp\.where") as info:
    convert()
  assert isinstance(info.value.__cause__, jax.errors.JAXTypeError)
