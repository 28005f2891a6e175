"""Case 3: `fl.unflaxify` against Penzai's `unflaxify_apply`, and against batch size.

Both converters run the model's Python once under `jax.eval_shape`, so each is also
compared with that floor, an abstract trace of `module.apply` alone, timed in the same
run. The Linen model is converted at each of `sizes.conversion_layers` depths and at two
batch sizes; conversion must not grow with the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np

import flaxlens as fl
from bench.harness import Progress, interleaved, median, profile, ratios, seconds, timed
from bench.models import Sizes, linen_model, tokens
from bench.report import Row
from bench.subjects import Subject, pz_unflaxify

NAME = "3. conversion"


def _converters(model: nn.Module, variables: Any) -> dict[str, Callable[[jax.Array], Any]]:
  """The conversions of case 3, and their floor: an abstract trace of `module.apply`."""
  converters = {
    "flaxlens": lambda x: fl.unflaxify(model, variables, x),
    "floor": lambda x: jax.eval_shape(lambda v, x: model.apply(v, x), variables, x),
  }
  if pz_unflaxify is not None:
    converters["penzai"] = lambda x: pz_unflaxify.unflaxify_apply(model, variables, x)
  return converters


def _param_check_share(floor: Callable[[], Any]) -> float:
  """Share of an abstract trace spent in Flax's `Scope.param`, which re-runs every
  initializer under `jax.eval_shape` to check the given parameter's shape."""
  stats = profile(floor)
  total = sum(tottime for _, _, tottime, _, _ in stats.stats.values())
  param = sum(
    cumtime
    for (filename, _, function), (_, _, _, cumtime, _) in stats.stats.items()
    if filename.endswith("flax/core/scope.py") and function == "param"
  )
  return param / total


def measure(subjects: list[Subject], sizes: Sizes, progress: Progress) -> list[Row]:
  progress(NAME)
  rows = []
  small, large = sizes.conversion_batches
  for layers in sizes.conversion_layers:
    model, variables = linen_model(sizes, layers)
    inputs = {batch: tokens(sizes, batch) for batch in (small, large)}
    converters = _converters(model, variables)
    contenders = {
      f"{name}@{batch}": functools.partial(timed, functools.partial(convert, x))
      for batch, x in inputs.items()
      for name, convert in converters.items()
    }
    samples = interleaved(contenders, sizes.conversion_reps)
    param_check = _param_check_share(functools.partial(converters["floor"], inputs[small]))
    for batch in (small, large):
      what = f"fl.unflaxify / Penzai unflaxify_apply, {layers}-layer model, batch {batch}"
      ours, floor = samples[f"flaxlens@{batch}"], samples[f"floor@{batch}"]
      over_floor = float(np.median(ratios(ours, floor)))
      note = (
        f"floor (jax.eval_shape of module.apply alone) {seconds(median(floor))};"
        f" flaxlens / floor {over_floor:.3f}"
      )
      if pz_unflaxify is None:
        rows.append(Row(NAME, what, "conversion_vs_penzai", status="not installed", note=note))
        continue
      theirs = samples[f"penzai@{batch}"]
      theirs_over_floor = float(np.median(ratios(theirs, floor)))
      analysis = (
        "both converters run the model's Python once under jax.eval_shape, so neither"
        " can beat the floor, an abstract trace of module.apply alone. flaxlens takes"
        f" {over_floor:.2f}x the floor and Penzai {theirs_over_floor:.2f}x: a converter with"
        f" no work of its own would take {1 / theirs_over_floor:.2f}x Penzai's time. Inside"
        " the floor, Flax's Scope.param (which re-runs every initializer under"
        " jax.eval_shape to check the given parameter's shape, at every apply) takes"
        f" {100 * param_check:.0f}% (at batch {small}); the rest is tracing the model's jnp"
        " operations and Flax's module machinery"
      )

      rows.append(
        Row(
          NAME,
          what,
          "conversion_vs_penzai",
          ratios(ours, theirs),
          f"{seconds(median(ours))} vs {seconds(median(theirs))}",
          note=f"{note}; Penzai / floor {theirs_over_floor:.3f}",
          analysis=analysis,
          profile=functools.partial(converters["flaxlens"], inputs[batch]),
        )
      )
    ours_small, ours_large = samples[f"flaxlens@{small}"], samples[f"flaxlens@{large}"]
    floor_flat = np.median(ratios(samples[f"floor@{large}"], samples[f"floor@{small}"]))
    rows.append(
      Row(
        NAME,
        f"fl.unflaxify at batch {large} / at batch {small}, {layers}-layer model",
        "conversion_flat_in_batch",
        ratios(ours_large, ours_small),
        f"{seconds(median(ours_large))} vs {seconds(median(ours_small))}",
        note=f"{large // small}x the batch; the floor's ratio {floor_flat:.3f}",
        analysis=(
          "conversion traces abstractly (jax.eval_shape), so no step grows with the batch;"
          f" the floor, an abstract trace of module.apply alone, measured {floor_flat:.3f}"
          " for the same two batch sizes in the same run, which is the machine's noise"
        ),
      )
    )
  return rows
