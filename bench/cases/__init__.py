"""The benchmark cases, one module per case.

Every case module has `measure(subjects, sizes, progress) -> list[Row]`: it times its
contenders on the subjects (a list of those at the main depth, `subjects.scaled` those at
every depth of `sizes.scales`) or on models of its own with `bench.harness`, and returns
rows of the results table, each naming the target it checks by its key in
`bench.targets.TARGETS`. `bench/run.py` runs them in the order of the report.
"""
