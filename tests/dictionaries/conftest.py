"""Shared settings of the dictionaries' tests."""

# The fixtures' generator runs in an environment of its own, with torch, SAELens and
# circuit-tracer (its docstring says how); pytest's doctest collection must not import it.
collect_ignore = ["fixtures/make_fixtures.py"]
