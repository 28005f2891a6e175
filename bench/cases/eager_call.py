"""Case 4: an un-jitted call, blocked on its result, against the native call, at every depth.

Outputs are compared bit for bit; Penzai's tree call, where installed, is shown for
context.
"""

from __future__ import annotations

import functools

from bench.harness import interleaved, median, ratios, seconds, timed
from bench.models import Sizes
from bench.report import Row
from bench.subjects import Subject, per_subject

NAME = "4. eager call"


def _measure(subject: Subject, sizes: Sizes) -> list[Row]:
  contenders = {n: functools.partial(timed, c) for n, c in subject.eager.items()}
  samples = interleaved(contenders, sizes.eager_reps)
  rows = []
  for comparison in subject.eager_comparisons:
    top, bottom = samples[comparison.top], samples[comparison.bottom]
    same = bool((subject.eager[comparison.top]() == subject.eager[comparison.bottom]()).all())
    extra = median(top) - median(bottom)
    rows.append(
      Row(
        NAME,
        f"{subject.name}: {comparison.label}",
        "eager_penzai" if comparison.peer else f"{subject.framework.lower()}_eager",
        ratios(top, bottom),
        f"{seconds(median(top))} vs {seconds(median(bottom))}",
        note=f"output bit-identical: {'yes' if same else 'no'}",
        analysis=(
          f"the tree call takes {seconds(extra)} more than the native call, which is"
          " itself mostly op-by-op dispatch from Python; the profile shows the split"
        ),
        profile=subject.eager[comparison.top],
      )
    )
  return rows


measure = per_subject(NAME, _measure, scaled=True)
