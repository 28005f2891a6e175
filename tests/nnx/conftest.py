"""The NNX corpus as the `cases` fixture of the NNX-only tests."""

from __future__ import annotations

import pytest
from frameworks import NNX


@pytest.fixture(scope="session")
def cases(corpora):
  return corpora[NNX]
