"""Finding 7: overwrite=True replaces only a flaxlens artifact and leaves nothing behind."""

from __future__ import annotations

import os

import pytest

import flaxlens as fl

from .conftest import ARRAYS, isolate_case, read_manifest, write_manifest


@pytest.fixture
def isolated(cases):
  return isolate_case(cases["mlp"], "Dense_0")


def _hidden(directory):
  return sorted(name for name in os.listdir(directory) if name.startswith("."))


def test_saving_over_an_existing_artifact_needs_overwrite(isolated, artifact):
  with pytest.raises(fl.ArtifactError, match="exists; pass overwrite=True"):
    fl.save_isolated(isolated, artifact)
  fl.save_isolated(isolated, artifact, overwrite=True)
  assert fl.load_isolated(artifact, allow=["linen"]).replay()
  assert _hidden(artifact.parent) == []


def test_overwrite_replaces_an_artifact_of_the_previous_format(isolated, artifact):
  """Format 2 kept its arrays in arrays.npz; such an artifact is replaced, not refused."""
  manifest = read_manifest(artifact)
  write_manifest(artifact, {**manifest, "format_version": 2})
  (artifact / ARRAYS).rename(artifact / "arrays.npz")
  with pytest.raises(fl.ArtifactError, match="format 2; this flaxlens reads format 3"):
    fl.load_isolated(artifact)
  fl.save_isolated(isolated, artifact, overwrite=True)
  assert sorted(os.listdir(artifact)) == [ARRAYS, "manifest.json"]
  assert fl.load_isolated(artifact, allow=["linen"]).replay()


def test_overwrite_refuses_a_directory_that_is_not_an_artifact(isolated, tmp_path):
  thesis = tmp_path / "thesis"
  thesis.mkdir()
  (thesis / "thesis.tex").write_text("\\chapter{One}")
  with pytest.raises(fl.ArtifactError, match="is not a flaxlens artifact"):
    fl.save_isolated(isolated, thesis, overwrite=True)
  assert os.listdir(thesis) == ["thesis.tex"]
  assert (thesis / "thesis.tex").read_text() == "\\chapter{One}"
  assert _hidden(tmp_path) == []


def test_overwrite_refuses_an_artifact_directory_holding_other_files(isolated, artifact):
  (artifact / "notes.txt").write_text("keep me")
  with pytest.raises(fl.ArtifactError, match=r"not a flaxlens artifact.*notes.txt"):
    fl.save_isolated(isolated, artifact, overwrite=True)
  assert (artifact / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_overwrite_refuses_a_file_or_a_symlink(isolated, artifact, tmp_path, kind):
  target = tmp_path / "target"
  if kind == "file":
    target.write_text("data")
  else:
    os.symlink(artifact, target)
  with pytest.raises(fl.ArtifactError, match="is not a flaxlens artifact"):
    fl.save_isolated(isolated, target, overwrite=True)
  assert target.is_symlink() if kind == "symlink" else target.read_text() == "data"
  assert _hidden(tmp_path) == []


def test_stale_leftovers_of_a_crash_do_not_block_a_save(isolated, artifact):
  for name in (f".{artifact.name}.old", f".{artifact.name}.abc123"):
    (artifact.parent / name).mkdir()
  fl.save_isolated(isolated, artifact, overwrite=True)
  assert fl.load_isolated(artifact, allow=["linen"]).replay()


def test_a_failed_replacement_restores_the_old_artifact(isolated, artifact, monkeypatch):
  before = {p.name: p.read_bytes() for p in artifact.iterdir()}
  real_replace = os.replace
  calls = []

  def failing_replace(src, dst):
    calls.append(dst)
    if len(calls) == 2:  # Moving the new artifact into place.
      raise OSError("disk full")
    real_replace(src, dst)

  monkeypatch.setattr(os, "replace", failing_replace)
  with pytest.raises(fl.ArtifactError, match="disk full"):
    fl.save_isolated(isolated, artifact, overwrite=True)
  monkeypatch.undo()
  assert {p.name: p.read_bytes() for p in artifact.iterdir()} == before
  assert _hidden(artifact.parent) == []
