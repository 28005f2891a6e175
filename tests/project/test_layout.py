"""The test suite's layout: tests mirror the package, each folder a package of its own.

A reader finds the tests of `flaxlens/tools/harvest/` in `tests/harvest/`, of
`flaxlens/core/` in `tests/core/`, and the behaviours Linen and NNX share in
`tests/shared/` (docs/architecture.md, "Tests"). Only helpers every folder imports
(`conftest.py`, `frameworks.py`, ...) sit at the top of `tests/`.
"""

from __future__ import annotations

import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_no_test_module_sits_at_the_top_of_tests():
  loose = sorted(path.name for path in TESTS.glob("test_*.py"))
  assert loose == [], f"move {loose} into the folder of the package they test"


def test_every_test_folder_is_a_package():
  # pytest imports a test module by its package path; two `test_isolate.py` (tests/linen,
  # tests/nnx) can be imported side by side only if each folder is a package.
  folders = [p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))]
  missing = sorted(path.name for path in folders if not (path / "__init__.py").exists())
  assert missing == [], f"add an empty __init__.py to tests/{missing}"
