"""The harvest tests' models: one small token model per Flax API, built once per session."""

from __future__ import annotations

import pytest

from . import models

_built: dict[str, models.Model] = {}


@pytest.fixture(params=["linen", "nnx"], scope="session")
def model(request) -> models.Model:
  if request.param not in _built:
    _built[request.param] = models.build(request.param)
  return _built[request.param]


@pytest.fixture(scope="session")
def linen_model() -> models.Model:
  if "linen" not in _built:
    _built["linen"] = models.build("linen")
  return _built["linen"]
