"""Reading a harvest back: rows by position, a shuffled batched iterator that yields each
row once per pass, a Grain data source, and a progress bar that stays silent off a TTY."""

from __future__ import annotations

import numpy as np
import pytest

import flaxlens as fl

from . import models

BATCHES = models.token_batches(4)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
  model = models.build("linen")
  path = tmp_path_factory.mktemp("read") / "s"
  return fl.harvest(model.tree, BATCHES, model.sites, path, ids=models.token_ids)


def test_rows_read_by_int_slice_and_positions_as_numpy_does(stored):
  values = stored["Block_0"][:]
  assert len(stored["Block_0"]) == len(values) == 4 * 3 * models.LENGTH
  np.testing.assert_array_equal(stored["Block_0"][-1], values[-1])
  np.testing.assert_array_equal(stored["Block_0"][5:9], values[5:9])
  np.testing.assert_array_equal(stored["Block_0"][[7, 2, 7]], values[[7, 2, 7]])
  np.testing.assert_array_equal(stored["Block_0"][3:6, 2], values[3:6, 2])
  np.testing.assert_array_equal(stored.rows("Block_0", 10, 12), values[10:12])
  with pytest.raises(IndexError, match="outside the 72 rows"):
    stored["Block_0"][72]


def test_an_unknown_site_of_a_harvest_is_refused(stored):
  with pytest.raises(fl.ArgumentError, match="its sites are \\['Block_0', 'Block_1'\\]"):
    stored["Block_7"]


def _pass(stored, **options):
  return list(stored.batches(10, **options))


def test_a_shuffled_pass_yields_every_row_once_in_paired_batches(stored):
  batches = _pass(stored, seed=3)
  assert [len(b["Block_0"]) for b in batches] == [10] * 7 + [2]
  first = np.concatenate([b["Block_0"] for b in batches])
  second = np.concatenate([b["Block_1"] for b in batches])
  order = np.lexsort(first.T)
  np.testing.assert_array_equal(
    first[order], stored["Block_0"][:][np.lexsort(stored["Block_0"][:].T)]
  )
  # Rows of the two sites stay paired: the same permutation of both.
  position = {row.tobytes(): i for i, row in enumerate(stored["Block_0"][:])}
  picked = [position[row.tobytes()] for row in first]
  np.testing.assert_array_equal(second, stored["Block_1"][picked])
  assert picked != sorted(picked)


def test_the_order_follows_the_seed(stored):
  one, same, other = (_pass(stored, seed=s)[0]["Block_0"] for s in (0, 0, 1))
  np.testing.assert_array_equal(one, same)
  assert not np.array_equal(one, other)


def test_an_unshuffled_pass_reads_the_rows_in_order(stored):
  batches = _pass(stored, shuffle=False, sites="Block_1")
  np.testing.assert_array_equal(
    np.concatenate([b["Block_1"] for b in batches]), stored["Block_1"][:]
  )


def test_the_data_source_serves_grain(stored):
  grain = pytest.importorskip("grain")
  dataset = grain.MapDataset.source(stored.source(sites=["Block_0"])).shuffle(seed=0).batch(8)
  rows = np.concatenate([batch["Block_0"] for batch in dataset])
  expected = stored["Block_0"][:]
  np.testing.assert_array_equal(rows[np.lexsort(rows.T)], expected[np.lexsort(expected.T)])


def test_the_progress_bar_is_silent_off_a_terminal(linen_model, tmp_path, capfd):
  fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "quiet")
  assert capfd.readouterr().err == ""
  fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "shown", progress=True)
  shown = capfd.readouterr().err
  assert "4/4 batches" in shown and "12 examples" in shown and "tok/s" in shown
