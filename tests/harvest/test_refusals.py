"""Bad input is refused with a `FlaxlensError` before anything is written or overwritten."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

import flaxlens as fl

from . import models

BATCHES = models.token_batches(2)


def test_an_unknown_site_is_refused_before_the_store_is_made(model, tmp_path):
  with pytest.raises(fl.SelectionError, match="Block_9|block9"):
    fl.harvest(
      model.tree, BATCHES, "Block_9" if "Block_0" in model.sites else "block9", tmp_path / "s"
    )
  assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
  ("change", "differs"),
  [
    ({"at": "Block_1"}, "sites"),
    ({"positions": "last"}, "sites"),
    ({"batches": models.token_batches(2, seed=1)}, "first_batch"),
  ],
  ids=["sites", "positions", "data"],
)
def test_a_store_of_another_call_is_refused_and_left_as_it_was(
  linen_model, tmp_path, change, differs
):
  path = tmp_path / "s"
  fl.harvest(linen_model.tree, BATCHES, "Block_0", path)
  before = models.store_files(path)
  call = {"batches": BATCHES, "at": "Block_0", **change}
  with pytest.raises(fl.HarvestError, match=f"nothing was overwritten. What differs: {differs}"):
    fl.harvest(linen_model.tree, call.pop("batches"), call.pop("at"), path, **call)
  assert models.store_files(path) == before


def _padding_mask(pad):
  return lambda tokens: tokens != pad  # the same code, closing over another value per pad


def test_a_mask_closing_over_another_value_is_another_call(linen_model, tmp_path):
  path = tmp_path / "s"
  fl.harvest(linen_model.tree, BATCHES, "Block_0", path, positions=_padding_mask(models.PAD))
  before = models.store_files(path)
  with pytest.raises(fl.HarvestError, match="What differs: sites"):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", path, positions=_padding_mask(1))
  assert models.store_files(path) == before
  again = fl.harvest(linen_model.tree, BATCHES, "Block_0", path, positions=_padding_mask(0))
  assert again.complete  # the same values: the same call, resumed (complete already)


def test_overwrite_starts_a_store_of_another_call_afresh(linen_model, tmp_path):
  path = tmp_path / "s"
  fl.harvest(linen_model.tree, BATCHES, "Block_0", path)
  again = fl.harvest(linen_model.tree, BATCHES, "Block_0", path, positions="last", overwrite=True)
  assert again.complete and again["Block_0"].shape == (6, models.WIDTH)


def test_a_path_that_cannot_be_written_is_refused(linen_model, tmp_path):
  (tmp_path / "file").write_text("not a directory")
  with pytest.raises(fl.HarvestError, match="cannot write the store"):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "file" / "s")
  with pytest.raises(fl.HarvestError, match="is not a directory"):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "file")


def test_a_directory_holding_other_files_is_never_overwritten(linen_model, tmp_path):
  (tmp_path / "mine.txt").write_text("keep me")
  with pytest.raises(fl.HarvestError, match="not a harvest store"):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path, overwrite=True)
  assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_batches_of_other_feature_shapes_mid_stream_are_refused(linen_model, tmp_path):
  other = np.zeros((3, models.LENGTH - 2), np.int32)
  with pytest.raises(fl.HarvestError, match=r"batch 2 gives rows of float32\[4, 8\]"):
    fl.harvest(linen_model.tree, [*BATCHES, other], "Block_0", tmp_path / "s", positions=None)
  stored = fl.open_harvest(tmp_path / "s")
  assert not stored.complete and stored.batches_committed == 2


def test_no_batch_is_refused(linen_model, tmp_path):
  with pytest.raises(fl.HarvestError, match="no batch"):
    fl.harvest(linen_model.tree, [], "Block_0", tmp_path / "s")
  assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
  ("options", "message"),
  [
    ({"positions": "first"}, "positions= is 'all', 'last', None"),
    ({"positions": {"Block_1": "all"}}, "positions= gives no value for the site 'Block_0'"),
    ({"dtype": "float7"}, "dtype='float7' is no dtype"),
    ({"ids": [1, 2]}, "ids= must be a function"),
    ({"positions": lambda tokens: tokens}, "positions= gave a int32"),
    ({"ids": lambda tokens: tokens[:, :2]}, "ids= gave an array of shape"),
  ],
  ids=["rule", "rule-per-site", "dtype", "ids", "mask", "ids-shape"],
)
def test_options_of_the_wrong_kind_are_refused(linen_model, tmp_path, options, message):
  with pytest.raises(fl.ArgumentError, match=message):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "s", **options)
  assert not (tmp_path / "s").exists()


def test_a_site_whose_output_is_no_batch_of_rows_is_refused(linen_model, tmp_path):
  with pytest.raises(fl.ArgumentError, match="has shape"):
    fl.harvest(linen_model.tree, [np.zeros((), np.int32)], "Block_0", tmp_path / "s")


def test_a_missing_tensorstore_names_the_extra_to_install(linen_model, tmp_path, monkeypatch):
  real_import = builtins.__import__

  def without_tensorstore(name, *args, **kwargs):
    if name == "tensorstore":
      raise ImportError("No module named 'tensorstore'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", without_tensorstore)
  with pytest.raises(fl.HarvestError, match=r'pip install "flaxlens\[harvest\]"'):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "s")


def test_a_sharding_that_is_no_sharding_is_refused_before_the_store_is_made(model, tmp_path):
  with pytest.raises(fl.ArgumentError, match="sharding= holds str, not a jax.sharding.Sharding"):
    fl.harvest(model.tree, BATCHES, model.sites, tmp_path / "s", sharding="data")
  assert not (tmp_path / "s").exists()


def test_float_ids_are_refused_naming_the_site(linen_model, tmp_path):
  ids = lambda tokens: tokens.astype(np.float32)  # noqa: E731
  with pytest.raises(fl.ArgumentError, match=r"^Block_0: ids= gave an array of float32"):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "s", ids=ids)
  assert not (tmp_path / "s").exists()
