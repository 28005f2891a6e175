"""Models sharded across a device mesh (four CPU devices, in a subprocess)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

CHECK = pathlib.Path(__file__).with_name("mesh_check.py")


@pytest.fixture(scope="module")
def report() -> dict[str, str]:
  result = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)


@pytest.mark.parametrize(
  "check",
  [
    "buffers shared",
    "eager exact",
    "eager sharding",
    "jit exact",
    "jit sharding",
    "isolate exact",
  ],
)
def test_a_sharded_linen_model_converts_runs_and_isolates_like_flax(report, check):
  assert report[check] == "True"
