"""A harvest of batches sharded over four CPU devices, one process (in a subprocess)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

CHECK = pathlib.Path(__file__).with_name("sharded_check.py")
ROOT = CHECK.parents[2]


@pytest.fixture(scope="module")
def report() -> dict[str, str]:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  result = subprocess.run(
    [sys.executable, str(CHECK)], capture_output=True, text=True, timeout=300, env=env
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)


@pytest.mark.parametrize(
  "check",
  [
    "devices",
    "written shard by shard",
    "rows exact",
    "mask written shard by shard",
    "mask rows stay on their device",
    "mask rows equal one device",
  ],
)
def test_sharded_batches_are_written_from_their_shards(report, check):
  assert report[check] == "True"
