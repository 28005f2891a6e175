"""Arrays are saved in safetensors: every dtype an artifact claims round-trips bit for bit,
and the `safetensors` library reads our files and writes files we read."""

from __future__ import annotations

import hashlib
import json
from importlib.resources import files

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import flaxlens as fl

from .conftest import ARRAYS, read_arrays, write_arrays

# The dtypes the format claims (the schema's list), and how safetensors names each that it
# has; the others are stored as their raw bytes.
VALUES = json.loads(
  files("flaxlens.tools.files").joinpath("schemas/values.schema.json").read_text()
)
DTYPES = VALUES["$defs"]["dtype"]["enum"]
SAFETENSORS_NAMES = {
  "bool": "BOOL",
  "int8": "I8",
  "int16": "I16",
  "int32": "I32",
  "int64": "I64",
  "uint8": "U8",
  "uint16": "U16",
  "uint32": "U32",
  "uint64": "U64",
  "float16": "F16",
  "bfloat16": "BF16",
  "float32": "F32",
  "float64": "F64",
  "complex64": "C64",
  "float8_e4m3fn": "F8_E4M3",
  "float8_e5m2": "F8_E5M2",
}


def _example(dtype: str) -> np.ndarray:
  """A (2, 3) array of `dtype` with distinct values, zero (and negatives if signed) included."""
  kind = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
  if dtype == "bool":
    values = np.array([True, False, True, True, False, False])
  elif dtype.startswith("uint"):
    values = np.array([0, 1, 2, 3, 7, 5])
  else:
    values = np.array([0, 1, -2, 3, 7, -5])
  array = values.astype(kind).reshape(2, 3)
  return array + np.asarray(1j, kind) * array if kind.kind == "c" else array


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_array_of_every_claimed_dtype_round_trips_bit_for_bit(tmp_path, dtype):
  array = _example(dtype)
  with jax.enable_x64(True):
    fl.save_interventions([fl.patch("Dense_0", array)], tmp_path / "set")
    (loaded,) = fl.load_interventions(tmp_path / "set")
  operand = np.asarray(loaded.operands[0])
  assert operand.dtype == array.dtype and operand.shape == array.shape
  assert operand.tobytes() == array.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_safetensors_library_reads_each_arrays_header(tmp_path, dtype):
  array = _example(dtype)
  with jax.enable_x64(True):
    fl.save_interventions([fl.patch("Dense_0", array)], tmp_path / "set")
  with safe_open(tmp_path / "set" / ARRAYS, framework="numpy") as f:
    (name,) = f.keys()
    stored = f.get_slice(name)
    if dtype in SAFETENSORS_NAMES:
      assert (stored.get_dtype(), stored.get_shape()) == (SAFETENSORS_NAMES[dtype], [2, 3])
    else:  # int4, uint4, complex128: their raw bytes.
      assert (stored.get_dtype(), stored.get_shape()) == ("U8", [array.nbytes])


def test_the_safetensors_library_reads_an_artifacts_arrays_as_their_checksums_record(artifact):
  manifest = json.loads((artifact / "manifest.json").read_text())
  arrays = read_arrays(artifact)
  assert sorted(arrays) == sorted(manifest["arrays"])
  for name, info in manifest["arrays"].items():
    array = arrays[name]
    head = f"flaxlens-array {array.dtype.name} {list(array.shape)}\n".encode()
    assert hashlib.sha256(head + array.tobytes()).hexdigest() == info["sha256"]


def test_an_arrays_file_written_by_the_safetensors_library_loads(artifact):
  arrays = read_arrays(artifact)
  write_arrays(artifact, arrays)
  assert fl.load_isolated(artifact).replay()
