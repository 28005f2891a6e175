"""Case 13: the first call of a question in a second process, with the persistent cache.

For each framework and question (`fl.capture` of every block, `fl.sweep` over every
block), a fresh process with an empty cache folder (`fl.enable_compilation_cache`) asks
the question once (it compiles and fills the folder); then new processes on that folder
each time the first call (which must read, not compile: `fl.count_compiles`) and the
median of warm calls. The ratio is first call / steady call in the same process; the note
splits the first call into JAX's own trace, lowering and cache-read durations
(`jax.monitoring`). Each process is `python -m bench.cases.compilation_cache WORKER ...`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import seconds
from bench.models import FULL, QUICK, Sizes
from bench.report import Row

NAME = "13. compilation cache"
ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ("capture", "sweep")
FRAMEWORKS = ("Linen", "NNX")
STEADY_REPS = 5
TIMEOUT = 600  # seconds per process
_DURATIONS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/compilation_cache/cache_retrieval_time_sec": "cache read",
  "/jax/core/compile/backend_compile_duration": "compile or read",
}


def _metric(output: Any) -> Any:
  return output[:, -1, 0].mean()


def _worker(framework: str, question: str, quick: bool, cache: str) -> dict[str, Any]:
  """One process: asks the question once, then `STEADY_REPS` more times; what it took."""
  import jax

  import flaxlens as fl
  from bench.harness import timed
  from bench.models import LinenBlock, NNXBlock, linen_model, nnx_model, tokens

  sizes = QUICK if quick else FULL
  fl.enable_compilation_cache(cache)
  x = tokens(sizes)
  if framework == "Linen":
    model, variables = linen_model(sizes, sizes.layers)
    tree, block = fl.unflaxify(model, variables, x), LinenBlock
  else:
    tree, block = fl.unflaxify(nnx_model(sizes), x), NNXBlock
  corrupted = x[:, ::-1]
  ask = {
    "capture": lambda: fl.capture(tree, x, at=block),
    "sweep": lambda: fl.sweep(tree, x, corrupted, block, _metric).values,
  }[question]
  spent: dict[str, float] = dict.fromkeys(_DURATIONS.values(), 0.0)

  def on_duration(event: str, duration: float, **_: Any) -> None:
    if event in _DURATIONS:
      spent[_DURATIONS[event]] += duration

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  with fl.count_compiles() as count:
    first = timed(ask)["total"]
  jax.monitoring.unregister_event_duration_listener(on_duration)
  steady = [timed(ask)["total"] for _ in range(STEADY_REPS)]
  return {
    "first": first,
    "steady": float(np.median(steady)),
    "compilations": count.compilations,
    "cache_hits": count.cache_hits,
    **spent,
  }


def _process(framework: str, question: str, quick: bool, cache: str) -> dict[str, Any]:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  args = ["WORKER", framework, question, "quick" if quick else "full", cache]
  done = subprocess.run(
    [sys.executable, "-m", "bench.cases.compilation_cache", *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=TIMEOUT,
  )
  if done.returncode != 0:
    raise RuntimeError(f"{NAME}: a worker failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def measure(subjects: Any, sizes: Sizes, progress: Any) -> list[Row]:
  del subjects  # Every sample is a fresh process that builds its own model.
  quick = sizes is QUICK
  reps = 1 if quick else 3
  rows = []
  for framework in FRAMEWORKS:
    for question in QUESTIONS:
      progress(f"{NAME}, {framework}, {question}")
      with tempfile.TemporaryDirectory(prefix="flaxlens-bench-cache-") as cache:
        started = time.perf_counter()
        cold = _process(framework, question, quick, cache)
        warm = [_process(framework, question, quick, cache) for _ in range(reps)]
        progress(f"{NAME}, {framework}, {question}: {time.perf_counter() - started:.0f} s")
      ratio = np.array([w["first"] / w["steady"] for w in warm])
      first, steady = np.median([w["first"] for w in warm]), np.median([w["steady"] for w in warm])
      parts = ", ".join(
        f"{part} {seconds(float(np.median([w[part] for w in warm])))}"
        for part in ("trace", "lower", "cache read")
      )
      compiled = sorted({w["compilations"] for w in warm})
      note = (
        f"second process: first call {seconds(first)} ({parts}; XLA compilations"
        f" {compiled}, cache reads {sorted({w['cache_hits'] for w in warm})}); first"
        f" process (empty cache): first call {seconds(cold['first'])}, steady"
        f" {seconds(cold['steady'])}"
      )
      rows.append(
        Row(
          NAME,
          f"{framework}: fl.{question}, second-process first call / steady call",
          "second_process_first_call",
          ratio,
          f"{seconds(first)} vs {seconds(steady)}",
          note=note,
          analysis=(
            f"{note}. The cache skips XLA compilation only: the second process still"
            " traces the run in Python and lowers it to StableHLO (the cache key is computed"
            " from the lowered module), which is what the first call costs over a steady one."
          ),
        )
      )
  return rows


if __name__ == "__main__" and sys.argv[1:2] == ["WORKER"]:
  _, _, framework, question, size, cache = sys.argv
  print(json.dumps(_worker(framework, question, size == "quick", cache)))
