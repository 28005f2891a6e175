"""The documentation site: the API page covers the public surface, the examples run.

`mkdocs build --strict` (in `.ci/run`) checks links and renders every page; these tests
check what a build cannot: that no public name is missing from the API reference and that
the workflow pages' Python examples run as written, each page as one program.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import flaxlens as fl

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
WORKFLOW_PAGES = [
  "inspect.md",
  "replace.md",
  "interventions.md",
  "sweeps.md",
  "path-patching.md",
  "heads.md",
  "experts.md",
  "intervention-specs.md",
  "lenses.md",
  "isolate.md",
  "export.md",
  "sharding.md",
  "harvest.md",
  "dictionaries.md",
  "graphs.md",
  "training-interventions.md",
  "circuits.md",
  "compilation.md",
  "architecture.md",
]


def test_the_api_page_documents_every_public_name_once():
  documented = re.findall(r"^::: flaxlens\.(\w+)$", (DOCS / "api.md").read_text(), re.M)
  assert sorted(documented) == sorted(fl.__all__)


@pytest.mark.parametrize("page", WORKFLOW_PAGES)
def test_a_workflow_pages_examples_run_in_order(page):
  blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
  assert blocks, page
  namespace: dict = {}
  for index, block in enumerate(blocks):
    exec(compile(block, f"docs/{page}[python block {index}]", "exec"), namespace)
