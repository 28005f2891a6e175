"""The rows a harvest stores are what `fl.capture` returns for the same batches, selected
and cast as asked, bit for bit; and, on one batch, what Flax's own capture returns."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import flaxlens as fl

from . import models

BATCHES = models.token_batches(3, last=2)


def _captured(model, site, batches=BATCHES):
  return [np.asarray(fl.capture(model.tree, b, site)[1][site]) for b in batches]


def test_rows_of_every_position_equal_fl_capture_bit_for_bit(model, tmp_path):
  stored = fl.harvest(model.tree, BATCHES, model.sites, tmp_path / "s")
  assert stored.complete and len(stored) == 8
  for site in model.sites:
    expected = np.concatenate([c.reshape(-1, models.WIDTH) for c in _captured(model, site)])
    np.testing.assert_array_equal(stored[site][:], expected)
    example, position = stored[site].index[:].T
    np.testing.assert_array_equal(example, np.repeat(np.arange(8), models.LENGTH))
    np.testing.assert_array_equal(position, np.tile(np.arange(models.LENGTH), 8))


def test_rows_equal_flax_own_capture_of_a_batch(model, tmp_path):
  tokens = BATCHES[0]
  stored = fl.harvest(model.tree, [tokens], model.sites, tmp_path / "s")
  native = model.native(tokens)
  for site in model.sites:
    np.testing.assert_array_equal(
      stored[site][:], np.asarray(native[site]).reshape(-1, models.WIDTH)
    )


def test_a_zarr_reader_given_only_an_array_folder_reads_flax_own_rows(linen_model, tmp_path):
  # Another tool reading the store: TensorStore's zarr v3 driver, told nothing but the
  # folder of one site's arrays (the chunk layout comes from their zarr.json).
  import tensorstore as ts

  def read(name):
    folder = str(tmp_path / "s" / "s0" / name)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": folder}}
    return ts.open(spec, read=True).result().read().result()

  tokens = BATCHES[0]
  fl.harvest(linen_model.tree, [tokens, tokens], linen_model.sites, tmp_path / "s")
  native = np.asarray(linen_model.native(tokens)[linen_model.sites[0]])
  np.testing.assert_array_equal(read("values"), np.tile(native.reshape(-1, models.WIDTH), (2, 1)))
  example, position = read("index").T
  np.testing.assert_array_equal(example, np.repeat(np.arange(2 * len(tokens)), models.LENGTH))
  np.testing.assert_array_equal(position, np.tile(np.arange(models.LENGTH), 2 * len(tokens)))


def test_the_last_position_gives_one_row_per_example(model, tmp_path):
  site = model.sites[1]
  stored = fl.harvest(model.tree, BATCHES, site, tmp_path / "s", positions="last")
  expected = np.concatenate([c[:, -1] for c in _captured(model, site)])
  np.testing.assert_array_equal(stored[site][:], expected)
  np.testing.assert_array_equal(stored[site].index[:, 1], np.full(8, models.LENGTH - 1))


def test_a_mask_keeps_only_its_positions_in_stream_order(model, tmp_path):
  site = model.sites[0]
  stored = fl.harvest(model.tree, BATCHES, site, tmp_path / "s", positions=models.not_padding)
  tokens = np.concatenate(BATCHES)
  keep = tokens != models.PAD
  expected = np.concatenate(_captured(model, site))[keep]
  np.testing.assert_array_equal(stored[site][:], expected)
  np.testing.assert_array_equal(stored[site].index[:], np.stack(np.nonzero(keep), 1))


def test_bfloat16_rows_are_the_capture_cast(model, tmp_path):
  site = model.sites[0]
  stored = fl.harvest(model.tree, BATCHES, site, tmp_path / "s", dtype=jnp.bfloat16)
  expected = np.concatenate([c.reshape(-1, models.WIDTH) for c in _captured(model, site)])
  assert stored[site].dtype == jnp.bfloat16
  np.testing.assert_array_equal(stored[site][:], expected.astype(jnp.bfloat16))


def test_rules_and_dtypes_apply_per_site(linen_model, tmp_path):
  first, second = linen_model.sites
  stored = fl.harvest(
    linen_model.tree,
    BATCHES,
    [first, second],
    tmp_path / "s",
    positions={first: "last", "**": "all"},
    dtype={first: jnp.float16, "**": None},
  )
  assert stored[first].shape == (8, models.WIDTH) and stored[first].dtype == np.float16
  assert stored[second].shape == (48, models.WIDTH) and stored[second].dtype == np.float32
  np.testing.assert_array_equal(
    stored[first][:],
    np.concatenate([c[:, -1] for c in _captured(linen_model, first)]).astype(np.float16),
  )


def test_token_ids_are_stored_beside_each_row(linen_model, tmp_path):
  site = linen_model.sites[0]
  stored = fl.harvest(
    linen_model.tree,
    BATCHES,
    site,
    tmp_path / "s",
    positions=models.not_padding,
    ids=models.token_ids,
  )
  tokens = np.concatenate(BATCHES)
  np.testing.assert_array_equal(stored[site].ids[:], tokens[tokens != models.PAD])


def test_one_row_per_example_without_a_position_axis(linen_model, tmp_path):
  site = linen_model.sites[0]
  stored = fl.harvest(linen_model.tree, BATCHES, site, tmp_path / "s", positions=None)
  assert stored[site].shape == (8, models.LENGTH, models.WIDTH)
  np.testing.assert_array_equal(stored[site][:], np.concatenate(_captured(linen_model, site)))
  np.testing.assert_array_equal(stored[site].index[:, 0], np.arange(8))
