"""Linen (logical axis rules) and NNX (sharding names) models on a 2x4 mesh of CPU devices.

Run in a subprocess (`mesh_2x4_check.py`), since the device count is fixed when JAX
starts. Conversion keeps every parameter the same sharded array; tree calls (eager,
`fl.variable_jit`, `jax.jit` of `stateless_call`) give the native output and output
sharding bit for bit; captured intermediates are sharded as Flax's; an isolated call
replays exactly on the mesh and, on one device, up to the rounding of a reduction that
the mesh split across devices; export keeps the arrays, their boxes and metadata.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

CHECK = pathlib.Path(__file__).with_name("mesh_2x4_check.py")
EXACT = [
  "linen kernel sharded",
  "linen buffers shared",
  "linen eager exact",
  "linen eager sharding",
  "linen jit exact",
  "linen jit sharding",
  "linen stateless jit exact",
  "linen stateless jit sharding",
  "linen intermediates sharding",
  "linen isolate on mesh exact",
  "linen isolated input sharded",
  "linen export same arrays and boxes",
  "nnx kernel sharded",
  "nnx buffers shared",
  "nnx jit exact",
  "nnx jit sharding",
  "nnx stateless jit exact",
  "nnx stateless jit sharding",
  "nnx eager exact",
  "nnx eager sharding",
  "nnx isolate on mesh exact",
  "nnx export same arrays and metadata",
  "nnx export into same arrays and metadata",
]


@pytest.fixture(scope="module")
def report() -> dict[str, str]:
  result = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)


@pytest.mark.parametrize("check", EXACT)
def test_sharded_models_convert_run_isolate_and_export_like_flax(report, check):
  assert report[check] == "True"


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_a_call_isolated_on_the_mesh_replays_on_one_device_up_to_rounding(report, framework):
  assert 0.0 <= float(report[f"{framework} isolate on one device max diff"]) < 1e-5
