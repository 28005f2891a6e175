"""Artifacts of Flax's own layers load in a fresh process that has only run `import flaxlens`.

The loading policy imports no module of jax, flax or numpy for an artifact: a reference
into them is looked up among the modules already loaded. So every module a saved Linen
or NNX model refers to (its layer classes, activations, NNX graph parts, intervention
site classes) must be loaded by `import flaxlens` itself; these tests load in a new
interpreter, where no test has imported anything else, and compare with native Flax.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl

ROOT = Path(__file__).resolve().parents[2]
X = np.arange(6.0, dtype=np.float32).reshape(2, 3) / 4 - 0.5
MASK = np.array([True, False, True, False])
STEER = np.arange(4.0, dtype=np.float32)

# Loads everything right after `import flaxlens`, then (only then) rebuilds the Linen
# model to run the loaded interventions on, and writes what each loaded artifact computes.
LOAD = textwrap.dedent(
  """
  import json, sys
  import flaxlens as fl

  folder = sys.argv[1]
  loaded = {name: fl.load_isolated(f"{folder}/{name}") for name in ("linen", "nnx")}
  edits = fl.load_interventions(f"{folder}/edits")

  import flax.linen as nn, jax, numpy as np

  outputs = {}
  for name, isolated in loaded.items():
    output, _ = isolated.submodel.stateless_call(
      isolated.initial_var_values, isolated.saved_arg, **isolated.saved_side_inputs
    )
    outputs[name] = np.asarray(output)
  x = np.load(f"{folder}/x.npy")
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.LayerNorm()])
  tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  outputs["edited"] = np.asarray(fl.run(tree, x, interventions=edits))
  np.savez(f"{folder}/outputs.npz", **outputs)
  print(json.dumps({name: bool(isolated.replay()) for name, isolated in loaded.items()}))
  """
)


def _linen_model() -> tuple[nn.Module, dict]:
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.LayerNorm()])
  return model, model.init(jax.random.key(0), X)


def _nnx_model() -> nnx.Module:
  rngs = nnx.Rngs(0)
  return nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), nnx.relu, nnx.LayerNorm(4, rngs=rngs))


def _edited_natively(model: nn.Module, variables: dict) -> np.ndarray:
  """The Linen model with its Dense output zeroed under MASK and its output steered by
  2 * STEER, computed with `module.apply` layer by layer."""
  dense, _, norm = model.layers
  params = variables["params"]
  hidden = dense.apply({"params": params["layers_0"]}, X) * ~MASK
  out = norm.apply({"params": params["layers_2"]}, nn.relu(hidden))
  return np.asarray(out + 2.0 * STEER)


@pytest.fixture(scope="module")
def loaded_elsewhere(tmp_path_factory) -> tuple[dict, dict[str, np.ndarray]]:
  """`(replay verdicts, outputs)` of the artifacts saved here and loaded in a fresh process."""
  folder = tmp_path_factory.mktemp("fresh")
  model, variables = _linen_model()
  tree = fl.unflaxify(model, variables, X)
  fl.save_isolated(fl.isolate(tree, X, ""), folder / "linen")
  nnx_model = _nnx_model()
  fl.save_isolated(fl.isolate(fl.unflaxify(nnx_model, X), X, ""), folder / "nnx")
  fl.save_interventions(
    [fl.ablate(nn.Dense, where=jnp.asarray(MASK)), fl.steer("layers_2", STEER, alpha=2.0)],
    folder / "edits",
  )
  np.save(folder / "x.npy", X)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run(
    [sys.executable, "-c", LOAD, str(folder)],
    capture_output=True,
    text=True,
    env=env,
    cwd=folder,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  with np.load(folder / "outputs.npz") as outputs:
    return json.loads(done.stdout.splitlines()[-1]), dict(outputs)


def test_a_linen_call_loads_and_replays_exactly_in_a_fresh_process(loaded_elsewhere):
  replayed, outputs = loaded_elsewhere
  model, variables = _linen_model()
  assert replayed["linen"]
  np.testing.assert_array_equal(outputs["linen"], model.apply(variables, X))


def test_an_nnx_call_loads_and_replays_exactly_in_a_fresh_process(loaded_elsewhere):
  replayed, outputs = loaded_elsewhere
  assert replayed["nnx"]
  np.testing.assert_array_equal(outputs["nnx"], _nnx_model()(X))


def test_an_intervention_set_loads_in_a_fresh_process_and_edits_as_saved(loaded_elsewhere):
  _, outputs = loaded_elsewhere
  model, variables = _linen_model()
  np.testing.assert_allclose(outputs["edited"], _edited_natively(model, variables), rtol=1e-6)
