"""Saving isolated calls as artifacts, loading them elsewhere, and refusing bad ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl
from flaxlens import cli

from .conftest import assert_trees_equal, convert

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
]


def _isolate(case, path):
  tree = convert(case)
  selection = tree.select() if path is None else tree.select().at_path(path)
  argument = fl.ArgsAndKwargs.capture(*case.args, **case.kwargs)
  return fl.isolate_submodel(selection, argument, random_streams=case.rngs)


@pytest.mark.parametrize("name, path", SAVED)
def test_a_loaded_artifact_replays_exactly(cases, tmp_path, name, path):
  isolated = _isolate(cases[name], path)
  fl.save_isolated(isolated, tmp_path / "artifact")
  loaded = fl.load_isolated(tmp_path / "artifact")
  assert loaded.replay()
  assert_trees_equal(loaded.saved_output, isolated.saved_output)
  assert loaded.saved_arg.kwargs == {} or all(
    type(loaded.saved_arg.kwargs[k]) is type(v) for k, v in isolated.saved_arg.kwargs.items()
  )


@pytest.fixture
def artifact(cases, tmp_path):
  path = tmp_path / "dropout"
  fl.save_isolated(_isolate(cases["dropout"], "Dropout_1"), path)
  return path


def test_the_manifest_records_versions_shapes_and_checksums(artifact):
  manifest = json.loads((artifact / "manifest.json").read_text())
  assert manifest["format_version"] == 1
  assert set(manifest["versions"]) >= {"flaxlens", "jax", "flax"}
  assert manifest["recipe"]["module"]["dataclass"] == "flax.linen.stochastic:Dropout"
  assert all(len(a["sha256"]) == 64 and "shape" in a for a in manifest["arrays"].values())


def test_the_artifact_holds_no_pickle(artifact):
  with np.load(artifact / "arrays.npz", allow_pickle=False) as npz:
    assert all(npz[name].dtype == np.uint8 for name in npz.files)


def test_saving_over_an_existing_artifact_needs_overwrite(cases, artifact):
  isolated = _isolate(cases["mlp"], "Dense_0")
  with pytest.raises(fl.ArtifactError, match="exists"):
    fl.save_isolated(isolated, artifact)
  fl.save_isolated(isolated, artifact, overwrite=True)
  assert fl.load_isolated(artifact).replay()


def test_a_failed_save_leaves_no_artifact_behind(tmp_path):
  class Closure(nn.Module):
    act: object

    @nn.compact
    def __call__(self, x):
      return self.act(nn.Dense(2)(x))

  scale = 3.0
  module = Closure(act=lambda y: y * scale)
  x = jnp.ones((1, 2))
  isolated = fl.isolate(module, module.init(jax.random.key(0), x), x, at="Dense_0")
  fl.save_isolated(isolated, tmp_path / "ok")
  whole = fl.isolate_submodel(
    fl.unflaxify(module, module.init(jax.random.key(0), x), x).select(),
    fl.ArgsAndKwargs.capture(x),
  )
  with pytest.raises(fl.ArtifactError, match="module.act.*cannot be referenced"):
    fl.save_isolated(whole, tmp_path / "bad")
  assert sorted(os.listdir(tmp_path)) == ["ok"]


def test_a_truncated_array_file_is_reported(artifact):
  data = (artifact / "arrays.npz").read_bytes()
  (artifact / "arrays.npz").write_bytes(data[: len(data) // 2])
  with pytest.raises(fl.ArtifactError, match="arrays.npz is corrupted or truncated"):
    fl.load_isolated(artifact)


def test_a_missing_manifest_is_reported(artifact):
  (artifact / "manifest.json").unlink()
  with pytest.raises(fl.ArtifactError, match="manifest.json is missing"):
    fl.load_isolated(artifact)


def test_a_corrupted_manifest_is_reported(artifact):
  (artifact / "manifest.json").write_text('{"format": "flaxlens-iso')
  with pytest.raises(fl.ArtifactError, match="corrupted or truncated"):
    fl.load_isolated(artifact)


def test_a_tampered_array_fails_its_checksum(artifact):
  with np.load(artifact / "arrays.npz", allow_pickle=False) as npz:
    arrays = {name: npz[name].copy() for name in npz.files}
  name = next(n for n, a in arrays.items() if a.size)
  arrays[name][0] ^= 1
  np.savez(artifact / "arrays.npz", **arrays)
  with pytest.raises(fl.ArtifactError, match=f"array '{name}' does not match its checksum"):
    fl.load_isolated(artifact)


def test_a_newer_format_version_is_refused(artifact):
  manifest = json.loads((artifact / "manifest.json").read_text())
  manifest["format_version"] = 99
  (artifact / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(fl.ArtifactError, match="format 99, newer"):
    fl.load_isolated(artifact)


def test_an_unimportable_module_class_is_reported(artifact):
  manifest = json.loads((artifact / "manifest.json").read_text())
  manifest["recipe"]["module"]["dataclass"] = "no_such_package.layers:Dropout"
  (artifact / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(fl.ArtifactError, match="Cannot import 'no_such_package.layers:Dropout'"):
    fl.load_isolated(artifact)


def test_a_class_that_is_not_a_module_is_refused(artifact):
  manifest = json.loads((artifact / "manifest.json").read_text())
  manifest["recipe"]["module"] = {
    "dataclass": "flaxlens.core._args:ArgsAndKwargs",
    "fields": {"args": {"tuple": []}, "kwargs": {"dict": []}},
  }
  (artifact / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(fl.ArtifactError, match="not a flax.linen.Module"):
    fl.load_isolated(artifact)


def test_cli_replay_exits_zero_on_an_exact_match(artifact, capsys):
  assert cli.main(["replay", str(artifact)]) == 0
  assert "exact replay" in capsys.readouterr().out


def test_cli_replay_exits_nonzero_when_the_saved_output_differs(artifact, capsys):
  manifest = json.loads((artifact / "manifest.json").read_text())
  manifest["saved"]["output"] = {"array": "a0"}
  (artifact / "manifest.json").write_text(json.dumps(manifest))
  assert cli.main(["replay", str(artifact)]) == 1
  assert "replay differs" in capsys.readouterr().out


def test_cli_replay_reports_a_broken_artifact(artifact, capsys):
  (artifact / "arrays.npz").unlink()
  assert cli.main(["replay", str(artifact)]) == 2
  assert "arrays.npz is missing" in capsys.readouterr().err


def test_replay_runs_in_a_fresh_process(artifact):
  result = subprocess.run(
    [sys.executable, "-m", "flaxlens.cli", "replay", str(artifact)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  assert "exact replay" in result.stdout
