"""Fixtures every test directory shares: each framework's corpus, built once per session."""

from __future__ import annotations

from typing import Any

import pytest
from frameworks import Framework


class Corpora:
  """Each framework's corpus, built on first use: `corpora[framework][case name]`."""

  def __init__(self) -> None:
    self._built: dict[str, dict[str, Any]] = {}

  def __getitem__(self, framework: Framework) -> dict[str, Any]:
    if framework.name not in self._built:
      self._built[framework.name] = framework.corpus.build()
    return self._built[framework.name]


@pytest.fixture(scope="session", autouse=True)
def session_compilation_cache(tmp_path_factory):
  """Commands the tests start (`flaxlens demo`, ...) keep what they compile in a folder of
  this session's, not in the user's own compilation cache."""
  patch = pytest.MonkeyPatch()
  patch.setenv("FLAXLENS_COMPILATION_CACHE", str(tmp_path_factory.mktemp("compilation-cache")))
  yield
  patch.undo()


@pytest.fixture(scope="session")
def corpora() -> Corpora:
  return Corpora()


def pytest_make_parametrize_id(config, val, argname):
  """Test ids name a framework parameter "linen" or "nnx"."""
  if isinstance(val, Framework):
    return val.name
  return None
