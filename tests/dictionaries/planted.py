"""Synthetic rows with planted ground-truth features: sparse, non-negative combinations of
known unit directions, as dictionary-learning tests use them."""

from __future__ import annotations

import numpy as np

D_IN, D_OUT, FEATURES = 32, 24, 64  # row widths, planted features
ACTIVE = 3  # features active per row on average


def directions(count: int, width: int, seed: int) -> np.ndarray:
  """`count` random unit directions in `width` dimensions, `[count, width]`."""
  drawn = np.random.default_rng(seed).normal(size=(count, width))
  return drawn / np.linalg.norm(drawn, axis=1, keepdims=True)


def codes(rows: int, seed: int) -> np.ndarray:
  """Sparse non-negative codes `[rows, FEATURES]`: each feature on with probability
  `ACTIVE / FEATURES`, at a magnitude uniform in [0.5, 1.5]."""
  rng = np.random.default_rng(seed)
  on = rng.random((rows, FEATURES)) < ACTIVE / FEATURES
  return rng.uniform(0.5, 1.5, (rows, FEATURES)) * on


def recovered(planted: np.ndarray, decoder: np.ndarray, cosine: float = 0.9) -> float:
  """The fraction of planted directions (`[features, width]`) whose best cosine with a
  decoder row (`[width_of_dictionary, width]`) is at least `cosine`."""
  rows = decoder / np.linalg.norm(decoder, axis=1, keepdims=True)
  return float(np.mean((planted @ rows.T).max(axis=1) >= cosine))
