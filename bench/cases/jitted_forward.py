"""Case 1: a jitted call, blocked on its result, after compilation, at every model depth.

Each jitted style of a subject is timed against its native counterpart, end to end and
for the host time until the call returns (its own row: what a loop of small calls pays
per call); outputs are compared bit for bit, and the lowered StableHLO of plain
`jax.jit` functions is compared by operation counts (recorded on the subject for case 2).
The smallest model, where host work is a large part of a call, has its own target.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from bench.harness import Sample, interleaved, median, ratios, seconds
from bench.models import Sizes
from bench.report import Row
from bench.subjects import Subject, is_plain_jit, per_subject

NAME = "1. jitted forward"


def op_counts(lowered: Any) -> collections.Counter:
  """StableHLO operations of a lowered program, by name (locations and names ignored)."""
  return collections.Counter(re.findall(r"stablehlo\.[a-z_]+|call @", lowered.as_text()))


def _measure(subject: Subject, sizes: Sizes) -> list[Row]:
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
    if is_plain_jit(fn) and is_plain_jit(native_fn):
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
    small = subject.layers <= SMALL
    rows.append(
      Row(
        NAME,
        f"{subject.name}: {comparison.label}",
        "jitted_forward_penzai"
        if comparison.peer
        else ("jitted_small_model" if small else "jitted_forward"),
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
    if comparison.peer:
      continue
    rows.append(
      Row(
        NAME,
        f"{subject.name}: host time until the call returns, {comparison.label}",
        "jitted_host_time",
        ratios(top, bottom, "host"),
        f"{seconds(host)} vs {seconds(native_host)}",
        note=f"end to end {seconds(median(top))} vs {seconds(median(bottom))}",
        analysis=(
          f"{seconds(host - native_host)} more Python work per call before the program is"
          " dispatched (splitting the arguments and reading the variables' values); the"
          " profile shows where"
        ),
        profile=lambda fn=fn, args=args: [fn(*args) for _ in range(50)],
      )
    )
  return rows


SMALL = 2  # Models at most this deep are "small": host work shows in the end-to-end time.
measure = per_subject(NAME, _measure, scaled=True)
