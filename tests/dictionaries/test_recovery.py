"""A dictionary trained on rows built from planted features recovers them: at least 90% of
the planted directions have a decoder row within cosine 0.9, for each activation kind (an
SAE) and for a transcoder on a planted linear map. This is how we know training is right."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import flaxlens.dictionaries as fld

from . import planted

ROWS, WIDTH = 16384, 128

KINDS = {
  "relu": ({}, fld.Recipe(learning_rate=3e-3, l1_coefficient=1.0), 2000),
  "jumprelu": (
    {"threshold": 0.1, "bandwidth": 0.05},
    fld.Recipe(learning_rate=3e-3, l0_coefficient=0.1),
    2000,
  ),
  "topk": ({"k": 3}, fld.Recipe(learning_rate=1e-2, dead_steps=100), 1000),
  "batchtopk": ({"k": 3}, fld.Recipe(learning_rate=1e-2, dead_steps=100), 1000),
}


@pytest.mark.parametrize("activation", list(KINDS))
def test_an_sae_recovers_the_planted_features(activation):
  options, recipe, steps = KINDS[activation]
  directions = planted.directions(planted.FEATURES, planted.D_IN, seed=0)
  rows = (planted.codes(ROWS, seed=1) @ directions).astype(np.float32)
  sae = fld.SAE(planted.D_IN, WIDTH, activation=activation, rngs=nnx.Rngs(0), **options)
  fld.train(
    sae, fld.from_arrays(rows), steps=steps, batch_size=256, recipe=recipe, progress=False
  )
  assert planted.recovered(directions, np.asarray(sae.W_dec[...])) >= 0.9


def test_a_transcoder_recovers_the_output_directions_of_a_planted_map():
  inputs = planted.directions(planted.FEATURES, planted.D_IN, seed=0)
  outputs = planted.directions(planted.FEATURES, planted.D_OUT, seed=2)
  code = planted.codes(ROWS, seed=1)
  data = fld.from_arrays((code @ inputs).astype(np.float32), (code @ outputs).astype(np.float32))
  transcoder = fld.Transcoder(planted.D_IN, planted.D_OUT, WIDTH, rngs=nnx.Rngs(0))
  recipe = fld.Recipe(learning_rate=3e-3, l1_coefficient=1.0)
  fld.train(transcoder, data, steps=2000, batch_size=256, recipe=recipe, progress=False)
  assert planted.recovered(outputs, np.asarray(transcoder.W_dec[...])) >= 0.9
