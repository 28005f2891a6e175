"""The Linen corpus as the `cases` fixture of the Linen-only tests."""

from __future__ import annotations

import pytest
from frameworks import LINEN


@pytest.fixture(scope="session")
def cases(corpora):
  return corpora[LINEN]
