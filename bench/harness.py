"""The timing harness: interleaved repetitions, per-repetition ratios, units and profiles.

Every case runs its contenders interleaved (A B, then B A, ...) and repeated in one
process, so that a noisy, shared machine slows both sides of a ratio alike. A contender
returns its own measurements (a `Sample`), so it can leave its set-up out and split its
time into parts. Profiles run the flaxlens side of a missed target once under cProfile.
What needs a process of its own (a first call, a cache read from disk) runs in a fresh
worker process (`in_fresh_process`).
"""

from __future__ import annotations

import collections
import cProfile
import gc
import io
import json
import os
import pstats
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

Sample = dict[str, float]
Progress = Callable[[str], None]  # reports a step of the run on stderr
REPO = Path(__file__).resolve().parent.parent


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


def in_fresh_process(module: str, *args: str, timeout: float | None = None) -> Any:
  """Runs `python -m module *args` in a fresh process, from the repository root with the
  repository on its `PYTHONPATH`, and returns the JSON value of the last line it prints.

  Raises:
    RuntimeError: the process failed (the message ends with the end of its stderr).
    subprocess.TimeoutExpired: it ran past `timeout` seconds.
  """
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
  }
  done = subprocess.run(
    [sys.executable, "-m", module, *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  if done.returncode != 0:
    raise RuntimeError(f"python -m {shlex.join([module, *args])} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def seconds(t: float) -> str:
  if abs(t) >= 1:
    return f"{t:.2f} s"
  if abs(t) >= 1e-3:
    return f"{t * 1e3:.1f} ms"
  return f"{t * 1e6:.0f} µs"


def nbytes(n: float) -> str:
  return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:.0f} B"


def profile(run: Callable[[], Any]) -> pstats.Stats:
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
  stats = profile(run)
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
