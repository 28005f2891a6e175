"""New intervention values reuse the compiled run: 100 steering values, one trace.

Traces are counted by a function that runs only while JAX traces: an `fl.modify` at the
root call that returns the output unchanged. Python floats become arrays when an
intervention is made, so floats, arrays and a mix of both compile one program. The last
run's output must still equal the native model steered by the last value, so that a
value baked into the first trace cannot pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX, Wrap

import flaxlens as fl

STEERED = [
  (LINEN, "mlp", "Dense_0", 16),
  (NNX, "mlp", "hidden", 8),
  # Inside a scan body: one site, steered at every iteration.
  (LINEN, "scan", "layers/Dense_0", 8),
  (NNX, "scan", "blocks/linear", 4),
]
VALUES = 100


def _alphas(kind: str) -> list:
  floats = [0.01 * i - 0.5 for i in range(VALUES)]
  if kind == "floats":
    return floats
  arrays = [jnp.float32(a) for a in floats]
  if kind == "arrays":
    return arrays
  return [f if i % 2 else a for i, (f, a) in enumerate(zip(floats, arrays, strict=True))]


@pytest.mark.parametrize("kind", ["floats", "arrays", "mixed"])
@pytest.mark.parametrize("fw, name, path, features", STEERED)
def test_a_hundred_steering_values_trace_once(corpora, fw, name, path, features, kind):
  case = corpora[fw][name]
  tree = fw.convert(case)
  traces = []

  def count(argument, output):
    traces.append(None)
    return output

  counter = fl.modify(fw.module_class(tree), count)
  vector = jax.random.normal(jax.random.key(0), (features,))
  argument = fw.argument(case)
  for alpha in _alphas(kind):
    steering = fl.steer(path, vector, alpha)
    output = fl.run(tree, argument, interventions=[steering, counter])

  assert len(traces) == 1
  expected, _ = fw.native(
    case, times=VALUES, jit=True, wrap=Wrap(path, lambda y, *_: y + alpha * vector)
  )
  assert_trees_equal(output, expected)


@pytest.mark.parametrize("fw, name, path, features", STEERED)
def test_a_hundred_steering_vectors_trace_once(corpora, fw, name, path, features):
  case = corpora[fw][name]
  tree = fw.convert(case)
  traces = []

  def count(argument, output):
    traces.append(None)
    return output

  counter = fl.modify(fw.module_class(tree), count)
  argument = fw.argument(case)
  for seed in range(VALUES):
    vector = jax.random.normal(jax.random.key(seed), (features,))
    steering = fl.steer(path, vector)
    output = fl.run(tree, argument, interventions=[steering, counter])

  assert len(traces) == 1
  expected, _ = fw.native(
    case, times=VALUES, jit=True, wrap=Wrap(path, lambda y, *_: y + 1.0 * vector)
  )
  assert_trees_equal(output, expected)
