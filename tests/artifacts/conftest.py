"""Shared fixtures for the artifact tests: saved Linen corpus calls and manifest edits."""

from __future__ import annotations

import json
import pathlib

import pytest
from frameworks import LINEN
from linen import corpus

import flaxlens as fl
from flaxlens.tools.files._manifest import checksum

# The corpus modules are defined in the `linen` test package: loading names it.
ALLOW = ["linen"]


@pytest.fixture(scope="session")
def cases(corpora) -> dict[str, corpus.Case]:
  return corpora[LINEN]


def isolate_case(case: corpus.Case, path: str | None) -> fl.IsolatedSubmodel:
  return LINEN.isolate(case, path)


@pytest.fixture
def artifact(cases, tmp_path) -> pathlib.Path:
  """A saved Dropout call: arrays, an rng key, Python-valued kwargs, a Flax module class."""
  path = tmp_path / "dropout"
  fl.save_isolated(isolate_case(cases["dropout"], "Dropout_1"), path)
  return path


def read_manifest(path: pathlib.Path) -> dict:
  return json.loads((path / "manifest.json").read_text())


def write_manifest(path: pathlib.Path, manifest: dict, rehash: bool = True) -> None:
  """Writes `manifest`, with a matching checksum unless `rehash` is False (as a forger would)."""
  if rehash:
    manifest = {**manifest, "manifest_sha256": checksum(manifest)}
  (path / "manifest.json").write_text(json.dumps(manifest))
