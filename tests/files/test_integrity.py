"""Finding 3: every malformed or tampered field is an ArtifactError, and the CLI exits 2."""

from __future__ import annotations

import copy
import json
import pathlib
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flaxlens as fl
from flaxlens import cli

from .conftest import (
  ARRAYS,
  read_arrays,
  read_manifest,
  split_arrays_file,
  write_arrays,
  write_arrays_file,
  write_manifest,
)


def test_an_edited_manifest_fails_its_checksum(artifact):
  manifest = read_manifest(artifact)
  manifest["call_number"] = 1
  write_manifest(artifact, manifest, rehash=False)
  with pytest.raises(fl.ArtifactError, match="manifest.json does not match its checksum"):
    fl.load_isolated(artifact)


def test_a_missing_array_checksum_is_malformed(artifact):
  manifest = read_manifest(artifact)
  del manifest["arrays"]["a0"]["sha256"]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"at \$\.arrays\.a0: 'sha256' is a required"):
    fl.load_isolated(artifact)


@pytest.mark.parametrize("change", ["reshaped", "int32", "uint8"])
def test_the_array_checksum_covers_shape_and_dtype(artifact, change):
  """Changes that keep the bytes, made to the manifest and the arrays file alike, so that
  only the checksum can tell."""
  manifest = read_manifest(artifact)
  name = next(n for n, a in manifest["arrays"].items() if a["dtype"] == "float32")
  info = manifest["arrays"][name]
  arrays = read_arrays(artifact)
  size = int(np.prod(info["shape"]))
  if change == "reshaped":
    arrays[name] = arrays[name].reshape([1, size] if info["shape"] == [size] else [size])
  else:
    arrays[name] = arrays[name].reshape(-1).view(change)
  info["dtype"], info["shape"] = arrays[name].dtype.name, list(arrays[name].shape)
  write_manifest(artifact, manifest)
  write_arrays(artifact, arrays)
  with pytest.raises(fl.ArtifactError, match=f"'{name}' does not match its checksum"):
    fl.load_isolated(artifact)


@pytest.mark.parametrize(
  "version, message",
  [
    (0, "not a positive integer"),
    (-2, "not a positive integer"),
    (True, "not a positive integer"),
    (2.0, "not a positive integer"),
    ("2", "not a positive integer"),
    (1, "format 1; this flaxlens reads format 3 only"),
    (2, r"format 2; this flaxlens reads format 3 only \(arrays in arrays.safetensors, not"),
    (99, "format 99, newer"),
  ],
)
def test_an_unknown_format_version_is_refused(artifact, version, message):
  manifest = read_manifest(artifact)
  manifest["format_version"] = version
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=message):
    fl.load_isolated(artifact)


def test_a_tampered_array_fails_its_checksum(artifact):
  header, data = split_arrays_file(artifact)
  name, entry = next((n, e) for n, e in header.items() if e["data_offsets"][1])
  flipped = bytearray(data)
  flipped[entry["data_offsets"][0]] ^= 1
  write_arrays_file(artifact, header, bytes(flipped))
  with pytest.raises(fl.ArtifactError, match=f"array '{name}' does not match its checksum"):
    fl.load_isolated(artifact)


def test_a_truncated_array_file_is_reported(artifact):
  data = (artifact / ARRAYS).read_bytes()
  (artifact / ARRAYS).write_bytes(data[: len(data) // 2])
  with pytest.raises(fl.ArtifactError, match=r"arrays.safetensors \(\d+ bytes\) is smaller"):
    fl.load_isolated(artifact)


def test_a_missing_manifest_is_reported(artifact):
  (artifact / "manifest.json").unlink()
  with pytest.raises(fl.ArtifactError, match="manifest.json is missing"):
    fl.load_isolated(artifact)


@pytest.mark.parametrize(
  "text", ['{"format": "flaxlens-iso', '{"a": NaN}', '{"a": 1, "a": 2}', "[" * 100000]
)
def test_a_manifest_that_is_not_strict_json_is_reported(artifact, text):
  (artifact / "manifest.json").write_text(text)
  with pytest.raises(fl.ArtifactError, match="corrupted or truncated|not JSON|repeats a key"):
    fl.load_isolated(artifact)


def test_an_unknown_field_is_malformed(artifact):
  manifest = read_manifest(artifact)
  manifest["recipe"]["extra"] = 1
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"at \$\.recipe: .*\('extra' was unexpected\)"):
    fl.load_isolated(artifact)


def test_the_reserved_replay_field_is_accepted(artifact):
  manifest = read_manifest(artifact)
  manifest["replay"] = {"jit": False}
  write_manifest(artifact, manifest)
  assert fl.load_isolated(artifact).replay()


def test_cli_replay_exits_two_on_a_broken_artifact(artifact, capsys):
  (artifact / ARRAYS).unlink()
  assert cli.main(["replay", str(artifact)]) == 2
  assert "arrays.safetensors is missing" in capsys.readouterr().err


# A fuzz of single-field mutations: replace one node of the manifest's JSON tree by another
# JSON value, or delete it from its object.
JSON_VALUES = st.recursive(
  st.none()
  | st.booleans()
  | st.integers(-(2**40), 2**40)
  | st.floats(allow_nan=False, allow_infinity=False)
  | st.sampled_from(["", "a0", "a99", "os:system", "flax.linen.linear:Dense", "float32", "dict"])
  | st.text(max_size=8),
  lambda inner: (
    st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
  ),
  max_leaves=6,
)


def _nodes(tree, path=()):
  yield path
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _nodes(v, (*path, k))
  elif isinstance(tree, list):
    for i, v in enumerate(tree):
      yield from _nodes(v, (*path, i))


def _mutated(manifest: dict, path: tuple, value, delete: bool) -> dict:
  mutated = copy.deepcopy(manifest)
  parent = mutated
  for part in path[:-1]:
    parent = parent[part]
  if delete and isinstance(parent, dict):
    del parent[path[-1]]
  else:
    parent[path[-1]] = value
  return mutated


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, cases):
  from .conftest import isolate_case

  path = tmp_path_factory.mktemp("fuzz") / "dropout"
  fl.save_isolated(isolate_case(cases["dropout"], "Dropout_1"), path)
  return path, read_manifest(path), (path / ARRAYS).read_bytes()


@pytest.mark.parametrize("rehash", [False, True], ids=["as-corrupted", "as-forged"])
@settings(
  max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_every_single_field_mutation_is_refused_or_replays(pristine, tmp_path, rehash, data):
  path, manifest, arrays = pristine
  nodes = [p for p in _nodes(manifest) if p and p[0] != "manifest_sha256"]
  where = data.draw(st.sampled_from(nodes))
  mutated = _mutated(manifest, where, data.draw(JSON_VALUES), data.draw(st.booleans()))
  target = pathlib.Path(tempfile.mkdtemp(dir=tmp_path))
  (target / ARRAYS).write_bytes(arrays)
  write_manifest(target, mutated, rehash=rehash)
  try:
    loaded = fl.load_isolated(target)
  except fl.ArtifactError:
    return
  if not rehash:
    assert json.dumps(mutated, sort_keys=True) == json.dumps(manifest, sort_keys=True)
  assert cli.main(["replay", str(target)]) in (0, 1, 2)
  assert mutated != manifest or loaded.replay().bitwise
