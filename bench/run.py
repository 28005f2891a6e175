"""flaxlens benchmarks: the speed targets of the design brief, measured as ratios in one run.

Every case runs its contenders interleaved (A B, then B A, ...) and repeated in one
process, so that a noisy, shared machine slows both sides of a ratio alike; it reports
each contender's median and the median and interquartile range of the per-repetition
ratios. Where a target is missed, the report says by how much, splits the cost into its
measured parts and adds a cProfile summary of the flaxlens side. Penzai is an optional
comparison (`pip install -e ".[bench]"`); without it its rows say "not installed". Rows
whose API does not exist yet say "not yet available".

Usage:
  python bench/run.py          # full run, ~5 minutes on 2 cores; rewrites docs/BENCHMARKS.md
  python bench/run.py --quick  # tiny model, few repetitions, no profiles (CI smoke); prints only
  python bench/run.py --out -  # full run, printed only
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import io
import os
import platform
import pstats
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flaxlens as fl

try:
  from penzai import pz
  from penzai.toolshed import unflaxify as pz_unflaxify
except ImportError:
  pz = pz_unflaxify = None

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "BENCHMARKS.md"
_JAX_JIT = type(jax.jit(lambda: None))


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Model sizes and repetition counts of one run."""

  layers: int
  width: int
  heads: int
  vocab: int
  seq: int
  batch: int
  conversion_layers: tuple[int, ...]
  conversion_batches: tuple[int, int]
  forward_reps: int
  compile_reps: int
  conversion_reps: int
  eager_reps: int


FULL = Sizes(
  layers=12,
  width=256,
  heads=4,
  vocab=1024,
  seq=128,
  batch=4,
  conversion_layers=(12, 48),
  conversion_batches=(4, 64),
  forward_reps=15,
  compile_reps=7,
  conversion_reps=4,
  eager_reps=7,
)
QUICK = Sizes(
  layers=1,
  width=32,
  heads=2,
  vocab=64,
  seq=8,
  batch=2,
  conversion_layers=(1, 2),
  conversion_batches=(2, 8),
  forward_reps=3,
  compile_reps=1,
  conversion_reps=2,
  eager_reps=3,
)


# --- the models: plain compact GPT-style stacks, no self-method calls (Penzai needs that) --


class LinenBlock(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class LinenGPT(nn.Module):
  layers: int
  width: int
  heads: int
  vocab: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.width)(tokens)
    for _ in range(self.layers):
      x = LinenBlock(self.width, self.heads)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class NNXBlock(nnx.Module):
  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.norm_1 = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
    self.norm_2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + self.attention(self.norm_1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm_2(x))))


class NNXGPT(nnx.Module):
  def __init__(self, layers: int, width: int, heads: int, vocab: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.blocks = nnx.List([NNXBlock(width, heads, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def tokens(sizes: Sizes, batch: int | None = None) -> jax.Array:
  shape = (batch or sizes.batch, sizes.seq)
  return jax.random.randint(jax.random.key(1), shape, 0, sizes.vocab)


def linen_model(sizes: Sizes, layers: int) -> tuple[nn.Module, dict[str, Any]]:
  """The Linen model and random variables (drawn with numpy: eager init takes seconds)."""
  model = LinenGPT(layers, sizes.width, sizes.heads, sizes.vocab)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens(sizes))
  rng = np.random.default_rng(0)
  variables = jax.tree_util.tree_map(
    lambda s: jnp.asarray(0.02 * rng.standard_normal(s.shape, dtype=np.float32)), shapes
  )
  return model, variables


# --- timing ------------------------------------------------------------------------------

Sample = dict[str, float]


def interleaved(
  contenders: Mapping[str, Callable[[], Sample]], reps: int, warm_up: bool = True
) -> dict[str, list[Sample]]:
  """Runs every contender `reps` times, alternating the order (A B, then B A, ...).

  Each contender returns its own measurements (a dict with at least "total", in
  seconds), so it can leave its set-up out. An untimed warm-up run comes first.
  """
  if warm_up:
    for run in contenders.values():
      run()
  samples: dict[str, list[Sample]] = {name: [] for name in contenders}
  names = list(contenders)
  for rep in range(reps):
    for name in names if rep % 2 == 0 else reversed(names):
      gc.collect()
      gc.disable()
      try:
        samples[name].append(contenders[name]())
      finally:
        gc.enable()
  return samples


def median(samples: list[Sample], key: str = "total") -> float:
  return float(np.median([s[key] for s in samples]))


def ratios(top: list[Sample], bottom: list[Sample], key: str = "total") -> np.ndarray:
  return np.array([a[key] / b[key] for a, b in zip(top, bottom, strict=True)])


def timed(call: Callable[[], Any]) -> Sample:
  start = time.perf_counter()
  jax.block_until_ready(call())
  return {"total": time.perf_counter() - start}


def seconds(t: float) -> str:
  if abs(t) >= 1:
    return f"{t:.2f} s"
  if abs(t) >= 1e-3:
    return f"{t * 1e3:.1f} ms"
  return f"{t * 1e6:.0f} µs"


def nbytes(n: float) -> str:
  return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:.0f} B"


def op_counts(lowered: Any) -> collections.Counter:
  """StableHLO operations of a lowered program, by name (locations and names ignored)."""
  return collections.Counter(re.findall(r"stablehlo\.[a-z_]+|call @", lowered.as_text()))


# --- results -----------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
  """One line of the results table."""

  case: str
  what: str
  target: str
  limit: float | None = None  # the median ratio must be <= limit
  ratio: np.ndarray | None = None  # per-repetition ratios
  measured: str = ""  # the contenders' medians, or a value that is not a ratio
  status: str = ""  # overrides the verdict: "not installed", "not yet available"
  note: str = ""
  analysis: str = ""  # what the cost is made of, reported for a MISS
  profile: Callable[[], Any] | None = None  # runs the flaxlens side once, for a MISS

  @property
  def verdict(self) -> str:
    if self.status:
      return self.status
    if self.limit is None or self.ratio is None:
      return "info"
    if float(np.median(self.ratio)) <= self.limit:
      return "PASS"
    low = float(np.percentile(self.ratio, 25))
    return "MISS (target within spread)" if low <= self.limit else "MISS"

  def ratio_text(self) -> str:
    if self.ratio is None:
      return "—"
    low, mid, high = np.percentile(self.ratio, [25, 50, 75])
    return f"**{mid:.3f}** ({low:.3f}–{high:.3f})"

  def shortfall(self) -> str:
    value = float(np.median(self.ratio))
    return f"{value:.3f} against ≤ {self.limit} ({100 * (value / self.limit - 1):+.0f}%)"


def unavailable(case: str, what: str, target: str, status: str, note: str = "") -> Row:
  return Row(case, what, target, status=status, note=note)


# --- the subjects: one model in native and converted form ---------------------------------


@dataclasses.dataclass
class Comparison:
  """A ratio to report: contender `top` over contender `bottom`."""

  label: str
  top: str
  bottom: str
  peer: bool = False  # Penzai's ratio, shown for context (no flaxlens target)


@dataclasses.dataclass
class Subject:
  """One model, native and converted, and the calls the cases time on it.

  `jitted` maps a contender name to a factory returning a fresh jitted function and its
  arguments: fresh, so that each compile-time sample really compiles.
  """

  framework: str
  eager: dict[str, Callable[[], Any]]
  eager_comparisons: list[Comparison]
  jitted: dict[str, Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]]
  jit_comparisons: list[Comparison]
  tree: Any
  convert: Callable[[], Any]
  user_arrays: list[Any]
  same_program: dict[str, str] = dataclasses.field(default_factory=dict)


def _call_tree(tree: Any, x: jax.Array) -> Any:
  return tree(fl.ArgsAndKwargs.capture(x))


def _stateless_jit(tree: Any, x: jax.Array) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  slots, values = fl.unbind_variables(tree, freeze=True)
  fn = jax.jit(lambda vs, x: slots.stateless_call(vs, fl.ArgsAndKwargs.capture(x))[0])
  return fn, (values, x)


def linen_subject(sizes: Sizes) -> Subject:
  model, variables = linen_model(sizes, sizes.layers)
  x = tokens(sizes)
  tree = fl.unflaxify(model, variables, x)
  eager = {"native": lambda: model.apply(variables, x), "flaxlens": lambda: _call_tree(tree, x)}
  eager_comparisons = [Comparison("tree call / module.apply", "flaxlens", "native")]
  jitted = {
    "native": lambda: (jax.jit(model.apply), (variables, x)),
    "variable_jit": lambda: (fl.variable_jit(_call_tree), (tree, x)),
    "stateless_call": lambda: _stateless_jit(tree, x),
  }
  jit_comparisons = [
    Comparison("fl.variable_jit(tree call) / jax.jit(module.apply)", "variable_jit", "native"),
    Comparison("jax.jit(tree.stateless_call) / jax.jit(module.apply)", "stateless_call", "native"),
  ]
  if pz is not None:
    pz_tree = pz_unflaxify.unflaxify_apply(model, variables, x)
    capture = pz_unflaxify.ArgsAndKwargs.capture
    eager["penzai"] = lambda: pz_tree(capture(x))
    eager_comparisons.append(
      Comparison("Penzai tree call / module.apply", "penzai", "native", peer=True)
    )

    def penzai() -> tuple[Callable[..., Any], tuple[Any, ...]]:
      slots, values = pz.unbind_variables(pz_tree, freeze=True)
      return jax.jit(lambda vs, x: slots.stateless_call(vs, capture(x))[0]), (values, x)

    jitted["penzai"] = penzai
    jit_comparisons.append(
      Comparison(
        "Penzai jax.jit(stateless_call) / jax.jit(module.apply)", "penzai", "native", peer=True
      )
    )
  return Subject(
    "Linen",
    eager,
    eager_comparisons,
    jitted,
    jit_comparisons,
    tree,
    lambda: fl.unflaxify(model, variables, x),
    jax.tree_util.tree_leaves(variables),
  )


def nnx_subject(sizes: Sizes) -> Subject:
  model = NNXGPT(sizes.layers, sizes.width, sizes.heads, sizes.vocab, nnx.Rngs(0))
  x = tokens(sizes)
  tree = fl.unflaxify(model, x)
  graphdef, state = nnx.split(model)
  return Subject(
    "NNX",
    {"native": lambda: model(x), "flaxlens": lambda: _call_tree(tree, x)},
    [Comparison("tree call / model call", "flaxlens", "native")],
    {
      "nnx.jit": lambda: (nnx.jit(lambda m, x: m(x)), (model, x)),
      "variable_jit": lambda: (fl.variable_jit(_call_tree), (tree, x)),
      "jax.jit+merge": lambda: (jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)), (state, x)),
      "stateless_call": lambda: _stateless_jit(tree, x),
    },
    [
      Comparison("fl.variable_jit(tree call) / nnx.jit(model call)", "variable_jit", "nnx.jit"),
      Comparison(
        "jax.jit(tree.stateless_call) / jax.jit(merge + call)", "stateless_call", "jax.jit+merge"
      ),
    ],
    tree,
    lambda: fl.unflaxify(model, x),
    jax.tree_util.tree_leaves(state),
  )


# --- the cases ---------------------------------------------------------------------------


def jitted_forward(subject: Subject, sizes: Sizes) -> list[Row]:
  """Case 1: a jitted call, blocked on its result, after compilation."""
  calls = {name: make() for name, make in subject.jitted.items()}

  def sample(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[], Sample]:
    def run() -> Sample:
      start = time.perf_counter()
      out = fn(*args)
      returned = time.perf_counter()
      jax.block_until_ready(out)
      return {"total": time.perf_counter() - start, "host": returned - start}

    return run

  outputs = {name: fn(*args) for name, (fn, args) in calls.items()}
  samples = interleaved({n: sample(*c) for n, c in calls.items()}, sizes.forward_reps)
  for comparison in subject.jit_comparisons:
    (fn, args), (native_fn, native_args) = calls[comparison.top], calls[comparison.bottom]
    program = "not comparable (not a plain jax.jit function)"
    if isinstance(fn, _JAX_JIT) and isinstance(native_fn, _JAX_JIT):
      equal = op_counts(fn.lower(*args)) == op_counts(native_fn.lower(*native_args))
      program = "same operations" if equal else "different operations"
    subject.same_program[comparison.top] = program
  rows = []
  for comparison in subject.jit_comparisons:
    top, bottom = samples[comparison.top], samples[comparison.bottom]
    same = bool((outputs[comparison.top] == outputs[comparison.bottom]).all())
    program = subject.same_program[comparison.top]
    host, native_host = median(top, "host"), median(bottom, "host")
    analysis = (
      f"the call returns to Python after {seconds(host)} against {seconds(native_host)}:"
      f" {seconds(host - native_host)} more host work per call, before the program is"
      f" dispatched, is {100 * (host - native_host) / median(bottom):.1f}% of the native"
      f" forward. Lowered StableHLO: {program}"
    )
    if not program.startswith("same") and "stateless_call" in subject.same_program:
      analysis += (
        "; the same tree in the functional style, a plain jax.jit function, lowers to"
        f" the {subject.same_program['stateless_call']} as native"
      )
    fn, args = calls[comparison.top]
    rows.append(
      Row(
        "1. jitted forward",
        f"{subject.framework}: {comparison.label}",
        "context" if comparison.peer else "≤ 1.02",
        None if comparison.peer else 1.02,
        ratios(top, bottom),
        f"{seconds(median(top))} vs {seconds(median(bottom))}",
        note=(
          f"host time until the call returns {seconds(host)} vs {seconds(native_host)};"
          f" output bit-identical: {'yes' if same else 'no'}; lowered StableHLO: {program}"
        ),
        analysis=analysis,
        profile=lambda fn=fn, args=args: [fn(*args) for _ in range(5)],
      )
    )
  return rows


def compile_time(subject: Subject, sizes: Sizes) -> list[Row]:
  """Case 2: time from a fresh jitted function to its first result, less one warm call.

  Caches are cleared before every sample. Plain `jax.jit` functions go through the AOT
  stages, which splits the time into trace+lower, XLA compile and the first run.
  """

  def sample(make: Callable[[], Any]) -> Callable[[], Sample]:
    def run() -> Sample:
      jax.clear_caches()
      fn, args = make()
      if not isinstance(fn, _JAX_JIT):
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
        "2. compile time",
        f"{subject.framework}: {comparison.label}",
        "context (brief: about 1.16)" if comparison.peer else "≤ 1.10",
        None if comparison.peer else 1.10,
        ratios(top, bottom),
        f"{seconds(median(top))} vs {seconds(median(bottom))}",
        note=note,
        analysis=analysis,
        profile=profile,
      )
    )
  return rows


def _converters(model: nn.Module, variables: Any) -> dict[str, Callable[[jax.Array], Any]]:
  """The conversions of case 3, and their floor: an abstract trace of `module.apply`."""
  converters = {
    "flaxlens": lambda x: fl.unflaxify(model, variables, x),
    "floor": lambda x: jax.eval_shape(lambda v, x: model.apply(v, x), variables, x),
  }
  if pz is not None:
    converters["penzai"] = lambda x: pz_unflaxify.unflaxify_apply(model, variables, x)
  return converters


def _param_check_share(floor: Callable[[], Any]) -> float:
  """Share of an abstract trace spent in Flax's `Scope.param`, which re-runs every
  initializer under `jax.eval_shape` to check the given parameter's shape."""
  stats = _profile(floor)
  total = sum(tottime for _, _, tottime, _, _ in stats.stats.values())
  param = sum(
    cumtime
    for (filename, _, function), (_, _, _, cumtime, _) in stats.stats.items()
    if filename.endswith("flax/core/scope.py") and function == "param"
  )
  return param / total


def conversion_time(sizes: Sizes) -> list[Row]:
  """Case 3: `fl.unflaxify` against Penzai's `unflaxify_apply`, and against batch size."""
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
      if pz is None:
        rows.append(Row("3. conversion", what, "≤ 0.5", status="not installed", note=note))
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
          "3. conversion",
          what,
          "≤ 0.5",
          0.5,
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
        "3. conversion",
        f"fl.unflaxify at batch {large} / at batch {small}, {layers}-layer model",
        "flat (≤ 1.10)",
        1.10,
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


def eager_call(subject: Subject, sizes: Sizes) -> list[Row]:
  """Case 4: an un-jitted call, blocked on its result."""
  contenders = {n: functools.partial(timed, c) for n, c in subject.eager.items()}
  samples = interleaved(contenders, sizes.eager_reps)
  rows = []
  for comparison in subject.eager_comparisons:
    top, bottom = samples[comparison.top], samples[comparison.bottom]
    same = bool((subject.eager[comparison.top]() == subject.eager[comparison.bottom]()).all())
    extra = median(top) - median(bottom)
    rows.append(
      Row(
        "4. eager call",
        f"{subject.framework}: {comparison.label}",
        "context (brief: about 1.9)" if comparison.peer else "≤ 1.25",
        None if comparison.peer else 1.25,
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


def _buffer(x: Any) -> int | None:
  try:
    return x.unsafe_buffer_pointer()
  except (AttributeError, RuntimeError):
    return None


def extra_bytes(subject: Subject) -> Row:
  """Case 7: parameter bytes of the tree not shared with the user's arrays, and device
  bytes that a fresh conversion leaves alive."""
  user = {_buffer(a) for a in subject.user_arrays} - {None}
  values = [v.value for v in fl.variables_in(subject.tree) if isinstance(v, fl.Parameter)]
  held = {_buffer(v): v.nbytes for v in jax.tree_util.tree_leaves(values) if _buffer(v)}
  unshared = sum(n for pointer, n in held.items() if pointer not in user)
  gc.collect()
  before = {_buffer(a) for a in jax.live_arrays()}
  tree = subject.convert()
  gc.collect()
  created = sum(a.nbytes for a in jax.live_arrays() if _buffer(a) not in before)
  del tree
  return Row(
    "7. extra bytes",
    f"{subject.framework}: tree parameter bytes not shared with the model's arrays",
    "0 B",
    measured=f"**{nbytes(unshared)}** of {nbytes(sum(held.values()))}",
    status="PASS" if unshared == 0 and created == 0 else "MISS",
    note=f"device bytes left alive by a fresh conversion: {nbytes(created)}",
  )


def isolate_and_replay(sizes: Sizes) -> Row:
  """Case 8: isolating one block (one eager run of the tree) and replaying it alone."""
  model, variables = linen_model(sizes, sizes.layers)
  x = tokens(sizes)
  tree = fl.unflaxify(model, variables, x)
  name = f"LinenBlock_{max(sizes.layers // 2 - 1, 0)}"
  block = tree.select().at_path(name)

  def isolate_replay() -> Sample:
    start = time.perf_counter()
    isolated = fl.isolate_submodel(block, fl.ArgsAndKwargs.capture(x))
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
  return Row(
    "8. isolate + replay",
    f"Linen: fl.isolate_submodel({name}) + replay / one module.apply",
    "(no target)",
    ratio=ratios(ours, native),
    measured=f"{seconds(median(ours))} vs {seconds(median(native))}",
    note=(
      f"isolate (one eager run of the whole tree, observing the block)"
      f" {seconds(median(ours, 'isolate'))}, replay of the block alone"
      f" {seconds(median(ours, 'replay'))}"
    ),
  )


# --- profiles ------------------------------------------------------------------------------


def _profile(run: Callable[[], Any]) -> pstats.Stats:
  """Profiles one run of `run`; waiting for its device results is left out."""
  jax.block_until_ready(run())
  profiler = cProfile.Profile()
  profiler.enable()
  result = run()
  profiler.disable()
  jax.block_until_ready(result)
  return pstats.Stats(profiler, stream=io.StringIO())


def _package(filename: str) -> str:
  for marker, name in (
    ("/flaxlens/", "flaxlens"),
    ("/penzai/", "penzai"),
    ("/flax/", "flax"),
    ("/jax/", "jax"),
    ("/jaxlib/", "jax"),
  ):
    if marker in filename:
      return name
  return "builtins" if filename == "~" else "other Python"


def _where(filename: str, line: int, function: str) -> str:
  if filename == "~":
    return function
  for marker in ("/flaxlens/", "site-packages/"):
    if marker in filename:
      filename = filename.split(marker, 1)[1]
      break
  return f"{filename}:{line}({function})"


def profile_summary(run: Callable[[], Any]) -> str:
  """Own time by package, and the functions (all, then flaxlens's) with most own time."""
  stats = _profile(run)
  own: dict[str, float] = collections.defaultdict(float)
  functions = []
  for (filename, line, function), (_, calls, tottime, _, _) in stats.stats.items():
    own[_package(filename)] += tottime
    functions.append((tottime, calls, _package(filename), _where(filename, line, function)))
  total = sum(own.values())
  shares = ", ".join(
    f"{name} {100 * t / total:.0f}%" for name, t in sorted(own.items(), key=lambda kv: -kv[1])
  )
  functions.sort(reverse=True)
  lines = [f"  - own time under cProfile ({seconds(total)}): {shares}", "  - most own time:"]
  lines += [f"    - `{where}`: {seconds(t)} in {n} calls" for t, n, _, where in functions[:5]]
  lines.append("  - most own time in flaxlens:")
  ours = [f for f in functions if f[2] == "flaxlens"][:5]
  lines += [f"    - `{where}`: {seconds(t)} in {n} calls" for t, n, _, where in ours]
  return "\n".join(lines)


# --- the report --------------------------------------------------------------------------


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _git() -> str:
  def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""

  commit = git("rev-parse", "--short", "HEAD")
  if not commit:
    return ""
  dirty = git("status", "--porcelain", "--", "flaxlens")
  return f" (git {commit}{', with uncommitted changes in flaxlens/' if dirty else ''})"


def _proc_field(path: str, field: str) -> str:
  try:
    for line in Path(path).read_text().splitlines():
      if line.startswith(field):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def environment() -> list[str]:
  cpu = _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  memory = _proc_field("/proc/meminfo", "MemTotal")
  memory = f", {int(memory.split()[0]) / 2**20:.0f} GiB memory" if memory else ""
  device = jax.devices()[0]
  return [
    f"- Date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
    f"- Machine: {cpu}, {cores} cores{memory}; JAX device: {device.platform}"
    f" ({device.device_kind}); shared with other work, hence interleaved ratios",
    f"- Versions: Python {platform.python_version()}, jax {jax.__version__}, jaxlib"
    f" {_version('jaxlib')}, flax {_version('flax')}, penzai {_version('penzai')},"
    f" flaxlens {fl.__version__}{_git()}",
  ]


def render(rows: list[Row], sizes: Sizes, command: str, taken: float) -> str:
  out = [
    "# Benchmarks",
    "",
    "Generated by `bench/run.py`; do not edit by hand. Each case runs its contenders",
    "interleaved and repeated in one process; a ratio is flaxlens over native Flax (or",
    "over Penzai) per repetition, shown as **median** (interquartile range). A verdict",
    'compares the median with the design brief\'s target; "target within spread" means',
    "the target lies inside the interquartile range. Rows marked *context* show Penzai's",
    "ratio on the same model, next to the figure the design brief quotes for it.",
    "",
    *environment(),
    f"- Command: `{command}` (measurements took {seconds(taken)})",
    f"- Model (rows 1, 2, 4, 7, 8): GPT-style, {sizes.layers} layers, width {sizes.width},"
    f" {sizes.heads} heads, vocabulary {sizes.vocab}; input batch {sizes.batch} x"
    f" {sizes.seq} tokens, float32. Linen: `nn.Embed`, blocks of `nn.LayerNorm` +"
    " causal `nn.MultiHeadDotProductAttention` + MLP, final `nn.LayerNorm` + `nn.Dense`;"
    " NNX: the same with `nnx` layers. Row 3 uses the Linen model at"
    f" {' and '.join(map(str, sizes.conversion_layers))} layers.",
    f"- Repetitions: forward {sizes.forward_reps}, compile {sizes.compile_reps}, conversion"
    f" {sizes.conversion_reps}, eager {sizes.eager_reps}.",
    "- Jitted styles: `fl.variable_jit` jits a function of the tree and writes state back"
    " (its native counterpart for NNX is `nnx.jit`); `jax.jit` over"
    " `tree.stateless_call(values, ...)` with `fl.unbind_variables(tree, freeze=True)` is"
    " the functional style (for NNX against `jax.jit` over `nnx.merge`).",
    "",
    "| # | what | flaxlens vs baseline (medians) | ratio | target | verdict |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for row in rows:
    out.append(
      f"| {row.case} | {row.what} | {row.measured or '—'} | {row.ratio_text()} | {row.target}"
      f" | {row.verdict} |"
    )
  out += ["", "## Notes per row", ""]
  out += [f"- {row.case}, {row.what}: {row.note}." for row in rows if row.note]
  return "\n".join(out) + "\n"


def closing_notes(missed: list[Row], profiles: bool, progress: Callable[[str], None]) -> str:
  out = ["", "## Missed targets: by how much, and what dominates", ""]
  if profiles:
    out += [
      "Profiles: one run of the flaxlens side under cProfile (which inflates Python-heavy",
      "code); own time is time spent in a function itself, not in what it calls.",
      "",
    ]
  for row in missed:
    analysis = row.analysis[:1].upper() + row.analysis[1:]
    out.append(f"- **{row.case}, {row.what}**: {row.shortfall()}. {analysis}.")
    if profiles and row.profile is not None:
      progress(f"profiling {row.case}, {row.what}")
      out.append(profile_summary(row.profile))
  return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes, few reps, print only")
  parser.add_argument("--out", help=f"where to write the report ('-': print only; default {DOC})")
  args = parser.parse_args(argv)
  out = args.out or ("-" if args.quick else str(DOC))
  if args.quick and out != "-" and Path(out).resolve() == DOC:
    parser.error(f"--quick numbers are not the benchmark; it does not write {DOC}.")
  sizes = QUICK if args.quick else FULL
  started = time.perf_counter()

  def progress(message: str) -> None:
    print(f"[{time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

  subjects = [linen_subject(sizes), nnx_subject(sizes)]
  rows: list[Row] = []
  for subject in subjects:
    progress(f"1. jitted forward, {subject.framework}")
    rows += jitted_forward(subject, sizes)
  for subject in subjects:
    progress(f"2. compile time, {subject.framework}")
    rows += compile_time(subject, sizes)
  progress("3. conversion")
  rows += conversion_time(sizes)
  for subject in subjects:
    progress(f"4. eager call, {subject.framework}")
    rows += eager_call(subject, sizes)
  rows.append(
    unavailable(
      "5. capture everything",
      "capturing every intermediate under jit / plain jitted forward",
      "≤ 1.10",
      "not yet available",
      "flaxlens has no capture API yet",
    )
  )
  rows.append(
    unavailable(
      "6. recompiles",
      "traces after the first for 100 different intervention values",
      "0",
      "not yet available",
      "flaxlens has no intervention API yet",
    )
  )
  progress("7. extra bytes")
  rows += [extra_bytes(subject) for subject in subjects]
  progress("8. isolate + replay")
  rows.append(isolate_and_replay(sizes))
  rows.sort(key=lambda row: int(row.case.split(".")[0]))

  command = "python bench/run.py" + (" --quick" if args.quick else "")
  text = render(rows, sizes, command, time.perf_counter() - started)
  missed = [row for row in rows if row.verdict.startswith("MISS") and row.analysis]
  if missed:
    text += closing_notes(missed, not args.quick, progress)
  print(text)
  if out != "-":
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    progress(f"wrote {out}")


if __name__ == "__main__":
  main()
