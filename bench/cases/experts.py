"""Case 15: an experts sweep of an 8-layer, 8-expert MoE in one compiled call.

The model (built here, Linen) is LAYERS residual mixture-of-experts blocks, each a
Dense router (top-2 of EXPERTS, softmaxed) and a module holding stacked expert weights
`[experts, ...]` that computes every expert on every token (`einsum`, `[..., experts,
features]`), combined by the gates: the dense dispatch of MaxText and Tunix. The site is
`fl.experts` of every block: LAYERS × EXPERTS units, each patched from a clean run into
a run on other inputs, the metric the mean of the last position's output. `fl.sweep` is
timed against the same number of plain forwards batched with `jax.vmap` in one jitted
call; the metric is traced once per compiled program, and a second sweep on other
clean inputs of the same shape must reuse the first one's program.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import flaxlens as fl
from bench.harness import interleaved, median, ratios, seconds, timed
from bench.models import Sizes
from bench.report import Row
from bench.subjects import Subjects

NAME = "15. experts sweep"
USES_SUBJECTS = False  # it builds its own MoE
LAYERS, EXPERTS, TOP_K = 8, 8, 2
REPS = 7


class StackedExperts(nn.Module):
  """Every expert on every token from stacked weights: `[..., experts, features]`."""

  hidden: int

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    wi = self.param("wi", nn.initializers.normal(0.1), (EXPERTS, width, self.hidden))
    wo = self.param("wo", nn.initializers.normal(0.1), (EXPERTS, self.hidden, width))
    return jnp.einsum("bseh,ehd->bsed", nn.gelu(jnp.einsum("bsd,edh->bseh", x, wi)), wo)


class MoeBlock(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    top, chosen = jax.lax.top_k(nn.Dense(EXPERTS, name="router")(x), TOP_K)
    gates = jnp.sum(jax.nn.one_hot(chosen, EXPERTS) * jax.nn.softmax(top)[..., None], axis=-2)
    return x + jnp.einsum("bse,bsed->bsd", gates, StackedExperts(self.hidden, name="experts")(x))


class Moe(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    for i in range(LAYERS):
      x = MoeBlock(self.hidden, name=f"block_{i}")(x)
    return x


def _metric(output: Any) -> Any:
  return output[:, -1].mean()


def measure(subjects: Subjects, sizes: Sizes, progress: Any) -> list[Row]:
  del subjects
  progress(NAME)
  width, seq = max(sizes.width // 4, 16), max(sizes.seq // 8, 4)
  model = Moe(hidden=2 * width)
  clean = jax.random.normal(jax.random.key(1), (sizes.batch, seq, width))
  corrupted = clean[:, ::-1]
  tree = fl.unflaxify(model, model.init(jax.random.key(0), clean), clean)
  site = fl.experts("block_*")
  traces = []

  def counted(output: Any) -> Any:
    traces.append(None)
    return _metric(output)

  first = fl.sweep(tree, clean, corrupted, site, counted)
  fl.sweep(tree, clean * 0.5, corrupted, site, counted)
  n = first.values.size + 2  # with the clean and corrupted baselines the sweep also runs

  def sweep() -> Any:
    return fl.sweep(tree, clean, corrupted, site, counted).values

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
  where = f"Linen, {LAYERS} layers × {EXPERTS} experts (stacked einsum), width {width}, seq {seq}"
  return [
    Row(
      NAME,
      f"{where}: fl.sweep(fl.experts(...)) / {n} plain forwards batched (jax.vmap, one jitted"
      " call)",
      "experts_sweep_vs_batched",
      ratios(sweep_s, batched_s),
      f"{seconds(median(sweep_s))} vs {seconds(median(batched_s))}",
      note=f"{first.values.size} (layer, expert) forwards and the two baselines on each side;"
      " the sweep also runs the clean forward once",
    ),
    Row(
      NAME,
      f"{where}: compiled programs for two sweeps on different clean inputs",
      "experts_sweep_compiles",
      measured=f"**{len(traces)}**",
      status="PASS" if len(traces) == 1 else "MISS",
      note=f"the metric was traced {len(traces)} time(s) over every sweep of this case",
    ),
  ]
