"""The SAELens side of case 15 (dictionaries): a worker that times SAELens's own training
step, run with the interpreter of an environment where `sae-lens` is installed
(`FLAXLENS_BENCH_SAELENS_PYTHON`; its pins clash with ours, so it is not imported here).

Started as `python bench/saelens_step.py SPEC`, SPEC a JSON object: `rows` (a .npy of
float32 activations `[N, d_in]`), `kind` ("standard" or "topk"), `width`, `k`,
`batch_size`, `steps`, `learning_rate`, `l1_coefficient`, `core` (the CPU this process
is pinned to). It builds SAELens's `TrainingSAE` of that kind and its `SAETrainer` (adam,
a constant learning rate, no logging, no checkpoints), prints `{"ready": ...}`, then for
every line "run" on stdin trains `steps` steps of `SAETrainer.step` (the training forward,
the loss, the backward, the gradient clipping and the optimizer step, as `SAETrainer.fit`
runs them) on batches drawn from the rows in a fresh shuffled order, and prints one JSON
line: the seconds from the second step's batch to the end (the first step's own warm-up
left out, as the JAX side leaves out its compilation) and in all. It reads no file but
SPEC's .npy (no pickle).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
from sae_lens.config import SAETrainerConfig
from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig
from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig
from sae_lens.training.sae_trainer import SAETrainer


def _sae(spec: dict, d_in: int) -> StandardTrainingSAE | TopKTrainingSAE:
  if spec["kind"] == "standard":
    config = StandardTrainingSAEConfig(
      d_in=d_in, d_sae=spec["width"], l1_coefficient=spec["l1_coefficient"]
    )
    return StandardTrainingSAE(config)
  config = TopKTrainingSAEConfig(d_in=d_in, d_sae=spec["width"], k=spec["k"])
  return TopKTrainingSAE(config)


def main() -> None:
  spec = json.loads(sys.argv[1])
  os.sched_setaffinity(0, {spec["core"]})
  torch.set_num_threads(1)
  torch.manual_seed(0)
  rows = torch.from_numpy(np.load(spec["rows"], allow_pickle=False))
  batch_size, steps = spec["batch_size"], spec["steps"]
  trainer_config = SAETrainerConfig(
    total_training_samples=batch_size * steps * 1000,
    train_batch_size_samples=batch_size,
    lr=spec["learning_rate"],
    lr_end=spec["learning_rate"],  # constant: the runner config sets lr_end from lr alike
  )
  sae = _sae(spec, rows.shape[1])
  batches = iter(())  # SAETrainer.step is given each batch; fit() would read this provider
  trainer = SAETrainer(trainer_config, sae, batches)
  generator = torch.Generator().manual_seed(0)
  print(json.dumps({"ready": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
  for line in sys.stdin:
    if line.strip() != "run":
      break
    order = torch.randperm(len(rows), generator=generator)
    start = second = time.perf_counter()
    for step in range(steps):
      if step == 1:
        second = time.perf_counter()
      chosen = order[(step * batch_size) % (len(rows) - batch_size + 1) :][:batch_size]
      trainer.step(rows[chosen])
      trainer.n_training_steps += 1
    end = time.perf_counter()
    print(json.dumps({"steady": end - second, "total": end - start}), flush=True)


if __name__ == "__main__":
  main()
