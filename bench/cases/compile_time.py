"""Case 2: time from a fresh jitted function to its first result, less one warm call.

Caches are cleared before every sample. Plain `jax.jit` functions go through the AOT
stages, which splits the time into trace+lower, XLA compile and the first run; other
styles report the first call less a warm one. Runs after case 1, whose comparison of
the lowered programs it quotes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from bench.harness import Sample, interleaved, median, ratios, seconds, timed
from bench.models import Sizes
from bench.report import Row
from bench.subjects import Subject, is_plain_jit, per_subject

NAME = "2. compile time"


def _measure(subject: Subject, sizes: Sizes) -> list[Row]:
  def sample(make: Callable[[], Any]) -> Callable[[], Sample]:
    def run() -> Sample:
      jax.clear_caches()
      fn, args = make()
      if not is_plain_jit(fn):
        first = timed(lambda: fn(*args))["total"]
        return {"total": first - timed(lambda: fn(*args))["total"]}
      start = time.perf_counter()
      lowered = fn.lower(*args)
      traced = time.perf_counter()
      compiled = lowered.compile()
      done = time.perf_counter()
      first = timed(lambda: compiled(*args))["total"] - timed(lambda: compiled(*args))["total"]
      return {
        "total": done - start + first,
        "trace+lower": traced - start,
        "XLA compile": done - traced,
        "first run less a warm one": first,
      }

    return run

  # No warm-up: every sample clears the caches, and case 1 compiled each function once.
  contenders = {n: sample(m) for n, m in subject.jitted.items()}
  samples = interleaved(contenders, sizes.compile_reps, warm_up=False)
  rows = []
  for comparison in subject.jit_comparisons:
    top, bottom = samples[comparison.top], samples[comparison.bottom]
    parts = [k for k in top[0] if k != "total" and k in bottom[0]]
    split = ", ".join(
      f"{k} {seconds(median(top, k))} vs {seconds(median(bottom, k))}" for k in parts
    )
    note = f"{split}; lowered StableHLO: {subject.same_program.get(comparison.top, '?')}"
    if not parts:
      note = "first call less a warm call (no AOT stages for this function)"

    analysis = (
      "this style has no AOT stages that would split the time into trace, lowering and"
      " XLA compile; the profile of one first call shows the split"
    )
    if parts:
      gaps = {part: median(top, part) - median(bottom, part) for part in parts}
      worst = max(gaps, key=gaps.__getitem__)
      analysis = f"{note}; the largest difference is in {worst} ({seconds(gaps[worst])})"

    make = subject.jitted[comparison.top]

    def profile(make: Callable[[], Any] = make) -> None:
      jax.clear_caches()
      fn, args = make()
      jax.block_until_ready(fn(*args))

    rows.append(
      Row(
        NAME,
        f"{subject.framework}: {comparison.label}",
        "compile_time_penzai" if comparison.peer else "compile_time",
        ratios(top, bottom),
        f"{seconds(median(top))} vs {seconds(median(bottom))}",
        note=note,
        analysis=analysis,
        profile=profile,
      )
    )
  return rows


measure = per_subject(NAME, _measure)
