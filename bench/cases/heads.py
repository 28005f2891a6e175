"""Case 10: a heads × positions patching sweep of the 12-layer model in one compiled call.

On each subject, the site is every block's attention heads (`fl.heads` of the attention
modules: layers × heads units) at the last `POSITIONS` positions, patched from a clean
run into a run on the reversed tokens, and the metric is one logit at the last
position. `fl.sweep` is timed against the same number of plain forwards batched with
`jax.vmap` in one jitted call (the work a sweep cannot avoid). Compilation is counted:
the metric is traced once per compiled program, and a second sweep on other clean
tokens of the same shape must reuse the first one's program.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import flaxlens as fl
from bench.harness import interleaved, median, ratios, seconds, timed
from bench.models import Sizes, tokens
from bench.report import Row
from bench.subjects import Subject, per_subject

NAME = "10. heads sweep"
POSITIONS = 2  # the last positions swept: layers × heads × POSITIONS patched forwards
REPS = 5  # each side does layers × heads × POSITIONS forwards' work: seconds per repetition


def _metric(output: Any) -> Any:
  return output[:, -1, 0].mean()


def _measure(subject: Subject, sizes: Sizes) -> list[Row]:
  tree = subject.tree
  site = fl.heads(
    nn.MultiHeadDotProductAttention if subject.framework == "Linen" else nnx.MultiHeadAttention
  )
  clean = tokens(sizes)
  corrupted = clean[:, ::-1]
  positions = range(sizes.seq - POSITIONS, sizes.seq)
  traces = []

  def counted(output: Any) -> Any:
    traces.append(None)
    return _metric(output)

  first = fl.sweep(tree, clean, corrupted, site, counted, positions=positions)
  fl.sweep(tree, (clean + 1) % sizes.vocab, corrupted, site, counted, positions=positions)
  n = first.values.size
  rows = len(first.sites)

  def sweep() -> Any:
    return fl.sweep(tree, clean, corrupted, site, counted, positions=positions).values

  slots, values = fl.unbind_variables(tree, freeze=True)

  def forward(values: Any, x: Any) -> Any:
    return _metric(slots.stateless_call(values, fl.ArgsAndKwargs.capture(x))[0])

  batched_forwards = jax.jit(jax.vmap(forward, in_axes=(None, 0)))
  stacked = jnp.broadcast_to(corrupted, (n, *corrupted.shape))
  samples = interleaved(
    {
      "sweep": lambda: timed(sweep),
      "batched": lambda: timed(lambda: batched_forwards(values, stacked)),
    },
    min(sizes.forward_reps, REPS),
  )
  sweep_s, batched_s = samples["sweep"], samples["batched"]
  where = f"{subject.framework}, {rows} (layer, head) rows × {POSITIONS} positions"
  return [
    Row(
      NAME,
      f"{where}: fl.sweep(fl.heads(...)) / {n} plain forwards batched (jax.vmap, one jitted call)",
      "heads_sweep_vs_batched",
      ratios(sweep_s, batched_s),
      f"{seconds(median(sweep_s))} vs {seconds(median(batched_s))}",
      note=f"the sweep also runs the clean forward once (1/{n} of the batched work)",
    ),
    Row(
      NAME,
      f"{where}: compiled programs for two sweeps on different clean tokens",
      "heads_sweep_compiles",
      measured=f"**{len(traces)}**",
      status="PASS" if len(traces) == 1 else "MISS",
      note=f"the metric was traced {len(traces)} time(s) over every sweep of this case",
    ),
  ]


measure = per_subject(NAME, _measure)
