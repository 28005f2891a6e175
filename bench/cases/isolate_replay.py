"""Case 8: isolating one block of the Linen model (one eager run of the whole tree,
observing the block) and replaying it alone, against one `module.apply`.
"""

from __future__ import annotations

import time

import jax

import flaxlens as fl
from bench.harness import Progress, Sample, interleaved, median, ratios, seconds, timed
from bench.models import Sizes, linen_model, tokens
from bench.report import Row
from bench.subjects import Subject

NAME = "8. isolate + replay"


def measure(subjects: list[Subject], sizes: Sizes, progress: Progress) -> list[Row]:
  progress(NAME)
  model, variables = linen_model(sizes, sizes.layers)
  x = tokens(sizes)
  tree = fl.unflaxify(model, variables, x)
  name = f"LinenBlock_{max(sizes.layers // 2 - 1, 0)}"

  def isolate_replay() -> Sample:
    start = time.perf_counter()
    isolated = fl.isolate(tree, x, name)
    isolated_at = time.perf_counter()
    jax.block_until_ready(
      isolated.submodel.stateless_call(
        isolated.initial_var_values, isolated.saved_arg, **isolated.saved_side_inputs
      )
    )
    done = time.perf_counter()
    return {"total": done - start, "isolate": isolated_at - start, "replay": done - isolated_at}

  samples = interleaved(
    {"isolate": isolate_replay, "native": lambda: timed(lambda: model.apply(variables, x))},
    sizes.eager_reps,
  )
  ours, native = samples["isolate"], samples["native"]
  return [
    Row(
      NAME,
      f"Linen: fl.isolate(tree, x, {name!r}) + replay / one module.apply",
      "isolate_replay",
      ratio=ratios(ours, native),
      measured=f"{seconds(median(ours))} vs {seconds(median(native))}",
      note=(
        f"isolate (one eager run of the whole tree, observing the block)"
        f" {seconds(median(ours, 'isolate'))}, replay of the block alone"
        f" {seconds(median(ours, 'replay'))}"
      ),
    )
  ]
