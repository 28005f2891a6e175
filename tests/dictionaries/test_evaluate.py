"""fld.evaluate: each metric against a plain NumPy/JAX recomputation written here, over
rows (SAE, transcoder, CLT) and spliced into a toy Linen and NNX language model (the
model's own run with the site's value replaced or zeroed by hand)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl
import flaxlens.dictionaries as fld

from .toy_lms import VOCAB, WIDTH, ToyLM


class ArrayData:
  """A `DictionaryData` over arrays, in order (evaluation's sums do not depend on order)."""

  def __init__(self, inputs, targets, layers=1):
    self.inputs, self.targets, self.layers = np.asarray(inputs), np.asarray(targets), layers
    self.d_in, self.d_out = self.inputs.shape[-1], self.targets.shape[-1]
    self.reads, self.writes = ("in",), ("out",)

  def batches(self, batch_size, *, seed):
    for start in range(0, len(self.inputs), batch_size):
      yield fld.Rows(
        self.inputs[start : start + batch_size], self.targets[start : start + batch_size]
      )


def _randomised(dictionary, seed):
  """The dictionary with every parameter random (negative encoder biases: feature 0 never
  fires, others rarely)."""
  random = np.random.default_rng(seed)
  for _, param in nnx.iter_graph(dictionary):
    if isinstance(param, nnx.Param):
      param[...] = (random.standard_normal(param.shape) * 0.5).astype(np.float32)
  biases = np.asarray(dictionary.b_enc[...]) - 1.0
  biases[..., 0] = -100.0
  dictionary.b_enc[...] = biases
  return dictionary


def _expected(features, reconstruction, targets, dense):
  """The metrics from whole arrays, in float64: features [rows, ...F], targets [rows, ...]."""
  features, reconstruction = (
    np.asarray(features, np.float64),
    np.asarray(reconstruction, np.float64),
  )
  targets = np.asarray(targets, np.float64)
  rows = len(targets)
  frequencies = (features != 0).mean(axis=0)
  return {
    "rows": rows,
    "l0": (features != 0).reshape(rows, -1).sum(1).mean(),
    "fvu": ((targets - reconstruction) ** 2).sum() / ((targets - targets.mean(0)) ** 2).sum(),
    "mse": ((targets - reconstruction) ** 2).mean(),
    "frequencies": frequencies,
    "dead": (frequencies == 0).mean(),
    "dense": (frequencies > dense).mean(),
  }


def _check(result, expected):
  assert result.rows == expected["rows"]
  for name in ("l0", "fvu", "mse", "dead", "dense"):
    np.testing.assert_allclose(getattr(result, name), expected[name], rtol=2e-5, err_msg=name)
  np.testing.assert_allclose(result.frequencies, expected["frequencies"], rtol=1e-12)


def test_sae_and_transcoder_row_metrics_match_numpy():
  random = np.random.default_rng(0)
  x = (random.standard_normal((300, WIDTH)) * 2 + 1).astype(np.float32)
  y = np.tanh(x @ random.standard_normal((WIDTH, WIDTH))).astype(np.float32)
  sae = _randomised(fld.SAE(WIDTH, 16, rngs=nnx.Rngs(0)), 2)
  w_enc, b_enc, w_dec, b_dec = (
    np.asarray(p[...], np.float64) for p in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec)
  )
  features = np.maximum((x - b_dec) @ w_enc + b_enc, 0)
  result = fld.evaluate(sae, ArrayData(x, x), batch_size=64, dense_above=0.3)
  _check(result, _expected(features, features @ w_dec + b_dec, x, 0.3))
  assert 0 < result.dead < 1 and 0 < result.dense < 1  # the case exercises both

  transcoder = _randomised(fld.Transcoder(WIDTH, WIDTH, 16, skip=True, rngs=nnx.Rngs(0)), 3)
  w_enc, b_enc, w_dec, b_dec, w_skip = (
    np.asarray(p[...], np.float64)
    for p in (
      transcoder.W_enc,
      transcoder.b_enc,
      transcoder.W_dec,
      transcoder.b_dec,
      transcoder.W_skip,
    )
  )
  features = np.maximum(x @ w_enc + b_enc, 0)
  reconstruction = features @ w_dec + b_dec + x @ w_skip
  result = fld.evaluate(transcoder, ArrayData(x, y), batch_size=100, batches=2)
  _check(result, _expected(features[:200], reconstruction[:200], y[:200], 0.1))


def test_clt_row_metrics_match_numpy():
  layers, rows = 2, 90
  random = np.random.default_rng(4)
  xs = random.standard_normal((rows, layers, WIDTH)).astype(np.float32)
  ys = random.standard_normal((rows, layers, WIDTH)).astype(np.float32)
  clt = _randomised(fld.CrossLayerTranscoder(layers, WIDTH, WIDTH, 16, rngs=nnx.Rngs(0)), 6)
  w_enc, b_enc = np.asarray(clt.W_enc[...], np.float64), np.asarray(clt.b_enc[...], np.float64)
  b_dec = np.asarray(clt.b_dec[...], np.float64)
  features = np.maximum(np.einsum("rli,lif->rlf", xs, w_enc) + b_enc, 0)  # [rows, L, width]
  reconstruction = np.zeros((rows, layers, WIDTH)) + b_dec
  for source in range(layers):
    w_dec = np.asarray(clt.W_dec[source][...], np.float64)  # [width, L - source, d_out]
    for target in range(source, layers):
      reconstruction[:, target] += features[:, source] @ w_dec[:, target - source]
  result = fld.evaluate(clt, ArrayData(xs, ys, layers), batch_size=32)
  _check(result, _expected(features, reconstruction, ys, 0.1))
  assert result.frequencies.shape == (layers, 16)


def _log_softmax(logits):
  """Next-token log-probabilities (every position but the last) in float64."""
  logits = np.asarray(logits, np.float64)[:, :-1]
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _cross_entropy(logits, tokens):
  """The summed next-token cross-entropy, and the number of predictions."""
  picked = np.take_along_axis(_log_softmax(logits), np.asarray(tokens)[:, 1:, None], -1)
  return -picked.sum(), picked.size


def _kl(clean, other):
  p, q = _log_softmax(clean), _log_softmax(other)
  return (np.exp(p) * (p - q)).sum()


@pytest.fixture(scope="module", params=["linen", "nnx"])
def lm(request):
  return ToyLM(request.param)


@pytest.fixture(scope="module")
def linen_lm():
  """For what does not depend on the framework (options, refusals): one is enough."""
  return ToyLM("linen")


def _token_batches():
  return [jax.random.randint(jax.random.key(20 + i), (2, 6), 0, VOCAB) for i in range(2)]


def _clt_edit(clt):
  """A native edit replacing every MLP's output by the CLT's reconstruction, computed in
  plain JAX from its weights: layer l's features from the MLP's own input at layer l,
  output l from the features of layers 0..l."""
  features = {}

  def edited(layer, where, x, out):
    if where != "mlp":
      return out
    features[layer] = jax.nn.relu(x @ clt.W_enc[...][layer] + clt.b_enc[...][layer])
    written = clt.b_dec[...][layer]
    for source in range(layer + 1):
      written = written + features[source] @ clt.W_dec[source][...][:, layer - source]
    return written

  return edited


@pytest.mark.parametrize("kind", ["sae", "transcoder", "clt"])
def test_spliced_losses_match_the_models_own_run(lm, kind):
  tree = lm.tree()
  if kind == "clt":
    at = [lm.mlp.format(0), lm.mlp.format(1)]
    dictionary = _randomised(fld.CrossLayerTranscoder(2, WIDTH, WIDTH, 16, rngs=nnx.Rngs(0)), 9)
    data = fld.stream(tree, _token_batches(), at, at, on="input", buffer=24)
  elif kind == "sae":
    at, where = lm.block.format(0), "block"
    dictionary = _randomised(fld.SAE(WIDTH, 16, rngs=nnx.Rngs(0)), 7)
    data = fld.stream(tree, _token_batches(), at, buffer=24)
  else:
    at, where = lm.mlp.format(1), "mlp"
    dictionary = _randomised(fld.Transcoder(WIDTH, WIDTH, 16, rngs=nnx.Rngs(0)), 8)
    data = fld.stream(tree, _token_batches(), at, at, on="input", buffer=24)
  dictionary.b_enc[...] = (
    np.asarray(dictionary.b_enc[...]) + 1.0
  )  # most features fire: a useful splice
  if kind != "clt":
    layer = int(at.split("/")[0][-1]) if lm.framework == "linen" else int(at.split("/")[1])

  def edit(replace):
    if kind == "clt":
      return _clt_edit(dictionary)

    def edited(at_layer, at_where, x, out):
      return replace(x, out) if (at_layer, at_where) == (layer, where) else out

    return edited

  reads_input = kind == "transcoder"
  runs = {
    "clean": jax.jit(lambda t: lm.native(t)),
    "spliced": jax.jit(
      lambda t: lm.native(t, edit(lambda x, out: dictionary(x if reads_input else out)))
    ),
    "ablated": jax.jit(
      lambda t: lm.native(
        t,
        (lambda l, w, x, out: jnp.zeros_like(out) if w == "mlp" else out)  # noqa: E741
        if kind == "clt"
        else edit(lambda x, out: jnp.zeros_like(out)),
      )
    ),
  }
  sums, kls, count = dict.fromkeys(runs, 0.0), {"spliced": 0.0, "ablated": 0.0}, 0
  for tokens in _token_batches():
    logits = {name: f(tokens) for name, f in runs.items()}
    for name, value in logits.items():
      loss, predictions = _cross_entropy(value, tokens)
      sums[name] += loss
    for name in kls:
      kls[name] += _kl(logits["clean"], logits[name])
    count += predictions
  result = fld.evaluate(
    dictionary, data, batch_size=8, tree=tree, model_inputs=_token_batches(), at=at
  )
  means = {name: value / count for name, value in sums.items()}
  for name in runs:
    np.testing.assert_allclose(
      getattr(result, f"loss_{name}"), means[name], rtol=1e-5, err_msg=name
    )
  for name in kls:
    np.testing.assert_allclose(
      getattr(result, f"kl_{name}"), kls[name] / count, rtol=1e-4, atol=1e-7
    )
  gap = means["ablated"] - means["clean"]
  recovered = (means["ablated"] - means["spliced"]) / gap
  # Each loss is within 1e-5 (relative) of float32 rounding; the ratio's error grows as
  # the gap between ablated and clean shrinks (a random toy model's gap may be small).
  error = 1e-5 * max(means.values())
  tolerance = 2 * error * (1 + abs(recovered)) / abs(gap)
  np.testing.assert_allclose(result.loss_recovered, recovered, rtol=0, atol=tolerance)
  assert "loss_recovered=" in repr(result)


def _identity_sae():
  """An SAE that reconstructs exactly: features relu(x) and relu(-x), decoded +x and -x."""
  sae = fld.SAE(WIDTH, 2 * WIDTH, center_input=False, rngs=nnx.Rngs(0))
  eye = np.eye(WIDTH, dtype=np.float32)
  sae.W_enc[...] = np.concatenate([eye, -eye], axis=1)
  sae.W_dec[...] = np.concatenate([eye, -eye], axis=0)
  return sae


def test_a_perfect_dictionary_recovers_all_and_a_zero_one_nothing(lm):
  tree, at = lm.tree(), lm.block.format(0)
  data = fld.stream(tree, _token_batches(), at, buffer=24)
  perfect = fld.evaluate(
    _identity_sae(), data, batch_size=8, tree=tree, model_inputs=_token_batches(), at=at
  )
  assert perfect.loss_recovered == 1.0 and perfect.kl_spliced == 0.0 and perfect.fvu == 0.0
  zero = fld.SAE(WIDTH, 16, rngs=nnx.Rngs(0))
  for param in (zero.W_enc, zero.W_dec):
    param[...] = jnp.zeros_like(param[...])
  nothing = fld.evaluate(zero, data, batch_size=8, tree=tree, model_inputs=_token_batches(), at=at)
  assert nothing.loss_recovered == 0.0 and nothing.dead == 1.0 and nothing.l0 == 0.0


def test_a_metric_replaces_the_next_token_loss(linen_lm):
  lm = linen_lm
  tree, at = lm.tree(), lm.block.format(1)
  data = fld.stream(tree, _token_batches(), at, buffer=24)
  sae = _identity_sae()

  def distance(clean, out):
    return jnp.mean((clean - out) ** 2)

  result = fld.evaluate(
    sae, data, batch_size=8, tree=tree, model_inputs=_token_batches(), at=at, metric=distance
  )
  assert result.loss_clean == 0.0 and result.loss_spliced == 0.0 and result.kl_spliced is None
  ablated = [
    lm.native(
      t, lambda layer, where, x, out: jnp.zeros_like(out) if (layer, where) == (1, "block") else out
    )
    for t in _token_batches()
  ]
  clean = [lm.native(t) for t in _token_batches()]
  expected = np.mean(
    [
      np.mean((np.asarray(c, np.float64) - np.asarray(a)) ** 2)
      for c, a in zip(clean, ablated, strict=True)
    ]
  )
  np.testing.assert_allclose(result.loss_ablated, expected, rtol=1e-4)


def test_refusals(linen_lm):
  lm = linen_lm
  tree, at = lm.tree(), lm.block.format(0)
  data = fld.stream(tree, _token_batches(), at, buffer=24)
  with pytest.raises(fl.ArgumentError, match="reads 4 and writes 4"):
    fld.evaluate(fld.SAE(4, 16, rngs=nnx.Rngs(0)), data)
  with pytest.raises(fl.ArgumentError, match="Give both"):
    fld.evaluate(_identity_sae(), data, tree=tree)
  with pytest.raises(fl.ArgumentError, match="need tree="):
    fld.evaluate(_identity_sae(), data, at=at)
  floats = [jnp.ones((2, 6))]
  with pytest.raises(fl.ArgumentError, match="token ids"):
    fld.evaluate(_identity_sae(), data, batch_size=8, tree=tree, model_inputs=floats, at=at)
