"""JAX's persistent compilation cache, as `fl.enable_compilation_cache` and the command line
turn it on: a second process asking the same questions compiles nothing.

Two fresh interpreters (`second_process_check.py`) share a new cache folder, one after the
other, each asking every compiled tool one question and counting with
`fl.count_compiles`; the second's results must equal the first's and native Flax's.
The folder choice (argument, `$FLAXLENS_COMPILATION_CACHE`, the per-user default, a folder
the user gave JAX) is checked in this process, JAX's settings restored after each test.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import flaxlens as fl
from flaxlens import cli

from . import second_process_check as check

CHECK = pathlib.Path(check.__file__)
ROOT = CHECK.parents[2]
TIMEOUT = 240  # seconds per process
TOOLS = ("run", "capture", "sweep", "attribute", "grad_at", "path_patch", "linen_run", "nnx_run")


def _ask(cache: pathlib.Path, out: pathlib.Path) -> tuple[dict, dict]:
  out.mkdir()
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run(
    [sys.executable, str(CHECK), str(cache), str(out)],
    capture_output=True,
    text=True,
    env=env,
    timeout=TIMEOUT,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads((out / "report.json").read_text())
  with np.load(out / "values.npz") as values:
    return report, dict(values)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple:
  """The reports and values of two processes that ask the same questions, one after the
  other, sharing a cache folder that is empty at first."""
  root = tmp_path_factory.mktemp("persistent-cache")
  first = _ask(root / "cache", root / "first")
  second = _ask(root / "cache", root / "second")
  return first, second


@pytest.fixture
def jax_cache_settings():
  """JAX's cache settings as they were, restored after the test."""
  names = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
  )
  before = {name: jax.config.values[name] for name in names}
  yield before
  fl.disable_compilation_cache()
  for name, value in before.items():
    jax.config.update(name, value)


def test_a_second_process_compiles_nothing_for_the_questions_a_first_one_asked(two_processes):
  (first, _), (second, _) = two_processes
  for tool in TOOLS:
    assert first[tool]["compilations"] >= 1, (tool, first[tool])  # The cache started empty.
    assert second[tool]["compilations"] == 0, (tool, second[tool])
    assert second[tool]["hits"] == first[tool]["compilations"], (tool, second[tool])


def test_programs_read_from_the_cache_give_the_first_process_results_and_native_flax(
  two_processes,
):
  (_, first), (_, second) = two_processes
  assert first.keys() == second.keys()
  for name, value in first.items():
    np.testing.assert_array_equal(second[name], value, err_msg=name)
  np.testing.assert_array_equal(second["linen_run/0"], second["native_linen/0"])
  np.testing.assert_array_equal(second["nnx_run/0"], second["native_nnx/0"])


def test_the_cache_folder_is_the_one_given(tmp_path, jax_cache_settings):
  folder = fl.enable_compilation_cache(tmp_path / "given")
  assert folder == str(tmp_path / "given")
  assert jax.config.jax_compilation_cache_dir == folder
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
  jax.jit(lambda x: x * 3 + 1)(np.arange(5.0))  # A program no other test compiles.
  assert os.listdir(folder)


def test_the_environment_variable_moves_the_cache(tmp_path, monkeypatch, jax_cache_settings):
  monkeypatch.setenv("FLAXLENS_COMPILATION_CACHE", str(tmp_path / "moved"))
  assert fl.enable_compilation_cache() == str(tmp_path / "moved")


@pytest.mark.parametrize("off", ["0", "off", "OFF"])
def test_off_in_the_environment_leaves_jax_without_a_cache(off, monkeypatch, jax_cache_settings):
  monkeypatch.setenv("FLAXLENS_COMPILATION_CACHE", off)
  assert fl.enable_compilation_cache() is None
  assert jax.config.jax_compilation_cache_dir == jax_cache_settings["jax_compilation_cache_dir"]


def test_the_default_folder_is_the_users_cache_home(tmp_path, monkeypatch, jax_cache_settings):
  monkeypatch.delenv("FLAXLENS_COMPILATION_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  jax.config.update("jax_compilation_cache_dir", None)
  assert fl.enable_compilation_cache() == str(tmp_path / "flaxlens" / "jax")
  assert (tmp_path / "flaxlens" / "jax").is_dir()


def test_a_folder_the_user_gave_jax_is_kept(tmp_path, monkeypatch, jax_cache_settings):
  monkeypatch.delenv("FLAXLENS_COMPILATION_CACHE")
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
  assert fl.enable_compilation_cache() == str(tmp_path / "mine")
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.0


def test_disabling_restores_jax_settings(tmp_path, jax_cache_settings):
  fl.enable_compilation_cache(tmp_path)
  fl.disable_compilation_cache()
  for name, value in jax_cache_settings.items():
    assert jax.config.values[name] == value


@pytest.mark.parametrize("options", [[], ["--no-cache"]])
def test_the_command_line_uses_the_cache_unless_told_not_to(
  options, tmp_path, monkeypatch, capsys, jax_cache_settings
):
  monkeypatch.setenv("FLAXLENS_COMPILATION_CACHE", str(tmp_path / "cli"))
  target = f"{ROOT / 'examples' / 'inspect_targets.py'}:nnx_mlp"
  assert cli.main(["inspect", target, *options]) == 0
  expected = None if options else str(tmp_path / "cli")
  assert jax.config.jax_compilation_cache_dir == (
    expected or jax_cache_settings["jax_compilation_cache_dir"]
  )


def test_the_command_line_option_moves_the_cache(tmp_path, capsys, jax_cache_settings):
  target = f"{ROOT / 'examples' / 'inspect_targets.py'}:nnx_mlp"
  assert cli.main(["inspect", target, "--compilation-cache", str(tmp_path / "opt")]) == 0
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "opt")
