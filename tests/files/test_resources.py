"""Finding 2: hostile files are refused quickly, without reading or allocating their size.

The arrays files here are built by hand, as bytes and JSON (`conftest.write_arrays_file`).

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

import pytest

import flaxlens as fl

from .conftest import ARRAYS, read_manifest, split_arrays_file, write_arrays_file, write_manifest

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


@pytest.fixture
def huge_artifact(artifact) -> pathlib.Path:
  """The saved artifact with one 4 GiB array, declared alike by the manifest and by the
  header of an arrays file that holds no data at all."""
  manifest = read_manifest(artifact)
  manifest["arrays"] = {"a0": {"shape": [GiB4], "dtype": "uint8", "sha256": "0" * 64}}
  manifest["saved"]["args"] = {"tuple": [{"array": "a0"}]}
  manifest["saved"]["output"] = {"array": "a0"}
  manifest["recipe"]["rngs"] = None
  write_manifest(artifact, manifest)
  write_arrays_file(
    artifact, {"a0": {"dtype": "U8", "shape": [GiB4], "data_offsets": [0, GiB4]}}, b""
  )
  return artifact


def test_arrays_declared_larger_than_the_file_are_refused_in_well_under_a_second(huge_artifact):
  report = _load_in_child(huge_artifact)
  assert f"is smaller than the {GiB4} bytes of arrays it should hold" in report["outcome"]
  assert report["seconds"] < 0.5


def _edit_entry(name_of, **fields):
  def edit(header, data, expected):
    name = name_of(header, expected)
    header[name] = {**header[name], **fields}
    return json.dumps(header).encode(), data

  return edit


def _first(header, expected):
  return sorted(header, key=lambda n: header[n]["data_offsets"])[0]


def _float32(header, expected):
  return next(n for n, info in expected.items() if info["dtype"] == "float32")


def _overlapping(header, data, expected):
  first, second = sorted(header, key=lambda n: header[n]["data_offsets"])[:2]
  begin, end = header[second]["data_offsets"]
  header[second]["data_offsets"] = [begin - 1, end - 1]
  return json.dumps(header).encode(), data


def _past_the_end(header, data, expected):
  last = sorted(header, key=lambda n: header[n]["data_offsets"])[-1]
  header[last]["data_offsets"][1] += 8
  return json.dumps(header).encode(), data


def _duplicate_name(header, data, expected):
  name = _first(header, expected)
  text = json.dumps(header)
  return ("{" + json.dumps(name) + ": " + json.dumps(header[name]) + ", " + text[1:]).encode(), data


def _without(name_of):
  def edit(header, data, expected):
    del header[name_of(header, expected)]
    return json.dumps(header).encode(), data

  return edit


def _with_extra(header, data, expected):
  end = max(e["data_offsets"][1] for e in header.values())
  header["a999"] = {"dtype": "U8", "shape": [0], "data_offsets": [end, end]}
  return json.dumps(header).encode(), data


# Each edit takes the real header, data and the manifest's array table, and returns the
# header bytes and data of a malformed arrays file.
MALFORMED = {
  "header_not_json": (lambda h, d, e: (b"{not json", d), "the header is corrupted or truncated"),
  "header_not_utf8": (lambda h, d, e: (b'{"\xff": 1}', d), "the header is corrupted or truncated"),
  "header_not_an_object": (lambda h, d, e: (b"[]", d), r"header is malformed at \$: \[\] is not"),
  "duplicate_name": (_duplicate_name, "repeats a key"),
  "wrong_dtype_string": (
    _edit_entry(_first, dtype="F33"),
    r"header is malformed at \$\.a\d+\.dtype: 'F33' is not one of",
  ),
  "unknown_field": (_edit_entry(_first, offsets=[0, 0]), r"header is malformed at \$\.a\d+:"),
  "negative_offset": (_edit_entry(_first, data_offsets=[-1, 0]), r"data_offsets\[0\]"),
  "metadata_not_strings": (
    lambda h, d, e: (json.dumps({**h, "__metadata__": {"n": 1}}).encode(), d),
    r"header is malformed at \$\['__metadata__'\]\.n: 1 is not of type 'string'",
  ),
  "huge_shape": (_edit_entry(_float32, shape=[2**40]), r"is stored as F32\[1099511627776\]"),
  "dtype_disagrees": (_edit_entry(_float32, dtype="I32"), r"is stored as I32\[.*, but the"),
  "overlapping_ranges": (_overlapping, "the byte ranges must tile the data"),
  "range_past_the_end": (_past_the_end, "the byte ranges must tile the data"),
  "missing_array": (_without(_first), "holds the arrays .*, but the manifest lists"),
  "extra_array": (_with_extra, "holds the arrays .*, but the manifest lists"),
}


@pytest.mark.parametrize("edit, message", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_arrays_header_is_refused_before_any_array_is_read(artifact, edit, message):
  header, data = split_arrays_file(artifact)
  text, data = edit(header, data, read_manifest(artifact)["arrays"])
  write_arrays_file(artifact, text, data)
  with pytest.raises(fl.ArtifactError, match=message):
    fl.load_isolated(artifact)


@pytest.mark.parametrize(
  "length, message",
  [(2**63, "declares a 9223372036854775808-byte header"), (None, r"declares a \d+-byte header")],
  ids=["huge", "past_the_end"],
)
def test_a_header_length_that_does_not_fit_the_file_is_refused(artifact, length, message):
  raw = (artifact / ARRAYS).read_bytes()
  (declared,) = struct.unpack("<Q", raw[:8])
  length = declared + 64 if length is None else length
  (artifact / ARRAYS).write_bytes(struct.pack("<Q", length) + raw[8:])
  with pytest.raises(fl.ArtifactError, match=message):
    fl.load_isolated(artifact)


def test_an_arrays_file_shorter_than_its_length_field_is_refused(artifact):
  (artifact / ARRAYS).write_bytes(b"\x01\x02")
  with pytest.raises(fl.ArtifactError, match=r"\(2 bytes\) is smaller than"):
    fl.load_isolated(artifact)


def test_arrays_larger_than_max_bytes_are_refused_before_reading(artifact):
  with pytest.raises(fl.ArtifactError, match="more than max_bytes=16"):
    fl.load_isolated(artifact, max_bytes=16)


@pytest.mark.parametrize("name", ["manifest.json", ARRAYS])
def test_a_symlink_to_dev_zero_is_refused(artifact, name):
  (artifact / name).unlink()
  os.symlink("/dev/zero", artifact / name)
  report = _load_in_child(artifact)
  assert f"{name} is a symbolic link" in report["outcome"]
  assert report["seconds"] < 0.5


@pytest.mark.parametrize("name", ["manifest.json", ARRAYS])
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
