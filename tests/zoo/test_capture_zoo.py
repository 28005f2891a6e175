"""Captures and steering on third-party models, against their own ways of exposing calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal

import flaxlens as fl
from flaxlens.tools.base._sites import sites_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["gpt2", "griffin", "resnet18"])
def test_captured_calls_equal_capture_intermediates_under_jit(request, name):
  zoo = request.getfixturevalue(name)
  tree = zoo.convert()
  out, cache = fl.capture(
    tree, fl.ArgsAndKwargs(args=tuple(zoo.args), kwargs=dict(zoo.kwargs)), random_streams=zoo.rngs
  )
  mutable = ["intermediates", *(zoo.mutable or [])]
  native_out, state = jax.jit(
    lambda v: zoo.module.apply(
      v, *zoo.args, rngs=zoo.rngs, mutable=mutable, capture_intermediates=True, **zoo.kwargs
    )
  )(zoo.variables)
  assert_trees_equal(out, native_out)
  compared = 0
  for site in sites_of(tree)[1:]:
    if not site.node.path:  # A nested apply (GPT-2's tied lm_head): Flax keeps no capture.
      continue
    native = state["intermediates"]
    for key in (*map(str, site.node.path), site.node.method_name):
      native = native.get(key, {}) if isinstance(native, dict) else {}
    if isinstance(native, tuple) and "#" not in site.name and site.name in cache:
      assert_trees_equal(cache[site.name], native[0])
      compared += 1
  assert compared > 10


def test_gpt2_block_outputs_equal_its_hidden_states(gpt2):
  tree = gpt2.convert()
  kwargs = {"deterministic": True}
  _, cache = fl.capture(tree, fl.ArgsAndKwargs.capture(*gpt2.args, **kwargs), at="transformer/h/*")
  native = jax.jit(lambda v: gpt2.module.apply(v, *gpt2.args, output_hidden_states=True, **kwargs))(
    gpt2.variables
  )
  # hidden_states[i] is what block i receives: block i-1's output.
  for i in range(1, len(native.hidden_states) - 1):
    assert_trees_equal(cache[f"transformer/h/{i - 1}"][0], native.hidden_states[i])


def test_steering_a_gpt2_block_equals_intercepting_it(gpt2):
  import flax.linen as nn

  tree = gpt2.convert()
  vector = jnp.linspace(-1.0, 1.0, 32)
  kwargs = {"deterministic": True}
  ours = fl.run(
    tree,
    fl.ArgsAndKwargs.capture(*gpt2.args, **kwargs),
    interventions=[fl.steer("transformer/h/0", vector, 2.0, part=0)],
  )

  def steer(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if "/".join(context.module.path) == "transformer/h/0" and context.method_name == "__call__":
      out = (out[0] + jnp.float32(2.0) * vector, *out[1:])
    return out

  def native(v):
    with nn.intercept_methods(steer):
      return gpt2.module.apply(v, *gpt2.args, **kwargs)

  assert_trees_equal(ours, jax.jit(native)(gpt2.variables))
