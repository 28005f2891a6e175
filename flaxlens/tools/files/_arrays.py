"""The arrays file of artifacts and intervention sets: safetensors, read header first.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the tensors' bytes back to back: no code, no
compression, readable by the `safetensors` library and the tools built on it. flaxlens
writes it itself, each array under its manifest name, in safetensors's dtype where one
exists (`STORED_AS`); int4, uint4 and complex128, which safetensors has no dtype for, are
stored as their raw bytes (`U8`, 1-D), their real dtype and shape being in the manifest.
Reading checks the manifest's total against `max_bytes` and the file's size before
reading anything, the header (strict JSON, the `safetensors-header` schema, then each
tensor against the manifest and the byte ranges tiling the data exactly) before
allocating, then reads each tensor straight into its own buffer, hashing it on the way.
No Flax internals here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, BinaryIO

import jax
import numpy as np

from flaxlens.errors import ArtifactError
from flaxlens.tools.files._schemas import check_schema, read_json

ARRAYS = "arrays.safetensors"
# The safetensors dtype each array dtype is stored as; the others are stored as raw bytes.
STORED_AS = {
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
# Bytes a header may take: flaxlens writes about 80 per array.
MAX_HEADER_BYTES = 64 * 2**20
_ALIGNMENT = 8
_CHUNK = 2**20


def nbytes(info: dict) -> int:
  """Bytes of the array a manifest's array table describes (`{"shape", "dtype", ...}`)."""
  return int(np.prod(info["shape"], dtype=object)) * jax.numpy.dtype(info["dtype"]).itemsize


def stored_as(info: dict) -> tuple[str, list[int]]:
  """The safetensors dtype and shape an array of the array table is stored with."""
  if info["dtype"] in STORED_AS:
    return STORED_AS[info["dtype"]], list(info["shape"])
  return "U8", [nbytes(info)]


def digest(dtype: str, shape: Iterable[int], data: bytes = b"") -> Any:
  """SHA-256 over an array's dtype, shape and bytes (`update` it with more bytes), so that
  none of the three can change unnoticed."""
  return hashlib.sha256(f"flaxlens-array {dtype} {list(shape)}\n".encode() + data)


def array_table(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
  """The manifest's `arrays` field: each array's shape, dtype and checksum."""
  return {
    name: {
      "shape": list(a.shape),
      "dtype": a.dtype.name,
      "sha256": digest(a.dtype.name, a.shape, np.ascontiguousarray(a).tobytes()).hexdigest(),
    }
    for name, a in arrays.items()
  }


def write_arrays(f: BinaryIO, arrays: dict[str, np.ndarray]) -> None:
  """Writes `arrays` to `f` as a safetensors file.

  Larger items first, and the header padded with spaces to 8 bytes, as the `safetensors`
  library writes them, so that every tensor starts aligned to its item size.
  """
  table = array_table(arrays)
  order = sorted(arrays, key=lambda name: (-arrays[name].dtype.itemsize, name))
  header, offset = {}, 0
  for name in order:
    dtype, shape = stored_as(table[name])
    size = nbytes(table[name])
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % _ALIGNMENT)
  f.write(len(text).to_bytes(8, "little") + text)
  for name in order:
    f.write(np.ascontiguousarray(arrays[name]).tobytes())


def read_arrays(
  f: BinaryIO, size: int, expected: dict, max_bytes: int, where: str
) -> dict[str, np.ndarray]:
  """The arrays the manifest's table `expected` lists, from the open safetensors file `f`
  of `size` bytes; ArtifactError, before anything is allocated, for any disagreement."""
  fix = "The artifact is corrupted or was tampered with; save it again."
  total = sum(nbytes(info) for info in expected.values())
  if total > max_bytes:
    raise ArtifactError(
      f"{where}: the manifest declares {total} bytes of arrays, more than max_bytes="
      f"{max_bytes}; pass a larger max_bytes if you expect that much."
    )
  if size < 8 + total:
    raise ArtifactError(
      f"{where} ({size} bytes) is smaller than the {total} bytes of arrays it should hold;"
      f" it is truncated. {fix}"
    )
  length = int.from_bytes(f.read(8), "little")
  if length != size - 8 - total or length > MAX_HEADER_BYTES:
    raise ArtifactError(
      f"{where} declares a {length}-byte header, but {size - 8 - total} bytes are left"
      f" for it beside the {total} bytes of arrays its manifest lists (at most"
      f" {MAX_HEADER_BYTES} allowed). {fix}"
    )
  header = read_json(f.read(length), f"{where}: the header", fix)
  check_schema(header, "safetensors-header", f"{where}: the header", fix)
  header.pop("__metadata__", None)
  arrays = {}
  for name in _check_header(header, expected, where, fix):
    info = expected[name]
    data = np.empty(nbytes(info), np.uint8)
    view, position = memoryview(data), 0
    hashed = digest(info["dtype"], info["shape"])
    while position < len(data):
      read = f.readinto(view[position : position + _CHUNK])
      if not read:
        raise ArtifactError(f"{where}: array {name!r} is truncated. {fix}")
      hashed.update(view[position : position + read])
      position += read
    if hashed.hexdigest() != info["sha256"]:
      raise ArtifactError(f"{where}: array {name!r} does not match its checksum. {fix}")
    arrays[name] = data.view(jax.numpy.dtype(info["dtype"])).reshape(info["shape"])
  return arrays


def _check_header(header: dict, expected: dict, where: str, fix: str) -> list[str]:
  """Each tensor as the manifest says it is stored, and byte ranges tiling the data
  exactly (no gap, no overlap, none past the end); the names in the order of the data."""
  if set(header) != set(expected):
    raise ArtifactError(
      f"{where} holds the arrays {sorted(header)[:5]}, but the manifest lists"
      f" {sorted(expected)[:5]}. {fix}"
    )
  for name, info in expected.items():
    dtype, shape = stored_as(info)
    found = header[name]
    if (found["dtype"], found["shape"]) != (dtype, shape):
      raise ArtifactError(
        f"{where}: array {name!r} is stored as {found['dtype']}{found['shape']}, but the"
        f" manifest's {info['dtype']}{info['shape']} is stored as {dtype}{shape}. {fix}"
      )
  ranges = sorted((tuple(entry["data_offsets"]), name) for name, entry in header.items())
  end = 0
  for (begin, stop), name in ranges:
    if begin != end or stop - begin != nbytes(expected[name]):
      raise ArtifactError(
        f"{where}: array {name!r} takes bytes [{begin}, {stop}) of the data, where the"
        f" arrays before it end at {end} and it needs {nbytes(expected[name])}; the byte"
        f" ranges must tile the data. {fix}"
      )
    end = stop
  return [name for _, name in ranges]
