"""Tools on converted trees, written against the runtime and the adapter interface only:
isolate and replay, artifacts, summaries."""
