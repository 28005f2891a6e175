"""Loading a saved intervention set imports nothing the policy refuses and trusts no byte."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import flaxlens as fl

from .conftest import read_manifest, split_arrays_file, write_arrays_file, write_manifest


@pytest.fixture
def saved(tmp_path):
  """A set with a vetted modify function, a module-class site, a mask and a vector."""
  path = tmp_path / "set"
  fl.save_interventions(
    [
      fl.modify("Dense_0", jax.nn.relu),
      fl.steer("Dense_0", jnp.arange(4.0), alpha=2.0),
      fl.ablate(nn.Dense, where=jnp.array([True, False, True, False])),
    ],
    path,
  )
  return path


def _forge(path, edit):
  manifest = read_manifest(path)
  edit(manifest)
  write_manifest(path, manifest)


def _set_fn(ref, requires):
  def edit(manifest):
    manifest["interventions"][0]["fn"] = {"ref": ref}
    manifest["requires"] = requires

  return edit


@pytest.mark.parametrize("ref", ["os:system", "subprocess:getoutput", "builtins:eval"])
def test_a_forged_function_outside_the_allowed_packages_is_refused(saved, ref):
  _forge(saved, _set_fn(ref, [ref.partition(":")[0]]))
  with pytest.raises(fl.ArtifactError, match=ref):
    fl.load_interventions(saved)


def test_a_package_named_by_a_forged_reference_is_never_imported(saved):
  assert "this" not in sys.modules  # importing `this` prints; a stand-in for side effects
  _forge(saved, _set_fn("this:s", ["this"]))
  with pytest.raises(fl.ArtifactError, match=r"allow=\['this'\]"):
    fl.load_interventions(saved)
  assert "this" not in sys.modules


@pytest.mark.parametrize("ref", ["numpy:save", "jax.numpy:load", "flax.linen:Dense"])
def test_a_function_of_a_default_package_outside_the_vetted_set_is_refused(saved, ref):
  _forge(saved, _set_fn(ref, []))
  with pytest.raises(fl.ArtifactError, match="as a function to call, which the loading policy"):
    fl.load_interventions(saved)


def test_a_function_of_an_allowed_package_is_loaded(saved):
  _forge(saved, _set_fn("operator:add", ["operator"]))
  import operator

  assert fl.load_interventions(saved, allow=["operator"])[0].fn is operator.add


@pytest.mark.parametrize("ref", ["numpy:ndarray", "flax.linen:jit", "flax.nnx:Variable"])
def test_a_site_class_that_is_not_a_flax_module_is_refused(saved, ref):
  _forge(saved, lambda manifest: manifest["interventions"][2].update(at={"class": ref}))
  with pytest.raises(fl.ArtifactError, match="as a Flax module class"):
    fl.load_interventions(saved)


def test_a_site_class_from_a_package_not_allowed_is_refused(saved):
  def edit(manifest):
    manifest["interventions"][2]["at"] = {"class": "collections:OrderedDict"}
    manifest["requires"] = ["collections"]

  _forge(saved, edit)
  with pytest.raises(fl.ArtifactError, match=r"allow=\['collections'\]"):
    fl.load_interventions(saved)


def test_a_tampered_array_fails_its_checksum(saved):
  header, data = split_arrays_file(saved)
  flipped = bytearray(data)
  flipped[header["a0"]["data_offsets"][0]] ^= 1
  write_arrays_file(saved, header, bytes(flipped))
  with pytest.raises(fl.ArtifactError, match="array 'a0' does not match its checksum"):
    fl.load_interventions(saved)


def test_an_edited_manifest_fails_its_checksum(saved):
  manifest = read_manifest(saved)
  manifest["interventions"][1]["at"] = "Dense_1"
  write_manifest(saved, manifest, rehash=False)
  with pytest.raises(fl.ArtifactError, match="does not match its checksum"):
    fl.load_interventions(saved)


def test_a_symlinked_set_directory_is_refused(saved, tmp_path):
  os.symlink(saved, tmp_path / "link")
  with pytest.raises(fl.ArtifactError, match="symbolic link"):
    fl.load_interventions(tmp_path / "link")


@pytest.mark.parametrize("name", ["manifest.json", "arrays.safetensors"])
def test_a_symlinked_file_in_the_set_is_refused(saved, tmp_path, name):
  os.replace(saved / name, tmp_path / name)
  os.symlink(tmp_path / name, saved / name)
  with pytest.raises(fl.ArtifactError, match=f"{name} is a symbolic link"):
    fl.load_interventions(saved)


def test_arrays_larger_than_max_bytes_are_refused_before_reading(saved):
  with pytest.raises(fl.ArtifactError, match="more than max_bytes=8"):
    fl.load_interventions(saved, max_bytes=8)


def test_an_array_whose_manifest_shape_is_huge_is_refused_before_reading(saved):
  def edit(manifest):
    manifest["arrays"]["a0"]["shape"] = [2**40]

  _forge(saved, edit)
  with pytest.raises(fl.ArtifactError, match="more than max_bytes"):
    fl.load_interventions(saved)


@pytest.mark.parametrize(
  "text, message",
  [
    ('{"format": "flaxlens-interventions", "format_version": NaN}', "is not JSON"),
    ('{"format": "flaxlens-interventions", "format": "x"}', "repeats a key"),
    ('{"format": "flaxlens-interv', "corrupted or truncated"),
    ("[1, 2]", "not a flaxlens-interventions manifest"),
    ('{"format": "flaxlens-interventions", "format_version": 7}', "format 7, newer"),
    (
      '{"format": "flaxlens-interventions", "format_version": 1}',
      r"format 1; this flaxlens reads formats 2 to 3 only \(arrays in arrays.safetensors",
    ),
  ],
  ids=["nan", "duplicate_key", "truncated", "not_an_object", "newer_version", "older_version"],
)
def test_bad_json_is_refused(saved, text, message):
  (saved / "manifest.json").write_text(text)
  with pytest.raises(fl.ArtifactError, match=message):
    fl.load_interventions(saved)


@pytest.mark.parametrize(
  "edit, message",
  [
    (lambda m: m["interventions"][1].update(fn={"ref": "jax.nn:relu"}), "only 'modify'"),
    (lambda m: m["interventions"][1]["operands"].pop(), "1 operands where 'steer' takes 2"),
    (lambda m: m["interventions"][1].update(kind="exec"), r"\$\.interventions\[1\]\.kind"),
    (
      lambda m: m["interventions"][2].update(where=["index", ["int", "0"]]),
      r"\$\.interventions\[2\]\.where\[1\]\[1\]: '0' is not of type 'integer'",
    ),
    (lambda m: m["interventions"][2].update(where=["index", ["array"], ["array"]]), "needs 2"),
    (lambda m: m["interventions"][0]["operands"].append({"array": "a9"}), "does not list"),
    (
      lambda m: m["interventions"][0].update(at={"ref": "os:system"}),
      r"\$\.interventions\[0\]\.at: \{'ref': 'os:system'\} is not valid",
    ),
    (
      lambda m: m["interventions"][1].update(operands=[{"list": []}] * 2),
      r"\$\.interventions\[1\]\.operands\[\d\]: 'list' is not one of \['array', 'key'",
    ),
  ],
  ids=[
    "fn_on_steer",
    "operand_missing",
    "unknown_kind",
    "bad_index",
    "index_arrays_missing",
    "unlisted_array",
    "site_as_a_function",
    "operand_not_an_array",
  ],
)
def test_a_manifest_that_does_not_describe_interventions_is_refused(saved, edit, message):
  _forge(saved, edit)
  with pytest.raises(fl.ArtifactError, match=message):
    fl.load_interventions(saved)


def test_a_mask_that_is_not_boolean_is_refused(saved):
  def edit(manifest):
    manifest["interventions"][2]["where_arrays"] = [{"array": "a1"}]  # the float vector

  _forge(saved, edit)
  with pytest.raises(fl.ArtifactError, match="not a boolean array"):
    fl.load_interventions(saved)


def test_an_isolated_call_artifact_is_not_an_intervention_set(artifact):
  with pytest.raises(fl.ArtifactError, match="not a flaxlens-interventions manifest"):
    fl.load_interventions(artifact)


def test_overwrite_replaces_a_set_but_never_an_isolated_call_artifact(saved, artifact):
  fl.save_interventions([fl.ablate("Dense_1")], saved, overwrite=True)
  assert [i.at for i in fl.load_interventions(saved)] == ["Dense_1"]
  with pytest.raises(fl.ArtifactError, match="is not a flaxlens artifact"):
    fl.save_interventions([fl.ablate("Dense_1")], artifact, overwrite=True)
  assert json.loads((artifact / "manifest.json").read_text())["format"] == "flaxlens-isolated"


PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "intervention-specs.md"


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", PAGE.read_text()))))
def test_the_intervention_sets_page_examples_run(index):
  block = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)[index]
  exec(compile(block, f"{PAGE.name}[python block {index}]", "exec"), {})


@pytest.mark.parametrize(
  "where, message",
  [
    (["index", ["slice", 0, 4, 0]], "a slice with step 0"),
    (["index", ["ellipsis"], ["int", 0], ["ellipsis"]], "more than one '...'"),
    (["index", ["array"]], "an array of dtype float32"),
  ],
  ids=["step_0", "two_ellipses", "float_array"],
)
def test_a_forged_where_that_is_no_index_is_refused_naming_the_file_the_entry_and_the_site(
  saved, where, message
):
  def edit(manifest):
    entry = manifest["interventions"][1]
    entry["where"] = where
    if ["array"] in where:  # the index array is the steering vector, float32[4]
      entry["where_arrays"] = entry["operands"][:1]

  _forge(saved, edit)
  with pytest.raises(fl.ArtifactError) as raised:
    fl.load_interventions(saved)
  said = str(raised.value)
  assert said.startswith(f"{saved}: manifest.json's interventions[1] ")
  assert re.search(rf"fl\.steer\('Dense_0'\): where= .*{message}", said), said
  assert said.endswith("save it again with fl.save_interventions.")
  assert isinstance(raised.value.__cause__, fl.ArgumentError)


def test_a_format_2_set_still_loads(saved):
  def edit(manifest):
    manifest["format_version"] = 2

  _forge(saved, edit)
  loaded = fl.load_interventions(saved)
  assert [i.kind for i in loaded] == ["modify", "steer", "zero"]


def test_a_format_2_set_holding_a_kind_of_format_3_is_refused(tmp_path):
  path = tmp_path / "set"
  fl.save_interventions([fl.low_rank_edit("Dense_0", jnp.eye(4)[:2])], path)
  _forge(path, lambda manifest: manifest.update(format_version=2))
  with pytest.raises(fl.ArtifactError, match="kind 'low_rank', which format 2 does not have"):
    fl.load_interventions(path)
