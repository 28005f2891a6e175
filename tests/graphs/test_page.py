"""The attribution graph's web page, checked in a real headless browser.

As in tests/view/test_html.py: Debian's `chromium` driven by Selenium through Debian's
`chromium-driver`, the page opened from a file with no server; the browser tests skip,
saying why, when either is missing. The graph is written by hand here in the JSON format
of circuit-tracer and Neuronpedia, with markup in a token and in a label.
"""

from __future__ import annotations

import copy
import math
import re
import shutil
from urllib.parse import quote

import pytest

from flaxlens.errors import ArgumentError
from flaxlens.tools.graphs._page import graph_page

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
HOSTILE_TOKEN = "</script><img src=x onerror=alert(1)>"
HOSTILE_LABEL = "<!-- </script><b id=bold>says</b> & <svg onload=alert(2)>"


def _node(node_id, feature_type, layer, position, **fields):
  return {
    "node_id": node_id,
    "feature": 0,
    "layer": layer,
    "ctx_idx": position,
    "feature_type": feature_type,
    "jsNodeId": node_id,
    **fields,
  }


def _graph():
  tokens = ["<bos>", "The", HOSTILE_TOKEN, " cat"]
  nodes = [_node(f"E_{p + 10}_{p}", "embedding", "E", p) for p in range(4)]
  features = [("0_11_1", 1), ("0_12_2", 2), ("0_13_2", 2), ("1_5_3", 3), ("1_6_2", 2)]
  features += [("1_7_3", 3), ("1_8_1", 1)]
  for number, (node_id, position) in enumerate(features):
    clerp = HOSTILE_LABEL if node_id == "1_5_3" else ""
    layer = node_id.split("_")[0]
    nodes.append(
      _node(
        node_id,
        "cross layer transcoder",
        layer,
        position,
        activation=1.0 + number,
        influence=0.1 * number,
        clerp=clerp,
      )
    )
  error = _node("1_-1_3", "mlp reconstruction error", "1", 3, influence=0.05)
  nodes.append({**error, "feature": -1})
  nodes.append(_node("3_50_3", "logit", "3", 3, token_prob=0.6, is_target_logit=True))
  nodes.append(_node("3_51_3", "logit", "3", 3, token_prob=0.2, clerp='Output " dog"'))
  sources = [node["node_id"] for node in nodes if node["feature_type"] != "logit"]
  pairs = [(source, "3_50_3") for source in sources]  # 12 edges into the target logit.
  pairs += [("E_11_1", "0_11_1"), ("E_12_2", "0_12_2"), ("E_12_2", "0_13_2"), ("0_12_2", "1_6_2")]
  pairs += [("0_11_1", "1_5_3"), ("1_-1_3", "3_51_3"), ("1_5_3", "3_51_3"), ("1_7_3", "3_51_3")]
  weights = [round(3 * math.sin(1.7 * k + 0.3), 4) for k in range(len(pairs))]
  weights[sources.index("1_5_3")] = 5.0  # The labelled feature is the logit's strongest input.
  links = [
    {"source": s, "target": t, "weight": w} for (s, t), w in zip(pairs, weights, strict=True)
  ]
  assert len({abs(w) for w in weights}) == len(weights)
  metadata = {"slug": "cat-test", "prompt_tokens": tokens, "prompt": "".join(tokens)}
  return {"metadata": metadata, "qParams": {}, "nodes": nodes, "links": links}


def test_the_page_is_one_file_that_names_no_other_resource():
  page = graph_page(_graph())
  assert page.startswith("<!DOCTYPE html>") and page.count("<script") == 2
  tags = re.findall(r"<[a-zA-Z][^<>]*>", page)
  assert [tag for tag in tags if re.search(r"\b(src|href|srcset|action)\s*=", tag)] == [
    '<link rel="icon" href="data:,">'
  ]
  assert "url(" not in page and "@import" not in page
  assert "<img" not in page and "<!-- <" not in page and "<b id" not in page
  assert "default-src 'none'" in page  # The page's policy forbids every load.


def test_a_title_is_escaped():
  page = graph_page(_graph(), title="a <b>graph</b>")
  assert "<title>a &lt;b&gt;graph&lt;/b&gt;</title>" in page


@pytest.fixture(scope="module")
def browser():
  webdriver = pytest.importorskip("selenium.webdriver")
  if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium-driver)")
  from selenium.webdriver.chrome.service import Service

  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
    options.add_argument(flag)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
  yield driver
  driver.quit()


def _open(browser, tmp_path, graph, fragment="", **options):
  from selenium.webdriver.support.wait import WebDriverWait

  page = tmp_path / "graph.html"
  page.write_text(graph_page(graph, **options), encoding="utf-8")
  browser.get(page.as_uri() + fragment)
  WebDriverWait(browser, 20).until(
    lambda b: b.execute_script("return document.body.dataset.ready === 'true'")
  )


_DRAWN = """
return {
  nodes: [...document.querySelectorAll("svg g.node")].map((g) => g.dataset.nodeId),
  links: document.querySelectorAll("svg line.link").length,
  titles: [...document.querySelectorAll("svg title")].map((t) => t.textContent),
  markup: document.querySelectorAll("img, b, body svg svg, #bold").length,
  loads: performance.getEntriesByType("resource").length,
};
"""


def test_every_node_and_link_is_drawn_and_markup_in_the_data_stays_text(browser, tmp_path):
  graph = _graph()
  _open(browser, tmp_path, graph)
  drawn = browser.execute_script(_DRAWN)
  assert drawn["nodes"] == [node["node_id"] for node in graph["nodes"]]
  assert drawn["links"] == len(graph["links"])
  assert HOSTILE_TOKEN in drawn["titles"] and HOSTILE_LABEL in drawn["titles"]
  assert drawn["markup"] == 0 and drawn["loads"] == 0
  assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


# The panel's edge rows: (link index, weight shown, the other node's label).
_PANEL = """
const rows = (id) => [...document.querySelectorAll(`#${id} tr.edge`)].map((row) =>
  [Number(row.dataset.link), Number(row.cells[0].textContent), row.cells[1].textContent]);
return { title: document.querySelector("#panel h2").textContent,
  incoming: rows("incoming"), outgoing: rows("outgoing"),
  selected: [...document.querySelectorAll("g.node.selected")].map((g) => g.dataset.nodeId),
  hash: decodeURIComponent(location.hash) };
"""


def _strongest(graph, node_id, end):
  edges = [(i, link) for i, link in enumerate(graph["links"]) if link[end] == node_id]
  edges.sort(key=lambda edge: -abs(edge[1]["weight"]))
  return edges[:10]


def _label(graph, node_id):
  node = next(node for node in graph["nodes"] if node["node_id"] == node_id)
  if node["feature_type"] == "embedding":
    return graph["metadata"]["prompt_tokens"][node["ctx_idx"]]
  if node.get("clerp"):
    return node["clerp"]
  return f"error at layer {node['layer']}" if node["feature"] == -1 else node_id


def _expected_rows(graph, node_id, end, other):
  return [
    [i, pytest.approx(link["weight"], rel=1e-3), _label(graph, link[other])]
    for i, link in _strongest(graph, node_id, end)
  ]


def test_clicking_a_node_lists_its_ten_strongest_incoming_and_outgoing_edges(browser, tmp_path):
  from selenium.webdriver.common.by import By

  graph = _graph()
  _open(browser, tmp_path, graph)
  browser.find_element(By.CSS_SELECTOR, 'g.node[data-node-id="3_50_3"]').click()
  panel = browser.execute_script(_PANEL)
  assert panel["selected"] == ["3_50_3"] and panel["hash"] == "#node=3_50_3"
  assert panel["incoming"] == _expected_rows(graph, "3_50_3", "target", "source")
  assert len(panel["incoming"]) == 10 and panel["outgoing"] == []
  assert panel["incoming"][0][2] == HOSTILE_LABEL
  browser.find_element(By.CSS_SELECTOR, "#incoming tr.edge").click()  # Its other end.
  panel = browser.execute_script(_PANEL)
  assert panel["selected"] == ["1_5_3"] and panel["title"] == HOSTILE_LABEL
  assert panel["incoming"] == _expected_rows(graph, "1_5_3", "target", "source")
  assert panel["outgoing"] == _expected_rows(graph, "1_5_3", "source", "target")
  assert browser.execute_script("return document.querySelectorAll('img, b').length") == 0


def test_a_fragment_selects_a_node_and_its_feature_page_is_linked(browser, tmp_path):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.wait import WebDriverWait

  graph = _graph()
  pages = {"1_6_2": "features/layer1.html#feature-6", "9_9_9": "https://example.org/x"}
  _open(browser, tmp_path, graph, "#node=" + quote("1_6_2"), feature_pages=pages)
  panel = browser.execute_script(_PANEL)
  assert panel["selected"] == ["1_6_2"]
  assert panel["incoming"] == _expected_rows(graph, "1_6_2", "target", "source")
  link = browser.execute_script("return document.getElementById('feature-page').href")
  assert link == (tmp_path / "features/layer1.html").as_uri() + "#feature-6"
  browser.execute_script("location.hash = '#node=' + encodeURIComponent('E_12_2')")
  WebDriverWait(browser, 5).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".selected.token"))
  panel = browser.execute_script(_PANEL)
  assert panel["selected"] == ["E_12_2"] and panel["title"] == HOSTILE_TOKEN
  assert panel["outgoing"] == _expected_rows(graph, "E_12_2", "source", "target")
  assert panel["incoming"] == [] and not browser.find_elements(By.ID, "feature-page")


def _kept(weights, fraction):
  """The edges the slider keeps: the strongest, until they hold `fraction` of sum |w|."""
  total, summed, kept = sum(abs(w) for w in weights), 0.0, 0
  for weight in sorted(weights, key=lambda w: -abs(w)):
    kept += fraction >= 1 or summed < fraction * total
    summed += abs(weight)
  return kept


_SLIDE = """
const slider = document.getElementById("keep");
slider.value = arguments[0];
slider.dispatchEvent(new Event("input"));
return [...document.querySelectorAll("line.link")]
  .filter((line) => getComputedStyle(line).display !== "none").length;
"""


def test_the_slider_hides_the_weakest_edges(browser, tmp_path):
  graph = _graph()
  _open(browser, tmp_path, graph)
  weights = [link["weight"] for link in graph["links"]]
  shown = {value: browser.execute_script(_SLIDE, value) for value in (0, 300, 600, 900, 1000)}
  assert shown == {value: _kept(weights, value / 1000) for value in shown}
  assert shown[0] == 0 < shown[300] < shown[600] < shown[900] < shown[1000] == len(weights)


def _broken(edit):
  graph = _graph()
  edit(graph)
  return graph


@pytest.mark.parametrize(
  "edit, message",
  [
    (
      lambda g: g["links"].append({"source": "0_11_1", "target": "7_7_7", "weight": 1.0}),
      r"links\[20\] names target '7_7_7', which is no node's node_id",
    ),
    (lambda g: g["nodes"][5].pop("node_id"), r"nodes\[5\] has no 'node_id'"),
    (
      lambda g: g["links"][3].update(weight="0.5"),
      r"links\[3\] \('E_13_3' -> '3_50_3'\): 'weight' must be a finite number, got '0.5'",
    ),
    (lambda g: g["links"][0].update(weight=float("nan")), r"links\[0\] .*got nan"),
    (
      lambda g: g["nodes"][6].update(node_id="E_10_0"),
      r"nodes\[0\] and nodes\[6\] share the node_id 'E_10_0'",
    ),
    (
      lambda g: g["nodes"][4].update(feature_type="attention"),
      r"node '0_11_1' \(nodes\[4\]\): feature_type 'attention' is none of",
    ),
    (lambda g: g["nodes"][4].update(ctx_idx=4), r"node '0_11_1'.*ctx_idx 4 is outside the 4"),
    (lambda g: g["nodes"][4].update(layer=0), r"node '0_11_1'.*'layer' must be a str, got 0"),
    (lambda g: g["nodes"][4].update(activation="big"), r"node '0_11_1'.*'activation'"),
    (lambda g: g.pop("links"), r"the graph has no 'links'"),
    (lambda g: g["metadata"]["prompt_tokens"].append(3), r"prompt_tokens\[4\] must be a str"),
  ],
)
def test_a_malformed_graph_is_refused_naming_the_node_or_link(edit, message):
  with pytest.raises(ArgumentError, match=message):
    graph_page(_broken(edit))


@pytest.mark.parametrize(
  "url",
  [
    "javascript:alert(1)",
    "data:text/html,x",
    "//evil.example/x",
    "java\tscript:x",
    "",
    "http://[x",
  ],
)
def test_a_feature_page_that_is_no_relative_path_or_http_or_file_url_is_refused(url):
  with pytest.raises(ArgumentError, match=r"feature_pages\['0_11_1'\]"):
    graph_page(_graph(), feature_pages={"0_11_1": url})


def test_the_graph_given_is_not_changed():
  graph = _graph()
  before = copy.deepcopy(graph)
  graph_page(graph, feature_pages={"0_11_1": "f.html"})
  assert graph == before


@pytest.mark.parametrize(
  "url",
  ["../features/l0.html#feature-11", "https://example.org/f/11", "file:///tmp/f.html", "f.html"],
)
def test_a_relative_path_or_an_http_or_file_url_is_linked(url):
  page = graph_page(_graph(), feature_pages={"0_11_1": url})
  assert f'"page":"{url}"' in page
