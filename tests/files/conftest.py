"""Shared fixtures for the artifact tests: saved Linen corpus calls, manifest edits, and
arrays files read and written by the `safetensors` library or built by hand as bytes."""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
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


ARRAYS = "arrays.safetensors"


def read_arrays(path: pathlib.Path) -> dict[str, np.ndarray]:
  """The arrays of an artifact's arrays file, as the `safetensors` library reads them."""
  from safetensors.numpy import load_file

  return load_file(path / ARRAYS)


def write_arrays(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
  """Replaces an artifact's arrays file by one the `safetensors` library writes."""
  from safetensors.numpy import save_file

  save_file(arrays, path / ARRAYS)


def split_arrays_file(path: pathlib.Path) -> tuple[dict, bytes]:
  """An arrays file's JSON header and data, parsed by hand (8-byte length, header, data)."""
  raw = (path / ARRAYS).read_bytes()
  (length,) = struct.unpack("<Q", raw[:8])
  return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_arrays_file(path: pathlib.Path, header: bytes | dict, data: bytes) -> None:
  """Writes an arrays file by hand from a header (JSON text or data) and data bytes."""
  text = header if isinstance(header, bytes) else json.dumps(header).encode()
  (path / ARRAYS).write_bytes(struct.pack("<Q", len(text)) + text + data)
