"""Case 3: `fl.unflaxify` against its floor and Penzai's `unflaxify_apply`, at every depth.

Both converters run the model's Python once under `jax.eval_shape`, so each is compared
with that floor, an abstract trace of the native call alone, timed in the same run: for
Linen `module.apply`, for NNX the merged model's call (and, for context, `nnx.eval_shape`
of the model's call, which splits the model within its timing as conversion must). Linen
is also compared with Penzai at every depth of `sizes.scales`, and converted at two batch
sizes at the main depth: conversion must not grow with the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import flaxlens as fl
from bench.harness import Progress, interleaved, median, profile, ratios, seconds, timed
from bench.models import Sizes, linen_model, tokens
from bench.report import Row
from bench.subjects import Subject, Subjects

NAME = "3. conversion"


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


def _against_floor(subject: Subject, sizes: Sizes) -> list[Row]:
  contenders = {"flaxlens": subject.convert, "floor": subject.floor}
  if subject.penzai_convert is not None:
    contenders["penzai"] = subject.penzai_convert
  if subject.model_floor is not None:
    contenders["model_floor"] = subject.model_floor
  samples = interleaved(
    {name: functools.partial(timed, convert) for name, convert in contenders.items()},
    sizes.conversion_reps,
  )
  ours, floor = samples["flaxlens"], samples["floor"]
  floor_name = "module.apply" if subject.framework == "Linen" else "the merged model's call"
  rows = []
  share = ""
  if subject.framework == "Linen":
    share = (
      f" Inside the floor, Flax's Scope.param (which re-runs every initializer under"
      f" jax.eval_shape to check each given parameter's shape, at every apply) takes"
      f" {100 * _param_check_share(subject.floor):.0f}%; flaxlens does each distinct check"
      " once per conversion."
    )
  if "penzai" in samples:
    theirs = samples["penzai"]
    theirs_over_floor = float(np.median(ratios(theirs, floor)))
    rows.append(
      Row(
        NAME,
        f"{subject.name}: fl.unflaxify / Penzai unflaxify_apply",
        "conversion_vs_penzai_revised",
        ratios(ours, theirs),
        f"{seconds(median(ours))} vs {seconds(median(theirs))}",
        note=f"Penzai / floor {theirs_over_floor:.3f}",
        analysis=(
          "both converters run the model's Python once under jax.eval_shape; Penzai takes"
          f" {theirs_over_floor:.2f}x that floor.{share}"
        ),
        profile=subject.convert,
      )
    )
  elif subject.framework == "Linen":
    rows.append(
      Row(
        NAME,
        f"{subject.name}: fl.unflaxify / Penzai unflaxify_apply",
        "conversion_vs_penzai_revised",
        status="not installed",
      )
    )
  rows.append(
    Row(
      NAME,
      f"{subject.name}: fl.unflaxify / jax.eval_shape of {floor_name} (the floor)",
      "conversion_floor",
      ratios(ours, floor),
      f"{seconds(median(ours))} vs {seconds(median(floor))}",
      analysis=(
        "the floor is one abstract trace of the native call; flaxlens traces the model once"
        " the same way, recording every call, and builds the tree (a definition and scope"
        f" data per call).{share}"
      ),
      profile=subject.convert,
    )
  )
  if "model_floor" in samples:
    model_floor = samples["model_floor"]
    rows.append(
      Row(
        NAME,
        f"{subject.name}: fl.unflaxify / nnx.eval_shape of the model's call",
        "conversion_nnx_eval_shape",
        ratios(ours, model_floor),
        f"{seconds(median(ours))} vs {seconds(median(model_floor))}",
        analysis=(
          "the floor row's model is split before its timing starts; conversion is given the"
          " model, as nnx.eval_shape is, and both split it, merge a copy and trace the call"
          f" (nnx.eval_shape / the floor: {float(np.median(ratios(model_floor, floor))):.3f})"
        ),
      )
    )
  return rows


def _flat_in_batch(sizes: Sizes) -> Row:
  small, large = sizes.conversion_batches
  model, variables = linen_model(sizes, sizes.layers)
  inputs = {batch: tokens(sizes, batch) for batch in (small, large)}
  contenders = {}
  for batch, x in inputs.items():
    contenders[f"flaxlens@{batch}"] = functools.partial(
      timed, functools.partial(fl.unflaxify, model, variables, x)
    )
    contenders[f"floor@{batch}"] = functools.partial(
      timed, lambda x=x: jax.eval_shape(lambda v, x: model.apply(v, x), variables, x)
    )
  samples = interleaved(contenders, sizes.conversion_reps)
  ours_small, ours_large = samples[f"flaxlens@{small}"], samples[f"flaxlens@{large}"]
  floor_flat = np.median(ratios(samples[f"floor@{large}"], samples[f"floor@{small}"]))
  return Row(
    NAME,
    f"Linen, {sizes.layers} layers: fl.unflaxify at batch {large} / at batch {small}",
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


def measure(subjects: Subjects, sizes: Sizes, progress: Progress) -> list[Row]:
  rows = []
  for subject in subjects.scaled:
    progress(f"{NAME}, {subject.name}")
    rows += _against_floor(subject, sizes)
  progress(f"{NAME}, batch sizes")
  rows.append(_flat_in_batch(sizes))
  return rows
