"""Loading google-tunix's Llama3 model module without the rest of tunix.

`tunix/__init__.py` imports metrax, grain, datasets, qwix and more, and
`tunix/models/llama3/__init__.py` imports its weight loaders; the model file itself needs
only flax, jax and jaxtyping. This is the one place that works around that: it registers
stand-in packages with the right `__path__` and imports the model module alone.

Importing the module turns `flax.config.flax_always_shard_variable` off, globally, and its
models need it off (their variables carry sharding annotations but no mesh). The import
restores the setting; `tunix_settings()` turns it off only while a test uses the model.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

import flax

PACKAGES = (("tunix", ""), ("tunix.models", "/models"), ("tunix.models.llama3", "/models/llama3"))


def load_llama3():
  """The `tunix.models.llama3.model` module (skips the test if tunix is missing)."""
  import pytest

  name = "tunix.models.llama3.model"
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.find_spec("tunix")
  if spec is None:
    pytest.skip("google-tunix is not installed (requirements/models-nodeps.txt)")
  root = spec.submodule_search_locations[0]
  for package, sub in (
    ("tunix", ""),
    ("tunix.models", "/models"),
    ("tunix.models.llama3", "/models/llama3"),
  ):
    if package not in sys.modules:
      stand_in = types.ModuleType(package)
      stand_in.__path__ = [root + sub]
      sys.modules[package] = stand_in
  shard = flax.config.flax_always_shard_variable
  try:
    return importlib.import_module(name)
  finally:
    flax.config.update("flax_always_shard_variable", shard)


@contextlib.contextmanager
def tunix_settings() -> Iterator[None]:
  """Flax as tunix's models expect it, restored afterwards."""
  shard = flax.config.flax_always_shard_variable
  flax.config.update("flax_always_shard_variable", False)
  try:
    yield
  finally:
    flax.config.update("flax_always_shard_variable", shard)
