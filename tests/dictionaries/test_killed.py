"""A training run killed with SIGKILL (a subprocess, stopped once two checkpoints are
written) resumes from its latest checkpoint and ends bit for bit as an uninterrupted run:
parameters (the JumpReLU threshold included), history and dead-feature counters."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

from . import killed_check as check

CHECK = pathlib.Path(check.__file__)
ROOT = CHECK.parents[2]
TIMEOUT = 240  # seconds to wait for the checkpoints before giving up


def _arrays(dictionary) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(dictionary))[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def _steps_saved(directory: pathlib.Path) -> list[int]:
  if not directory.exists():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_a_run_killed_midway_resumes_to_the_uninterrupted_result(tmp_path):
  directory = tmp_path / "run"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  process = subprocess.Popen(
    [sys.executable, str(CHECK), str(directory)],
    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=CHECK.parent,
  )  # fmt: skip
  try:
    deadline = time.monotonic() + TIMEOUT
    while len(_steps_saved(directory)) < 2 and process.poll() is None:
      assert time.monotonic() < deadline, "no two checkpoints in time"
      time.sleep(0.05)
    assert process.poll() is None, process.stderr.read()[-3000:]
    process.send_signal(signal.SIGKILL)
  finally:
    if process.poll() is None:
      process.kill()
    process.wait()
    process.stderr.close()
  saved = _steps_saved(directory)
  assert saved and saved[-1] < check.STEPS
  resumed, resumed_result = check.killed_run(str(directory))
  whole, whole_result = check.killed_run(None)
  for name, value in _arrays(whole).items():
    assert np.array_equal(_arrays(resumed)[name], value), name
  for name, values in whole_result.history.items():
    assert np.array_equal(resumed_result.history[name], values), name
  assert np.array_equal(resumed_result.since_fired, whole_result.since_fired)
