"""Cases 5 and 6: capturing every call under jit, and new intervention values without traces.

Case 5 times `fl.capture(tree, x)` (every call's output, compiled by `fl.run`) against
the subject's plain jitted native forward, interleaved; `fl.run(tree, x)` without
captures is timed beside them, so that a miss splits into the cost of running through
`fl.run` and the cost of the captured outputs. Case 6 runs `fl.run` with a steering
intervention on every block for 100 strengths given as Python floats, then for 100
vectors given as arrays, and counts the traces of the run with a function that only
runs while JAX traces (an `fl.modify` at the root that returns the output unchanged).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flaxlens as fl
from bench.harness import Sample, interleaved, median, ratios, seconds
from bench.models import LinenBlock, NNXBlock, Sizes
from bench.report import Row
from bench.subjects import Subject, per_subject

CAPTURE, RECOMPILES = "5. capture everything", "6. recompiles"
VALUES = 100


def _timed(call: Callable[[], Any]) -> Callable[[], Sample]:
  def run() -> Sample:
    start = time.perf_counter()
    jax.block_until_ready(call())
    return {"total": time.perf_counter() - start}

  return run


def _capture_row(subject: Subject, sizes: Sizes) -> Row:
  native_name = "native" if "native" in subject.jitted else "nnx.jit"
  native_fn, args = subject.jitted[native_name]()
  x = args[-1]
  tree = subject.tree
  _, cache = fl.capture(tree, x)
  arrays = jax.tree_util.tree_leaves(cache)
  samples = interleaved(
    {
      "capture": _timed(lambda: fl.capture(tree, x)),
      "run": _timed(lambda: fl.run(tree, x)),
      "native": _timed(lambda: native_fn(*args)),
    },
    sizes.forward_reps,
  )
  capture, run, native = (median(samples[k]) for k in ("capture", "run", "native"))
  captured = f"{len(cache)} calls, {len(arrays)} arrays, {sum(a.nbytes for a in arrays)} B"
  return Row(
    CAPTURE,
    f"{subject.framework}: fl.capture(tree, x) (every call) / jitted native forward",
    "capture_everything",
    ratios(samples["capture"], samples["native"]),
    f"{seconds(capture)} vs {seconds(native)}",
    note=f"captured {captured}; fl.run(tree, x) without captures {seconds(run)}",
    analysis=(
      f"without captures, fl.run takes {seconds(run)} against the native {seconds(native)}"
      f" ({run / native:.3f}), and capturing every call adds {seconds(capture - run)}"
      f" ({capture / run:.3f} of fl.run alone) to write {captured} out of the program"
    ),
    profile=lambda: [fl.capture(tree, x) for _ in range(5)],
  )


BLOCKS = {"Linen": LinenBlock, "NNX": NNXBlock}


def _recompiles_row(subject: Subject, sizes: Sizes) -> Row:
  x = subject.jitted["variable_jit"]()[1][-1]
  rng = np.random.default_rng(0)
  vectors = [rng.standard_normal(sizes.width, dtype=np.float32) for _ in range(VALUES)]
  block = BLOCKS[subject.framework]
  steering = [fl.steer(block, vectors[0], alpha=0.01 * i) for i in range(VALUES)]
  steering += [fl.steer(block, jnp.asarray(vector)) for vector in vectors]
  traces = []

  def count(argument: Any, output: Any) -> Any:
    traces.append(None)
    return output

  counter = fl.modify(subject.tree.module_type, count)
  for intervention in steering:
    jax.block_until_ready(fl.run(subject.tree, x, interventions=[intervention, counter]))
  return [
    Row(
      RECOMPILES,
      f"{subject.framework}: traces after the first, fl.run steering every block with"
      f" {VALUES} Python-float strengths, then {VALUES} array vectors",
      "recompiles",
      measured=f"**{len(traces) - 1}**",
      status="PASS" if len(traces) == 1 else "MISS",
      note=f"{len(traces)} trace(s) in {len(steering)} runs",
    )
  ]


measure_capture = per_subject(CAPTURE, lambda subject, sizes: [_capture_row(subject, sizes)])
measure_recompiles = per_subject(RECOMPILES, _recompiles_row)


def measure(subjects: list[Subject], sizes: Sizes, progress: Callable[[str], None]) -> list[Row]:
  return measure_capture(subjects, sizes, progress) + measure_recompiles(subjects, sizes, progress)
