"""Reading flaxlens's JSON files: strict, bounded, then validated against a shipped schema.

The formats of the files flaxlens writes are JSON Schema documents (Draft 2020-12) in
`schemas/`: `isolated` and `interventions` (the two manifests), `values` (what they share:
encoded values, the array table) and `safetensors-header` (the header of the arrays file).
`read_json` parses bytes the caller has already bounded in size as strict JSON (no NaN,
no repeated keys, no overflowing numbers) and bounds its nesting and node count with one
iterative pass, before anything recursive (the validator, our own walks) sees it;
`check_schema` then validates it with `jsonschema`, naming the JSON path of the fault.
Nothing here imports code an artifact names.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any

import jsonschema
import referencing
from jsonschema.exceptions import best_match

from flaxlens.errors import ArtifactError

# JSON nesting a file may have: about 30 to 50 levels of nested Python values. The validator
# recurses about 5 Python frames per level; 100 levels stay far below the recursion limit.
MAX_DEPTH = 100
# JSON values (objects, lists, scalars) a file may hold: an NNX model's manifest holds about
# 200 per variable. jsonschema validates some 35,000 to 50,000 a second, so this also bounds
# the time a hostile manifest can cost, to about 30 s (docs/artifacts.md, Limits).
MAX_NODES = 1_000_000
_PREFIX = "urn:flaxlens:schema:"


def _is_integer(checker: Any, instance: Any) -> bool:
  """JSON Schema counts 1.0 as an integer; flaxlens's files write integers as integers."""
  return type(instance) is int


_Validator = jsonschema.validators.extend(
  jsonschema.Draft202012Validator,
  type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


@functools.cache
def schema(name: str) -> dict:
  """The schema document `schemas/<name>.schema.json`."""
  text = importlib.resources.files(__package__).joinpath(f"schemas/{name}.schema.json")
  return json.loads(text.read_text(encoding="utf-8"))


@functools.cache
def _validator(name: str) -> Any:
  names = ("values", "isolated", "interventions", "safetensors-header")
  registry = referencing.Registry().with_resources(
    (_PREFIX + n, referencing.Resource.from_contents(schema(n))) for n in names
  )
  return _Validator(schema(name), registry=registry)


def _no_duplicates(pairs: list) -> dict:
  keys = [k for k, _ in pairs]
  if len(set(keys)) != len(keys):
    raise ValueError(f"a JSON object repeats a key ({keys[:8]})")
  return dict(pairs)


def _finite(text: str) -> float:
  value = float(text)
  if value in (float("inf"), float("-inf")):
    raise ValueError(f"the number {text[:20]} overflows")
  return value


def _reject_constant(name: str) -> Any:
  raise ValueError(f"{name} is not JSON")


def read_json(raw: bytes, where: str, fix: str) -> Any:
  """`raw` as strict, bounded JSON; ArtifactError naming `where` and ending with `fix`."""
  try:
    data = json.loads(
      raw.decode("utf-8"),
      object_pairs_hook=_no_duplicates,
      parse_float=_finite,
      parse_constant=_reject_constant,
    )
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    said = " ".join(str(e).split())[:200]
    raise ArtifactError(f"{where} is corrupted or truncated: {said}. {fix}") from None
  nodes, stack = 0, [(data, 1)]
  while stack:
    value, depth = stack.pop()
    nodes += 1
    if depth > MAX_DEPTH:
      raise ArtifactError(f"{where} nests deeper than {MAX_DEPTH} levels. {fix}")
    if nodes > MAX_NODES:
      raise ArtifactError(f"{where} holds more than {MAX_NODES} JSON values. {fix}")
    if isinstance(value, dict | list):
      stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
  return data


def check_schema(data: Any, name: str, where: str, fix: str) -> None:
  """Validates `data` against the schema `name`; ArtifactError naming the JSON path."""
  try:
    error = best_match(_validator(name).iter_errors(data))
  except RecursionError:
    raise ArtifactError(f"{where} nests too deep to validate. {fix}") from None
  if error is not None:
    message = error.message if len(error.message) <= 200 else error.message[:200] + "..."
    raise ArtifactError(f"{where} is malformed at {error.json_path}: {message}. {fix}")
