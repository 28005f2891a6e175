"""`graph_page`: an attribution graph as one self-contained web page, opened from a file.

The page reads a graph in the JSON format of circuit-tracer and Neuronpedia (`metadata`,
`nodes`, `links`), checks what drawing needs, and draws it as SVG: one row per layer
(tokens at the bottom, logits at the top), one column per prompt position. A click on a
node lists its strongest edges in a side panel; a slider hides the weakest edges. The
data travels as JSON inside the page and the page's script builds every element from it
with `textContent` and attributes, never by parsing data as HTML; a Content Security
Policy forbids loading anything. No Flax internals here.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from flaxlens.core._checks import shown
from flaxlens.errors import ArgumentError

_WHERE = "flg.graph_page"
_KINDS = {
  "cross layer transcoder": "feature",
  "mlp reconstruction error": "error",
  "embedding": "token",
  "logit": "logit",
}
_LINK_SCHEMES = ("http", "https", "file")
_TYPE_NAMES: dict[Any, str] = {str: "a str", int: "an int", list: "a list"}
_GRAPH_FIX = (
  "Pass a graph in the circuit-tracer / Neuronpedia JSON format (metadata, nodes, links),"
  " as flaxlens.graphs writes it."
)

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1em 1.5em; color: #222; }
h1 { font-size: 1.2em; margin: 0 0 0.4em; }
#controls { margin: 0.4em 0 0.8em; font-size: 0.9em; }
#controls input { vertical-align: middle; width: 18em; }
.legend { color: #666; font-size: 0.85em; margin-left: 1.5em; }
main { display: flex; gap: 1.2em; align-items: flex-start; }
#drawing { overflow: auto; max-width: 72vw; max-height: 85vh; border: 1px solid #ddd; }
#panel { min-width: 20em; max-width: 28em; font-size: 0.9em; }
#panel h2 { font-size: 1.05em; margin: 0 0 0.4em; overflow-wrap: anywhere; }
#panel table { border-collapse: collapse; width: 100%; }
#panel td { padding: 0.1em 0.5em; border-bottom: 1px solid #eee; overflow-wrap: anywhere; }
#panel td.weight { text-align: right; font-family: monospace; white-space: nowrap; }
#panel tr.edge { cursor: pointer; } #panel tr.edge:hover { background: #f3f3f3; }
#panel h3 { font-size: 0.95em; margin: 0.9em 0 0.2em; }
.hint { color: #777; }
svg text { font-size: 11px; fill: #444; }
svg .grid { stroke: #eee; }
line.link { stroke-linecap: round; }
line.link.positive { stroke: #2166ac; } line.link.negative { stroke: #c0392b; }
line.link.pruned { display: none; }
svg.focus line.link { opacity: 0.06; } svg.focus line.link.incident { opacity: 0.9; }
g.node { cursor: pointer; }
g.node > * { stroke: #333; stroke-width: 1; }
g.node.feature > * { fill: #f5c26b; } g.node.error > * { fill: #bbb; }
g.node.token > * { fill: #dde8f3; } g.node.logit > * { fill: #9ed3a4; }
g.node.logit.target > * { stroke-width: 2.5; }
g.node.selected > * { stroke: #000; stroke-width: 3; }
"""

# Reads the graph from the JSON element, draws it, and wires the panel and the slider.
# Every text from the data goes in through textContent or setAttribute.
_SCRIPT = r"""
"use strict";
const graph = JSON.parse(document.getElementById("flaxlens-graph").textContent);
const SVG = "http://www.w3.org/2000/svg";
const ROW = 64, SLOT = 18, PAD = 16, LEFT = 56, TOP = 16, BOTTOM = 90, EDGES = 10;
const nodes = graph.nodes, links = graph.links, rows = graph.rows.length;

function svgElement(tag, attributes, text) {
  const element = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) element.setAttribute(name, value);
  if (text !== undefined) element.textContent = text;
  return element;
}

function element(tag, text, className) {
  const made = document.createElement(tag);
  if (text !== undefined) made.textContent = text;
  if (className !== undefined) made.className = className;
  return made;
}

function short(text, most) {
  return text.length > most ? text.slice(0, most - 1) + "\u2026" : text;
}

function columnsX() {
  const slots = graph.tokens.map(() => 1);
  for (const node of nodes) slots[node.col] = Math.max(slots[node.col], node.slot + 1);
  const starts = [];
  let x = LEFT;
  for (const count of slots) { starts.push(x); x += Math.max(count * SLOT + PAD, 44); }
  return { starts, width: x + PAD };
}

function place(layout) {
  for (const node of nodes) {
    node.x = layout.starts[node.col] + PAD / 2 + node.slot * SLOT + SLOT / 2;
    node.y = TOP + (rows - 1 - node.row) * ROW + ROW / 2;
  }
}

function drawAxes(svg, layout, height) {
  graph.rows.forEach((label, row) => {
    const y = TOP + (rows - 1 - row) * ROW + ROW / 2;
    svg.append(svgElement("line", { class: "grid", x1: LEFT, x2: layout.width, y1: y, y2: y }));
    svg.append(svgElement("text", { x: 4, y: y + 4 }, label));
  });
  graph.tokens.forEach((token, col) => {
    const x = layout.starts[col] + 6, y = height - BOTTOM + 14;
    const text = svgElement("text", { x, y, transform: `rotate(35 ${x} ${y})`, class: "column" });
    text.textContent = short(`${col}: ${token}`, 18);
    text.append(svgElement("title", {}, token));
    svg.append(text);
  });
}

function drawLinks(group) {
  const largest = links.reduce((most, link) => Math.max(most, Math.abs(link[2])), 1e-30);
  return links.map(([source, target, weight], index) => {
    const strength = Math.abs(weight) / largest, from = nodes[source], to = nodes[target];
    const line = svgElement("line", {
      class: `link ${weight >= 0 ? "positive" : "negative"}`, "data-link": index,
      x1: from.x, y1: from.y, x2: to.x, y2: to.y,
      "stroke-width": (0.5 + 3.5 * strength).toFixed(2),
      "stroke-opacity": (0.15 + 0.8 * strength).toFixed(3),
    });
    group.append(line);
    return line;
  });
}

function nodeShape(node) {
  const { x, y } = node;
  if (node.kind === "feature") return svgElement("circle", { cx: x, cy: y, r: 6 });
  if (node.kind === "error") {
    return svgElement("rect", { x: x - 5.5, y: y - 5.5, width: 11, height: 11 });
  }
  if (node.kind === "token") {
    return svgElement("rect", { x: x - 8, y: y - 6, width: 16, height: 12, rx: 3 });
  }
  const points = `${x},${y - 8} ${x + 8},${y} ${x},${y + 8} ${x - 8},${y}`;
  return svgElement("polygon", { points });
}

function drawNodes(group) {
  return nodes.map((node, index) => {
    const classes = `node ${node.kind}${node.target ? " target" : ""}`;
    const shape = svgElement("g", { class: classes, "data-node": index, "data-node-id": node.id });
    shape.append(nodeShape(node), svgElement("title", {}, node.label));
    group.append(shape);
    return shape;
  });
}

function number(value) {
  return value === null ? "\u2014" : Number(value).toPrecision(4);
}

function edgeTable(rowsOfEdges, other) {
  const table = element("table");
  if (rowsOfEdges.length === 0) table.append(element("tr", "none", "hint"));
  for (const [index, link] of rowsOfEdges) {
    const row = element("tr", undefined, "edge");
    row.dataset.link = index;
    row.append(element("td", number(link[2]), "weight"), element("td", nodes[other(link)].label));
    row.addEventListener("click", () => select(other(link)));
    table.append(row);
  }
  return table;
}

function edgeSection(direction, rowsOfEdges, other) {
  const section = element("section");
  section.id = direction;
  section.append(element("h3", `Strongest ${direction} edges`), edgeTable(rowsOfEdges, other));
  return section;
}

function strongest(index, end) {
  return links.map((link, at) => [at, link]).filter(([, link]) => link[end] === index)
    .sort((a, b) => Math.abs(b[1][2]) - Math.abs(a[1][2])).slice(0, EDGES);
}

function facts(node) {
  const list = element("table");
  const token = graph.tokens[node.col];
  const shownFacts = [["id", node.id], ["kind", node.kind], ["layer", node.layer],
    ["position", `${node.col}: ${token}`], ["activation", number(node.activation)],
    ["influence", number(node.influence)]];
  if (node.kind === "logit") shownFacts.push(["probability", number(node.prob)]);
  for (const [name, value] of shownFacts) {
    const row = element("tr");
    row.append(element("td", name), element("td", value));
    list.append(row);
  }
  return list;
}

function select(index) {
  const node = nodes[index], panel = document.getElementById("panel");
  shapes.forEach((shape, at) => shape.classList.toggle("selected", at === index));
  lines.forEach((line, at) => {
    line.classList.toggle("incident", links[at][0] === index || links[at][1] === index);
  });
  document.getElementById("graph").classList.add("focus");
  panel.replaceChildren(element("h2", node.label), facts(node));
  if (node.page !== null) {
    const link = element("a", "feature page"), paragraph = element("p");
    link.setAttribute("href", node.page);
    link.id = "feature-page";
    paragraph.append(link);
    panel.append(paragraph);
  }
  panel.append(
    edgeSection("incoming", strongest(index, 1), (link) => link[0]),
    edgeSection("outgoing", strongest(index, 0), (link) => link[1]),
  );
  history.replaceState(null, "", "#node=" + encodeURIComponent(node.id));
}

// Keeps the strongest edges until they hold `fraction` of the summed |weight|.
const order = links.map((link, index) => index)
  .sort((a, b) => Math.abs(links[b][2]) - Math.abs(links[a][2]));
const total = links.reduce((sum, link) => sum + Math.abs(link[2]), 0);

function prune(fraction) {
  const kept = new Set();
  let sum = 0;
  for (const index of order) {
    if (fraction >= 1 || sum < fraction * total) kept.add(index);
    sum += Math.abs(links[index][2]);
  }
  lines.forEach((line, index) => line.classList.toggle("pruned", !kept.has(index)));
  document.getElementById("kept").textContent =
    `${kept.size} of ${links.length} edges shown (${(100 * fraction).toFixed(1)}% of |weight|)`;
}

const layout = columnsX(), height = TOP + rows * ROW + BOTTOM;
place(layout);
const svg = svgElement("svg", { id: "graph", width: layout.width, height });
drawAxes(svg, layout, height);
const linkGroup = svgElement("g", { class: "links" });
const nodeGroup = svgElement("g", { class: "nodes" });
svg.append(linkGroup, nodeGroup);
const lines = drawLinks(linkGroup), shapes = drawNodes(nodeGroup);
document.getElementById("drawing").append(svg);
nodeGroup.addEventListener("click", (event) => {
  const shape = event.target.closest("g.node");
  if (shape !== null) select(Number(shape.dataset.node));
});
const slider = document.getElementById("keep");
slider.addEventListener("input", () => prune(Number(slider.value) / 1000));
prune(Number(slider.value) / 1000);
function selectFromFragment() {
  const wanted = new URLSearchParams(location.hash.slice(1)).get("node");
  const found = nodes.findIndex((node) => node.id === wanted);
  if (found >= 0) select(found);
}
window.addEventListener("hashchange", selectFromFragment);
selectFromFragment();
document.body.dataset.ready = "true";
"""


def _refuse(problem: str, fix: str = _GRAPH_FIX) -> ArgumentError:
  return ArgumentError(f"{_WHERE}: {problem}. {fix}")


def _real(value: Any, what: str, optional: bool = False) -> float | None:
  """`value` as a finite float; None passes when `optional`; bools and text are refused."""
  if value is None and optional:
    return None
  if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
    expected = "a finite number or null" if optional else "a finite number"
    raise _refuse(f"{what} must be {expected}, got {shown(value)}")
  return float(value)


def _field(record: Mapping[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
  """`record[key]`, refused when missing or not of `types` (bools are never ints here)."""
  if key not in record:
    raise _refuse(f"{what} has no {key!r}")
  value = record[key]
  if isinstance(value, bool) or not isinstance(value, types):
    raise _refuse(f"{what}: {key!r} must be {_TYPE_NAMES[types]}, got {shown(value)}")
  return value


def _checked_tokens(data: Any) -> list[str]:
  if not isinstance(data, Mapping):
    raise _refuse(f"the graph must be a dict (the parsed JSON), got {shown(data)}")
  for key in ("metadata", "nodes", "links"):
    if key not in data:
      raise _refuse(f"the graph has no {key!r}")
  metadata = data["metadata"]
  if not isinstance(metadata, Mapping):
    raise _refuse(f"the graph's 'metadata' must be an object, got {shown(metadata)}")
  tokens = _field(metadata, "prompt_tokens", list, "the graph's metadata")
  for number, token in enumerate(tokens):
    if not isinstance(token, str):
      raise _refuse(f"metadata.prompt_tokens[{number}] must be a str, got {shown(token)}")
  if not tokens:
    raise _refuse("metadata.prompt_tokens is empty; a graph has at least one position")
  return tokens


def _checked_node(number: int, node: Any, tokens: list[str]) -> dict[str, Any]:
  """What the page shows of node `number`, refused with its id when malformed."""
  if not isinstance(node, Mapping):
    raise _refuse(f"nodes[{number}] must be an object, got {shown(node)}")
  node_id = _field(node, "node_id", str, f"nodes[{number}]")
  what = f"node {node_id!r} (nodes[{number}])"
  feature_type = _field(node, "feature_type", str, what)
  if feature_type not in _KINDS:
    raise _refuse(f"{what}: feature_type {feature_type!r} is none of {sorted(_KINDS)}")
  kind = _KINDS[feature_type]
  layer = _field(node, "layer", str, what)
  if kind in ("feature", "error") and not layer.isdecimal():
    raise _refuse(f'{what}: layer must be a layer number as a str (such as "3"), got {layer!r}')
  position = _field(node, "ctx_idx", int, what)
  if not 0 <= position < len(tokens):
    raise _refuse(f"{what}: ctx_idx {position} is outside the {len(tokens)} prompt tokens")
  clerp = node.get("clerp", "")
  if not isinstance(clerp, str):
    raise _refuse(f"{what}: 'clerp' must be a str, got {shown(clerp)}")
  label = {
    "feature": clerp or node_id,
    "error": clerp or f"error at layer {layer}",
    "token": tokens[position],
    "logit": clerp or node_id,
  }[kind]
  return {
    "id": node_id,
    "kind": kind,
    "layer": layer,
    "col": position,
    "label": label,
    "target": node.get("is_target_logit") is True,
    "activation": _real(node.get("activation"), f"{what}: 'activation'", optional=True),
    "influence": _real(node.get("influence"), f"{what}: 'influence'", optional=True),
    "prob": _real(node.get("token_prob"), f"{what}: 'token_prob'", optional=True),
  }


def _rows(shown_nodes: list[dict[str, Any]]) -> list[str]:
  """Gives each node its row and its slot in its (row, column) cell; returns row labels.

  Rows from the bottom: tokens, then layer 0 up to the highest layer with a feature or an
  error, then logits.
  """
  layers = [int(node["layer"]) for node in shown_nodes if node["kind"] in ("feature", "error")]
  count = max(layers, default=-1) + 1
  taken: dict[tuple[int, int], int] = {}
  for node in shown_nodes:
    if node["kind"] == "token":
      row = 0
    elif node["kind"] == "logit":
      row = count + 1
    else:
      row = int(node["layer"]) + 1
    node["row"] = row
    node["slot"] = taken.get((row, node["col"]), 0)
    taken[row, node["col"]] = node["slot"] + 1
  return ["tokens", *(f"L{layer}" for layer in range(count)), "logits"]


def _checked_links(links: Any, index: Mapping[str, int]) -> list[list[Any]]:
  if not isinstance(links, list):
    raise _refuse(f"the graph's 'links' must be a list, got {shown(links)}")
  checked = []
  for number, link in enumerate(links):
    if not isinstance(link, Mapping):
      raise _refuse(f"links[{number}] must be an object, got {shown(link)}")
    ends = []
    for end in ("source", "target"):
      node_id = _field(link, end, str, f"links[{number}]")
      if node_id not in index:
        raise _refuse(
          f"links[{number}] names {end} {node_id!r}, which is no node's node_id",
          "Keep only links between nodes of the graph (prune links with their nodes).",
        )
      ends.append(index[node_id])
    what = f"links[{number}] ({link['source']!r} -> {link['target']!r}): 'weight'"
    if "weight" not in link:
      raise _refuse(f"links[{number}] has no 'weight'")
    checked.append([*ends, _real(link["weight"], what)])
  return checked


def _page_link(node_id: str, url: Any) -> str:
  """`url` if it is a relative path or an http(s) or file URL; refused otherwise."""
  fix = "Link feature pages by relative paths or http(s):// or file:// URLs."
  if not isinstance(url, str) or not url:
    raise _refuse(f"feature_pages[{node_id!r}] must be a non-empty str, got {shown(url)}", fix)
  # Browsers drop or reinterpret control characters, spaces and backslashes in URLs.
  if any(ord(c) <= 32 or c in "\\\x7f" for c in url):
    raise _refuse(
      f"feature_pages[{node_id!r}] = {url!r} holds whitespace, a control character or a backslash",
      fix,
    )
  try:
    parts = urlsplit(url)
  except ValueError as error:
    raise _refuse(f"feature_pages[{node_id!r}] = {url!r} is no URL ({error})", fix) from None
  if parts.scheme.lower() not in _LINK_SCHEMES and (parts.scheme or parts.netloc):
    raise _refuse(f"feature_pages[{node_id!r}] = {url!r} is not an allowed link", fix)
  return url


def _page_data(data: Any, feature_pages: Mapping[str, str] | None = None) -> dict[str, list[Any]]:
  """What the page's script draws: tokens, row labels, nodes and links by index.

  Raises:
    ArgumentError: the graph lacks what the page needs (naming the node or the link),
      or a feature page's link is not a relative path or an http(s) or file URL.
  """
  tokens = _checked_tokens(data)
  if not isinstance(data["nodes"], list):
    raise _refuse(f"the graph's 'nodes' must be a list, got {shown(data['nodes'])}")
  nodes = [_checked_node(number, node, tokens) for number, node in enumerate(data["nodes"])]
  index: dict[str, int] = {}
  for number, node in enumerate(nodes):
    if node["id"] in index:
      raise _refuse(
        f"nodes[{index[node['id']]}] and nodes[{number}] share the node_id {node['id']!r}",
        "Give every node its own node_id.",
      )
    index[node["id"]] = number
  if feature_pages is not None and not isinstance(feature_pages, Mapping):
    raise _refuse(
      f"feature_pages must be a mapping of node_id to link, got {shown(feature_pages)}",
      "Pass a dict such as {'3_17_2': 'features/3.html#feature-17'}, or None.",
    )
  for node in nodes:
    url = None if feature_pages is None else feature_pages.get(node["id"])
    node["page"] = None if url is None else _page_link(node["id"], url)
  rows = _rows(nodes)
  return {
    "tokens": tokens,
    "rows": rows,
    "nodes": nodes,
    "links": _checked_links(data["links"], index),
  }


def _script_json(value: Any) -> str:
  """`value` as JSON that no string in it can end early: `<`, `>` and `&` are escaped."""
  text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
  return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def graph_page(
  data: Mapping[str, Any],
  *,
  feature_pages: Mapping[str, str] | None = None,
  title: str | None = None,
) -> str:
  """An attribution graph as one self-contained web page (HTML source), opened from a file.

  The page draws the graph as SVG: rows are layers (the prompt's tokens at the bottom,
  then layer 0, 1, ..., the logits at the top) and columns are prompt positions, labelled
  by their tokens. Features are circles, errors squares, tokens rounded boxes and logits
  diamonds (the target logits outlined thicker). Edges are blue when positive and red when
  negative, wider and more opaque the larger their |weight|. Clicking a node lists, beside
  the drawing, its activation and influence, a link to its feature page (from
  `feature_pages`), and its ten strongest incoming and outgoing edges; clicking an edge
  there selects the node at its other end. Opening the page at `#node=<node_id>` (the
  node_id URL-encoded) selects that node; selecting a node writes the fragment. The slider
  shows only the strongest edges that together hold the chosen fraction of the summed
  |weight| (at 100% every edge shows).

  The graph's data travels as JSON inside the page, with `<`, `>` and `&` escaped, and
  the page's script builds every element from it as text, so no string in the graph can
  add markup or script; the page's Content Security Policy allows no network load.

  Args:
    data: the graph, in the JSON format of circuit-tracer and Neuronpedia: `metadata`
      with `prompt_tokens` (a list of str), `nodes` (each with `node_id`, `feature_type`
      one of "cross layer transcoder", "mlp reconstruction error", "embedding" and
      "logit", `layer` a str, `ctx_idx` a prompt position, and optionally `clerp`,
      `activation`, `influence`, `token_prob`, `is_target_logit`) and `links` (each with
      `source` and `target` node_ids and a numeric `weight`). Other keys are ignored.
    feature_pages: links from node_ids to their feature pages: paths relative to the
      page's own file (such as `features/layer3.html#feature-17`), or http(s) or file
      URLs. node_ids not in the graph are ignored.
    title: the page's title; by default it names the graph's slug or prompt.

  Returns:
    The page's HTML source; write it to a `.html` file and open it in a browser.

  Raises:
    ArgumentError: the graph lacks a key the page needs, a node or a link is malformed
      (the message names it: a node without `node_id`, a link to an unknown node, a
      weight that is not a finite number, two nodes with one node_id ...), or a feature
      page's link is neither a relative path nor an http(s) or file URL.

  Example:
    >>> graph = {
    ...   "metadata": {"prompt_tokens": ["<bos>", "Hi"], "slug": "hi"},
    ...   "nodes": [
    ...     {"node_id": "E_1_1", "feature_type": "embedding", "layer": "E", "ctx_idx": 1},
    ...     {"node_id": "0_7_1", "feature_type": "cross layer transcoder", "layer": "0",
    ...      "ctx_idx": 1, "activation": 2.5, "influence": 0.4},
    ...     {"node_id": "2_9_1", "feature_type": "logit", "layer": "2", "ctx_idx": 1,
    ...      "token_prob": 0.9, "is_target_logit": True},
    ...   ],
    ...   "links": [{"source": "E_1_1", "target": "0_7_1", "weight": 1.5},
    ...             {"source": "0_7_1", "target": "2_9_1", "weight": -0.5}],
    ... }
    >>> import flaxlens.graphs as flg
    >>> page = flg.graph_page(graph, feature_pages={"0_7_1": "features/0.html#feature-7"})
    >>> page.startswith("<!DOCTYPE html>"), "features/0.html#feature-7" in page
    (True, True)
  """
  payload = _page_data(data, feature_pages)
  if title is not None and not isinstance(title, str):
    raise _refuse(f"title must be a str or None, got {shown(title)}", "Pass a str.")
  if title is None:
    metadata = data["metadata"]
    name = metadata.get("slug") or metadata.get("prompt") or "".join(payload["tokens"])
    title = f"flaxlens: attribution graph of {name}" if isinstance(name, str) else "flaxlens"
  heading = html.escape(title)
  policy = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
  )
  return (
    "<!DOCTYPE html>\n"
    '<html lang="en"><head><meta charset="utf-8">'
    f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
    '<link rel="icon" href="data:,">'
    f"<title>{heading}</title><style>{_STYLE}</style></head>\n"
    f"<body><h1>{heading}</h1>\n"
    '<div id="controls"><label>Edges: <input type="range" id="keep" min="0" max="1000"'
    ' value="1000"></label> <span id="kept"></span><span class="legend">circles: features,'
    " squares: errors, boxes: tokens, diamonds: logits; blue edges positive, red negative"
    "</span></div>\n"
    '<main><div id="drawing"></div><aside id="panel">'
    '<p class="hint">Click a node to see its strongest edges.</p></aside></main>\n'
    f'<script type="application/json" id="flaxlens-graph">{_script_json(payload)}</script>\n'
    f"<script>{_SCRIPT}</script>\n"
    "</body></html>\n"
  )
