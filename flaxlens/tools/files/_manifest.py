"""The artifact manifest: its schema, its checksum and its version, checked before use.

`parse_manifest(text)` turns the bytes of `manifest.json` into a `Manifest` or raises
`ArtifactError`: strict JSON (no NaN, no duplicate keys), a known `format_version`, a
SHA-256 over the manifest's canonical form, then a declarative schema of every field
(`_SCHEMA`) that also validates each encoded value and collects the references and array
names it holds. Nothing is imported here. docs/artifacts.md lists the fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from flaxlens.errors import ArtifactError
from flaxlens.tools.files._codec import DTYPES, KEY_IMPLS, Found, validate
from flaxlens.tools.files._policy import DEFAULT_PACKAGES, package_of

FORMAT = "flaxlens-isolated"
FORMAT_VERSION = 2
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PACKAGE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Check = Callable[[Any, str, Found], None]


def _fail(where: str, what: str) -> ArtifactError:
  return ArtifactError(f"Malformed artifact: {where} {what}.")


def _is(kind: type | tuple, name: str) -> Check:
  def check(value: Any, where: str, found: Found) -> None:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
      raise _fail(where, f"must be {name}, not {json.dumps(value)[:40]}")

  return check


def _matching(pattern: re.Pattern, name: str) -> Check:
  def check(value: Any, where: str, found: Found) -> None:
    if not (isinstance(value, str) and pattern.fullmatch(value)):
      raise _fail(where, f"must be {name}, not {json.dumps(value)[:40]}")

  return check


def _one_of(allowed: frozenset[str], name: str) -> Check:
  def check(value: Any, where: str, found: Found) -> None:
    if not isinstance(value, str) or value not in allowed:
      raise _fail(where, f"must be {name} ({', '.join(sorted(allowed))})")

  return check


def _natural(value: Any, where: str, found: Found) -> None:
  if type(value) is not int or value < 0:
    raise _fail(where, f"must be a non-negative integer, not {json.dumps(value)[:40]}")


def _const(expected: Any) -> Check:
  def check(value: Any, where: str, found: Found) -> None:
    if value != expected or type(value) is not type(expected):
      raise _fail(where, f"must be {expected!r}")

  return check


def _list_of(item: Check) -> Check:
  def check(value: Any, where: str, found: Found) -> None:
    _is(list, "a list")(value, where, found)
    for i, v in enumerate(value):
      item(v, f"{where}[{i}]", found)

  return check


def _map_of(item: Check, key: re.Pattern | None = None) -> Check:
  def check(value: Any, where: str, found: Found) -> None:
    _is(dict, "an object")(value, where, found)
    for k, v in value.items():
      if key is not None and not key.fullmatch(k):
        raise _fail(where, f"has an invalid key {k!r}")
      item(v, f"{where}.{k}", found)

  return check


def _object(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
  optional = optional or {}

  def check(value: Any, where: str, found: Found) -> None:
    _is(dict, "an object")(value, where, found)
    missing = sorted(set(required) - set(value))
    unknown = sorted(set(value) - set(required) - set(optional))
    if missing or unknown:
      raise _fail(where, f"lacks fields {missing}" if missing else f"has unknown fields {unknown}")
    for k, v in value.items():
      (required.get(k) or optional[k])(v, f"{where}.{k}", found)

  return check


def _either(*checks: Check) -> Check:
  def check(value: Any, where: str, found: Found) -> None:
    errors = []
    for option in checks:
      try:
        option(value, where, found)
        return
      except ArtifactError as e:
        errors.append(str(e))
    raise ArtifactError(" Or: ".join(errors))

  return check


def _by_kind(schemas: dict[str, Check]) -> Check:
  """An object checked by the schema its `kind` field selects."""

  def check(value: Any, where: str, found: Found) -> None:
    kind = value.get("kind") if isinstance(value, dict) else None
    if not (isinstance(kind, str) and kind in schemas):
      raise _fail(where, f"must be an object whose 'kind' is one of {sorted(schemas)}")
    schemas[kind](value, where, found)

  return check


def _value(value: Any, where: str, found: Found) -> None:
  validate(value, where, found)


def _tagged(tag: str) -> Check:
  """An encoded value whose outer tag is `tag` (a tuple of arguments, a dict, ...)."""

  def check(value: Any, where: str, found: Found) -> None:
    if not (isinstance(value, dict) and next(iter(value), None) == tag):
      raise _fail(where, f"must be an encoded {tag}")
    validate(value, where, found)

  return check


def _named_dict(value: Any, where: str, found: Found) -> None:
  """An encoded dict whose keys are strings (keyword arguments, side inputs)."""
  _tagged("dict")(value, where, found)
  for pair in value["dict"]:
    if not isinstance(pair[0], str):
      raise _fail(where, f"has a non-string key {pair[0]!r}")


def _method(value: Any, where: str, found: Found) -> None:
  if isinstance(value, str):
    if not _IDENTIFIER.fullmatch(value):
      raise _fail(where, f"must be a method name, not {value!r}")
    return
  _object({"ref": _is(str, "a reference")})(value, where, found)
  validate(value, where, found)
  ref, _, place = found.references.pop()
  found.references.append((ref, "method", place))


def _counters(value: Any, where: str, found: Found) -> None:
  """Flax rng counters: `[[stream, count] | ["child", name, counters]]`."""
  _is(list, "a list")(value, where, found)
  for i, entry in enumerate(value):
    if isinstance(entry, list) and len(entry) == 3 and entry[0] == "child":
      _is(str, "a string")(entry[1], f"{where}[{i}][1]", found)
      _counters(entry[2], f"{where}[{i}][2]", found)
    elif isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str):
      _natural(entry[1], f"{where}[{i}][1]", found)
    else:
      raise _fail(f"{where}[{i}]", "must be [stream, count] or ['child', name, counters]")


def _cursor(value: Any, where: str, found: Found) -> None:
  """One Linen autoname counter: `[prefix, count]`."""
  if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
    raise _fail(where, "must be [prefix, count]")
  _natural(value[1], f"{where}[1]", found)


def _state(value: Any, where: str, found: Found) -> None:
  """State values: `[[label, value], ...]`."""
  _is(list, "a list")(value, where, found)
  for i, entry in enumerate(value):
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
      raise _fail(f"{where}[{i}]", "must be [label, value]")
    validate(entry[1], f"{where}[{entry[0]!r}]", found)


_RNG_FIELDS = {"keys": _named_dict, "suffixes": _named_dict, "counters": _counters}
# A module the call held but Flax had bound elsewhere: where it is bound, its own name.
_ADOPTED = _object(
  {
    "path": _list_of(_is(str, "a module name")),
    "name": _either(_const(None), _is(str, "a module name")),
    **_RNG_FIELDS,
  }
)
# `compact`: the autoname counters of a call made inside its module's compact method.
_rngs = _object(
  _RNG_FIELDS,
  optional={
    "adopted": _list_of(_ADOPTED),
    "compact": _list_of(_cursor),
  },
)

_ARRAY = _object(
  {
    "shape": _list_of(_natural),
    "dtype": _one_of(DTYPES, "an array dtype"),
    "sha256": _matching(_SHA256, "a SHA-256 hex digest"),
  }
)
_LINEN = _object(
  {
    "kind": _const("linen"),
    "module": _tagged("object"),
    "method": _method,
    "variables": _tagged("dict"),
    "rngs": _either(_const(None), _rngs),
    "mutable": _either(_is(bool, "a boolean"), _list_of(_is(str, "a collection name"))),
    "capture_intermediates": _value,
  }
)
_NNX = _object(
  {
    "kind": _const("nnx"),
    "graphdef": _tagged("object"),
    "leaves": _tagged("list"),
    "method": _method,
  }
)
_SCHEMA = _object(
  {
    "format": _const(FORMAT),
    "format_version": _const(FORMAT_VERSION),
    "manifest_sha256": _matching(_SHA256, "a SHA-256 hex digest"),
    "created": _is(str, "a string"),
    "versions": _map_of(_is(str, "a string")),
    "requires": _list_of(_matching(_PACKAGE, "a package name")),
    "call": _is(str, "a string"),
    "call_number": _natural,
    "calls": _list_of(_is(str, "a string")),
    "recipe": _by_kind({"linen": _LINEN, "nnx": _NNX}),
    "saved": _object(
      {
        "args": _tagged("tuple"),
        "kwargs": _named_dict,
        "side_inputs": _named_dict,
        "output": _value,
        "initial": _state,
        "final": _state,
      }
    ),
    "arrays": _map_of(_ARRAY, re.compile(r"a[0-9]{1,9}")),
  },
  # Written by isolate when the call ran compiled: replay then defaults to jit.
  optional={"replay": _object({"jit": _is(bool, "a boolean")})},
)


@dataclasses.dataclass(frozen=True)
class Manifest:
  """A manifest that passed every check, with what its values reference."""

  data: dict
  references: list[tuple[str, str, str]]
  # The packages beyond flaxlens's defaults the artifact needs (refusal messages only).
  requires: list[str]
  # `replay.jit` if the manifest records it: the call was recorded from compiled code.
  replay_jit: bool | None


def checksum(manifest: dict) -> str:
  """SHA-256 of the manifest's canonical JSON, its own checksum field left out."""
  body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
  canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
  return hashlib.sha256(canonical.encode()).hexdigest()


def _no_duplicates(pairs: list) -> dict:
  keys = [k for k, _ in pairs]
  if len(set(keys)) != len(keys):
    raise ArtifactError(f"Malformed artifact: a JSON object repeats a key ({keys[:8]}).")
  return dict(pairs)


def _finite(text: str) -> float:
  value = float(text)
  if value in (float("inf"), float("-inf")):
    raise ArtifactError(f"Malformed artifact: the number {text[:20]} overflows.")
  return value


def _reject_constant(name: str) -> Any:
  raise ArtifactError(f"Malformed artifact: {name} is not JSON.")


def read_json(raw: bytes, source: str, file_format: str, version: int) -> dict:
  """Strict JSON of a manifest marked `file_format`, at most at `version`; checksum unchecked.

  Raises ArtifactError for bytes that are not strict JSON (NaN, repeated keys,
  overflowing numbers), another format, or a format version that is not a positive
  integer or is newer than `version`. The caller refuses older versions and then calls
  `check_checksum`.
  """
  try:
    data = json.loads(
      raw.decode("utf-8"),
      object_pairs_hook=_no_duplicates,
      parse_float=_finite,
      parse_constant=_reject_constant,
    )
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise ArtifactError(f"{source}: manifest.json is corrupted or truncated ({e}).") from None
  except ArtifactError as e:
    raise ArtifactError(f"{source}: {e}") from None
  if not isinstance(data, dict) or data.get("format") != file_format:
    raise ArtifactError(f"{source}: manifest.json is not a {file_format} manifest.")
  found = data.get("format_version")
  if type(found) is not int or found < 1:
    raise ArtifactError(
      f"{source}: format_version {json.dumps(found)[:20]} is not a positive integer; the"
      " manifest is corrupted."
    )
  if found > version:
    raise ArtifactError(
      f"{source} uses {file_format} format {found}, newer than this flaxlens reads"
      f" ({version}). Upgrade flaxlens to load it."
    )
  return data


def check_checksum(data: dict, source: str) -> None:
  """Refuses a manifest whose `manifest_sha256` is not the checksum of the rest."""
  if data.get("manifest_sha256") != checksum(data):
    raise ArtifactError(
      f"{source}: manifest.json does not match its checksum; the artifact is corrupted or"
      " was tampered with."
    )


def parse_manifest(raw: bytes, source: str) -> Manifest:
  """Parses and checks a whole manifest; raises ArtifactError naming the first fault."""
  data = read_json(raw, source, FORMAT, FORMAT_VERSION)
  if data["format_version"] < FORMAT_VERSION:
    raise ArtifactError(
      f"{source} uses artifact format {data['format_version']}, which has no manifest"
      " checksum and imports code without a loading policy; it is no longer read. Save the"
      f" isolated call again with this flaxlens (format {FORMAT_VERSION})."
    )
  check_checksum(data, source)
  found = Found()
  try:
    _SCHEMA(data, "manifest", found)
  except ArtifactError as e:
    raise ArtifactError(f"{source}: {e}") from None
  check_arrays(data["arrays"], found, source)
  needed = {package_of(ref) for ref, _, _ in found.references} - DEFAULT_PACKAGES
  if not needed <= set(data["requires"]):
    raise ArtifactError(
      f"{source}: manifest.json's 'requires' omits {sorted(needed - set(data['requires']))},"
      " which its references name; the manifest is corrupted."
    )
  replay = data.get("replay")
  return Manifest(
    data=data,
    references=found.references,
    requires=sorted(set(data["requires"])),
    replay_jit=None if replay is None else replay["jit"],
  )


def references_of(manifest: dict) -> list[tuple[str, str, str]]:
  """The references a manifest holds, with their roles (save side: to compute `requires`)."""
  found = Found()
  _SCHEMA({**manifest, "manifest_sha256": "0" * 64}, "manifest", found)
  return found.references


def check_arrays(arrays: dict, found: Found, source: str) -> None:
  """Every array a value uses is in the table; keys fit their implementation."""
  if not set(found.arrays) <= set(arrays):
    raise ArtifactError(
      f"{source}: manifest.json's values use arrays"
      f" {sorted(set(found.arrays) - set(arrays))[:8]} that its table does not list; the"
      " manifest is corrupted."
    )
  for name, impl in found.arrays.items():
    info = arrays[name]
    if impl != "array" and (
      info["dtype"] != "uint32" or tuple(info["shape"][-len(KEY_IMPLS[impl]) :]) != KEY_IMPLS[impl]
    ):
      raise ArtifactError(
        f"{source}: array {name!r} holds {impl} keys but has dtype {info['dtype']} and"
        f" shape {info['shape']}; the manifest is corrupted."
      )
