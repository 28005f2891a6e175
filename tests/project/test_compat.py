"""Flax and JAX internals are looked up on first use, and a missing one is named.

Every internal flaxlens uses is declared in `flaxlens/_compat/` as an `Internal` and
resolved when first called. These tests make one unresolvable by replacing its
declaration with one naming an attribute the installed Flax or JAX lacks, as a renamed
internal would be, and leave Flax and JAX themselves as they are.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import flax
import flax.core.lift
import flax.core.scope
import flax.linen.transforms
import jax
import pytest
from flax import nnx
from flax.nnx.transforms import compilation
from frameworks import LINEN, NNX, nnx_modules

import flaxlens as fl
from flaxlens import _compat
from flaxlens._compat import Formerly, Internal, linen_lift, nnx_jit, tracing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _declared() -> list[Internal]:
  """Every `Internal` the modules of flaxlens/_compat declare (alone or in a tuple)."""
  found = []
  for info in pkgutil.iter_modules(_compat.__path__):
    module = importlib.import_module(f"flaxlens._compat.{info.name}")
    for value in vars(module).values():
      values = value if isinstance(value, tuple) else (value,)
      found += [v for v in values if isinstance(v, Internal)]
  return found


def test_importing_flaxlens_looks_up_no_internal():
  code = (
    "import flaxlens, sys, pkgutil, importlib\n"
    "from flaxlens import _compat\n"
    "names = [f'flaxlens._compat.{m.name}' for m in pkgutil.iter_modules(_compat.__path__)]\n"
    "assert set(names) <= set(sys.modules), set(names) - set(sys.modules)\n"
    "found = [v for n in names for v in vars(sys.modules[n]).values()]\n"
    "found = [x for v in found for x in (v if isinstance(v, tuple) else (v,))]\n"
    "internals = [v for v in found if isinstance(v, _compat.Internal)]\n"
    "print(len(internals), [i for i in internals if i.resolved()])\n"
  )
  result = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    env={**os.environ, "PYTHONPATH": str(ROOT)},
    capture_output=True,
    text=True,
    check=True,
  )
  count, resolved = result.stdout.split(" ", 1)
  assert int(count) == len(_declared()) > 0
  assert resolved.strip() == "[]"


def _owners(model) -> list:
  """What a run may patch: the model's classes (NNX wraps their methods) and Flax's."""
  classes = {type(model)}
  if isinstance(model, nnx.Module):
    classes |= {type(m) for _, m in nnx_modules(model)}
  mro = {c for cls in classes for c in cls.__mro__ if c is not object}
  flax_owners = [flax.core.lift, flax.linen.transforms, flax.core.scope.Scope]
  jit_wrappers = [compilation.JitWrapped]
  if nnx_jit.SIMPLE_JIT_WRAPPED_CALL.or_none() is not None:  # flax >= 0.12.6
    jit_wrappers.append(compilation.SimpleJitWrapped)
  return [*mro, *flax_owners, *jit_wrappers]


@pytest.mark.parametrize(
  "fw, declaration, internal",
  [
    (LINEN, (linen_lift, "PARTIAL_PACK"), Internal("flax.core.lift", "_partial_pack_renamed")),
    (NNX, (nnx_jit, "SIMPLE_JIT_WRAPPED_CALL"), Internal("flax.nnx", "SimpleJitRenamed")),
    (LINEN, (tracing, "GET_OPAQUE_TRACE_STATE"), Internal("jax.extend.core", "no_trace_state")),
    (NNX, (tracing, "GET_OPAQUE_TRACE_STATE"), Internal("jax.extend.core", "no_trace_state")),
  ],
)
def test_a_missing_internal_raises_at_first_use_naming_it_and_the_supported_versions(
  corpora, monkeypatch, fw, declaration, internal
):
  case = corpora[fw]["mlp"]
  model = fw.plain_model(case)
  model = model[0] if isinstance(model, tuple) else model
  before = [(owner, dict(vars(owner))) for owner in _owners(model)]
  monkeypatch.setattr(*declaration, internal)
  with pytest.raises(fl.UnsupportedFlaxFeatureError) as raised:
    fw.call(fw.convert(case), case)
  message = str(raised.value)
  assert f"flaxlens uses {internal.module}.{internal.name}," in message
  assert _compat.SUPPORTED in message
  assert f"flax {flax.__version__} with jax {jax.__version__}" in message
  for owner, attributes in before:  # Nothing was left patched.
    now = vars(owner)
    assert now.keys() == attributes.keys()
    assert all(now[name] is value for name, value in attributes.items()), owner


def test_the_supported_window_is_the_one_pyproject_declares():
  pyproject = (ROOT / "pyproject.toml").read_text()
  bounds = dict(re.findall(r'"(flax|jax)>=([0-9.]+),<[0-9.]+"', pyproject))
  below = dict(re.findall(r'"(flax|jax)>=[0-9.]+,<([0-9]+\.[0-9]+)"', pyproject))
  series = {}
  for package, upper in below.items():
    major, minor = upper.split(".")
    series[package] = f"{major}.{int(minor) - 1}.x"
  lowest = {p: v for p, v in bounds.items() if not v.endswith(".0")}
  expected = " with ".join(
    f"{p} {lowest[p]}–{series[p]}" if p in lowest else f"{p} {series[p]}" for p in ("flax", "jax")
  )
  assert _compat.SUPPORTED == expected
  for requirement in re.findall(r"'([^']+)'", _compat.INSTALL):  # What the error says to run.
    assert f'"{requirement}"' in pyproject


def test_every_declared_internal_is_listed_in_the_compat_docs():
  page = (ROOT / "docs" / "compat.md").read_text()
  missing = [i.full_name for i in _declared() if f"`{i.full_name}`" not in page]
  assert not missing, f"docs/compat.md does not list: {missing}"


def test_an_internal_an_older_release_kept_elsewhere_is_found_there():
  moved = Internal(
    "flax.core.no_such_module",
    "LazyRng",
    formerly=(
      Formerly("flax.core.scope", "NoSuchName", "never"),
      Formerly("flax.core.scope", "LazyRng", "every release"),
    ),
  )
  assert moved() is flax.core.scope.LazyRng
  assert moved.site() == (flax.core.scope, "LazyRng")
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="flax.core.no_such_module.LazyRng,"):
    Internal("flax.core.no_such_module", "LazyRng", formerly=moved.formerly[:1])()


def test_an_internal_added_in_a_later_release_is_none_before_it_and_required_from_it():
  later = Internal("flax.core.scope", "NoSuchName", added_in="flax 99.0.0")
  assert later.or_none() is None
  assert Internal("flax.core.scope", "LazyRng", added_in="flax 0.1.0").or_none() is (
    flax.core.scope.LazyRng
  )
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="flax.core.scope.NoSuchName,"):
    Internal("flax.core.scope", "NoSuchName", added_in="flax 0.1.0").or_none()
