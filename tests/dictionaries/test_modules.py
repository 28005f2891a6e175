"""The dictionary modules against plain NumPy: each activation, the straight-through
gradients of JumpReLU, the cross-layer transcoder's encode and decode, and config checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl
import flaxlens.dictionaries as fld


def _rows(shape, seed=0):
  return np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


def _pre(dictionary, x):
  """Pre-activations computed in NumPy from the dictionary's weights."""
  w_enc, b_enc, b_dec = (
    np.asarray(p[...]) for p in (dictionary.W_enc, dictionary.b_enc, dictionary.b_dec)
  )
  centred = x - b_dec if dictionary.config.center_input else x
  return centred @ w_enc + b_enc


def _randomised(dictionary, seed=1):
  """The dictionary with random biases and thresholds, so that every term matters."""
  key = jax.random.key(seed)
  for name in ("b_enc", "b_dec"):
    param = getattr(dictionary, name)
    key, sub = jax.random.split(key)
    param[...] = 0.3 * jax.random.normal(sub, param.shape)
  if dictionary.config.activation == "jumprelu":
    key, sub = jax.random.split(key)
    dictionary.activation.threshold[...] = jax.random.uniform(
      sub, dictionary.activation.threshold.shape
    )
  return dictionary


def test_relu_sae_encodes_and_decodes_as_numpy_says():
  sae = _randomised(fld.SAE(6, 20, rngs=nnx.Rngs(0)))
  x = _rows((3, 4, 6))
  features = np.maximum(_pre(sae, x), 0)
  np.testing.assert_allclose(np.asarray(sae.encode(x)), features, rtol=1e-6, atol=1e-6)
  reconstruction = features @ np.asarray(sae.W_dec[...]) + np.asarray(sae.b_dec[...])
  np.testing.assert_allclose(np.asarray(sae(x)), reconstruction, rtol=1e-5, atol=1e-5)


def test_jumprelu_keeps_values_above_each_features_threshold():
  sae = _randomised(fld.SAE(6, 20, activation="jumprelu", center_input=False, rngs=nnx.Rngs(0)))
  x = _rows((5, 6))
  pre = _pre(sae, x)
  threshold = np.asarray(sae.activation.threshold[...])
  expected = np.where(pre > threshold, np.maximum(pre, 0), 0)
  np.testing.assert_allclose(np.asarray(sae.encode(x)), expected, rtol=1e-6, atol=1e-6)


def test_topk_keeps_the_k_largest_of_each_row():
  sae = _randomised(fld.SAE(6, 20, activation="topk", k=3, rngs=nnx.Rngs(0)))
  x = _rows((2, 5, 6))
  pre = _pre(sae, x)
  expected = np.zeros_like(pre)
  for index in np.ndindex(pre.shape[:-1]):
    top = np.argsort(-pre[index])[:3]
    expected[index][top] = np.maximum(pre[index][top], 0)
  np.testing.assert_allclose(np.asarray(sae.encode(x)), expected, rtol=1e-6, atol=1e-6)


def test_batchtopk_trains_on_the_batchs_largest_and_infers_with_a_threshold():
  sae = _randomised(fld.SAE(6, 20, activation="batchtopk", k=2, rngs=nnx.Rngs(0)))
  x = _rows((8, 6))
  pre = np.maximum(_pre(sae, x), 0)
  keep = np.argsort(-pre.reshape(-1))[: 2 * 8]
  expected = np.zeros(pre.size, np.float32)
  expected[keep] = pre.reshape(-1)[keep]
  sae.train()
  np.testing.assert_allclose(np.asarray(sae.encode(x)), expected.reshape(pre.shape), rtol=1e-6)
  smallest = pre.reshape(-1)[keep].min()
  np.testing.assert_allclose(float(sae.activation.threshold[...]), 0.01 * smallest, rtol=1e-5)
  sae.eval()
  threshold = float(sae.activation.threshold[...])
  np.testing.assert_allclose(
    np.asarray(sae.encode(x)), np.where(pre > threshold, pre, 0), rtol=1e-6, atol=1e-6
  )


def test_jumprelu_threshold_gradient_is_the_straight_through_estimate():
  sae = _randomised(fld.SAE(4, 8, activation="jumprelu", bandwidth=0.5, rngs=nnx.Rngs(0)))
  x = _rows((64, 4))
  pre = _pre(sae, x)
  threshold = np.asarray(sae.activation.threshold[...])
  inside = np.abs((pre - threshold) / 0.5) < 0.5
  # d/dθ of sum(features) and of sum(L0): -(θ/ε) K and -(1/ε) K, summed over rows.
  grads = nnx.grad(lambda m: m.encode(x).sum())(sae)
  np.testing.assert_allclose(
    np.asarray(grads.activation.threshold[...]), (-(threshold / 0.5) * inside).sum(0), rtol=1e-5
  )
  step = lambda m: fld.heaviside(m.pre_activation(x), m.activation.threshold[...], 0.5).sum()  # noqa: E731
  grads = nnx.grad(step)(sae)
  np.testing.assert_allclose(
    np.asarray(grads.activation.threshold[...]), (-(1 / 0.5) * inside).sum(0), rtol=1e-5
  )
  # Through the features, pre gets the mask: the encoder's gradient of sum(features).
  grads = nnx.grad(lambda m: m.encode(x).sum())(sae)
  mask = (pre > threshold) & (pre > 0)
  np.testing.assert_allclose(np.asarray(grads.b_enc[...]), mask.sum(0), rtol=1e-6)


@pytest.mark.parametrize("skip", [False, True])
def test_cross_layer_transcoder_sums_every_earlier_layers_decode(skip):
  clt = _randomised(fld.CrossLayerTranscoder(3, 5, 4, 7, skip=skip, rngs=nnx.Rngs(0)))
  if skip:
    clt.W_skip[...] = jax.random.normal(jax.random.key(3), clt.W_skip.shape)
  xs = _rows((3, 2, 5))
  w_enc, b_enc = np.asarray(clt.W_enc[...]), np.asarray(clt.b_enc[...])
  features = np.stack(
    [np.maximum(xs[layer] @ w_enc[layer] + b_enc[layer], 0) for layer in range(3)]
  )
  np.testing.assert_allclose(np.asarray(clt.encode(xs)), features, rtol=1e-5, atol=1e-6)
  outputs = []
  for target in range(3):
    out = np.asarray(clt.b_dec[target]).copy()
    for source in range(target + 1):
      out = out + features[source] @ np.asarray(clt.W_dec[source][...])[:, target - source]
    if skip:
      out = out + xs[target] @ np.asarray(clt.W_skip[...])[target]
    outputs.append(out)
  np.testing.assert_allclose(np.asarray(clt(xs)), np.stack(outputs), rtol=1e-5, atol=1e-5)
  decoded = np.asarray(clt.decode_layer(jnp.asarray(features[1]), 1))
  for offset in range(2):
    np.testing.assert_allclose(
      decoded[offset], features[1] @ np.asarray(clt.W_dec[1][...])[:, offset], rtol=1e-5, atol=1e-6
    )


def test_make_dictionary_rebuilds_from_the_config():
  for config in (
    fld.DictionaryConfig("sae", 4, 4, 8, "topk", k=2, center_input=True),
    fld.DictionaryConfig("transcoder", 4, 3, 8, "jumprelu", skip=True),
    fld.DictionaryConfig("clt", 4, 3, 8, "batchtopk", k=2, layers=2, skip=True),
  ):
    assert fld.make_dictionary(config, rngs=nnx.Rngs(1)).config == config


@pytest.mark.parametrize(
  ("kwargs", "says"),
  [
    (dict(kind="sae", d_in=4, d_out=5, width=8), "d_out (5) must equal d_in (4)"),
    (dict(kind="mlp", d_in=4, d_out=4, width=8), "kind='mlp'"),
    (dict(kind="sae", d_in=4, d_out=4, width=0), "width=0"),
    (dict(kind="transcoder", d_in=4, d_out=4, width=8, center_input=True), "center_input"),
    (dict(kind="sae", d_in=4, d_out=4, width=8, layers=2), "layers=2"),
    (dict(kind="sae", d_in=4, d_out=4, width=8, activation="gelu"), "activation='gelu'"),
  ],
)
def test_a_config_that_cannot_be_built_is_refused(kwargs, says):
  with pytest.raises(fl.ArgumentError, match=says.replace("(", r"\(").replace(")", r"\)")):
    fld.DictionaryConfig(**kwargs)


@pytest.mark.parametrize(
  ("activation", "k", "says"),
  [("topk", None, "k=None"), ("topk", 99, "k=99"), ("relu", 3, "k=3 is given")],
)
def test_k_must_fit_the_activation(activation, k, says):
  with pytest.raises(fl.ArgumentError, match=says):
    fld.SAE(4, 8, activation=activation, k=k, rngs=nnx.Rngs(0))
