"""The Flax ports of the reference cases' TransformerLens models, and their transcoders.

Each port must give TransformerLens's logits (stored by `fixtures/make_fixtures.py`), have
its MLPs as sites, and, fed to the transcoders flaxlens loads from circuit-tracer's files,
reproduce exactly the active features circuit-tracer found (so the graph tests compare
graphs of the same replacement model)."""

import functools

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl
from flaxlens.extend import sites_of

from .reference import CASES, load_case

load = functools.cache(load_case)


@pytest.mark.parametrize("name", CASES)
def test_ports_give_transformer_lens_logits(name):
  case = load(name)
  linen = case.linen_model.apply(case.linen_variables, case.tokens)
  np.testing.assert_allclose(np.asarray(linen), case.logits, rtol=0, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(case.nnx_model(case.tokens)), case.logits, rtol=0, atol=1e-5
  )


@pytest.mark.parametrize("name", CASES)
def test_mlps_are_sites_reading_the_norm_output(name):
  case = load(name)
  _, intermediates = case.linen_model.apply(
    case.linen_variables, case.tokens, capture_intermediates=True, mutable=["intermediates"]
  )
  trees = (
    (fl.unflaxify(case.linen_model, case.linen_variables, case.tokens), case.linen_mlp_sites),
    (fl.unflaxify(case.nnx_model, case.tokens), case.nnx_mlp_sites),
  )
  for tree, sites in trees:
    assert set(sites) <= {site.name for site in sites_of(tree)}
    _, cache = fl.capture(tree, case.tokens, sites, inputs=True, jit=False)
    for layer, site in enumerate(sites):
      block = intermediates["intermediates"][f"blocks_{layer}"]
      (norm_out,), (mlp_out,) = block["ln2"]["__call__"], block["mlp"]["__call__"]
      np.testing.assert_allclose(cache[f"{site}:input"], norm_out, rtol=0, atol=1e-6)
      np.testing.assert_allclose(cache[site], mlp_out, rtol=0, atol=1e-6)


def _mlp_inputs(case) -> jnp.ndarray:
  """Each block's MLP input, `[layers, P, d_model]`, from Linen's own intermediates."""
  _, state = case.linen_model.apply(
    case.linen_variables,
    case.tokens,
    capture_intermediates=lambda module, method: isinstance(module, (nn.LayerNorm, nn.RMSNorm)),
    mutable=["intermediates"],
  )
  blocks = [state["intermediates"][f"blocks_{i}"] for i in range(case.config.n_layers)]
  return jnp.stack([block["ln2"]["__call__"][0][0] for block in blocks])


@pytest.mark.parametrize("name", CASES)
def test_transcoders_find_circuit_tracers_active_features(name):
  case = load(name)
  inputs = _mlp_inputs(case)
  if isinstance(case.transcoders, list):
    features = jnp.stack([t.encode(x) for t, x in zip(case.transcoders, inputs, strict=True)])
  else:
    features = case.transcoders.encode(inputs)
  features = np.asarray(features).copy()
  features[:, 0] = 0  # circuit-tracer zeroes the first position's features
  for graph in case.graphs.values():
    found = np.argwhere(features != 0)  # (layer, position, feature), lexicographic
    np.testing.assert_array_equal(found, graph.active_features)
    np.testing.assert_allclose(features[tuple(found.T)], graph.activation_values, rtol=0, atol=1e-5)
    assert 50 <= len(found) <= 400
