"""`fl.harvest(budget=)`: batches whose rows exceed the budget run in chunks of examples,
and the store holds the same rows as an unbudgeted harvest and Flax's own capture; what
cannot be split, or a budget that holds no example, is refused before anything is written."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl

from . import models

BATCHES = models.token_batches(3, size=5, last=2)
# Rows of one example at every position of both sites (float32), held by three steps at once.
PER_EXAMPLE = 2 * models.LENGTH * models.WIDTH * 4 * 3
FIXED = 3 * 3 * 4  # each step's `sizes` (examples and each site's positions), int32
TWO_EXAMPLES = FIXED + 2 * PER_EXAMPLE


def test_a_budgeted_harvest_stores_the_rows_of_flax_own_capture(model, tmp_path):
  stored = fl.harvest(model.tree, BATCHES, model.sites, tmp_path / "s", budget=TWO_EXAMPLES)
  tokens = np.concatenate(BATCHES)
  assert stored.complete and len(stored) == len(tokens)
  for site in model.sites:
    expected = np.concatenate([np.asarray(model.native(t[None])[site]) for t in tokens])
    np.testing.assert_array_equal(stored[site][:], expected.reshape(-1, models.WIDTH))
    example, position = stored[site].index[:].T
    np.testing.assert_array_equal(example, np.repeat(np.arange(len(tokens)), models.LENGTH))
    np.testing.assert_array_equal(position, np.tile(np.arange(models.LENGTH), len(tokens)))


def test_a_budgeted_harvest_with_a_mask_and_ids_matches_the_unbudgeted_one(model, tmp_path):
  options = {"positions": models.not_padding, "ids": models.token_ids}
  whole = fl.harvest(model.tree, BATCHES, model.sites, tmp_path / "a", **options)
  split = fl.harvest(
    model.tree, BATCHES, model.sites, tmp_path / "b", budget=TWO_EXAMPLES, **options
  )
  for site in model.sites:
    np.testing.assert_allclose(split[site][:], whole[site][:], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(split[site].index[:], whole[site].index[:])
    np.testing.assert_array_equal(split[site].ids[:], whole[site].ids[:])


def test_a_budget_that_holds_no_example_is_refused_before_writing(model, tmp_path):
  with pytest.raises(fl.BudgetError, match="budget of at least"):
    fl.harvest(model.tree, BATCHES, model.sites, tmp_path / "s", budget=PER_EXAMPLE // 2)
  assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, "1GB"])
def test_a_budget_that_is_no_positive_int_is_refused(linen_model, tmp_path, budget):
  with pytest.raises(fl.BudgetError, match="positive number of bytes"):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "s", budget=budget)


def test_a_model_that_couples_its_examples_is_refused_with_a_budget(tmp_path):
  class Centred(nn.Module):  # subtracts the batch mean: each example depends on the others
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(models.VOCAB, models.WIDTH)(tokens)
      x = nn.Dense(models.WIDTH)(x)
      return x - x.mean(axis=0)

  module = Centred()
  tree = fl.unflaxify(module, module.init(jax.random.key(0), BATCHES[0]), BATCHES[0])
  with pytest.raises(fl.BudgetError, match="couples the examples"):
    fl.harvest(tree, BATCHES, "Centred.__call__", tmp_path / "s", budget=TWO_EXAMPLES)
  assert not (tmp_path / "s").exists()


def test_random_streams_with_a_budget_that_splits_are_refused(tmp_path):
  class Noisy(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(models.VOCAB, models.WIDTH)(tokens)
      return nn.Dropout(0.5, deterministic=False)(nn.Dense(models.WIDTH)(x))

  module, streams = Noisy(), {"dropout": jax.random.key(1)}
  variables = module.init({"params": jax.random.key(0), **streams}, BATCHES[0])
  tree = fl.unflaxify(module, variables, BATCHES[0], rngs=streams)
  with pytest.raises(fl.BudgetError, match="random_streams"):
    fl.harvest(
      tree,
      BATCHES,
      "Dense_0",
      tmp_path / "s",
      budget=TWO_EXAMPLES,
      random_streams=streams,
    )
  assert not (tmp_path / "s").exists()


def test_a_budgeted_harvest_stopped_between_batches_resumes_without_gaps(linen_model, tmp_path):
  path, site = tmp_path / "s", "Block_1"

  def stopping():
    yield from BATCHES[:2]
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    fl.harvest(linen_model.tree, stopping(), site, path, budget=TWO_EXAMPLES)
  assert fl.open_harvest(path).complete is False
  stored = fl.harvest(linen_model.tree, BATCHES, site, path, budget=TWO_EXAMPLES)
  whole = fl.harvest(linen_model.tree, BATCHES, site, tmp_path / "whole")
  np.testing.assert_allclose(stored[site][:], whole[site][:], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(stored[site].index[:], whole[site].index[:])


def test_a_batch_that_fits_the_budget_runs_whole(linen_model, tmp_path):
  stored = fl.harvest(
    linen_model.tree, BATCHES, "Block_0", tmp_path / "s", budget=2**30, dtype=jnp.bfloat16
  )
  assert len(stored) == sum(len(b) for b in BATCHES)
