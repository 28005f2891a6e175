"""Saving isolated calls as artifacts, loading them elsewhere, replaying them exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal

import flaxlens as fl
from flaxlens import cli

from .conftest import ALLOW, isolate_case, read_manifest, write_manifest

# Calls whose replay depends on saved state, rng state or Python-valued arguments.
SAVED = [
  ("batchnorm_train", "BatchNorm_0"),
  ("dropout", "Dropout_1"),
  ("transformer", "TransformerBlock_0"),
  ("created_during_apply", None),
  ("partitioned", None),
  ("dropout", None),
  ("spectral_norm_train", None),
  ("weight_norm", None),
  ("handed_modules", "second"),
  ("weight_norm", "WeightNorm_1.__call__"),
  ("spectral_norm_train", "SpectralNorm_0.__call__"),
]


@pytest.mark.parametrize("name, path", SAVED)
def test_a_loaded_artifact_replays_exactly(cases, tmp_path, name, path):
  isolated = isolate_case(cases[name], path)
  fl.save_isolated(isolated, tmp_path / "artifact")
  loaded = fl.load_isolated(tmp_path / "artifact", allow=ALLOW)
  assert loaded.replay()
  assert_trees_equal(loaded.saved_output, isolated.saved_output)
  assert loaded.saved_arg.kwargs == {} or all(
    type(loaded.saved_arg.kwargs[k]) is type(v) for k, v in isolated.saved_arg.kwargs.items()
  )


def test_the_manifest_records_versions_shapes_and_checksums(artifact):
  manifest = read_manifest(artifact)
  assert manifest["format_version"] == 3
  assert set(manifest["versions"]) >= {"flaxlens", "jax", "flax"}
  assert manifest["recipe"]["module"]["class"] == "flax.linen.stochastic:Dropout"
  assert len(manifest["manifest_sha256"]) == 64
  assert all(len(a["sha256"]) == 64 and "shape" in a for a in manifest["arrays"].values())


def test_the_manifest_records_the_packages_loading_must_allow(cases, tmp_path):
  fl.save_isolated(isolate_case(cases["transformer"], None), tmp_path / "a")
  assert read_manifest(tmp_path / "a")["requires"] == ["linen"]


def test_a_flax_only_call_needs_no_allowed_package(artifact):
  assert read_manifest(artifact)["requires"] == []
  assert fl.load_isolated(artifact).replay()


def test_the_artifact_holds_a_manifest_and_a_safetensors_file_only(artifact):
  assert sorted(os.listdir(artifact)) == ["arrays.safetensors", "manifest.json"]


def test_a_failed_save_leaves_no_artifact_behind(tmp_path):
  class Closure(nn.Module):
    act: object

    @nn.compact
    def __call__(self, x):
      return self.act(nn.Dense(2)(x))

  scale = 3.0
  module = Closure(act=lambda y: y * scale)
  x = jnp.ones((1, 2))
  tree = fl.unflaxify(module, module.init(jax.random.key(0), x), x)
  fl.save_isolated(fl.isolate(tree, x, "Dense_0"), tmp_path / "ok")
  whole = fl.isolate(tree, x, "")
  with pytest.raises(fl.ArtifactError, match="module.act.*cannot be referenced"):
    fl.save_isolated(whole, tmp_path / "bad")
  assert sorted(os.listdir(tmp_path)) == ["ok"]


def test_cli_replay_exits_zero_on_an_exact_match(artifact, capsys):
  assert cli.main(["replay", str(artifact)]) == 0
  assert "exact replay" in capsys.readouterr().out


def test_cli_replay_exits_one_when_the_saved_output_differs(artifact, capsys):
  manifest = read_manifest(artifact)
  saved = manifest["saved"]
  saved["output"], saved["args"]["tuple"][0] = saved["args"]["tuple"][0], saved["output"]
  write_manifest(artifact, manifest)
  assert cli.main(["replay", str(artifact)]) == 1
  assert "replay differs" in capsys.readouterr().out


def test_cli_replay_allows_the_packages_named_by_allow(cases, tmp_path, capsys):
  fl.save_isolated(isolate_case(cases["transformer"], None), tmp_path / "a")
  assert cli.main(["replay", str(tmp_path / "a")]) == 2
  assert "--allow linen" in capsys.readouterr().err
  assert cli.main(["replay", str(tmp_path / "a"), "--allow", "linen"]) == 0


def test_replay_runs_in_a_fresh_process(artifact):
  result = subprocess.run(
    [sys.executable, "-m", "flaxlens.cli", "replay", str(artifact)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  assert "exact replay" in result.stdout


class Helped(nn.Module):
  """A helper method, called from the compact `__call__`, makes a parameter and a Dense."""

  @nn.compact
  def __call__(self, x):
    return self.helper(nn.Dense(3)(x))

  def helper(self, x):
    return nn.Dense(3)(x) * self.param("scale", nn.initializers.ones, (3,))


def test_a_loaded_helper_call_makes_its_variables_as_inside_its_compact_method(tmp_path):
  model, x = Helped(), jnp.ones((2, 3))
  variables = model.init(jax.random.key(0), x)
  isolated = fl.isolate(fl.unflaxify(model, variables, x), x, ".helper")
  fl.save_isolated(isolated, tmp_path / "helper")
  loaded = fl.load_isolated(tmp_path / "helper", allow=[Helped.__module__.split(".")[0]])
  assert_trees_equal(loaded.saved_output, isolated.saved_output)
  assert loaded.replay()
