"""Case 9: activation patching over every block × position in one call, and attribution
patching.

On each subject, the sites are the model's blocks (L of them) at the last P positions
(N = L × P cells) and the metric is one logit at the last position, patched from a clean
run into a run on the reversed tokens. `fl.sweep(share_prefix=True)` (one compiled call,
sharing each patched forward's prefix with one corrupted base run) is timed against the
loop a user writes without it (a clean capture, then N jitted `fl.run` calls each with
one `fl.patch`) and against N plain forwards batched with `jax.vmap` in one jitted call
(the work a sweep without prefix sharing cannot avoid), as is `fl.sweep(share_prefix=
False)` (one batch of whole patched forwards, the default off CPU);
`fl.attribute` against one jitted forward and backward pass (the metric's gradient with
respect to the parameters). Results are checked against each other before timing: the
sweeps against the loop, to rounding (forwards batched, the loop's are not).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flaxlens as fl
from bench.harness import interleaved, median, ratios, seconds, timed
from bench.models import LinenBlock, NNXBlock, Sizes, tokens
from bench.report import Row
from bench.subjects import Subject, per_subject

NAME = "9. sweeps"
# Repetitions of this case (at most `forward_reps`): each runs three 48-cell sweeps and a
# loop of 48 forwards, and at 31 (the forward rows' count) its ratios' interquartile
# ranges were within ±2% while the case took 22 of the full run's 53 minutes.
SWEEP_REPS = 11


def _metric(output: Any) -> Any:
  return output[:, -1, 0].mean()


def _measure(subject: Subject, sizes: Sizes) -> list[Row]:
  tree = subject.tree
  block = LinenBlock if subject.framework == "Linen" else NNXBlock
  clean = tokens(sizes)
  corrupted = clean[:, ::-1]
  positions = tuple(range(max(0, sizes.seq - 4), sizes.seq))
  names = fl.sweep(tree, clean, corrupted, block, _metric).sites
  n = len(names) * len(positions)
  metric = jax.jit(_metric)

  def sweep(share_prefix: bool = True) -> Any:
    return fl.sweep(
      tree, clean, corrupted, block, _metric, positions=positions, share_prefix=share_prefix
    ).values

  def loop() -> Any:
    _, cache = fl.capture(tree, clean, at=block)
    return jnp.stack(
      [
        jnp.stack(
          [
            metric(
              fl.run(tree, corrupted, interventions=[fl.patch(s, cache[s], where=jnp.s_[:, p])])
            )
            for p in positions
          ]
        )
        for s in names
      ]
    )

  slots, values = fl.unbind_variables(tree, freeze=True)

  def forward(values: Any, x: Any) -> Any:
    return _metric(slots.stateless_call(values, fl.ArgsAndKwargs.capture(x))[0])

  batched_forwards = jax.jit(jax.vmap(forward, in_axes=(None, 0)))
  stacked = jnp.broadcast_to(corrupted, (n, *corrupted.shape))
  forward_backward = jax.jit(jax.value_and_grad(forward))

  def attribute() -> Any:
    return fl.attribute(tree, clean, corrupted, block, _metric).values

  np.testing.assert_allclose(sweep(), loop(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(sweep(False), loop(), rtol=1e-5, atol=1e-5)
  samples = interleaved(
    {
      "sweep": lambda: timed(sweep),
      "unshared": lambda: timed(lambda: sweep(False)),
      "loop": lambda: timed(loop),
      "batched": lambda: timed(lambda: batched_forwards(values, stacked)),
      "attribute": lambda: timed(attribute),
      "forward_backward": lambda: timed(lambda: forward_backward(values, corrupted)),
    },
    min(sizes.forward_reps, SWEEP_REPS),
  )
  sweep_s, loop_s = samples["sweep"], samples["loop"]
  batched_s, attribute_s = samples["batched"], samples["attribute"]
  fb_s, unshared_s = samples["forward_backward"], samples["unshared"]
  where = f"{subject.framework}, {len(names)} blocks × {len(positions)} positions"
  return [
    Row(
      NAME,
      f"{where}: fl.sweep(share_prefix=True) / loop of {n} jitted fl.run with one fl.patch",
      "patching_sweep_vs_loop",
      ratios(sweep_s, loop_s),
      f"{seconds(median(sweep_s))} vs {seconds(median(loop_s))}",
      note="both include the clean run; the sweep equals the loop to rounding (checked)",
    ),
    Row(
      NAME,
      f"{where}: fl.sweep(share_prefix=True) / {n} plain forwards batched (jax.vmap, one call)",
      "patching_sweep_vs_batched",
      ratios(sweep_s, batched_s),
      f"{seconds(median(sweep_s))} vs {seconds(median(batched_s))}",
      note=(
        "the sweep also runs the clean and corrupted forwards once; its patched forwards"
        " skip the blocks before the patched one (about (L+1)/2L of the batched work)"
      ),
    ),
    Row(
      NAME,
      f"{where}: fl.sweep(share_prefix=False) / {n} plain forwards batched",
      "patching_sweep_unshared_vs_batched",
      ratios(unshared_s, batched_s),
      f"{seconds(median(unshared_s))} vs {seconds(median(batched_s))}",
      note="one batch of whole patched forwards (the default off CPU)",
    ),
    Row(
      NAME,
      f"{where}: fl.attribute / one forward and backward (gradient of the metric)",
      "attribution_patching",
      ratios(attribute_s, fb_s),
      f"{seconds(median(attribute_s))} vs {seconds(median(fb_s))}",
      note=(
        "attribution runs the clean forward, then the corrupted forward and backward;"
        " the reference differentiates with respect to the parameters"
      ),
    ),
  ]


measure = per_subject(NAME, _measure)
