"""flaxlens benchmarks: the speed targets of the design brief, measured as ratios in one run.

Every case runs its contenders interleaved (A B, then B A, ...) and repeated in one
process, so that a noisy, shared machine slows both sides of a ratio alike; it reports
each contender's median and the median and interquartile range of the per-repetition
ratios. Where a target is missed, the report says by how much, splits the cost into its
measured parts and adds a cProfile summary of the flaxlens side. Penzai is an optional
comparison (`pip install -e ".[bench]"`); without it its rows say "not installed", as do
case 14's rows (TransformerLens, nnsight and PyTorch next to flaxlens on one Hugging Face
GPT-2) without the packages of `pip install -e ".[bench,models]"` (a CPU torch first), and
case 15's SAELens rows without `FLAXLENS_BENCH_SAELENS_PYTHON` naming the interpreter of an
environment with `sae-lens` installed (its pins clash with ours), and case 16's
circuit-tracer rows without `FLAXLENS_BENCH_CIRCUIT_TRACER_PYTHON` (likewise). Rows whose
API does not exist yet say "not yet available".

This file is the entry point; the package `bench` holds the harness, the models, the
table of targets (`bench/targets.py`), one module per case (`bench/cases/`) and the report.

Usage:
  python bench/run.py          # full run, ~15 minutes on 2 cores; rewrites docs/BENCHMARKS.md
  python bench/run.py --quick  # tiny model, few repetitions, no profiles (CI smoke); prints only
  python bench/run.py --out -  # full run, printed only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script, Python puts bench/ on the path; the package `bench` needs the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cases import (
  compare,
  compilation_cache,
  compile_time,
  conversion,
  dictionaries,
  eager_call,
  experts,
  extra_bytes,
  graphs,
  harvest,
  heads,
  interventions,
  isolate_replay,
  jitted_forward,
  paths,
  sweeps,
)
from bench.models import FULL, QUICK
from bench.report import DOC, Row, closing_notes, render
from bench.subjects import Subjects, make_subjects

# In the order of the report; compile_time quotes what jitted_forward found.
CASES = (
  jitted_forward,
  compile_time,
  conversion,
  eager_call,
  interventions,
  extra_bytes,
  isolate_replay,
  sweeps,
  heads,
  experts,
  harvest,
  paths,
  compilation_cache,
  compare,
  dictionaries,
  graphs,
)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes, few reps, print only")
  parser.add_argument("--out", help=f"where to write the report ('-': print only; default {DOC})")
  names = [case.__name__.rpartition(".")[2] for case in CASES]
  parser.add_argument(
    "--cases",
    help=f"comma-separated cases to run (default: all; {', '.join(names)}); a partial run"
    " prints only",
  )
  args = parser.parse_args(argv)
  cases = CASES
  if args.cases:
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
      parser.error(f"unknown case(s) {unknown}; choose from {names}")
    cases = tuple(case for case, name in zip(CASES, names, strict=True) if name in chosen)
    if args.out not in (None, "-"):
      parser.error("a partial run (--cases) is not the benchmark; it prints only.")
    args.out = "-"
  out = args.out or ("-" if args.quick else str(DOC))
  if args.quick and out != "-" and Path(out).resolve() == DOC:
    parser.error(f"--quick numbers are not the benchmark; it does not write {DOC}.")
  sizes = QUICK if args.quick else FULL
  started = time.perf_counter()

  def progress(message: str) -> None:
    print(f"[{time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

  # A case that builds its own models says so (USES_SUBJECTS = False).
  if any(getattr(case, "USES_SUBJECTS", True) for case in cases):
    subjects = make_subjects(sizes, progress)
  else:
    subjects = Subjects([], [])
  rows: list[Row] = []
  for case in cases:
    rows += case.measure(subjects, sizes, progress)

  command = "python bench/run.py" + (" --quick" if args.quick else "")
  command += f" --cases {args.cases}" if args.cases else ""
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
