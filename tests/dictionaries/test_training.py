"""fld.train: one step is the recipe's loss under optax, the decoder-norm rule and the
dead-feature counters hold, BatchTopK trains in training mode, a killed run resumes bit
for bit, a non-finite loss stops with its step, and bad input is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flaxlens as fl
import flaxlens.dictionaries as fld

D, WIDTH, BATCH = 8, 16, 32
NAMES = ("W_enc", "b_enc", "W_dec", "b_dec")


def _rows(count: int, width: int = D, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(count, width)).astype(np.float32)


class Repeated:
  """A test-only `DictionaryData`: the same batch every step (one batch per pass), so a
  hand-written loop sees the rows in the same order."""

  layers = 1
  reads = writes = ("rows",)

  def __init__(self, rows: np.ndarray, *, fail_at: int | None = None, nan_at: int | None = None):
    self.rows, self.d_in, self.d_out = rows, rows.shape[-1], rows.shape[-1]
    self.fail_at, self.nan_at, self.served = fail_at, nan_at, 0

  def batches(self, batch_size, *, seed):
    if self.served == self.fail_at:
      raise KeyboardInterrupt("killed")
    rows = self.rows if self.served != self.nan_at else np.full_like(self.rows, np.nan)
    self.served += 1
    yield fld.Rows(rows, rows)


class Interrupted:
  """Wraps a `DictionaryData`; raises (as a kill would end the run) at batch `fail_at`."""

  def __init__(self, data, fail_at: int):
    self.data, self.fail_at, self.served = data, fail_at, 0
    self.d_in, self.d_out, self.layers = data.d_in, data.d_out, data.layers
    self.reads, self.writes = data.reads, data.writes

  def batches(self, batch_size, *, seed):
    for rows in self.data.batches(batch_size, seed=seed):
      if self.served == self.fail_at:
        raise KeyboardInterrupt("killed")
      self.served += 1
      yield rows


def _arrays(dictionary) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(dictionary))[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def test_a_step_is_adam_on_the_relu_loss_written_by_hand():
  rows, l1, rate = _rows(BATCH), 0.3, 1e-2
  sae = fld.SAE(D, WIDTH, rngs=nnx.Rngs(0))
  params = {name: jnp.asarray(getattr(sae, name)[...]) for name in NAMES}

  def loss(p, x):
    features = jax.nn.relu((x - p["b_dec"]) @ p["W_enc"] + p["b_enc"])
    error = x - (features @ p["W_dec"] + p["b_dec"])
    norms = jnp.linalg.norm(p["W_dec"], axis=-1)
    return (jnp.sum(error**2) + l1 * jnp.sum(features * norms)) / len(x)

  optimizer = optax.adam(rate)
  opt = optimizer.init(params)
  for _ in range(3):
    updates, opt = optimizer.update(jax.grad(loss)(params, rows), opt, params)
    params = optax.apply_updates(params, updates)
  recipe = fld.Recipe(learning_rate=rate, l1_coefficient=l1)
  fld.train(sae, Repeated(rows), steps=3, batch_size=BATCH, recipe=recipe, progress=False)
  for name in NAMES:
    got = np.asarray(getattr(sae, name)[...])
    np.testing.assert_allclose(got, params[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_unit_rule_keeps_every_decoder_at_unit_norm_a_clt_feature_over_all_its_layers():
  clt = fld.CrossLayerTranscoder(3, D, D, WIDTH, activation="topk", k=2, rngs=nnx.Rngs(0))
  inputs = np.random.default_rng(0).normal(size=(4 * BATCH, 3, D)).astype(np.float32)
  data = fld.from_arrays(inputs, 2 * inputs)
  result = fld.train(clt, data, steps=10, batch_size=BATCH, progress=False)
  for decoder in clt.W_dec:
    norms = np.sqrt((np.asarray(decoder[...]) ** 2).sum(axis=(1, 2)))
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
  assert result.since_fired.shape == (3, WIDTH)
  assert result.history["loss"][-1] < result.history["loss"][0]


def test_batchtopk_trains_on_the_batch_and_ends_in_eval_with_a_running_threshold():
  sae = fld.SAE(D, WIDTH, activation="batchtopk", k=2, rngs=nnx.Rngs(0))
  result = fld.train(sae, fld.from_arrays(_rows(256)), steps=20, batch_size=BATCH, progress=False)
  assert np.all(result.history["l0"] == 2.0)  # k per row on average over each batch
  assert sae.activation.use_running_average and float(sae.activation.threshold[...]) > 0


def test_a_feature_that_never_fires_is_counted_dead_from_the_first_step():
  sae = fld.SAE(D, WIDTH, rngs=nnx.Rngs(0))
  sae.b_enc[...] = sae.b_enc[...].at[3].set(-1e6)
  recipe = fld.Recipe(dead_steps=5)
  result = fld.train(sae, fld.from_arrays(_rows(256)), steps=8, batch_size=BATCH, recipe=recipe,
                     progress=False)  # fmt: skip
  assert result.since_fired[3] == 8 and result.since_fired.max() == 8
  assert result.history["dead_fraction"][5] >= 1 / WIDTH
  assert result.history["dead_fraction"][0] == 0


def _batchtopk_run(data, checkpoint, steps=40):
  sae = fld.SAE(D, WIDTH, activation="batchtopk", k=2, rngs=nnx.Rngs(0))
  recipe = fld.Recipe(dead_steps=3, warmup_steps=5, decay="cosine")
  result = fld.train(
    sae, data, steps=steps, batch_size=BATCH, recipe=recipe, seed=7, progress=False,
    checkpoint=checkpoint,
  )  # fmt: skip
  return sae, result


def test_a_killed_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
  rows = _rows(3 * BATCH + 5)  # three batches a pass: the run crosses epochs
  whole, whole_result = _batchtopk_run(fld.from_arrays(rows), None)
  checkpoints = fld.Checkpoints(str(tmp_path / "run"), every=10)
  with pytest.raises(KeyboardInterrupt):
    _batchtopk_run(Interrupted(fld.from_arrays(rows), fail_at=27), checkpoints)
  resumed, resumed_result = _batchtopk_run(fld.from_arrays(rows), checkpoints)
  for name, value in _arrays(whole).items():
    assert np.array_equal(_arrays(resumed)[name], value), name
  for name, values in whole_result.history.items():
    assert np.array_equal(resumed_result.history[name], values), name
  assert np.array_equal(resumed_result.since_fired, whole_result.since_fired)


def test_a_non_finite_loss_stops_with_its_step_and_the_last_good_state_and_checkpoint(tmp_path):
  rows = _rows(BATCH)
  good = fld.SAE(D, WIDTH, rngs=nnx.Rngs(0))
  fld.train(good, Repeated(rows), steps=12, batch_size=BATCH, progress=False)
  sae = fld.SAE(D, WIDTH, rngs=nnx.Rngs(0))
  checkpoints = fld.Checkpoints(str(tmp_path / "run"), every=5)
  with pytest.raises(fl.TrainingError, match="step 12") as caught:
    fld.train(sae, Repeated(rows, nan_at=12), steps=30, batch_size=BATCH, progress=False,
              checkpoint=checkpoints)  # fmt: skip
  assert caught.value.step == 12 and len(caught.value.losses) == 12
  for name, value in _arrays(good).items():
    assert np.array_equal(_arrays(sae)[name], value), name
  assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["10", "5"]


def test_data_of_other_widths_is_refused_naming_the_width_and_the_sites():
  sae = fld.SAE(D, WIDTH, rngs=nnx.Rngs(0))
  with pytest.raises(fl.ArgumentError, match=r"d_in is 8 in the dictionary but 6 .*inputs"):
    fld.train(sae, fld.from_arrays(_rows(64, 6)), steps=1, batch_size=8, progress=False)
  transcoder = fld.Transcoder(D, 4, WIDTH, rngs=nnx.Rngs(0))
  with pytest.raises(fl.ArgumentError, match="d_out is 4 in the dictionary but 8"):
    fld.train(transcoder, fld.from_arrays(_rows(64)), steps=1, batch_size=8, progress=False)


@pytest.mark.parametrize(
  ("arguments", "message"),
  [
    ({"steps": 0}, "steps=0"),
    ({"batch_size": 1000}, "no batch of 1000 rows"),
    ({"recipe": {"l1_coefficient": 1}}, "give fld.Recipe"),
    ({"optimizer": "adam"}, "optax"),
    ({"checkpoint": 3}, "checkpoint is a int"),
  ],
)
def test_bad_arguments_are_refused(arguments, message):
  sae = fld.SAE(D, WIDTH, rngs=nnx.Rngs(0))
  call = {"steps": 2, "batch_size": 8, "progress": False, **arguments}
  with pytest.raises(fl.ArgumentError, match=message):
    fld.train(sae, fld.from_arrays(_rows(64)), **call)


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
  rows, path = _rows(64), str(tmp_path / "run")
  fld.train(fld.SAE(D, WIDTH, rngs=nnx.Rngs(0)), fld.from_arrays(rows), steps=2, batch_size=8,
            checkpoint=path, progress=False)  # fmt: skip
  with pytest.raises(fl.ArgumentError, match="repeats them"):
    fld.train(fld.SAE(D, WIDTH, rngs=nnx.Rngs(0)), fld.from_arrays(rows), steps=4, batch_size=8,
              checkpoint=path, progress=False)  # fmt: skip
  with pytest.raises(fl.TrainingError, match="does not fit this run"):
    fld.train(fld.SAE(D, 2 * WIDTH, rngs=nnx.Rngs(0)), fld.from_arrays(rows), steps=2,
              batch_size=8, checkpoint=path, progress=False)  # fmt: skip
