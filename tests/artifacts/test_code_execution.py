"""Finding 1: loading an artifact runs no code the user did not allow."""

from __future__ import annotations

import json
import sys

import pytest

import flaxlens as fl
from flaxlens import cli

from .conftest import read_manifest, write_manifest

RCE_V1 = {
  "format": "flaxlens-isolated",
  "format_version": 1,
  "arrays": {},
  "recipe": {
    "kind": "linen",
    "method": {"ref": "flax.linen.combinators:Sequential.__call__"},
    "module": {
      "dataclass": "flax.linen.combinators:Sequential",
      "fields": {"layers": {"list": [{"ref": "os:system"}]}},
    },
    "variables": {"dict": []},
    "rngs": None,
    "mutable": [],
    "capture_intermediates": False,
  },
  "saved": {
    "args": {"tuple": ["touch PWNED"]},
    "kwargs": {"dict": []},
    "side_inputs": {"dict": []},
    "output": 0,
    "initial": [],
    "final": [],
  },
}


def _sequential_calling(manifest: dict, ref: str, requires: list[str]) -> dict:
  """The issue's attack in format 2: a Sequential whose one layer is `ref`, called on a
  shell command, with a valid manifest checksum (which anyone can compute)."""
  manifest["requires"] = requires
  manifest["recipe"]["method"] = {"ref": "flax.linen.combinators:Sequential.__call__"}
  manifest["recipe"]["module"] = {
    "object": "dataclass",
    "class": "flax.linen.combinators:Sequential",
    "data": {"dict": [["layers", {"list": [{"ref": ref}]}]]},
  }
  manifest["saved"]["args"] = {"tuple": ["touch PWNED"]}
  return manifest


def test_the_issue_manifest_runs_nothing(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "manifest.json").write_text(json.dumps(RCE_V1))
  with pytest.raises(fl.ArtifactError, match="format 1"):
    fl.load_isolated(tmp_path / "a")
  assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("ref", ["os:system", "subprocess:getoutput", "builtins:eval"])
def test_a_forged_function_reference_is_refused_before_anything_runs(
  artifact, tmp_path, monkeypatch, capsys, ref
):
  monkeypatch.chdir(tmp_path)
  package = ref.partition(":")[0]
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), ref, [package]))
  with pytest.raises(fl.ArtifactError, match=ref):
    fl.load_isolated(artifact)
  assert cli.main(["replay", str(artifact)]) == 2
  assert ref in capsys.readouterr().err
  assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("ref", ["numpy:save", "jax.numpy:load", "flax.linen:jit"])
def test_a_function_of_an_allowed_package_outside_the_vetted_set_is_refused(artifact, ref):
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), ref, []))
  with pytest.raises(fl.ArtifactError, match=f"names '{ref}'.*function or class held as a"):
    fl.load_isolated(artifact)


def test_the_refusal_names_the_allow_flag(artifact):
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), "os:system", ["os"]))
  with pytest.raises(fl.ArtifactError, match=r"allow=\['os'\].*--allow os"):
    fl.load_isolated(artifact)


@pytest.fixture
def side_effect_package(tmp_path, monkeypatch):
  """A module on sys.path whose import writes a file: importing it is running code."""
  package = tmp_path / "pkgs"
  package.mkdir()
  marker = tmp_path / "IMPORTED"
  (package / "sideeffect_mod.py").write_text(
    f"open({str(marker)!r}, 'w').close()\nimport flax.linen as nn\nclass Block(nn.Dense):\n  pass\n"
  )
  monkeypatch.syspath_prepend(str(package))
  yield marker
  sys.modules.pop("sideeffect_mod", None)


def test_a_module_class_from_an_unallowed_package_is_not_imported(artifact, side_effect_package):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = "sideeffect_mod:Block"
  manifest["requires"] = ["sideeffect_mod"]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"'sideeffect_mod:Block'.*allow=\['sideeffect_mod'\]"):
    fl.load_isolated(artifact)
  assert not side_effect_package.exists()
  assert "sideeffect_mod" not in sys.modules


@pytest.mark.parametrize("ref", ["this:s", "antigravity:geohash"])
def test_a_standard_library_module_named_by_the_manifest_is_not_imported(artifact, ref):
  module = ref.partition(":")[0]
  already = module in sys.modules
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), ref, [module]))
  with pytest.raises(fl.ArtifactError, match="not allowed to be imported"):
    fl.load_isolated(artifact)
  assert (module in sys.modules) == already


def test_nothing_is_imported_before_the_whole_manifest_is_valid(artifact, side_effect_package):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = "sideeffect_mod:Block"
  manifest["requires"] = ["sideeffect_mod"]
  manifest["saved"]["final"] = [["label", {"no such tag": 1}]]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"at \$\.saved\.final\[0\]\[1\]: 'no such tag'"):
    fl.load_isolated(artifact, allow=["sideeffect_mod"])
  assert not side_effect_package.exists()


def test_the_policy_is_checked_before_the_arrays_are_read(artifact):
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), "os:system", ["os"]))
  (artifact / "arrays.safetensors").unlink()
  with pytest.raises(fl.ArtifactError, match="os:system"):
    fl.load_isolated(artifact)


def test_a_dataclass_that_is_not_a_module_is_not_constructed(artifact):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"] = {
    "object": "dataclass",
    "class": "flaxlens.core._args:ArgsAndKwargs",
    "data": {"dict": [["args", {"tuple": []}], ["kwargs", {"dict": []}]]},
  }
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match="ArgsAndKwargs.*as a dataclass to construct"):
    fl.load_isolated(artifact)


def test_a_mapping_type_outside_flax_is_not_constructed(artifact):
  manifest = read_manifest(artifact)
  manifest["saved"]["kwargs"] = {
    "object": "mapping",
    "class": "flax.core.scope:Scope",
    "data": {"dict": []},
  }
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError):
    fl.load_isolated(artifact)


def test_an_unimportable_module_class_is_reported(artifact):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = "flax.no_such_module:Dropout"
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match="Cannot import 'flax.no_such_module:Dropout'"):
    fl.load_isolated(artifact)


def test_a_user_allowed_package_loads(artifact, side_effect_package):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"] = {
    "object": "dataclass",
    "class": "sideeffect_mod:Block",
    "data": {"dict": [["features", 3]]},
  }
  manifest["requires"] = ["sideeffect_mod"]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match="cannot be rebuilt"):
    fl.load_isolated(artifact, allow=["sideeffect_mod"])
  assert side_effect_package.exists()


def test_allow_rejects_a_bare_string():
  with pytest.raises(fl.ArgumentError, match=r"allow=\['transformers'\]"):
    fl.load_isolated("anywhere", allow="transformers")
