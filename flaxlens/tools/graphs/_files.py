"""Graph files: the JSON that circuit-tracer's and Neuronpedia's viewers read
(`graph_json`, `save`), and reading one back (`load`: bounded, strict JSON, checked
against `attribution-graph.schema.json`, every link between nodes the file holds).

Node ids follow the reference (`{layer}_{feature}_{position}` for a feature,
`E_{token}_{position}` for a token, `{layers + 1}_{token}_{position}` for a logit) except
an error's: the reference writes `0_{layer}_{position}`, the id of layer 0's feature
`layer` at that position; here it is `err_{layer}_{position}`, which no other node has.
No Flax internals here.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from flaxlens.errors import ArgumentError, ArtifactError
from flaxlens.tools.files._schemas import check_schema, read_json
from flaxlens.tools.graphs._graph import Graph
from flaxlens.tools.graphs._prune import Pruned, prune

MAX_BYTES = 512 * 2**20


def _cantor(x: int, y: int) -> int:
  return (x + y) * (x + y + 1) // 2 + y


def node_ids(graph: Graph) -> list[str]:
  """Every node's id, in node order (see the module docstring)."""
  L, P, last = graph.layers, graph.positions, graph.positions - 1
  ids = [f"{layer}_{f}_{p}" for layer, p, f in graph.active_features[graph.selected]]
  ids += [f"err_{layer}_{p}" for layer in range(L) for p in range(P)]
  ids += [f"E_{int(t)}_{p}" for p, t in enumerate(graph.tokens)]
  ids += [
    f"{L + 1}_{int(t) if t >= 0 else 'target' + str(k)}_{last}"
    for k, t in enumerate(graph.targets.ids)
  ]
  return ids


def _nodes(graph: Graph, pruned: Pruned, tokens: Sequence[str]) -> list[dict]:
  ids, L, P = node_ids(graph), graph.layers, graph.positions
  nodes = []
  for index in np.flatnonzero(pruned.nodes):
    node: dict[str, Any] = {"node_id": ids[index], "run_idx": 0, "reverse_ctx_idx": 0, "clerp": ""}
    influence = float(pruned.cumulative[index])
    if index < graph.n_features:
      layer, p, f = (int(v) for v in graph.active_features[graph.selected[index]])
      activation = float(graph.activations[graph.selected[index]])
      node.update(
        feature=_cantor(layer, f),
        layer=str(layer),
        ctx_idx=p,
        feature_type="cross layer transcoder",
        jsNodeId=f"{layer}_{f}-0",
        influence=influence,
        activation=activation,
      )
    elif index < graph.n_features + L * P:
      layer, p = divmod(int(index) - graph.n_features, P)
      node.update(
        feature=-1,
        layer=str(layer),
        ctx_idx=p,
        feature_type="mlp reconstruction error",
        jsNodeId=f"err_{layer}_{p}-0",
        influence=influence,
      )
    elif index < graph.n_features + (L + 1) * P:
      p = int(index) - graph.n_features - L * P
      token = int(graph.tokens[p])
      node.update(
        feature=p,
        layer="E",
        ctx_idx=p,
        feature_type="embedding",
        jsNodeId=f"E_{token}-{p}",
        influence=influence,
        clerp=tokens[p],
      )
    else:
      k = int(index) - graph.n_features - (L + 1) * P
      probability = float(graph.targets.probabilities[k])
      token = int(graph.targets.ids[k])
      label = graph.targets.labels[k]
      node.update(
        feature=token,
        layer=str(L + 1),
        ctx_idx=P - 1,
        feature_type="logit",
        jsNodeId=f"L_{token}-{P - 1}",
        token_prob=probability,
        is_target_logit=True,
        clerp=f'Output "{label}" (p={probability:.3f})',
      )
    nodes.append(node)
  return nodes


def graph_json(
  graph: Graph,
  *,
  slug: str = "graph",
  prompt_tokens: Sequence[str] | None = None,
  pruned: Pruned | None = None,
  node_threshold: float = 0.8,
  edge_threshold: float = 0.98,
  scan: str = "flaxlens",
  transcoder_list: Sequence[str] = (),
) -> dict:
  """The graph as the viewers' JSON object (pruned with `flg.prune` unless `pruned=`).

  Args:
    graph: the graph (`flg.attribute`).
    slug: its name in the viewers' list.
    prompt_tokens: each position's text (default: the token ids as text).
    pruned: a pruning of `graph` (default: `flg.prune(graph, node_threshold,
      edge_threshold)`).
    node_threshold: pruning's node threshold, also recorded in the metadata.
    edge_threshold: pruning's edge threshold.
    scan: the name of the transcoder set, for the viewers.
    transcoder_list: the transcoders' names, for the viewers.

  Example:
    >>> import flaxlens.graphs as flg
    >>> data = flg.graph_json(flg.demo_graph(), slug="demo")
    >>> sorted(data), data["metadata"]["slug"]
    (['links', 'metadata', 'nodes', 'qParams'], 'demo')
  """
  tokens = (
    [str(int(t)) for t in graph.tokens]
    if prompt_tokens is None
    else [str(t) for t in prompt_tokens]
  )
  if len(tokens) != graph.positions:
    raise ArgumentError(
      f"flg.graph_json: prompt_tokens= has {len(tokens)} entries for a prompt of"
      f" {graph.positions} positions. Give one text per position."
    )
  pruned = prune(graph, node_threshold, edge_threshold) if pruned is None else pruned
  ids = node_ids(graph)
  row_nodes = graph.row_nodes
  targets, sources = np.nonzero(
    pruned.edges & pruned.nodes[row_nodes][:, None] & pruned.nodes[None, :]
  )
  links = [
    {"source": ids[s], "target": ids[row_nodes[t]], "weight": float(graph.rows[t, s])}
    for t, s in zip(targets, sources, strict=True)
  ]
  return {
    "metadata": {
      "slug": slug, "scan": scan, "transcoder_list": list(transcoder_list), "prompt_tokens": tokens,
      "prompt": "".join(tokens), "node_threshold": node_threshold, "schema_version": 1,
    },
    "qParams": {
      "pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": "",
    },
    "nodes": _nodes(graph, pruned, tokens),
    "links": links,
  }  # fmt: skip


def save(data: dict, directory: str | os.PathLike) -> pathlib.Path:
  """Writes `data` (`flg.graph_json`) as `<slug>.json` in `directory` and lists it in the
  directory's `graph-metadata.json` (as the viewers expect); returns the graph's path.

  Example:
    >>> import flaxlens.graphs as flg, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> path = flg.save(flg.graph_json(flg.demo_graph(), slug="demo"), folder)
    >>> path.name, len(flg.load(path)["nodes"]) > 0
    ('demo.json', True)
  """
  check_schema(
    data, "attribution-graph", "flg.save: data", "Give the object flg.graph_json returns."
  )
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  slug = data["metadata"]["slug"]
  if not slug or "/" in slug or "\\" in slug or slug.startswith("."):
    raise ArgumentError(f"flg.save: the slug {slug!r} is a file name: no '/', '\\' or leading '.'.")
  path = directory / f"{slug}.json"
  _atomic(path, json.dumps(data, allow_nan=False))
  listing_path = directory / "graph-metadata.json"
  listing = load_listing(listing_path) if listing_path.exists() else {"graphs": []}
  entry = {k: data["metadata"][k] for k in ("slug", "scan", "prompt_tokens", "prompt")}
  listing["graphs"] = [g for g in listing["graphs"] if g.get("slug") != slug] + [entry]
  _atomic(listing_path, json.dumps(listing, indent=2))
  return path


def _atomic(path: pathlib.Path, text: str) -> None:
  partial = path.with_name(path.name + ".partial")
  partial.write_text(text, encoding="utf-8")
  os.replace(partial, path)


def _read(path: str | os.PathLike, where: str) -> Any:
  path = pathlib.Path(path)
  if not path.is_file():
    raise ArtifactError(f"{where}: {path} is not a file. Give the path of a graph's .json.")
  if path.stat().st_size > MAX_BYTES:
    raise ArtifactError(
      f"{where}: {path} is larger than {MAX_BYTES} bytes; a graph file is pruned and small."
    )
  return read_json(path.read_bytes(), f"{where}: {path}", "Write it again with flg.save.")


def load_listing(path: str | os.PathLike) -> dict:
  """A `graph-metadata.json` listing (`{"graphs": [...]}`), checked."""
  data = _read(path, "flg.load_listing")
  if not isinstance(data, dict) or not isinstance(data.get("graphs"), list):
    raise ArtifactError(f"flg.load_listing: {path} holds no {{'graphs': [...]}} listing.")
  return data


def load(path: str | os.PathLike) -> dict:
  """A graph file read back (bounded, strict JSON, checked against the viewers' format,
  ids unique, every link between nodes it holds). Runs no code.

  Example:
    >>> import flaxlens.graphs as flg, tempfile
    >>> path = flg.save(flg.graph_json(flg.demo_graph()), tempfile.mkdtemp())
    >>> sorted(flg.load(path)["metadata"])[:3]
    ['node_threshold', 'prompt', 'prompt_tokens']
  """
  where = "flg.load"
  data = _read(path, where)
  check_schema(
    data,
    "attribution-graph",
    f"{where}: {path}",
    "Give a graph file flg.save or circuit-tracer wrote.",
  )
  ids = [node["node_id"] for node in data["nodes"]]
  if len(set(ids)) != len(ids):
    repeated = sorted({i for i in ids if ids.count(i) > 1})[:5]
    raise ArtifactError(
      f"{where}: {path} repeats node ids {repeated}: links to them are ambiguous."
    )
  known = set(ids)
  for link in data["links"]:
    if link["source"] not in known or link["target"] not in known:
      raise ArtifactError(
        f"{where}: {path} links {link['source']!r} -> {link['target']!r}, a node it does not hold."
      )
  return data
