"""The manifest of a flaxlens file: its format and version, its checksum, its schema.

`read_manifest` turns the bytes of a `manifest.json` into checked JSON or raises
`ArtifactError`: strict, bounded JSON (`_schemas.read_json`), the expected `format` and
`format_version`, a SHA-256 over the manifest's canonical form, then the format's JSON
Schema (`schemas/isolated.schema.json`, `schemas/interventions.schema.json`).
`parse_manifest` adds, for an isolated call, what a schema cannot state: the references
and arrays its values use, every array listed, key arrays fitting their implementation,
`requires` naming every package its references need allowed (`needs_allowing`: not
`builtins` for a `dict`). Nothing is imported here. docs/artifacts.md
lists the fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from flaxlens.errors import ArtifactError
from flaxlens.tools.files._codec import KEY_IMPLS, Found, collect
from flaxlens.tools.files._policy import needs_allowing, package_of
from flaxlens.tools.files._schemas import check_schema, read_json

FORMAT = "flaxlens-isolated"
FORMAT_VERSION = 3
# Each format's schema in `schemas/`, and the function that writes it.
_FORMATS = {
  FORMAT: ("isolated", "fl.save_isolated"),
  "flaxlens-interventions": ("interventions", "fl.save_interventions"),
}


@dataclasses.dataclass(frozen=True)
class Manifest:
  """A manifest that passed every check, with what its values reference."""

  data: dict
  references: list[tuple[str, str, str]]
  # `replay.jit` if the manifest records it: the call was recorded from compiled code.
  replay_jit: bool | None


def checksum(manifest: dict) -> str:
  """SHA-256 of the manifest's canonical JSON, its own checksum field left out."""
  body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
  canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
  return hashlib.sha256(canonical.encode()).hexdigest()


def fix_for(file_format: str) -> str:
  """What to do about a file of `file_format` that is corrupted."""
  return f"It is corrupted or was tampered with; save it again with {_FORMATS[file_format][1]}."


def read_manifest(
  raw: bytes, source: str, file_format: str, version: int, oldest: int | None = None
) -> dict:
  """The manifest `raw` of a file of `file_format` at `version` (or any from `oldest`
  on), checked against its checksum and its schema; ArtifactError naming the fault and
  what to do.

  Files of an older version are refused (their arrays are in `arrays.npz`, which this
  flaxlens no longer reads), and so are files of a newer one.
  """
  where, fix = f"{source}: manifest.json", fix_for(file_format)
  data = read_json(raw, where, fix)
  if not isinstance(data, dict) or data.get("format") != file_format:
    raise ArtifactError(
      f"{source}: manifest.json is not a {file_format} manifest. Pass a directory that"
      f" {_FORMATS[file_format][1]} wrote."
    )
  found = data.get("format_version")
  if type(found) is not int or found < 1:
    raise ArtifactError(
      f"{source}: format_version {json.dumps(found)[:20]} is not a positive integer. {fix}"
    )
  if found > version:
    raise ArtifactError(
      f"{source} uses {file_format} format {found}, newer than this flaxlens reads"
      f" ({version}). Upgrade flaxlens to load it."
    )
  oldest = version if oldest is None else oldest
  if found < oldest:
    reads = f"format {version}" if oldest == version else f"formats {oldest} to {version}"
    raise ArtifactError(
      f"{source} uses {file_format} format {found}; this flaxlens reads {reads}"
      " only (arrays in arrays.safetensors, not arrays.npz). Save it again from its model"
      " with this flaxlens, or load it with the flaxlens version that wrote it (its"
      " manifest's 'versions')."
    )
  if data.get("manifest_sha256") != checksum(data):
    raise ArtifactError(f"{source}: manifest.json does not match its checksum. {fix}")
  check_schema(data, _FORMATS[file_format][0], where, fix)
  return data


def parse_manifest(raw: bytes, source: str) -> Manifest:
  """Parses and checks a whole isolated-call manifest; ArtifactError at the first fault."""
  data = read_manifest(raw, source, FORMAT, FORMAT_VERSION)
  found = references_of(data, source)
  check_arrays(data, found, source, FORMAT)
  replay = data.get("replay")
  return Manifest(
    data=data,
    references=found.references,
    replay_jit=None if replay is None else replay["jit"],
  )


def references_of(manifest: dict, source: str = "manifest") -> Found:
  """The references (with their roles) and arrays a schema-valid manifest's values use."""
  found = Found()
  recipe, saved = manifest["recipe"], manifest["saved"]
  try:
    if recipe["kind"] == "linen":
      collect(recipe["module"], "recipe.module", found)
      collect(recipe["variables"], "recipe.variables", found)
      _collect_rngs(recipe["rngs"], found)
      collect(recipe["capture_intermediates"], "recipe.capture_intermediates", found)
    else:
      collect(recipe["graphdef"], "recipe.graphdef", found)
      collect(recipe["leaves"], "recipe.leaves", found)
    if isinstance(recipe["method"], dict):
      found.references.append((recipe["method"]["ref"], "method", "recipe.method"))
    for name in ("args", "kwargs", "side_inputs", "output"):
      collect(saved[name], f"saved.{name}", found)
    for name in ("initial", "final"):
      for label, value in saved[name]:
        collect(value, f"saved.{name}[{label!r}]", found)
  except ArtifactError as e:
    raise ArtifactError(f"{source}: {e}") from None
  return found


def _collect_rngs(rngs: Any, found: Found) -> None:
  if rngs is None:
    return
  for n, held in enumerate([rngs, *rngs.get("adopted", [])]):
    where = "recipe.rngs" if n == 0 else f"recipe.rngs.adopted[{n - 1}]"
    collect(held["keys"], f"{where}.keys", found)
    collect(held["suffixes"], f"{where}.suffixes", found)


def check_arrays(data: dict, found: Found, source: str, file_format: str) -> None:
  """What the schema cannot state about arrays and references: every array a value uses
  is in the table, key arrays fit their implementation, and `requires` names every
  package the references need allowed (`needs_allowing`)."""
  arrays = data["arrays"]
  if not set(found.arrays) <= set(arrays):
    raise ArtifactError(
      f"{source}: manifest.json's values use arrays"
      f" {sorted(set(found.arrays) - set(arrays))[:8]} that its table does not"
      f" list. {fix_for(file_format)}"
    )
  for name, impl in found.arrays.items():
    info = arrays[name]
    if impl != "array" and (
      info["dtype"] != "uint32" or tuple(info["shape"][-len(KEY_IMPLS[impl]) :]) != KEY_IMPLS[impl]
    ):
      raise ArtifactError(
        f"{source}: array {name!r} holds {impl} keys but has dtype {info['dtype']} and"
        f" shape {info['shape']}. {fix_for(file_format)}"
      )
  needed = {package_of(ref) for ref, _, _ in found.references if needs_allowing(ref)}
  if not needed <= set(data["requires"]):
    raise ArtifactError(
      f"{source}: manifest.json's 'requires' omits {sorted(needed - set(data['requires']))},"
      f" which its references name. {fix_for(file_format)}"
    )
