"""Attribution graphs (public as `flaxlens.graphs`), standing on `tools/base`,
`tools/files` and `tools/dictionaries`:

- `_freeze`: a call frozen for the replacement model (its own jaxpr re-evaluated with
  stop-gradients on its square roots or exponentials).
- `_model`: the replacement model of a tree: its MLPs, embedding, norms and attentions,
  the frozen forward, and the check that it is affine in the writes.
- `_targets`: the logit targets.
- `_graph`: the graph: clean run, the forward linearised once and its rows as vmapped
  transposes (a branch per depth), edge columns in groups, feature selection.
- `_prune`: pruning by influence.
- `_files`, `_page`: the viewers' JSON files and the static page.
- `_check`, `_share`: checking a feature's effect; attention's share of a score.
- `_demo`: a small model and graph to try the tools on.
"""
