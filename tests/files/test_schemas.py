"""Manifests are validated against the JSON Schemas shipped in the package: documents
other tools can use as they are, and limits on the JSON that hold before validation."""

from __future__ import annotations

import json
import time
from importlib.resources import files

import jsonschema
import pytest
import referencing

import flaxlens as fl

from .conftest import read_manifest, write_manifest

SCHEMAS = files("flaxlens.tools.files").joinpath("schemas")
NAMES = [
  "values",
  "isolated",
  "interventions",
  "safetensors-header",
  "harvest",
  "harvest-progress",
]


def _schema(name: str) -> dict:
  return json.loads(SCHEMAS.joinpath(f"{name}.schema.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_each_shipped_schema_is_a_valid_draft_2020_12_schema(name):
  jsonschema.Draft202012Validator.check_schema(_schema(name))


@pytest.fixture
def saved_set(tmp_path):
  import jax.numpy as jnp

  path = tmp_path / "set"
  fl.save_interventions([fl.steer("Dense_0", jnp.arange(4.0), alpha=2.0)], path)
  return path


@pytest.mark.parametrize("which, name", [("artifact", "isolated"), ("saved_set", "interventions")])
def test_a_saved_manifest_validates_with_plain_jsonschema(request, which, name):
  """Another tool needs only the schema files and jsonschema to check our manifests."""
  registry = referencing.Registry().with_resources(
    (_schema(n)["$id"], referencing.Resource.from_contents(_schema(n))) for n in NAMES
  )
  validator = jsonschema.Draft202012Validator(_schema(name), registry=registry)
  manifest = read_manifest(request.getfixturevalue(which))
  assert validator.is_valid(manifest)
  assert not validator.is_valid({**manifest, "unknown_field": 1})


def test_a_float_where_an_integer_belongs_is_refused(artifact):
  manifest = read_manifest(artifact)
  manifest["call_number"] = 0.0
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"at \$\.call_number: 0\.0 is not of type 'integer'"):
    fl.load_isolated(artifact)


def test_a_reference_with_a_trailing_newline_is_refused(artifact):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] += "\n"
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"at \$\.recipe\.module\.class: .* does not match"):
    fl.load_isolated(artifact)


def _nested(depth: int) -> dict:
  value = 1
  for _ in range(depth):
    value = {"tuple": [value]}
  return value


def test_a_manifest_nested_to_the_limit_loads(artifact):
  """47 nested tuples bring the manifest to JSON depth 98 of the 100 allowed; validating
  it must not exhaust Python's recursion limit."""
  manifest = read_manifest(artifact)
  manifest["saved"]["output"] = _nested(47)
  write_manifest(artifact, manifest)
  output = fl.load_isolated(artifact).saved_output
  for _ in range(47):
    (output,) = output
  assert output == 1


def test_a_manifest_nested_deeper_than_the_limit_is_refused(artifact):
  manifest = read_manifest(artifact)
  manifest["saved"]["output"] = _nested(60)
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match="manifest.json nests deeper than 100 levels"):
    fl.load_isolated(artifact)


def test_a_manifest_of_too_many_values_is_refused_before_validation(artifact):
  manifest = read_manifest(artifact)
  manifest["saved"]["output"] = {"list": [0] * 1_000_001}
  write_manifest(artifact, manifest)
  start = time.monotonic()
  with pytest.raises(fl.ArtifactError, match="holds more than 1000000 JSON values"):
    fl.load_isolated(artifact)
  assert time.monotonic() - start < 5
