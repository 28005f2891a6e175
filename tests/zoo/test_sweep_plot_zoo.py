"""A patching sweep of Hugging Face's Flax GPT-2 plots in readable colours.

Its metric (a logit) sits far from 0 and moves little, so a colour map centred on 0 drew
every cell in one flat blue; centred on the corrupted run's metric, or showing the
normalised effect, the cells that matter stand out.
"""

from __future__ import annotations

import numpy as np
import pytest

import flaxlens as fl

pytestmark = pytest.mark.slow


def _sweep(gpt2, examples=slice(None)):
  """A sweep of the blocks, the corrupted ids changing token 2 of `examples` only."""
  pytest.importorskip("matplotlib")
  tree = gpt2.convert()
  ids, mask, positions = gpt2.args
  corrupted = ids.at[examples, 2].set((ids[examples, 2] + 1) % 100)
  answer = int(gpt2.apply(deterministic=True).logits[0, -1].argmax())

  def arguments(ids):
    return fl.ArgsAndKwargs.capture(ids, mask, positions, deterministic=True)

  result = fl.sweep(
    tree,
    arguments(ids),
    arguments(corrupted),
    "transformer/h/*",
    lambda out: out.logits[:, -1, answer],
    positions=range(ids.shape[1]),
    part=0,
    per_example=True,
  )
  native = [
    gpt2.module.apply(gpt2.variables, i, mask, positions, deterministic=True).logits[:, -1, answer]
    for i in (ids, corrupted)
  ]
  return result, native


def test_a_gpt2_sweep_keeps_the_native_clean_and_corrupted_logits(gpt2):
  result, (clean, corrupted) = _sweep(gpt2)
  np.testing.assert_allclose(result.clean_per_example, clean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.corrupted_per_example, corrupted, rtol=1e-5, atol=1e-6)


def test_a_gpt2_sweep_plots_more_than_one_flat_colour(gpt2):
  result, _ = _sweep(gpt2)
  values = np.asarray(result.values, np.float64)
  bound = np.abs(values).max()
  flat = (values + bound) / (2 * bound)  # where a map centred on 0 puts each cell, 0 to 1
  (image,) = result.plot().axes[0].images
  shown = image.norm(image.get_array())
  assert image.norm.vcenter == 0
  assert np.ptp(shown) > 4 * np.ptp(flat)
  assert np.ptp(shown) > 0.4


def test_a_gpt2_bootstrap_of_the_normalised_effect_refuses_resamples_missing_the_changed_example(
  gpt2,
):
  """Only example 1 is corrupted: the point estimate exists, but a quarter of the
  resamples hold example 0 twice, whose clean and corrupted logits are equal."""
  result, (clean, corrupted) = _sweep(gpt2, examples=1)
  np.testing.assert_array_equal(clean[0], corrupted[0])
  assert np.isfinite(result.normalised()).all()
  said = r"equal within rounding.*they differ on 1 of 2 examples \(\[1\]\)"
  with pytest.raises(fl.StatisticsError, match=said):
    result.bootstrap(normalised=True, confidence=0.5)
