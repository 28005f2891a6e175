"""Data-parallel training equals training on one device: on a mesh of four CPU devices (rows
over "data", features over "features") in a subprocess, and in two processes joined by
`jax.distributed` on 127.0.0.1 (two CPU devices each), launched with a hard time limit.

Tolerance: the parameters agree within 1e-6 relative (observed: at most 2e-7 absolute
after 30 steps), the history's losses within 1e-5; L0, dead fractions and the
dead-feature counters exactly. Only the order of the summations differs (the gradient of
a batch is summed per device, then across devices)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from . import parallel_check as check

CHECK = pathlib.Path(check.__file__)
ROOT = CHECK.parents[2]
TIMEOUT = 300  # seconds for a launch (both processes together)


def _environment() -> dict[str, str]:
  return {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
  }


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
  return check.train_run()[0]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp("parallel")


def _assert_equal_runs(got, reference) -> None:
  for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
    np.testing.assert_allclose(got[name], reference[name], rtol=1e-6, atol=1e-6, err_msg=name)
  for name in ("history loss", "history reconstruction", "history sparsity"):
    np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-5, err_msg=name)
  for name in ("history l0", "history dead_fraction", "since_fired"):
    assert np.array_equal(got[name], reference[name]), name


def test_a_mesh_of_four_devices_trains_as_one_device_with_the_features_split(out, reference):
  result = subprocess.run(
    [sys.executable, str(CHECK), "mesh", str(out)],
    capture_output=True, text=True, timeout=TIMEOUT, env=_environment(), cwd=CHECK.parent,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  placed = json.loads((out / "mesh.json").read_text())
  assert "'features'" in placed["W_enc"] and "P(None, 'features')" in placed["W_enc"]
  assert "P('features', None)" in placed["W_dec"]
  _assert_equal_runs(dict(np.load(out / "mesh.npz")), reference)


def test_two_processes_train_as_one_process_on_the_same_batches_and_seed(out, reference):
  port, processes, logs = _free_port(), [], []
  try:
    for process in range(2):
      logs.append(open(out / f"log-{process}.txt", "w"))  # noqa: SIM115 (closed in finally)
      processes.append(
        subprocess.Popen(
          [sys.executable, str(CHECK), "processes", str(out), str(port), str(process)],
          stdout=logs[-1],
          stderr=subprocess.STDOUT,
          env=_environment(),
          cwd=CHECK.parent,
        )  # fmt: skip
      )
    deadline = time.monotonic() + TIMEOUT
    for process in processes:
      process.wait(timeout=max(1.0, deadline - time.monotonic()))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
    for log in logs:
      log.close()
  failed = {
    n: (out / f"log-{n}.txt").read_text()[-3000:]
    for n, process in enumerate(processes)
    if process.returncode != 0
  }
  assert not failed, failed
  assert json.loads((out / "processes.json").read_text()) == {"devices": 4, "processes": 2}
  _assert_equal_runs(dict(np.load(out / "processes.npz")), reference)
