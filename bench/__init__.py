"""flaxlens benchmarks: the design brief's speed targets, measured as ratios in one run.

The command is `python bench/run.py` (see `bench/run.py`). The package splits the work:
`harness` times contenders interleaved and profiles them, `models` holds the benchmark
models and their sizes, `subjects` puts each model in native and converted form next to
the calls the cases time, `targets` is the one table of targets (value and reason),
`cases/` has one module per case, and `report` turns result rows into the table of
docs/BENCHMARKS.md.
"""
