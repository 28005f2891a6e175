"""Intervention sets as files: a list of `fl.Intervention` saved as data, loaded back safely.

A saved set is a directory like an isolated-call artifact (`_artifact`): `manifest.json`
(format `flaxlens-interventions`) holds each intervention's static part as JSON (its
kind, `on`, `part`, the structure of `where`, its sites: path patterns as strings and
module classes by import reference; for `fl.modify`, its function by import reference)
and names its arrays, which `arrays.npz` holds as raw bytes, each checksummed with its
shape and dtype. Loading is the artifact loader's, step for step: files opened without
following links and bounded in size, the whole manifest validated (strict JSON,
checksum, schema) and every package checked against the loading policy (`_policy`)
before anything is imported; then a module class must subclass a Flax module and a
function must be vetted or come from a package the user allows. Predicates and call
nodes are code or objects of one tree, not data: saving refuses them and says to use a
path pattern. docs/intervention-specs.md documents the format. No Flax internals here.
"""

from __future__ import annotations

import json
import operator
import os
import pathlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from flaxlens.core._checks import check_path, check_type
from flaxlens.core._node import CallNode
from flaxlens.errors import ArgumentError, ArtifactError
from flaxlens.tools.analysis._interventions import KINDS, Intervention, checked_interventions
from flaxlens.tools.files._artifact import (
  DEFAULT_MAX_BYTES,
  MANIFEST,
  MAX_MANIFEST_BYTES,
  Directory,
  array_table,
  check_target,
  load_arguments,
  provenance,
  read_arrays,
  requires,
  write_atomically,
)
from flaxlens.tools.files._codec import Decoder, Encoder, Found, resolve_references, validate
from flaxlens.tools.files._manifest import (
  _ARRAY,
  _PACKAGE,
  _SHA256,
  _const,
  _either,
  _fail,
  _is,
  _list_of,
  _map_of,
  _matching,
  _object,
  _one_of,
  check_arrays,
  check_checksum,
  checksum,
  read_json,
)
from flaxlens.tools.files._policy import (
  DEFAULT_PACKAGES,
  check_reference_syntax,
  package_of,
  reference,
)

FORMAT = "flaxlens-interventions"
FORMAT_VERSION = 1

# How many operands each kind holds ("modify": any number).
_OPERANDS = {"zero": 0, "patch": 1, "mean": 1, "resample": 1, "steer": 2, "scale": 1}
_INDEX_ENTRIES = {"slice": 4, "ellipsis": 1, "newaxis": 1, "int": 2, "array": 1}


# --- saving -------------------------------------------------------------------------------


def save_interventions(
  interventions: Sequence[Intervention], path: str | os.PathLike, overwrite: bool = False
) -> None:
  """Writes a list of interventions to the directory `path`, as data, atomically.

  Sites given as path patterns are saved as strings and Flax module classes by import
  reference; `fl.modify`'s function by import reference (it must be defined at module
  level). Arrays (steering vectors, patches, masks) are saved bit for bit. A site given
  as a predicate or a call node cannot be saved: give its path pattern instead.

  Args:
    interventions: `fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify` results.
    path: the directory to create.
    overwrite: replace an existing saved intervention set at `path`; anything else there
      is never replaced.

  Raises:
    ArgumentError: `interventions` is not a list of `fl.Intervention`s, `path` not a
      path, or `overwrite` not a bool.
    ArtifactError: `path` exists (and not `overwrite`), an intervention holds a site,
      function or value that is not data (the message names it and what to use
      instead), or the directory cannot be written.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp, tempfile
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> edits = [fl.steer("layers_0", jnp.arange(3.0), alpha=2.0), fl.ablate(nn.Dense)]
    >>> path = tempfile.mkdtemp() + "/edits"
    >>> fl.save_interventions(edits, path)
    >>> loaded = fl.load_interventions(path)
    >>> bool((fl.run(tree, x, interventions=loaded) == fl.run(tree, x, interventions=edits)).all())
    True
  """
  where = "fl.save_interventions"
  interventions = checked_interventions(interventions, where)
  target = pathlib.Path(check_path(path, where, "Pass the directory to create."))
  check_type(
    overwrite, bool, where, "overwrite", "True or False", "Pass overwrite=True to replace."
  )
  check_target(target, overwrite, FORMAT)
  encoder = Encoder()
  entries = [_encode(intervention, n, encoder) for n, intervention in enumerate(interventions)]
  manifest = {
    "format": FORMAT,
    "format_version": FORMAT_VERSION,
    **provenance(),
    "requires": [],
    "interventions": entries,
    "arrays": array_table(encoder.arrays),
  }
  found = Found()
  _SCHEMA({**manifest, "manifest_sha256": "0" * 64}, "manifest", found)
  manifest["requires"] = requires(found.references)
  manifest["manifest_sha256"] = checksum(manifest)
  raw = json.dumps(manifest, indent=1, allow_nan=False).encode()
  try:
    _parse(raw, str(target))
  except ArtifactError as e:
    raise ArtifactError(f"Cannot save {target}: its manifest would not load ({e}).") from None
  write_atomically(target, raw, encoder.arrays, overwrite, FORMAT)


def _encode(intervention: Any, number: int, encoder: Encoder) -> dict[str, Any]:
  if not isinstance(intervention, Intervention):
    raise ArgumentError(
      f"save_interventions takes fl.ablate/patch/steer/scale/modify results; element"
      f" {number} is a {type(intervention).__name__}."
    )
  where = f"intervention {number} ({intervention.kind})"
  fn = None
  if intervention.fn is not None:
    ref = reference(intervention.fn)
    if ref is None:
      raise ArtifactError(
        f"Cannot save {where}: its function {intervention.fn!r} cannot be imported by"
        " name (it is a lambda, a closure or defined in a function). Define it at module"
        " level in a package, and load the set with allow=['that_package']."
      )
    fn = {"ref": ref}
  return {
    "kind": intervention.kind,
    "at": _encode_at(intervention.at, where),
    "on": intervention.on,
    "part": _encode_part(intervention.part, where),
    "where": _encode_index(intervention.index, where),
    "fn": fn,
    "operands": _encode_arrays(intervention.operands, encoder, f"{where} operand"),
    "where_arrays": _encode_arrays(intervention.where_arrays, encoder, f"{where} where="),
  }


def _encode_at(at: Any, where: str, nested: bool = False) -> Any:
  import flax.linen as nn
  from flax import nnx

  if isinstance(at, str):
    return at
  if isinstance(at, tuple) and not nested:
    return [_encode_at(a, where, nested=True) for a in at]
  if isinstance(at, CallNode):
    path, method = at.readable_path()
    pattern = path if method == "__call__" else f"{path}.{method}"
    raise ArtifactError(
      f"Cannot save {where}: its site is a call node ({at.where()}), an object of one"
      f" converted tree that a file cannot name. Give its path pattern instead: at={pattern!r}."
    )
  if isinstance(at, type):
    ref = reference(at)
    if not issubclass(at, nn.Module | nnx.Module) or ref is None:
      raise ArtifactError(
        f"Cannot save {where}: its site {at.__qualname__} is "
        + ("not a Flax module class" if ref else "a class defined in a function")
        + "; a saved site is a path pattern or a Flax module class defined at module level."
      )
    return {"class": ref}
  if callable(at):
    raise ArtifactError(
      f"Cannot save {where}: its site is a predicate ({getattr(at, '__qualname__', at)!r}),"
      " code that a file does not hold as data. Give the sites as path patterns (globs"
      " such as 'Block_*/mlp', '**/Dense_0') or a Flax module class."
    )
  raise ArtifactError(
    f"Cannot save {where}: its site {at!r} is not a path pattern or a Flax module class."
  )


def _encode_part(part: Any, where: str) -> Any:
  if part is None or type(part) in (int, str):
    return part
  raise ArtifactError(
    f"Cannot save {where}: part={part!r} is neither an int nor a str; only those are saved."
  )


def _encode_index(index: Any, where: str) -> Any:
  """The static structure of `where=` (`_interventions._split_index`) as JSON lists."""
  if index is None or index == ("mask",):
    return None if index is None else ["mask"]
  entries: list[Any] = ["index"]
  for entry in index[1:]:
    if entry[0] in ("slice", "int"):
      try:
        values = [None if v is None else operator.index(v) for v in entry[1:]]
      except TypeError:
        raise ArtifactError(
          f"Cannot save {where}: where= holds {entry[0]} bounds {entry[1:]!r}; only Python"
          " ints and None are saved."
        ) from None
      entries.append([entry[0], *values])
    else:
      entries.append([entry[0]])
  return entries


def _encode_arrays(arrays: tuple[Any, ...], encoder: Encoder, where: str) -> list[Any]:
  if any(isinstance(x, jax.core.Tracer) for x in arrays):
    raise ArtifactError(
      f"Cannot save {where}: it holds a traced value. Save interventions outside jax.jit,"
      " jax.vmap and jax.grad."
    )
  return [encoder.encode(x, f"{where} {i}") for i, x in enumerate(arrays)]


# --- the manifest -------------------------------------------------------------------------


def _at(value: Any, where: str, found: Found, nested: bool = False) -> None:
  if isinstance(value, str):
    return
  if isinstance(value, list) and value and not nested:
    for i, item in enumerate(value):
      _at(item, f"{where}[{i}]", found, nested=True)
    return
  if not (isinstance(value, dict) and set(value) == {"class"}):
    raise _fail(where, "must be a path pattern, {'class': reference} or a list of these")
  check_reference_syntax(value["class"], where)
  found.references.append((value["class"], "module", where))


def _fn(value: Any, where: str, found: Found) -> None:
  if value is None:
    return
  if not (isinstance(value, dict) and set(value) == {"ref"}):
    raise _fail(where, "must be null or {'ref': reference}")
  check_reference_syntax(value["ref"], where)
  found.references.append((value["ref"], "function", where))


def _index(value: Any, where: str, found: Found) -> None:
  if value is None or value == ["mask"]:
    return
  if not (isinstance(value, list) and value and value[0] == "index"):
    raise _fail(where, "must be null, ['mask'] or ['index', entries...]")
  for i, entry in enumerate(value[1:]):
    tag = entry[0] if isinstance(entry, list) and entry else None
    if not (isinstance(tag, str) and len(entry) == _INDEX_ENTRIES.get(tag)):
      raise _fail(f"{where}[{i + 1}]", f"must be one of {sorted(_INDEX_ENTRIES)} with its values")
    bounds = entry[1:]
    if any(not (b is None and tag == "slice" or type(b) is int) for b in bounds):
      raise _fail(f"{where}[{i + 1}]", "must hold integers (or null slice bounds)")


def _array_value(value: Any, where: str, found: Found) -> None:
  if not (isinstance(value, dict) and next(iter(value), None) in ("array", "key")):
    raise _fail(where, "must be an encoded array or key")
  validate(value, where, found)


_INTERVENTION = _object(
  {
    "kind": _one_of(frozenset(KINDS), "an intervention kind"),
    "at": _at,
    "on": _one_of(frozenset({"output", "input"}), "what the edit acts on"),
    "part": _either(_const(None), _is(int, "an index"), _is(str, "a key")),
    "where": _index,
    "fn": _fn,
    "operands": _list_of(_array_value),
    "where_arrays": _list_of(_array_value),
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
    "interventions": _list_of(_INTERVENTION),
    "arrays": _map_of(_ARRAY, re.compile(r"a[0-9]{1,9}")),
  }
)


def _check_consistent(entry: dict, arrays: dict, where: str) -> None:
  """What the schema cannot say: operand counts, a function exactly for "modify", and
  `where_arrays` matching the structure of `where`."""
  kind, count = entry["kind"], len(entry["operands"])
  if (entry["fn"] is None) != (kind != "modify"):
    raise _fail(where, f"holds a function for kind {kind!r}; only 'modify' has one")
  if kind in _OPERANDS and count != _OPERANDS[kind]:
    raise _fail(where, f"has {count} operands where {kind!r} takes {_OPERANDS[kind]}")
  index, where_arrays = entry["where"], entry["where_arrays"]
  if index is None:
    expected = 0
  elif index == ["mask"]:
    expected = 1
  else:
    expected = sum(e[0] == "array" for e in index[1:])
  if len(where_arrays) != expected:
    raise _fail(where, f"has {len(where_arrays)} where= arrays where its index needs {expected}")
  if index == ["mask"] and arrays.get(where_arrays[0].get("array"), {}).get("dtype") != "bool":
    raise _fail(where, "has a where= mask that is not a boolean array")


def _parse(raw: bytes, source: str) -> tuple[dict, Found]:
  """The checked manifest and what it references; ArtifactError at the first fault."""
  data = read_json(raw, source, FORMAT, FORMAT_VERSION)
  check_checksum(data, source)
  found = Found()
  try:
    _SCHEMA(data, "manifest", found)
    for n, entry in enumerate(data["interventions"]):
      _check_consistent(entry, data["arrays"], f"manifest.interventions[{n}]")
  except ArtifactError as e:
    raise ArtifactError(f"{source}: {e}") from None
  check_arrays(data["arrays"], found, source)
  needed = {package_of(ref) for ref, _, _ in found.references} - DEFAULT_PACKAGES
  if not needed <= set(data["requires"]):
    raise ArtifactError(
      f"{source}: manifest.json's 'requires' omits {sorted(needed - set(data['requires']))},"
      " which its references name; the manifest is corrupted."
    )
  return data, found


# --- loading ------------------------------------------------------------------------------


def load_interventions(
  path: str | os.PathLike,
  allow: Iterable[str] | None = None,
  max_bytes: int = DEFAULT_MAX_BYTES,
  import_path: Iterable[str | os.PathLike] | None = None,
) -> list[Intervention]:
  """Reads a set written by `save_interventions`; the file is treated as untrusted.

  Nothing is imported before the whole manifest is validated and every package it names
  is allowed: jax, flax, numpy and flaxlens by default, plus the packages in `allow`,
  whose code you thereby trust. A site's class must then subclass a Linen or NNX module,
  and `fl.modify`'s function must be one of a vetted set of pure jax/Flax functions or
  come from a package in `allow`. Sizes are checked before reading, and arrays against
  their checksums (docs/artifacts.md, loading policy).

  Args:
    path: the directory `save_interventions` wrote.
    allow: top-level packages the set may import from (the module of your own model
      classes or of your `fl.modify` functions); the refusal names those it needs.
    max_bytes: refuse sets whose arrays hold more bytes than this.
    import_path: folders to import the allowed packages from, before the current folder
      and the installed packages, as for `fl.load_isolated`.

  Returns:
    The interventions, equal to those saved (arrays bit for bit), for `fl.run`.

  Raises:
    ArgumentError: `path` is not a path, `allow` not a list of package names,
      `max_bytes` not a non-negative integer, or `import_path` not a list of folders.
    ArtifactError: the set is missing files, not regular files, truncated, too large,
      corrupted or tampered with, from a newer format, or references code the policy
      does not allow; the message says which, and how to allow a package.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp, tempfile
    >>> path = tempfile.mkdtemp() + "/steer"
    >>> fl.save_interventions([fl.steer("**/mlp", jnp.ones(4), alpha=0.5)], path)
    >>> [(i.kind, i.at, i.operands[1].item()) for i in fl.load_interventions(path)]
    [('steer', '**/mlp', 0.5)]
  """
  source, policy = load_arguments(
    "fl.load_interventions",
    path,
    allow,
    max_bytes,
    "Pass the directory fl.save_interventions wrote.",
    import_path,
    cli=False,
  )
  with Directory(source) as directory:
    data, found = _parse(directory.read(MANIFEST, MAX_MANIFEST_BYTES), str(source))
    for ref, _, where in found.references:
      policy.check_package(ref, where, data["requires"])
    arrays = read_arrays(directory, data["arrays"], max_bytes)
  resolved = resolve_references(policy, found.references)
  decoder = Decoder(arrays, resolved)
  return [_decode(entry, decoder) for entry in data["interventions"]]


def _decode(entry: dict, decoder: Decoder) -> Intervention:
  at = entry["at"]
  fn = entry["fn"]
  return Intervention(
    operands=tuple(decoder.decode(x) for x in entry["operands"]),
    where_arrays=tuple(decoder.decode(x) for x in entry["where_arrays"]),
    at=_decode_at(at, decoder),
    kind=entry["kind"],
    on=entry["on"],
    part=entry["part"],
    index=None if entry["where"] is None else tuple(map(_tuple, entry["where"])),
    fn=None if fn is None else decoder.resolved[fn["ref"]],
  )


def _decode_at(at: Any, decoder: Decoder) -> Any:
  if isinstance(at, list):
    return tuple(_decode_at(a, decoder) for a in at)
  return at if isinstance(at, str) else decoder.resolved[at["class"]]


def _tuple(entry: Any) -> Any:
  return tuple(entry) if isinstance(entry, list) else entry
