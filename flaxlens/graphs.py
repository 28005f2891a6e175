"""Attribution graphs: `import flaxlens.graphs as flg`.

The direct effects between a prompt's active transcoder features, error terms, tokens
and output logits through the replacement model (transcoders standing in for the MLPs,
attention patterns and normalisation scales frozen), as circuit-tracer computes them;
pruning; the viewers' JSON files and a static page; checking a graph's claims by
intervening on its features; attention's share of a pattern entry. See the
"Attribution graphs" page.
"""

from flaxlens.tools.graphs._check import Check, check
from flaxlens.tools.graphs._demo import demo_graph, demo_model
from flaxlens.tools.graphs._files import graph_json, load, save
from flaxlens.tools.graphs._graph import Graph, attribute
from flaxlens.tools.graphs._model import Freeze
from flaxlens.tools.graphs._page import graph_page
from flaxlens.tools.graphs._prune import Pruned, prune
from flaxlens.tools.graphs._share import AttentionShare, attention_share
from flaxlens.tools.graphs._targets import Target, Targets

__all__ = [
  "attribute",
  "Graph",
  "Freeze",
  "Target",
  "Targets",
  "prune",
  "Pruned",
  "graph_json",
  "save",
  "load",
  "graph_page",
  "check",
  "Check",
  "attention_share",
  "AttentionShare",
  "demo_model",
  "demo_graph",
]
