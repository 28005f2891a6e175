"""A harvest of Linen and NNX models whose parameters are sharded over a 2x4 mesh ('data' x
'model') of CPU devices, one process (in a subprocess: the device count is fixed when JAX
starts)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

CHECK = pathlib.Path(__file__).with_name("tensor_parallel_check.py")
ROOT = CHECK.parents[2]
CHECKS = [
  "kernel sharded",
  "hidden sharded along features",
  "written at feature offsets",
  "masked rows exact",
  "rows exact",
  "ids exact",
]


@pytest.fixture(scope="module")
def report() -> dict[str, str]:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  result = subprocess.run(
    [sys.executable, str(CHECK)], capture_output=True, text=True, timeout=300, env=env
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("check", CHECKS)
def test_a_tensor_parallel_model_harvests_flaxs_rows_from_its_feature_shards(
  report, framework, check
):
  assert report[f"{framework} {check}"] == "True"
