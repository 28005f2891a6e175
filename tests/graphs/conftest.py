"""Shared settings of the attribution graphs' tests."""

# The fixtures' generator runs in an environment of its own, with torch, TransformerLens
# and circuit-tracer (its docstring says how); pytest's doctest collection must not import it.
collect_ignore = ["fixtures/make_fixtures.py"]
