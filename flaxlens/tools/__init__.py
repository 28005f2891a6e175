"""Tools that work on converted trees: summaries (and, later, isolate, capture, export)."""
