"""What every tool shares, at the bottom of `tools`: the other jobs (analysis, harvest,
export, isolation, files, view, and the families to come) import these modules, never
each other's private names.

- `_sites`: the sites of a tree, their names, and how a site pattern resolves to them.
- `_intervention`: the `Intervention` (one edit of a call, as data).
- `_probed`: the probed run (`fl.run`, `fl.capture`, `fl.place`): eager, compiled, or
  compiled in chunks under a memory budget.
- `_calling`: the calling convention (the model's arguments as one positional value).
- `_budget`: the arithmetic of memory budgets and of splitting a batch into chunks.
- `_index`, `_parts`: the index rules of `where=`/`index=`, and the `part=` rule.
- `_compare`: the one comparison of trees and states (`fl.EquivalenceReport`).
"""
