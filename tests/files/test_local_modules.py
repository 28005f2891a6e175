"""Artifacts whose module class lives in a local file (`mymodel.py`), not an installed package.

`flaxlens replay` and `fl.load_isolated` import an allowed package as `flaxlens inspect`
imports a TARGET's module: from the `--import-path` folders, the current folder, then the
installed packages. The CLI runs here as its installed `flaxlens` script runs it (a
launcher whose folder, not the current one, is first on `sys.path`), in a fresh process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import flaxlens as fl

ROOT = Path(__file__).resolve().parents[2]
MODULE = "localmodel_replayed"
MODEL = """
import pathlib
import flax.linen as nn

pathlib.Path(__file__).with_name("IMPORTED").touch()


class Block(nn.Module):
  features: int = 3

  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(self.features)(x)) * 2.0
"""
SAVE = f"""
import sys
import jax, jax.numpy as jnp
import flaxlens as fl
import {MODULE}

model, x = {MODULE}.Block(), jnp.arange(8.0).reshape(2, 4)
isolated = fl.isolate(fl.unflaxify(model, model.init(jax.random.key(0), x), x), x, "")
fl.save_isolated(isolated, sys.argv[1])
"""
LAUNCHER = "import sys\nfrom flaxlens.cli import main\nsys.exit(main())\n"


def _python(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  return subprocess.run(
    [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
  )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """`(folder holding the module file, artifact, launcher)`; the artifact is saved by a
  process that imported the module from its folder, then the import marker is removed."""
  base = tmp_path_factory.mktemp("local")
  models = base / "models"
  models.mkdir()
  (models / f"{MODULE}.py").write_text(textwrap.dedent(MODEL))
  (models / "save.py").write_text(textwrap.dedent(SAVE))
  artifact = base / "artifacts" / "block"
  done = _python("save.py", str(artifact), cwd=models)
  assert done.returncode == 0, done.stderr[-3000:]
  (models / "IMPORTED").unlink()
  launcher = base / "bin" / "flaxlens_launcher.py"
  launcher.parent.mkdir()
  launcher.write_text(LAUNCHER)
  return models, artifact, launcher


@pytest.fixture
def marker(saved):
  path = saved[0] / "IMPORTED"
  yield path
  path.unlink(missing_ok=True)


def test_replay_imports_an_allowed_module_from_the_current_folder(saved, marker):
  models, artifact, launcher = saved
  done = _python(str(launcher), "replay", str(artifact), "--allow", MODULE, cwd=models)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "exact replay" in done.stdout


def test_replay_imports_an_allowed_module_from_a_folder_given_with_import_path(
  saved, marker, tmp_path
):
  models, artifact, launcher = saved
  argv = ["replay", str(artifact), "--allow", MODULE, "--import-path", str(models)]
  done = _python(str(launcher), *argv, cwd=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "exact replay" in done.stdout


def test_replay_refusal_names_the_allow_flag_and_how_to_make_the_module_found(
  saved, marker, tmp_path
):
  _, artifact, launcher = saved
  done = _python(str(launcher), "replay", str(artifact), cwd=tmp_path)
  assert done.returncode == 2
  assert f"--allow {MODULE}" in done.stderr
  assert f"Run from the folder that holds {MODULE}.py" in done.stderr
  assert "--import-path DIR" in done.stderr
  assert not marker.exists()


def test_replay_refusal_names_the_folder_next_to_the_artifact_that_holds_the_module(
  saved, marker, tmp_path
):
  models, artifact, launcher = saved
  shared = tmp_path / "shared"
  shutil.copytree(artifact, shared / "block")
  shutil.copy(models / f"{MODULE}.py", shared)
  argv = ["replay", str(shared / "block"), "--allow", MODULE]
  done = _python(str(launcher), *argv, cwd=tmp_path)
  assert done.returncode == 2
  assert f"Python finds no module {MODULE!r}" in done.stderr
  assert f"--import-path {shared}" in done.stderr, done.stderr
  assert not (shared / "IMPORTED").exists()


def test_a_local_module_the_user_did_not_allow_is_not_imported(saved, marker):
  models, artifact, launcher = saved
  done = _python(str(launcher), "replay", str(artifact), cwd=models)
  assert done.returncode == 2
  assert f"allow=[{MODULE!r}]" in done.stderr
  assert "finds no module" not in done.stderr  # It is found, and refused.
  assert not marker.exists()


def test_load_isolated_follows_the_same_rule_as_the_command(saved, marker, monkeypatch, tmp_path):
  models, artifact, _ = saved
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  try:
    with pytest.raises(fl.ArtifactError, match=f"Python finds no module {MODULE!r}.*import_path"):
      fl.load_isolated(artifact, allow=[MODULE])
    loaded = fl.load_isolated(artifact, allow=[MODULE], import_path=[models])
    assert str(models) not in sys.path
    assert loaded.replay().bitwise
  finally:
    sys.modules.pop(MODULE, None)
