"""A training run to kill: `python killed_check.py DIRECTORY` trains
the run `killed_run` gives with checkpoints in DIRECTORY, slowed so that the test can kill
it (SIGKILL) midway; run by test_killed.py."""

from __future__ import annotations

import sys
import time

D, WIDTH, ROWS, BATCH, STEPS, EVERY = 8, 16, 200, 32, 300, 20


class Slowed:
  """Wraps a `DictionaryData`, sleeping before each batch (so a kill lands midway)."""

  def __init__(self, data, seconds: float):
    self.data, self.seconds = data, seconds
    self.d_in, self.d_out, self.layers = data.d_in, data.d_out, data.layers
    self.reads, self.writes = data.reads, data.writes

  def batches(self, batch_size, *, seed):
    for rows in self.data.batches(batch_size, seed=seed):
      time.sleep(self.seconds)
      yield rows


def killed_run(directory, seconds: float = 0.0):
  """The run: a JumpReLU SAE (a trained threshold), warm-up and cosine decay."""
  import numpy as np
  from flax import nnx

  import flaxlens.dictionaries as fld

  rows = np.random.default_rng(0).normal(size=(ROWS, D)).astype(np.float32)
  sae = fld.SAE(D, WIDTH, activation="jumprelu", rngs=nnx.Rngs(0))
  recipe = fld.Recipe(learning_rate=3e-3, warmup_steps=10, decay="cosine", l0_coefficient=0.1)
  checkpoints = None if directory is None else fld.Checkpoints(directory, every=EVERY)
  result = fld.train(
    sae, Slowed(fld.from_arrays(rows), seconds), steps=STEPS, batch_size=BATCH,
    recipe=recipe, seed=3, checkpoint=checkpoints, progress=False,
  )  # fmt: skip
  return sae, result


if __name__ == "__main__":
  killed_run(sys.argv[1], seconds=0.05)
