"""Pruning an attribution graph (`flg.prune`) by influence on the logits, as the reference
does (`../shared/GRAPHS.md`, "Pruning"), on the graph's nonzero rows only (error and
token rows are zero, so the dense `[nodes, nodes]` matrix is never built).
No Flax internals here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from flaxlens.errors import ArgumentError
from flaxlens.tools.graphs._graph import Graph


class Pruned(NamedTuple):
  """What pruning keeps.

  Attributes:
    nodes: which nodes are kept, `[nodes]` (tokens and logits always).
    edges: which edges of `graph.rows` are kept, `[rows, nodes]`.
    influence: each node's influence on the logits, `[nodes]`.
    cumulative: each node's cumulative influence fraction (largest first), `[nodes]`.
  """

  nodes: np.ndarray
  edges: np.ndarray
  influence: np.ndarray
  cumulative: np.ndarray


def _normalised(rows: np.ndarray) -> np.ndarray:
  absolute = np.abs(rows)
  return absolute / np.maximum(absolute.sum(axis=1, keepdims=True), 1e-10)


def _influence(
  normalised: np.ndarray, row_nodes: np.ndarray, weights: np.ndarray, max_iter: int = 1000
) -> np.ndarray:
  """`w B + w B^2 + ...` with `B` the normalised rows placed at `row_nodes`."""
  current = weights[row_nodes] @ normalised
  total = current.copy()
  for _ in range(max_iter):
    if not current.any():
      return total
    current = current[row_nodes] @ normalised
    total += current
  raise ArgumentError("flg.prune: the influence did not converge (the graph's rows hold a cycle).")


def _threshold(scores: np.ndarray, fraction: float, size: int) -> float:
  """The score keeping `fraction` of the total (over `size` entries, the rest zero)."""
  ordered = np.sort(scores.ravel())[::-1]
  total = ordered.sum()
  if total == 0:
    return 0.0
  index = int(np.searchsorted(np.cumsum(ordered) / total, fraction))
  return (
    float(ordered[index])
    if index < len(ordered)
    else (0.0 if size > len(ordered) else float(ordered[-1]))
  )


def prune(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
  """Keeps the nodes holding `node_threshold` of the influence on the logits and the
  edges holding `edge_threshold` of the edge scores, then drops features and errors left
  with no outgoing edge and features with no incoming one, until nothing changes.

  Args:
    graph: an attribution graph (`flg.attribute`).
    node_threshold: the fraction of node influence kept (0.8, as the reference).
    edge_threshold: the fraction of edge score kept (0.98).

  Example:
    >>> import flaxlens.graphs as flg
    >>> graph = flg.demo_graph()
    >>> pruned = flg.prune(graph)
    >>> bool(pruned.nodes[-len(graph.targets.ids):].all())  # logits are always kept
    True
  """
  for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
    if not 0.0 <= value <= 1.0:
      raise ArgumentError(f"flg.prune: {name}={value!r} is a fraction of influence, from 0 to 1.")
  n, n_logits, n_features = graph.n_nodes, len(graph.targets.ids), graph.n_features
  kept_always = n_logits + graph.positions
  row_nodes = graph.row_nodes
  weights = np.zeros(n, np.float32)
  weights[n - n_logits :] = graph.targets.probabilities
  influence = _influence(_normalised(graph.rows), row_nodes, weights)
  nodes = influence >= _threshold(influence, node_threshold, n)
  nodes[n - kept_always :] = True
  rows = np.where(nodes[row_nodes][:, None] & nodes[None, :], graph.rows, 0)
  normalised = _normalised(rows)
  scores = normalised * (_influence(normalised, row_nodes, weights) + weights)[row_nodes][:, None]
  edges = scores >= _threshold(scores, edge_threshold, n * n)
  previous = None
  while previous is None or (nodes != previous).any():
    previous = nodes.copy()
    edges &= nodes[row_nodes][:, None] & nodes[None, :]
    outgoing = edges.any(axis=0)
    nodes[: n - kept_always] &= outgoing[: n - kept_always]
    incoming = np.zeros(n, bool)
    incoming[row_nodes] = edges.any(axis=1)
    nodes[:n_features] &= incoming[:n_features]
  order = np.argsort(-influence, kind="stable")
  cumulative = np.zeros(n, np.float32)
  cumulative[order] = np.cumsum(influence[order]) / max(float(influence.sum()), 1e-30)
  return Pruned(nodes, edges, influence, cumulative)
