"""`fl.to_html`: the web page of a tree, checked in a real headless browser.

The browser is Debian's `chromium`, driven by Selenium through Debian's `chromium-driver`
(`.ci/run` installs both with apt when they are missing); nothing downloads a browser.
The page is opened from a file, as a user opens it, with no server.
"""

from __future__ import annotations

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


# Finds the foldable nodes of the rendered tree whose text starts with one of the given
# strings: [element, top, text] each, in document order (one browser round trip).
_FIND_FOLDABLE = """
const [host, prefixes] = arguments;
return [...host.shadowRoot.querySelectorAll(".foldable_node")]
  .filter((n) => prefixes.some((p) => n.innerText.startsWith(p)))
  .map((n) => [n, n.getBoundingClientRect().top, n.innerText]);
"""


def _foldable(browser, prefixes: list[str]) -> list[tuple]:
  from selenium.webdriver.common.by import By

  host = browser.find_element(By.CSS_SELECTOR, "treescope-container")
  return browser.execute_script(_FIND_FOLDABLE, host, prefixes)


# The tops of the foldable nodes directly inside `node` (no other foldable node between)
# whose text is one of `texts`.
_CHILD_TOPS = """
const [node, texts] = arguments;
return [...node.querySelectorAll(".foldable_node")]
  .filter((n) => n.parentElement.closest(".foldable_node") === node)
  .filter((n) => texts.includes(n.innerText))
  .map((n) => n.getBoundingClientRect().top);
"""


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
    assert f"{call!r}): {type(child).__name__}(" in rendered


def test_expanding_the_calls_of_the_root_puts_each_call_on_its_own_line(browser, tmp_path):
  from selenium.webdriver.common.by import By

  tree, _ = _transformer_tree()
  _open(browser, tree, tmp_path)
  keys = [str(key) for key in tree.submodule_calls]
  calls = next(node for node, _, _ in _foldable(browser, ["{" + keys[0]]))

  def lines() -> set[float]:
    return set(browser.execute_script(_CHILD_TOPS, calls, keys))

  assert len(lines()) == 1  # folded: the calls are written in one line
  calls.find_element(By.CSS_SELECTOR, ":scope > label").click()
  assert len(lines()) == len(keys)


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
