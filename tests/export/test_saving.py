"""Exported models saved with Orbax and to safetensors, restored in a fresh process.

The saving process converts a corpus model, edits its parameters, exports, saves, and
records the tree's output; a fresh process builds the model from its class alone,
restores the saved arrays into it and must compute that output bit for bit.
"""

from __future__ import annotations

import gc
import os
import pathlib
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from flax import nnx
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


# --- damaged and foreign inputs -----------------------------------------------------------

DENSE, DENSE_X = nn.Dense(3), jnp.ones((1, 4))
DENSE_VARIABLES = DENSE.init(jax.random.key(0), DENSE_X)


def _restores_exactly_or_is_refused(path):
  """Loading `path` into the Dense model gives its saved variables bit for bit, or an
  ExportError naming `path` and ending with what to do; nothing else may escape."""
  try:
    restored = fl.load_exported(path, like=DENSE_VARIABLES)
  except fl.ExportError as e:
    assert str(path) in str(e) and "save" in str(e).split(". ")[-1], str(e)
    return "refused"
  assert_trees_equal(restored, DENSE_VARIABLES)
  return "restored"


def _damaged_copies(saved, tmp_path):
  """`(what was done, path)`: copies of the checkpoint with one file removed, truncated
  at several offsets, or with bytes flipped (for safetensors, a file: the file itself)."""
  files = [saved] if saved.is_file() else sorted(p for p in saved.rglob("*") if p.is_file())
  rng = np.random.default_rng(0)
  for number, file in enumerate(files):
    size = file.stat().st_size
    changes = [("removed", None)] if saved.is_dir() else []
    changes += [(f"truncated at {cut}", cut) for cut in sorted({0, 1, size // 2, size - 1})]
    changes += [(f"flipped #{k}", -1 - k) for k in range(3)]
    for what, change in changes:
      copy = tmp_path / f"copy_{number}_{what.replace(' ', '_').replace('#', '')}{saved.suffix}"
      if saved.is_dir():
        shutil.copytree(saved, copy)
        target = copy / file.relative_to(saved)
      else:
        shutil.copy(saved, copy)
        target = copy
      if change is None:
        target.unlink()
      elif change >= 0:
        with open(target, "r+b") as f:
          f.truncate(change)
      elif size:
        data = bytearray(target.read_bytes())
        for i in rng.integers(0, size, 2):
          data[i] ^= 1 << int(rng.integers(0, 8))
        target.write_bytes(bytes(data))
      yield f"{file.relative_to(saved) if saved.is_dir() else file.name} {what}", copy


# A failed Orbax restore leaves coroutines of its own unawaited (orbax-checkpoint 0.12).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_orbax_checkpoint_is_refused_unless_orbax_does_not_need_the_file(tmp_path):
  saved = tmp_path / "checkpoint"
  fl.save_exported(DENSE_VARIABLES, saved)
  outcomes = {
    what: _restores_exactly_or_is_refused(p) for what, p in _damaged_copies(saved, tmp_path)
  }
  gc.collect()  # Orbax's unawaited coroutines are reported here, under the filter above.
  for needed in ("_METADATA", "manifest.ocdbt"):
    assert outcomes[f"{needed} removed"] == "refused"
    assert outcomes[f"{needed} truncated at 0"] == "refused"


def test_a_damaged_safetensors_file_is_refused(tmp_path):
  saved = tmp_path / "model.safetensors"
  fl.save_exported(DENSE_VARIABLES, saved, format="safetensors")
  for what, path in _damaged_copies(saved, tmp_path):
    assert _restores_exactly_or_is_refused(path) == "refused", what


def test_a_flipped_byte_in_a_safetensors_array_is_refused_by_its_checksum(tmp_path):
  saved = tmp_path / "model.safetensors"
  fl.save_exported(DENSE_VARIABLES, saved, format="safetensors")
  data = bytearray(saved.read_bytes())
  data[-1] ^= 1  # The last byte belongs to the last array's data.
  saved.write_bytes(bytes(data))
  with pytest.raises(fl.ExportError, match="do not match the checksum"):
    fl.load_exported(saved, like=DENSE_VARIABLES)


def test_an_empty_directory_is_refused_naming_what_a_checkpoint_holds(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(fl.ExportError, match=r"empty.*holds \['_METADATA', 'manifest.ocdbt'\]"):
    fl.load_exported(tmp_path / "empty", like=DENSE_VARIABLES)


def test_a_checkpoint_of_a_nested_pytree_is_refused_as_not_saved_by_save_exported(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "other", DENSE_VARIABLES)
  checkpointer.wait_until_finished()
  with pytest.raises(fl.ExportError, match="'params' is not an array saved by fl.save_exported"):
    fl.load_exported(tmp_path / "other", like=DENSE_VARIABLES)


@pytest.mark.parametrize("format", FORMATS)
def test_restoring_arrays_of_other_shapes_names_the_variable(tmp_path, format):
  saved = _saved_path(tmp_path, format)
  fl.save_exported(DENSE_VARIABLES, saved, format=format)
  like = DENSE.init(jax.random.key(0), jnp.ones((1, 5)))
  with pytest.raises(fl.ExportError, match=r"'params/kernel' was saved as float32\[4, 3\]"):
    fl.load_exported(saved, like=like)


def test_a_missing_path_is_refused(tmp_path):
  with pytest.raises(fl.ExportError, match="no such file or directory"):
    fl.load_exported(tmp_path / "nothing", like=DENSE_VARIABLES)


# --- what each format can save ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int4"])
def test_safetensors_refuses_dtypes_it_cannot_read_back_and_orbax_restores_them(tmp_path, dtype):
  variables = jax.tree_util.tree_map(lambda a: a.astype(dtype), DENSE_VARIABLES)
  with pytest.raises(fl.ExportError, match=rf"'params/bias' is {dtype}\[3\].*format='orbax'"):
    fl.save_exported(variables, tmp_path / "model.safetensors", format="safetensors")
  assert not (tmp_path / "model.safetensors").exists()
  fl.save_exported(variables, tmp_path / "checkpoint", format="orbax")
  restored = fl.load_exported(tmp_path / "checkpoint", like=variables)
  assert_trees_equal(restored, variables)
  if dtype != "int4":  # nn.Dense computes in float32 from float8 parameters.
    model = nn.Dense(3, dtype=jnp.float32)
    np.testing.assert_array_equal(model.apply(restored, DENSE_X), model.apply(variables, DENSE_X))


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_model_without_arrays_is_refused_by_orbax_and_restored_from_safetensors(tmp_path, fw):
  x = jnp.ones((2, 3))
  if fw is LINEN:
    model = nn.Sequential([nn.relu])
    like = model.init(jax.random.key(0), x)
    exported = fl.unflaxify(model, like, x).export()
  else:
    model = like = nnx.Sequential(nnx.relu)
    exported = fl.unflaxify(model, x).export()
  with pytest.raises(fl.ExportError, match="holds no arrays.*format='safetensors'"):
    fl.save_exported(exported, tmp_path / "free", format="orbax")
  assert list(tmp_path.iterdir()) == []
  fl.save_exported(exported, tmp_path / "free.safetensors", format="safetensors")
  restored = fl.load_exported(tmp_path / "free.safetensors", like=like)
  if fw is LINEN:
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(like)
    np.testing.assert_array_equal(model.apply(restored, x), model.apply(like, x))
  else:
    np.testing.assert_array_equal(restored(x), model(x))


def test_a_zero_size_array_is_refused_by_orbax_and_restored_from_safetensors(tmp_path):
  variables = {"params": {**DENSE_VARIABLES["params"], "unused": jnp.zeros((0, 4))}}
  with pytest.raises(fl.ExportError, match=r"'params/unused' is float32\[0, 4\].*safetensors"):
    fl.save_exported(variables, tmp_path / "checkpoint", format="orbax")
  assert list(tmp_path.iterdir()) == []
  fl.save_exported(variables, tmp_path / "model.safetensors", format="safetensors")
  assert_trees_equal(fl.load_exported(tmp_path / "model.safetensors", like=variables), variables)


@pytest.mark.parametrize("format", FORMATS)
def test_saving_makes_missing_parent_folders(tmp_path, format):
  saved = tmp_path / "no" / "such" / _saved_path(tmp_path, format).name
  fl.save_exported(DENSE_VARIABLES, saved, format=format)
  restored = fl.load_exported(saved, like=DENSE_VARIABLES)
  np.testing.assert_array_equal(
    DENSE.apply(restored, DENSE_X), DENSE.apply(DENSE_VARIABLES, DENSE_X)
  )


@pytest.mark.parametrize("format", FORMATS)
def test_saving_under_a_file_is_an_export_error_leaving_nothing_behind(tmp_path, format):
  (tmp_path / "file").write_text("")
  with pytest.raises(fl.ExportError, match="cannot write there.*folder you can write to"):
    fl.save_exported(DENSE_VARIABLES, tmp_path / "file" / "x", format=format)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("kind", ["symbolic link to a character device", "named pipe (FIFO)"])
def test_a_special_file_is_refused_as_not_a_regular_file(tmp_path, kind):
  path = tmp_path / "model.safetensors"
  if kind.startswith("symbolic"):
    path.symlink_to("/dev/zero")
  else:
    os.mkfifo(path)
  with pytest.raises(fl.ExportError, match=f"a {re.escape(kind)}, not a regular file"):
    fl.load_exported(path, like=DENSE_VARIABLES)
