"""Checking what a graph claims (`flg.check`): the effect the graph predicts for a feature
on a logit target against the model's measured response when the feature is ablated
through the dictionaries' splice (`fld.splice`, error terms kept, so the unedited model
is the model's own). No Flax internals here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from flaxlens.errors import ArgumentError
from flaxlens.tools.base._intervention import make_intervention
from flaxlens.tools.base._probed import run
from flaxlens.tools.dictionaries._modules import CrossLayerTranscoder
from flaxlens.tools.dictionaries._splicing import splice
from flaxlens.tools.graphs._graph import Graph


class Check(NamedTuple):
  """A feature's effect on a logit target when the feature is ablated (set to zero).

  Attributes:
    direct: what the graph's edge says: `-A[target, feature]`, the change through the
      residual stream with everything else (attention patterns, norm scales, the other
      features) held as on the clean run.
    predicted: what the graph says with the features downstream changing along its
      edges (their pre-activations move by the edges; those that stay active move their
      activations by as much): its linear prediction of the model's response.
    measured: the model's own response: the target (the demeaned logit, or the
      `flg.Target`'s direction) with the feature zero-ablated, less the clean one, every
      later feature recomputed, attention and norms live.
  """

  direct: float
  predicted: float
  measured: float


def _feature_row(graph: Graph, feature: Sequence[int]) -> int:
  layer, position, index = (int(v) for v in feature)
  chosen = graph.active_features[graph.selected]
  found = np.flatnonzero((chosen == (layer, position, index)).all(axis=1))
  if not len(found):
    raise ArgumentError(
      f"flg.check: feature (layer {layer}, position {position}, feature {index}) is no node of"
      " the graph (inactive, at position 0, or dropped by max_feature_nodes). Give one of"
      " graph.active_features[graph.selected]."
    )
  return int(found[0])


def _predicted(graph: Graph, node: int, target: int) -> float:
  """`-` the target's change along the graph's feature-to-feature edges."""
  n = graph.n_features
  features = graph.rows[:n, :n]  # [target feature, source feature]
  activations = graph.activations[graph.selected]
  change = np.zeros(n, np.float64)
  change[node] = -activations[node]
  for _ in range(graph.layers):  # one layer of features further each pass
    scaled = features @ (change / activations)
    change = np.where(np.arange(n) == node, -activations[node], np.maximum(scaled, -activations))
  logit_row = graph.rows[n + target, :n]
  return float(logit_row @ (change / activations))


def check(
  graph: Graph,
  tree: Any,
  args: Any,
  transcoders: Any,
  at: Sequence[Any],
  feature: Sequence[int],
  target: int = 0,
) -> Check:
  """The graph's direct and predicted effect of ablating `feature` on logit target
  `target` against the model's measured response.

  Args:
    graph: the graph (`flg.attribute` on `tree`, `args`, `transcoders`, `at`).
    tree: the converted model.
    args: the prompt, as for `flg.attribute`.
    transcoders: the transcoders (a list, or a CLT), as for `flg.attribute`.
    at: the MLP calls, as for `flg.attribute`.
    feature: `(layer, position, feature)`, a feature node of the graph.
    target: which logit target (an index into `graph.targets`).

  Example:
    >>> import flaxlens.graphs as flg
    >>> tree, tokens, transcoders, mlps = flg.demo_model()
    >>> graph = flg.attribute(tree, tokens, transcoders, mlps)
    >>> feature = graph.active_features[graph.selected[0]]
    >>> result = flg.check(graph, tree, tokens, transcoders, mlps, feature)
    >>> sorted(result._fields)
    ['direct', 'measured', 'predicted']
  """
  if not 0 <= target < len(graph.targets.ids):
    raise ArgumentError(
      f"flg.check: target={target!r} is not one of the graph's {len(graph.targets.ids)}"
      " logit targets. Give an index into graph.targets."
    )
  node = _feature_row(graph, feature)
  layer, position, index = (int(v) for v in feature)
  direct = -float(graph.rows[graph.n_features + target, node])
  names = list(at)
  if isinstance(transcoders, CrossLayerTranscoder):
    spliced = splice(tree, transcoders, names)
    site = f"{names[layer]}/clt/activation"
  else:
    spliced = tree
    for name, transcoder in zip(names, transcoders, strict=True):
      spliced = splice(spliced, transcoder, name)
    site = f"{names[layer]}/transcoder/activation"
  ablation = make_intervention("zero", site, (), jnp.s_[..., position, index], "output", None)
  direction = graph.targets.directions[target]

  def value(output: Any) -> float:
    return float(np.asarray(output).reshape(-1, direction.shape[0])[-1] @ direction)

  clean = value(run(spliced, args))
  ablated = value(run(spliced, args, interventions=[ablation]))
  return Check(direct=direct, predicted=_predicted(graph, node, target), measured=ablated - clean)
