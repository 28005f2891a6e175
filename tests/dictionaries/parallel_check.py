"""Data-parallel training in a subprocess, run by test_parallel.py.

`python parallel_check.py mesh OUT`: one process with four CPU devices trains on a mesh of
2 ("data") × 2 ("features") devices, writing `OUT/mesh.npz` (the trained arrays) and
`OUT/mesh.json` (how the parameters were placed).
`python parallel_check.py processes OUT PORT PROCESS`: one of two processes (two CPU
devices each, `jax.distributed` at 127.0.0.1:PORT) training on a "data" mesh of all four
devices; process 0 writes `OUT/processes.npz`.
Each trains the run `train_run` gives (the single-device reference is the same call
without a mesh).
"""

from __future__ import annotations

import json
import os
import sys

D, WIDTH, ROWS, BATCH, STEPS = 16, 32, 1024, 64, 30


def train_run(mesh=None):
  """The trained SAE's arrays (with its history and dead counters), and the partition
  spec of each parameter, of the run every check makes."""
  import numpy as np
  from flax import nnx

  import flaxlens.dictionaries as fld

  rows = np.random.default_rng(0).normal(size=(ROWS, D)).astype(np.float32)
  sae = fld.SAE(D, WIDTH, activation="topk", k=4, rngs=nnx.Rngs(0))
  recipe = fld.Recipe(learning_rate=1e-2, dead_steps=2)  # the aux-k loss takes part
  result = fld.train(sae, fld.from_arrays(rows), steps=STEPS, batch_size=BATCH, recipe=recipe,
                     mesh=mesh, progress=False)  # fmt: skip
  from jax.experimental import multihost_utils

  trained = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
  placed = {name: str(param[...].sharding) for name, param in trained.items()}
  arrays = {
    name: np.asarray(multihost_utils.process_allgather(param[...], tiled=True))
    for name, param in trained.items()
  }
  arrays.update({f"history {n}": v for n, v in result.history.items()})
  arrays["since_fired"] = result.since_fired
  return arrays, placed


def main() -> None:
  """Imports JAX only here, after the device count is set."""
  mode, out = sys.argv[1], sys.argv[2]
  devices = 4 if mode == "mesh" else 2
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  import jax
  import numpy as np
  from jax.sharding import Mesh

  if mode == "mesh":
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "features"))
    arrays, placed = train_run(mesh)
    np.savez(os.path.join(out, "mesh.npz"), **arrays)
    with open(os.path.join(out, "mesh.json"), "w") as file:
      json.dump(placed, file)
    return
  port, process = sys.argv[3], int(sys.argv[4])
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    coordinator_bind_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process,
    initialization_timeout=120,
  )
  arrays, _ = train_run(Mesh(np.array(jax.devices()), ("data",)))
  if process == 0:
    np.savez(os.path.join(out, "processes.npz"), **arrays)
    with open(os.path.join(out, "processes.json"), "w") as file:
      json.dump({"devices": jax.device_count(), "processes": jax.process_count()}, file)


if __name__ == "__main__":
  main()
