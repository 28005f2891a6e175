"""Tools on converted trees, written against the runtime (`core`) and the adapter interface
only; one subpackage per job, all standing on `base`:

- `base`: what every job shares: sites and their resolution, interventions as data, the
  probed run (eager, compiled, chunked under a budget), the calling convention, budgets,
  and the one comparison. It imports no other job.
- `analysis`: edit and read the calls of a tree (run, capture, interventions, sweeps,
  attribution).
- `isolation`: cut one call out of a run with what it saw, and replay it.
- `files`: the files flaxlens writes and reads (artifacts, intervention sets), every one
  treated as untrusted input on load.
- `export`: the way back to Flax (fold edits into weights, check equivalence, save
  exported variables).
- `view`: what people look at (text summary, HTML).
"""
