"""`fl.to_html`: the web page of a tree, checked in a real headless browser.

The browser is Debian's `chromium`, driven by Selenium through Debian's `chromium-driver`
(`.ci/run` installs both with apt when they are missing); nothing downloads a browser.
The page is opened from a file, as a user opens it, with no server.
"""

from __future__ import annotations

import re
import shutil

import jax
import pytest
from frameworks import LINEN, NNX
from linen import corpus as linen_corpus

import flaxlens as fl

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


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


def _transformer_tree():
  model, x = linen_corpus.Transformer(), linen_corpus.TOKENS
  variables = model.init(jax.random.key(0), x)
  return fl.unflaxify(model, variables, x), x


# treescope inserts the rendering in steps, each a <treescope-run-here> script that
# removes itself: none left means the tree is drawn.
_DRAWN = """
const host = document.querySelector("treescope-container");
const root = host === null ? null : host.shadowRoot.querySelector(".treescope_root");
return document.querySelectorAll("treescope-run-here").length === 0
  && root !== null && root.innerText.trim().length > 0;
"""


def _open(browser, tree, tmp_path, **options):
  from selenium.webdriver.support.wait import WebDriverWait

  page = tmp_path / "tree.html"
  fl.to_html(tree, page, **options)
  browser.get(page.as_uri())
  WebDriverWait(browser, 60).until(lambda b: b.execute_script(_DRAWN))


def test_the_page_loads_from_a_file_with_no_console_errors(browser, tmp_path):
  tree, _ = _transformer_tree()
  _open(browser, tree, tmp_path)
  assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


# The visible text of the table's first column, and of the rendered tree.
_SHOWN = """
const rows = document.querySelectorAll("table.flaxlens-summary tbody tr");
const tree = document.querySelector("treescope-container").shadowRoot;
const text = tree.querySelector(".treescope_root").innerText;
return [[...rows].map((r) => r.cells[0].innerText), text];
"""


@pytest.mark.parametrize("fw, name", [(LINEN, "transformer"), (NNX, "mlp")])
def test_every_call_is_visible_in_the_table_and_the_tree(browser, tmp_path, corpora, fw, name):
  tree = fw.convert(corpora[fw][name])
  _open(browser, tree, tmp_path)
  table, rendered = browser.execute_script(_SHOWN)
  assert table == [*(row.path or "<root>" for row in fl.summary(tree).rows), "total"]
  for (_, call), child in tree.submodule_calls.items():
    assert re.search(rf"{re.escape(repr(call))}\):\s*{type(child).__name__}\(", rendered)


# The tops of the keys in the `submodule_calls` of the rendered call `call` (a foldable
# node), whose texts are `keys`; and the node of its call whose text starts with `start`.
_CALLS_OF = """
const [call, keys, start] = arguments;
const direct = (parent) => [...parent.querySelectorAll(".foldable_node")]
  .filter((n) => n.parentElement.closest(".foldable_node") === parent);
const calls = direct(call).find((n) => n.innerText.startsWith("{"));
const made = direct(calls);
return [
  made.filter((n) => keys.includes(n.innerText)).map((n) => n.getBoundingClientRect().top),
  made.find((n) => n.innerText.startsWith(start)) ?? null,
];
"""


def test_each_call_a_call_makes_is_on_its_own_line(browser, tmp_path):
  from selenium.webdriver.common.by import By

  tree, _ = _transformer_tree()
  _open(browser, tree, tmp_path)
  root = browser.find_element(By.CSS_SELECTOR, "treescope-container").shadow_root
  root = root.find_element(By.CSS_SELECTOR, ".foldable_node")
  keys = [str(key) for key in tree.submodule_calls]
  block = tree.submodule_calls[1, "TransformerBlock_0.__call__"]
  start = f"{type(block).__name__}(module=TransformerBlock(name='TransformerBlock_0')"
  tops, block_node = browser.execute_script(_CALLS_OF, root, keys, start)
  assert len(set(tops)) == len(keys)  # Unfolded from the start, one call per line.
  block_node.find_element(By.CSS_SELECTOR, ":scope > label").click()
  block_keys = [str(key) for key in block.submodule_calls]
  tops, _ = browser.execute_script(_CALLS_OF, block_node, block_keys, "")
  assert len(set(tops)) == len(block_keys) == 5


def test_a_screenshot_of_the_page_is_written(browser, tmp_path):
  tree, x = _transformer_tree()
  _open(browser, tree, tmp_path, argument=fl.ArgsAndKwargs.capture(x))
  shot = tmp_path / "tree.png"
  assert browser.save_screenshot(str(shot))
  assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000


def test_the_returned_page_is_the_one_written_and_names_no_other_resource(tmp_path):
  tree, _ = _transformer_tree()
  page = fl.to_html(tree, tmp_path / "tree.html")
  assert (tmp_path / "tree.html").read_text(encoding="utf-8") == page
  assert "http://" not in page and "https://" not in page
