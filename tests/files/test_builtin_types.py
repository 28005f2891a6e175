"""Built-in types in a saved model need no `allow=`, and modules that hand out the process
(builtins, os, subprocess, ...) are never allowed, advised or loaded.

A model whose NNX graph holds a plain dict, list or tuple names `builtins:dict` (its
pytree node type) in its artifact; a module field `dtype=float` names `builtins:float`.
These load without allowing `builtins`, which would trust `builtins:exec` too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

import flaxlens as fl
from flaxlens import cli

from .conftest import read_manifest, write_manifest

ROOT = Path(__file__).resolve().parents[2]
# A script whose NNX module, defined in `__main__`, holds a plain dict (and list and
# tuple) of layers; it saves the call, then loads it as its user would.
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
import flaxlens as fl

class Mixer(nnx.Module):
  def __init__(self, rngs):
    up, down = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)
    self.by_name = nnx.data({"up": up, "down": down})
    self.chain = nnx.data([nnx.Linear(2, 2, rngs=rngs)])
    self.pair = nnx.data((nnx.Param(jnp.arange(2.0)), nnx.Param(jnp.ones(2))))

  def __call__(self, x):
    h = self.by_name["down"](jax.nn.relu(self.by_name["up"](x)))
    return self.chain[0](h) * self.pair[1] + self.pair[0]

model, x = Mixer(nnx.Rngs(0)), jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
native = model(x)
path = sys.argv[1]
fl.save_isolated(fl.isolate(fl.unflaxify(model, x), x, ""), path)
try:
  fl.load_isolated(path)
  refusal = None
except fl.ArtifactError as e:
  refusal = str(e)
loaded = fl.load_isolated(path, allow=["__main__"])
output, _ = loaded.submodel.stateless_call(loaded.initial_var_values, fl.ArgsAndKwargs.capture(x))
print(json.dumps({
  "refusal": refusal,
  "same_as_native": bool((output == native).all()),
  "replay": bool(loaded.replay()),
}))
"""


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
  """(the artifact the script saved, what the script reported after loading it)."""
  base = tmp_path_factory.mktemp("script")
  (base / "mixer.py").write_text(SCRIPT)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run(
    [sys.executable, "mixer.py", str(base / "mixer")],
    capture_output=True,
    text=True,
    env=env,
    cwd=base,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return base / "mixer", json.loads(done.stdout.splitlines()[-1])


def test_a_graph_holding_a_plain_dict_requires_only_main(script_run):
  artifact, _ = script_run
  manifest = read_manifest(artifact)
  assert "builtins:dict" in json.dumps(manifest["recipe"])
  assert manifest["requires"] == ["__main__"]


def test_the_refusal_advises_allowing_main_alone(script_run):
  _, report = script_run
  assert "allow=['__main__']" in report["refusal"]
  assert "builtins" not in report["refusal"]


def test_a_script_loads_its_own_dict_holding_module_with_allow_main_and_runs_it_exactly(
  script_run,
):
  _, report = script_run
  assert report["same_as_native"]
  assert report["replay"]


def test_an_old_artifact_listing_builtins_is_not_advised_to_allow_it(script_run, tmp_path):
  """Artifacts saved before built-in types needed no `allow=` list `builtins` in
  `requires`; refusals are worded from the references, not from that list."""
  artifact, _ = script_run
  manifest = read_manifest(artifact)
  manifest["requires"] = ["__main__", "builtins"]
  old = tmp_path / "old"
  old.mkdir()
  (old / "arrays.safetensors").write_bytes((artifact / "arrays.safetensors").read_bytes())
  write_manifest(old, manifest)
  with pytest.raises(fl.ArtifactError, match=r"allow=\['__main__'\] \(CLI") as refusal:
    fl.load_isolated(old)
  assert "builtins" not in str(refusal.value)


def test_a_module_holding_a_builtin_type_as_a_field_loads_without_allow(tmp_path):
  model = nnx.Linear(3, 2, dtype=float, param_dtype=float, rngs=nnx.Rngs(0))
  x = nnx.Rngs(1).params.normal((2, 3))
  fl.save_isolated(fl.isolate(fl.unflaxify(model, x), x, ""), tmp_path / "linear")
  assert "builtins:float" in json.dumps(read_manifest(tmp_path / "linear"))
  assert read_manifest(tmp_path / "linear")["requires"] == []
  loaded = fl.load_isolated(tmp_path / "linear")
  output, _ = loaded.submodel.stateless_call(loaded.initial_var_values, fl.ArgsAndKwargs.capture(x))
  assert (output == model(x)).all()


@pytest.mark.parametrize("package", ["builtins", "os", "subprocess", "importlib", "pickle"])
def test_allowing_a_package_that_hands_out_the_process_is_refused(artifact, package):
  with pytest.raises(fl.ArgumentError, match=rf"allow=\['{package}'\] is refused: {package} hands"):
    fl.load_isolated(artifact, allow=[package])


def test_the_command_refuses_allow_builtins_and_says_why(artifact, capsys):
  assert cli.main(["replay", str(artifact), "--allow", "builtins"]) == 2
  assert "builtins.exec" in capsys.readouterr().err


def test_saving_a_builtin_function_is_refused_naming_what_to_use(tmp_path):
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  model.activation = abs
  x = nnx.Rngs(1).params.normal((2, 3))
  isolated = fl.isolate(fl.unflaxify(model, x), x, "")
  with pytest.raises(fl.ArtifactError, match=r"'builtins:abs'.*jnp\.abs"):
    fl.save_isolated(isolated, tmp_path / "linear")
