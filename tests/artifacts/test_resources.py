"""Finding 2: hostile files are refused quickly, without reading or allocating their size.

Each load runs in a child process with a wall-clock timeout and an address-space limit
(RLIMIT_AS, 2 GiB) far below what the hostile file declares; the child reports how long
the refusal took.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys
import zipfile
import zlib

import numpy as np
import pytest

import flaxlens as fl

from .conftest import read_manifest, write_manifest

LIMIT = 2 * 2**30
GiB4 = 4 * 2**30
CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
import flaxlens as fl
start = time.monotonic()
try:
  fl.load_isolated(sys.argv[1])
  outcome = "loaded"
except fl.ArtifactError as e:
  outcome = str(e)
print(json.dumps({{"seconds": time.monotonic() - start, "outcome": outcome}}))
"""


def _load_in_child(path: pathlib.Path) -> dict:
  result = subprocess.run(
    [sys.executable, "-c", CHILD.format(limit=LIMIT), str(path)],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def _zip_bomb(path: pathlib.Path) -> None:
  """A valid zip64 archive whose one .npy member (4 GiB of uint8 zeros) is deflated to a
  few MB: one compressed block of zeros, ended by a full flush, repeated."""
  text = f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({GiB4},), }}"
  text = text.ljust(127 - 10) + "\n"
  header = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode()
  zeros = bytes(2**24)
  compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
  head = compressor.compress(header + zeros[len(header) :]) + compressor.flush(zlib.Z_FULL_FLUSH)
  block = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
  blocks = GiB4 // len(zeros)
  tail = compressor.compress(zeros[: len(header)]) + compressor.flush()
  crc = zlib.crc32(header + zeros[len(header) :])
  for _ in range(blocks):
    crc = zlib.crc32(zeros, crc)
  size = len(header) + GiB4
  packed = len(head) + blocks * len(block) + len(tail)
  name = b"a0.npy"
  zip64 = struct.pack("<HHQQ", 1, 16, size, packed)
  local = struct.pack(
    "<IHHHHHIIIHH", 0x04034B50, 45, 0, 8, 0, 0x21, crc, *[0xFFFFFFFF] * 2, len(name), len(zip64)
  )
  with open(path, "wb") as f:
    f.write(local + name + zip64 + head)
    for _ in range(blocks):
      f.write(block)
    f.write(tail)
    start = f.tell()
    central = struct.pack(
      "<IHHHHHHIIIHHHHHII",
      0x02014B50,
      45,
      45,
      0,
      8,
      0,
      0x21,
      crc,
      *[0xFFFFFFFF] * 2,
      len(name),
      len(zip64),
      0,
      0,
      0,
      0,
      0,
    )
    f.write(central + name + zip64)
    end = f.tell()
    f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, 1, 1, end - start, start))
    f.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
    f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, end - start, start, 0))


@pytest.fixture
def bomb_artifact(artifact) -> pathlib.Path:
  """The saved artifact with its arrays replaced by one 4 GiB array, as a zip bomb."""
  manifest = read_manifest(artifact)
  manifest["arrays"] = {"a0": {"shape": [GiB4], "dtype": "uint8", "sha256": "0" * 64}}
  manifest["saved"]["args"] = {"tuple": [{"array": "a0"}]}
  manifest["saved"]["output"] = {"array": "a0"}
  manifest["recipe"]["rngs"] = None
  write_manifest(artifact, manifest)
  _zip_bomb(artifact / "arrays.npz")
  return artifact


@pytest.mark.slow
def test_a_zip_bomb_is_refused_in_well_under_a_second(bomb_artifact):
  with zipfile.ZipFile(bomb_artifact / "arrays.npz") as archive:
    (member,) = archive.infolist()
  assert member.file_size > GiB4 and member.compress_size < 8 * 2**20
  report = _load_in_child(bomb_artifact)
  assert "smaller than the arrays it should hold" in report["outcome"]
  assert report["seconds"] < 0.5


def test_a_compressed_member_is_refused_unread(artifact):
  with np.load(artifact / "arrays.npz") as npz:
    arrays = {name: npz[name] for name in npz.files}
  padding = sum(a.nbytes for a in arrays.values())
  np.savez_compressed(artifact / "arrays.npz", **arrays)
  with open(artifact / "arrays.npz", "ab") as f:  # As large as the stored file would be.
    f.write(bytes(padding))
  with pytest.raises(fl.ArtifactError, match="compressed or declares .* refused unread"):
    fl.load_isolated(artifact)


def test_a_member_header_that_disagrees_with_the_manifest_is_refused(artifact):
  manifest = read_manifest(artifact)
  name, info = next((n, i) for n, i in manifest["arrays"].items() if i["dtype"] == "float32")
  with np.load(artifact / "arrays.npz") as npz:
    arrays = {n: npz[n] for n in npz.files}
  arrays[name] = arrays[name].view(np.float32)
  np.savez(artifact / "arrays.npz", **arrays)
  with pytest.raises(fl.ArtifactError, match=f"{name}.npy declares a float32"):
    fl.load_isolated(artifact)


def test_arrays_larger_than_max_bytes_are_refused_before_reading(artifact):
  with pytest.raises(fl.ArtifactError, match="more than max_bytes=16"):
    fl.load_isolated(artifact, max_bytes=16)


@pytest.mark.parametrize("name", ["manifest.json", "arrays.npz"])
def test_a_symlink_to_dev_zero_is_refused(artifact, name):
  (artifact / name).unlink()
  os.symlink("/dev/zero", artifact / name)
  report = _load_in_child(artifact)
  assert f"{name} is a symbolic link" in report["outcome"]
  assert report["seconds"] < 0.5


@pytest.mark.parametrize("name", ["manifest.json", "arrays.npz"])
def test_a_fifo_is_refused_without_blocking(artifact, name):
  (artifact / name).unlink()
  os.mkfifo(artifact / name)
  report = _load_in_child(artifact)
  assert f"{name} is not a regular file" in report["outcome"]
  assert report["seconds"] < 0.5


def test_a_symlinked_artifact_directory_is_refused(artifact, tmp_path):
  os.symlink(artifact, tmp_path / "link")
  with pytest.raises(fl.ArtifactError, match="is a symbolic link"):
    fl.load_isolated(tmp_path / "link")


def test_an_oversized_manifest_is_refused_unread(artifact):
  with open(artifact / "manifest.json", "ab") as f:
    f.truncate(65 * 2**20)
  with pytest.raises(fl.ArtifactError, match=r"manifest.json is too large"):
    fl.load_isolated(artifact)
