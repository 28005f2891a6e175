"""Exported models saved with Orbax and to safetensors, restored in a fresh process.

The saving process converts a corpus model, edits its parameters, exports, saves, and
records the tree's output; a fresh process builds the model from its class alone,
restores the saved arrays into it and must compute that output bit for bit.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX

import flaxlens as fl

CHECK = pathlib.Path(__file__).with_name("restore_check.py")
CASES = [
  (LINEN, "logically_partitioned_scan"),
  (LINEN, "transformer"),
  (NNX, "convnet_train"),
  (NNX, "variable_metadata"),
]
FORMATS = ["orbax", "safetensors"]


def _edited_export(fw, case):
  tree = fw.convert(case)
  for p in fl.variables_in(tree):
    if isinstance(p, fl.Parameter):
      p.value = jax.tree_util.tree_map(lambda a: a * 1.5 + 0.25, p.value)
  return tree, fw.export(tree)


def _saved_path(tmp_path, format):
  return tmp_path / ("model.safetensors" if format == "safetensors" else "checkpoint")


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("fw, name", CASES)
def test_a_fresh_process_restores_the_saved_model_and_computes_as_the_tree(
  corpora, tmp_path, fw, name, format
):
  case = corpora[fw][name]
  tree, exported = _edited_export(fw, case)
  saved = _saved_path(tmp_path, format)
  fl.save_exported(exported, saved, format=format)
  np.savez(tmp_path / "expected.npz", output=np.asarray(fw.call(tree, case)))
  result = subprocess.run(
    [sys.executable, str(CHECK), fw.name, name, str(saved), str(tmp_path / "expected.npz")],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "match: True" in result.stdout, result.stdout
  if fw is NNX:
    assert "metadata: True" in result.stdout, result.stdout


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("fw, name", CASES)
def test_restoring_into_the_concrete_model_gives_the_exported_model(
  corpora, tmp_path, fw, name, format
):
  case = corpora[fw][name]
  _, exported = _edited_export(fw, case)
  saved = _saved_path(tmp_path, format)
  fl.save_exported(exported, saved, format=format)
  restored = fl.load_exported(saved, like=fw.unedited_export(case))
  assert_trees_equal(fw.export_form(restored), fw.export_form(exported))


@pytest.mark.parametrize("format", FORMATS)
def test_restoring_into_another_architecture_names_the_mismatch(corpora, tmp_path, format):
  saved = _saved_path(tmp_path, format)
  fl.save_exported(LINEN.export(LINEN.convert(corpora[LINEN]["mlp"])), saved, format=format)
  with pytest.raises(fl.ExportError, match=r"not in `like` \['params/Dense_1/bias'"):
    fl.load_exported(saved, like=corpora[LINEN]["transformer"].variables)


def test_saving_never_overwrites(tmp_path):
  (tmp_path / "taken").mkdir()
  with pytest.raises(fl.ExportError, match="already exists"):
    fl.save_exported({"params": {}}, tmp_path / "taken")


def test_saving_a_tree_instead_of_its_export_says_to_export(corpora, tmp_path):
  with pytest.raises(fl.ArgumentError, match=r"exported must be .*tree\.export\(\)"):
    fl.save_exported(LINEN.convert(corpora[LINEN]["mlp"]), tmp_path / "x")
