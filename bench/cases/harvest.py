"""Case 11: `fl.harvest` throughput, its peak host memory as the dataset grows, resuming, and
capturing everything under a budget.

All three rows harvest the residual stream of every block of the Linen subject (the
outputs of its `LinenBlock`s, `at=LinenBlock`), every position, in float32 (the model's
dtype, so no cast), into a store in a fresh temporary directory on local disk; the
batches are NumPy int32 token arrays, as a data loader gives them.

- Throughput: a harvest of N batches is timed interleaved with the native jitted forward
  (`jax.jit(module.apply)`) over the same N batches, and with `fl.capture` of the same
  sites copied to the host (no store), which splits a miss into computing the rows and
  storing them. Each harvest call is timed whole (its set-up, compile excluded by the
  warm-up, and its final commit included); a second call on the complete store, untimed
  in the ratio, measures that set-up.
- Memory: a harvest of D batches and one of 10 D batches each run in a fresh
  subprocess, which reports its peak resident set (`ru_maxrss`); the batches come from a
  generator, so the dataset itself is never in memory.
- Resume: a subprocess harvest is killed (SIGKILL) as soon as its `progress.json` shows
  half the batches committed; the same call then resumes in a fresh subprocess, and a
  full harvest runs in another. Both time their `fl.harvest` call, so each counts one
  trace of the harvest's program and one set-up. All three share a persistent
  compilation cache (`fl.enable_compilation_cache`, warmed by the killed run), as the
  CLI has by default and docs/harvest.md advises for long harvests: a resumed run reads
  the compiled program instead of compiling it again, and so does the full run it is
  compared with. Each run also pays a fixed start (tracing, reading the program from the
  cache, set-up: about 0.7 s here), once in the resumed run and once in the full one, so
  the ratio is 0.5 + fixed / (2 x full run): the row harvests 128 batches (about 12 s), a
  run long enough that the ratio measures resuming, not starting a process (at 32 batches
  the fixed start alone put it at 0.6).

- Budget: `fl.capture` of every call of the model at a batch whose captures are about
  three times the budget, with `budget=`: the peak bytes of the device arrays alive
  during the call beyond those alive before it (sampled every millisecond from
  `jax.live_arrays()` by a thread; the unbudgeted capture is sampled alike, to show the
  sampler sees a capture's peak) over the budget, and the result compared with the
  unbudgeted capture.

NNX is not measured: after conversion a harvest runs the same loop over any tree.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

import flaxlens as fl
from bench.harness import Progress, Sample, interleaved, median, nbytes, ratios, seconds
from bench.models import FULL, QUICK, LinenBlock, Sizes, linen_model, tokens
from bench.report import Row
from bench.subjects import Subject
from bench.targets import TARGETS

NAME = "11. harvest"
REPO = Path(__file__).resolve().parents[2]
SITES = LinenBlock  # every block's output: the residual stream after each block


@dataclasses.dataclass(frozen=True)
class HarvestSizes:
  """How much each row harvests, and how often."""

  batches: int  # throughput: batches per timed run
  reps: int
  memory_batches: int  # D: the smaller of the two datasets of the memory row
  resume_batches: int  # a full run of the resume row; it is killed at half
  resume_reps: int


SIZES = {
  FULL: HarvestSizes(batches=24, reps=5, memory_batches=8, resume_batches=128, resume_reps=2),
  QUICK: HarvestSizes(batches=4, reps=2, memory_batches=2, resume_batches=48, resume_reps=1),
}


def _batches(sizes: Sizes, count: int, seed: int = 1) -> Iterator[np.ndarray]:
  """`count` batches of random token ids, made one at a time (the same for the same seed)."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    yield rng.integers(0, sizes.vocab, (sizes.batch, sizes.seq), dtype=np.int32)


def _written() -> int:
  """Bytes this process has passed to write calls (`wchar` of /proc/self/io), or -1."""
  try:
    for line in Path("/proc/self/io").read_text().splitlines():
      if line.startswith("wchar:"):
        return int(line.split()[1])
  except OSError:
    pass
  return -1


def _missing() -> str | None:
  try:
    import tensorstore  # noqa: F401
  except ImportError:
    return "not installed"
  return None


# --- throughput ---------------------------------------------------------------------------------


def _throughput_row(subject: Subject, sizes: Sizes, chosen: HarvestSizes) -> Row:
  native_fn, (variables, _) = subject.jitted["native"]()
  tree = subject.tree
  batches = list(_batches(sizes, chosen.batches))
  count = chosen.batches * sizes.batch * sizes.seq  # tokens
  _, cache = fl.capture(tree, batches[0], SITES)
  rows_bytes = chosen.batches * sum(value.nbytes for value in cache.values())

  def forward() -> Sample:
    start = time.perf_counter()
    for batch in batches:
      out = native_fn(variables, batch)
    jax.block_until_ready(out)
    return {"total": time.perf_counter() - start}

  def captured() -> Sample:
    start = time.perf_counter()
    for batch in batches:
      _, cache = fl.capture(tree, batch, SITES)
      [np.asarray(value) for value in cache.values()]
    return {"total": time.perf_counter() - start}

  def harvest() -> Sample:
    directory = tempfile.mkdtemp(prefix="flaxlens-bench-")
    path = os.path.join(directory, "store")
    try:
      written = _written()
      start = time.perf_counter()
      fl.harvest(tree, batches, SITES, path, progress=False)
      total = time.perf_counter() - start
      written = _written() - written
      start = time.perf_counter()
      fl.harvest(tree, batches, SITES, path, progress=False)  # complete: the set-up only
      setup = time.perf_counter() - start
    finally:
      shutil.rmtree(directory, ignore_errors=True)
    return {"total": total, "setup": setup, "written": written}

  samples = interleaved({"harvest": harvest, "forward": forward, "capture": captured}, chosen.reps)
  ours, theirs = samples["harvest"], samples["forward"]
  took, native, capture = median(ours), median(theirs), median(samples["capture"])
  setup, written = median(ours, "setup"), median(ours, "written")
  steady = [f["total"] / (h["total"] - h["setup"]) for h, f in zip(ours, theirs, strict=True)]
  store = f"{nbytes(rows_bytes)} of rows, {nbytes(written)} passed to write calls"
  return Row(
    NAME,
    f"{subject.name}: fl.harvest of every block's output over {chosen.batches} batches"
    " / jitted native forward over the same batches (throughput)",
    "harvest_throughput",
    ratios(theirs, ours),  # a throughput ratio: the forward's time over the harvest's
    f"{count / took:,.0f} vs {count / native:,.0f} tokens/s",
    note=(
      f"{count} tokens in {chosen.batches} batches of {sizes.batch} x {sizes.seq}; every"
      f" position of {len(cache)} blocks, float32, store in a temporary directory on local"
      f" disk ({store}); a harvest call's set-up (timed as a call on the complete store)"
      f" {seconds(setup)}, without it the ratio is {np.median(steady):.3f}; fl.capture of"
      f" the same sites copied to the host, no store, {seconds(capture)}"
    ),
    analysis=(
      f"over {chosen.batches} batches the native forward takes {seconds(native)}, computing"
      f" the same sites with fl.capture and copying them to the host {seconds(capture)}"
      f" ({capture / native:.3f} of the forward), and fl.harvest {seconds(took)}: its set-up"
      " (tracing the model abstractly, checksums of the variables and the first batch,"
      f" reading the store's metadata) {seconds(setup)}, the rest {seconds(took - setup)}"
      f" ({(took - setup) / capture:.3f} of the capture with copies), writing {store}"
    ),
    profile=lambda: _harvest_once(tree, batches),
  )


def _harvest_once(tree: Any, batches: list[np.ndarray]) -> None:
  """One harvest into a new store, for a profile: the stores are deleted at exit, so that
  deleting them is not profiled."""
  directory = tempfile.mkdtemp(prefix="flaxlens-bench-")
  atexit.register(shutil.rmtree, directory, True)
  fl.harvest(tree, batches, SITES, os.path.join(directory, "store"), progress=False)


# --- harvests in fresh subprocesses -----------------------------------------------------------


def _spawn(quick: bool, batches: int, path: str, cache: str | None = None) -> subprocess.Popen:
  """A fresh Python process harvesting `batches` batches into `path` (see `_child`), with
  the persistent compilation cache at `cache` (None: none)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  spec = json.dumps({"quick": quick, "batches": batches, "path": path, "cache": cache})
  return subprocess.Popen(
    [sys.executable, "-m", "bench.cases.harvest", spec],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _finish(process: subprocess.Popen) -> dict[str, Any]:
  """What the child reported (its last line of output), or a RuntimeError with its stderr."""
  out, err = process.communicate()
  if process.returncode != 0:
    raise RuntimeError(f"the harvest subprocess failed ({process.returncode}):\n{err[-3000:]}")
  return json.loads(out.strip().splitlines()[-1])


def _run_child(quick: bool, batches: int, path: str, cache: str | None = None) -> dict[str, Any]:
  start = time.perf_counter()
  found = _finish(_spawn(quick, batches, path, cache))
  found["process"] = time.perf_counter() - start
  return found


def _status(field: str) -> int:
  """A size from /proc/self/status (VmRSS, VmHWM) in bytes, or -1."""
  try:
    for line in Path("/proc/self/status").read_text().splitlines():
      if line.startswith(f"{field}:"):
        return int(line.split()[1]) * 1024
  except OSError:
    pass
  return -1


def _reset_peak() -> bool:
  """Resets the process's peak resident set (VmHWM) to its current one, where Linux can."""
  try:
    Path("/proc/self/clear_refs").write_text("5")
  except OSError:
    return False
  return _status("VmHWM") > 0


def _child(spec: dict[str, Any]) -> None:
  """In a fresh process: builds the Linen subject's model and tree, harvests, and prints
  the harvest call's time, the resident set when it started, its median over the last
  quarter of the batches and its peak during the call (the peak of the whole process where
  the peak cannot be reset), then the time of the same call on the complete store (its
  set-up)."""
  sizes = QUICK if spec["quick"] else FULL
  if spec.get("cache"):
    fl.enable_compilation_cache(spec["cache"])
  model, variables = linen_model(sizes, sizes.layers)
  x = tokens(sizes)
  tree = fl.unflaxify(model, variables, x)
  resident = []

  def batches() -> Iterator[np.ndarray]:
    for batch in _batches(sizes, spec["batches"]):
      resident.append(_status("VmRSS"))  # as each batch is asked for
      yield batch

  gc.collect()
  reset = _reset_peak()
  before = _status("VmRSS")
  start = time.perf_counter()
  fl.harvest(tree, batches(), SITES, spec["path"], progress=False)
  took = time.perf_counter() - start
  process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
  peak = _status("VmHWM") if reset else process_peak
  start = time.perf_counter()
  fl.harvest(tree, _batches(sizes, spec["batches"]), SITES, spec["path"], progress=False)
  setup = time.perf_counter() - start
  found = {"harvest": took, "setup": setup, "before": before, "peak": peak, "reset": reset}
  found["late"] = float(np.median(resident[-max(1, len(resident) // 4) :]))
  print(json.dumps({**found, "process_peak": process_peak}), flush=True)


def _committed(path: str) -> int:
  """The batches the store at `path` has committed (its progress.json), 0 before any."""
  try:
    return int(json.loads(Path(path, "progress.json").read_text())["batches"])
  except (OSError, ValueError, KeyError):
    return 0


# --- memory -----------------------------------------------------------------------------------


def _memory_row(subject: Subject, sizes: Sizes, chosen: HarvestSizes, quick: bool) -> Row:
  small, large = chosen.memory_batches, 10 * chosen.memory_batches
  found = {}
  with tempfile.TemporaryDirectory(prefix="flaxlens-bench-") as directory:
    for count in (small, large):
      found[count] = _run_child(quick, count, os.path.join(directory, f"store-{count}"))
  one, ten = found[small], found[large]
  how = (
    "VmHWM, reset when the harvest call starts"
    if one["reset"] and ten["reset"]
    else "ru_maxrss: the whole process's peak, as /proc/self/clear_refs could not reset it"
  )
  grew = ", ".join(f"{nbytes(f['peak'] - f['before'])}" for f in (one, ten))
  return Row(
    NAME,
    f"{subject.name}: peak host RSS during fl.harvest over {large} batches / over {small} batches",
    "harvest_rss_flat",
    np.array([ten["peak"] / one["peak"]]),
    f"{nbytes(ten['peak'])} vs {nbytes(one['peak'])}",
    note=(
      f"each harvest in a fresh subprocess, batches from a generator; peak during the"
      f" harvest call ({how}); the call started at {nbytes(one['before'])} and"
      f" {nbytes(ten['before'])} resident and peaked {grew} above that; resident over the"
      f" last quarter of the batches {nbytes(one['late'])} and {nbytes(ten['late'])}"
      f" (medians); the processes'"
      f" own peaks (ru_maxrss, model building included) {nbytes(one['process_peak'])} and"
      f" {nbytes(ten['process_peak'])}; harvest calls took {seconds(one['harvest'])} and"
      f" {seconds(ten['harvest'])}"
    ),
    analysis=(
      f"over {small} batches the harvest call peaked {nbytes(one['peak'] - one['before'])}"
      f" above the resident set it started with, over {large} batches"
      f" {nbytes(ten['peak'] - ten['before'])}; the resident set over the last quarter of"
      f" the batches was {nbytes(one['late'])} and {nbytes(ten['late'])} (medians)"
    ),
  )


# --- resume -------------------------------------------------------------------------------------


def _killed_at_half(quick: bool, batches: int, path: str, cache: str) -> int:
  """Runs a harvest of `batches` batches in a subprocess and SIGKILLs it once half are
  committed; returns the batches committed (`batches` when it finished first)."""
  process = _spawn(quick, batches, path, cache)
  try:
    while process.poll() is None and _committed(path) < batches // 2:
      time.sleep(0.001)
    if process.poll() is None:
      process.send_signal(signal.SIGKILL)
  finally:
    process.communicate()
  return _committed(path)


def _resume_row(subject: Subject, sizes: Sizes, chosen: HarvestSizes, quick: bool) -> Row:
  total = chosen.resume_batches
  resumed, full, committed = [], [], []
  with tempfile.TemporaryDirectory(prefix="flaxlens-bench-") as directory:
    cache = os.path.join(directory, "compilation-cache")
    for rep in range(chosen.resume_reps):
      killed, whole = (os.path.join(directory, f"{name}-{rep}") for name in ("killed", "full"))
      committed.append(_killed_at_half(quick, total, killed, cache))
      order = [("resumed", killed), ("full", whole)]
      for name, path in order if rep % 2 == 0 else reversed(order):
        sample = _run_child(quick, total, path, cache)
        (resumed if name == "resumed" else full).append(sample)
        shutil.rmtree(path, ignore_errors=True)
  ratio = np.array([r["harvest"] / f["harvest"] for r, f in zip(resumed, full, strict=True)])
  took_resumed, took_full = median(resumed, "harvest"), median(full, "harvest")
  fraction = float(np.median(committed)) / total
  # full = fixed + total * per_batch; resumed = fixed + (1 - fraction) * total * per_batch
  per_batch = (took_full - took_resumed) / (fraction * total) if fraction else float("nan")
  fixed = took_full - total * per_batch
  limit = TARGETS["harvest_resume"].limit
  # The batches from which a run killed at half meets the limit, at these costs.
  needed = fixed * (1 - limit) / (per_batch * (limit - 0.5)) if per_batch > 0 else float("nan")
  killed_text = ", ".join(f"{c}/{total}" for c in committed)
  late = any(c >= total for c in committed)
  status = "not measured (a run finished before its kill)" if late else ""
  return Row(
    NAME,
    f"{subject.name}: fl.harvest resumed after a SIGKILL at half of {total} batches / a full"
    " harvest",
    "harvest_resume",
    ratio,
    f"{seconds(took_resumed)} vs {seconds(took_full)}",
    status=status,
    note=(
      f"each run in a fresh subprocess, timing its fl.harvest call (so each counts one"
      f" trace, a compiled program read from the shared persistent compilation cache, and"
      f" one set-up); batches committed when the kill landed: {killed_text}"
      f"{' (the run finished before the kill: no resume measured)' if late else ''};"
      f" whole processes took {seconds(median(resumed, 'process'))} and"
      f" {seconds(median(full, 'process'))}; a call on the complete store (the set-up"
      f" alone) {seconds(median(full, 'setup'))}"
    ),
    analysis=(
      f"the resumed run had {100 * (1 - fraction):.0f}% of the batches left; solving"
      " full = fixed + batches x per-batch and resumed = fixed + left x per-batch gives a"
      f" fixed cost per run (trace of the harvest's program, reading it from the cache,"
      f" set-up, skipping the"
      f" committed batches) of {seconds(fixed)} of the full run's {seconds(took_full)}, and"
      f" {seconds(per_batch)} per batch; at these costs a harvest killed at half meets"
      f" ≤ {limit} from about {needed:.0f} batches"
    ),
  )


# --- capture everything under a budget -----------------------------------------------------------


class _LivePeak:
  """The peak bytes of live device arrays beyond those alive at the start, sampled by a
  thread every millisecond while the `with` block runs."""

  def __enter__(self) -> _LivePeak:
    import threading

    self._base = self._live()
    self.peak = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  @staticmethod
  def _live() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())

  def _sample(self) -> None:
    while not self._stop.is_set():
      self.peak = max(self.peak, self._live() - self._base)
      time.sleep(0.001)

  def __exit__(self, *exc: Any) -> None:
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, self._live() - self._base)


def _budget_row(subject: Subject, sizes: Sizes, quick: bool) -> Row:
  tree = subject.tree
  tokens = np.asarray(next(_batches(sizes, 1, seed=3)))
  tokens = np.concatenate([tokens] * (2 if quick else 4))  # a bigger batch than the others
  jax.block_until_ready(tokens)
  _, whole = fl.capture(tree, tokens)  # compiles the unbudgeted program
  captured = sum(value.nbytes for value in jax.tree_util.tree_leaves(whole))
  budget = captured // 3
  fl.capture(tree, tokens, budget=budget)  # compiles the chunks' program
  reps = 1 if quick else 3
  peaks, unbudgeted_peaks, took, took_whole = [], [], [], []
  out = split = out_whole = whole = None
  for _ in range(reps):
    out = split = out_whole = whole = None  # the last repetition's: each sample starts alike
    gc.collect()
    with _LivePeak() as live:
      start = time.perf_counter()
      out, split = fl.capture(tree, tokens, budget=budget)
      took.append(time.perf_counter() - start)
    peaks.append(live.peak)
    gc.collect()
    with _LivePeak() as live:
      start = time.perf_counter()
      out_whole, whole = fl.capture(tree, tokens)
      jax.block_until_ready(whole)
      took_whole.append(time.perf_counter() - start)
    unbudgeted_peaks.append(live.peak)
  pairs = [
    (np.asarray(a), np.asarray(b))
    for a, b in zip(
      jax.tree_util.tree_leaves((out, split)),
      jax.tree_util.tree_leaves((out_whole, whole)),
      strict=True,
    )
  ]
  equal = sum(a.tobytes() == b.tobytes() for a, b in pairs)
  largest = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in pairs)
  ratio = np.asarray(peaks, np.float64) / budget
  status = "" if equal == len(pairs) or largest <= 1e-5 else "FAILED: results differ"
  return Row(
    NAME,
    f"{subject.name}: fl.capture of every call ({len(split)} captures) at a batch of"
    f" {len(tokens)}, budget= a third of its {captured / 2**20:.1f} MiB: peak live device"
    " bytes / budget",
    "capture_budget",
    ratio,
    f"peak {np.median(peaks) / 2**20:.2f} MiB vs budget {budget / 2**20:.2f} MiB",
    status=status,
    note=(
      f"unbudgeted, the same sampler saw {np.median(unbudgeted_peaks) / 2**20:.2f} MiB;"
      f" {equal} of {len(pairs)} arrays equal the unbudgeted capture bit for bit, the"
      f" largest difference is {largest:.2g}; the budgeted call took"
      f" {seconds(float(np.median(took)))} vs {seconds(float(np.median(took_whole)))}"
      " unbudgeted"
    ),
  )


# --- the case -----------------------------------------------------------------------------------


def measure(subjects: list[Subject], sizes: Sizes, progress: Progress) -> list[Row]:
  subject = next(s for s in subjects if s.framework == "Linen")
  chosen = SIZES.get(sizes, SIZES[FULL])
  quick = sizes == QUICK
  steps = (
    ("throughput", "harvest_throughput", lambda: _throughput_row(subject, sizes, chosen)),
    ("peak memory", "harvest_rss_flat", lambda: _memory_row(subject, sizes, chosen, quick)),
    ("resume", "harvest_resume", lambda: _resume_row(subject, sizes, chosen, quick)),
  )
  budget_steps = (("budget", "capture_budget", lambda: _budget_row(subject, sizes, quick)),)
  missing = _missing()
  rows = []
  for what, target, make in steps:
    progress(f"{NAME}: {what}, {subject.name}")
    if missing:
      rows.append(
        Row(NAME, f"{subject.name}: fl.harvest {what} (TensorStore)", target, status=missing)
      )
    else:
      rows.append(make())
  for what, _, make in budget_steps:  # needs no TensorStore
    progress(f"{NAME}: {what}, {subject.name}")
    rows.append(make())
  return rows


if __name__ == "__main__":
  _child(json.loads(sys.argv[1]))
