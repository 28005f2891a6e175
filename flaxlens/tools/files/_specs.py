"""Intervention sets as files: a list of `fl.Intervention` saved as data, loaded back safely.

A saved set is a directory like an isolated-call artifact (`_artifact`): `manifest.json`
(format `flaxlens-interventions`) holds each intervention's static part as JSON (its
kind, `on`, `part`, the structure of `where`, its sites: path patterns as strings and
module classes by import reference; for `fl.modify`, its function by import reference)
and names its arrays, which `arrays.safetensors` holds (`_arrays`), each checksummed with
its shape and dtype. Loading is the artifact loader's, step for step: files opened
without following links and bounded in size, the whole manifest validated (strict JSON,
checksum, `schemas/interventions.schema.json`, then what a schema cannot state: operand
counts, `where=` arrays) and every package checked against the loading policy (`_policy`)
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
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from flaxlens.core._checks import check_path, check_type
from flaxlens.core._node import CallNode
from flaxlens.errors import ArgumentError, ArtifactError
from flaxlens.tools.base._intervention import Intervention, kind_of
from flaxlens.tools.base._kinds import BUILT_IN_KINDS
from flaxlens.tools.base._probed import checked_interventions
from flaxlens.tools.files._arrays import array_table
from flaxlens.tools.files._artifact import (
  DEFAULT_MAX_BYTES,
  MANIFEST,
  MAX_MANIFEST_BYTES,
  Directory,
  check_target,
  load_arguments,
  load_arrays,
  provenance,
  requires,
  write_atomically,
)
from flaxlens.tools.files._codec import Decoder, Encoder, Found, collect, resolve_references
from flaxlens.tools.files._manifest import check_arrays, checksum, fix_for, read_manifest
from flaxlens.tools.files._policy import reference

FORMAT = "flaxlens-interventions"
FORMAT_VERSION = 3
# Format 3 adds the kinds "low_rank" and "interchange"; a format 2 set loads as it is.
# What each built-in kind saves (its operand count, the format it came in, whether it
# holds a function) is its `SavedForm` (`tools/base/_kinds.py`).
OLDEST_VERSION = 2


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
    interventions: `fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify`,
      `fl.low_rank_edit`, `fl.interchange` results (trained ones too).
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
  manifest["requires"] = requires(_references(entries).references)
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
  kind = kind_of(intervention)
  where = f"intervention {number} ({kind.name})"
  if not isinstance(intervention.kind, str):
    raise ArtifactError(
      f"Cannot save {where}: its kind is {type(kind).__qualname__}, a kind of your own, and"
      " a saved set holds only the built-in kinds (loading one runs no code but the"
      " makers'). Save the other interventions, and make this one again in your code"
      " after loading them."
    )
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


def _references(entries: list[dict]) -> Found:
  """The references (with their roles) and arrays of schema-valid interventions."""
  found = Found()
  for n, entry in enumerate(entries):
    where = f"interventions[{n}]"
    sites = entry["at"] if isinstance(entry["at"], list) else [entry["at"]]
    for site in sites:
      if isinstance(site, dict):
        found.references.append((site["class"], "module", f"{where}.at"))
    if entry["fn"] is not None:
      found.references.append((entry["fn"]["ref"], "function", f"{where}.fn"))
    for name in ("operands", "where_arrays"):
      for i, value in enumerate(entry[name]):
        collect(value, f"{where}.{name}[{i}]", found)
  return found


def _check_consistent(entry: dict, arrays: dict, where: str, version: int) -> None:
  """What the schema cannot say: kinds newer than the set's format, operand counts, a
  function exactly for "modify", and `where_arrays` matching the structure of `where`."""

  def fail(fault: str) -> ArtifactError:
    return ArtifactError(f"{where} {fault}. {fix_for(FORMAT)}")

  kind, count = entry["kind"], len(entry["operands"])
  saved = BUILT_IN_KINDS[kind].saved  # the schema allows only the built-in kinds' names
  if saved.since > version:
    raise fail(f"has kind {kind!r}, which format {version} does not have (from {saved.since} on)")
  if (entry["fn"] is None) == saved.function:
    raise fail(f"holds a function for kind {kind!r}; only 'modify' has one")
  if saved.operands is not None and count != saved.operands:
    raise fail(f"has {count} operands where {kind!r} takes {saved.operands}")
  index, where_arrays = entry["where"], entry["where_arrays"]
  if index is None:
    expected = 0
  elif index == ["mask"]:
    expected = 1
  else:
    expected = sum(e[0] == "array" for e in index[1:])
  if len(where_arrays) != expected:
    raise fail(f"has {len(where_arrays)} where= arrays where its index needs {expected}")
  if index == ["mask"] and arrays.get(where_arrays[0].get("array"), {}).get("dtype") != "bool":
    raise fail("has a where= mask that is not a boolean array")


def _parse(raw: bytes, source: str) -> tuple[dict, Found]:
  """The checked manifest and what it references; ArtifactError at the first fault."""
  data = read_manifest(raw, source, FORMAT, FORMAT_VERSION, OLDEST_VERSION)
  for n, entry in enumerate(data["interventions"]):
    where = f"{source}: manifest.json's interventions[{n}]"
    _check_consistent(entry, data["arrays"], where, data["format_version"])
  found = _references(data["interventions"])
  check_arrays(data, found, source, FORMAT)
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
      corrupted or tampered with, from a newer format (format 2 sets load), or references
      code the policy does not allow; the message says which, and how to allow a package.

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
    named = [ref for ref, _, _ in found.references]
    for ref, _, where in found.references:
      policy.check_package(ref, where, named)
    arrays = load_arrays(directory, data["arrays"], max_bytes)
  resolved = resolve_references(policy, found.references)
  decoder = Decoder(arrays, resolved)
  return [
    _decode(entry, decoder, f"{source}: manifest.json's interventions[{n}]")
    for n, entry in enumerate(data["interventions"])
  ]


def _decode(entry: dict, decoder: Decoder, where: str) -> Intervention:
  """The intervention `entry` describes; an entry that passes the schema but that
  `Intervention` refuses (a `where=` slice of step 0, say) is an ArtifactError naming
  `where` (the file and the entry)."""
  at = entry["at"]
  fn = entry["fn"]
  try:
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
  except ArgumentError as e:
    raise ArtifactError(
      f"{where} describes an intervention flaxlens refuses: {e} {fix_for(FORMAT)}"
    ) from e


def _decode_at(at: Any, decoder: Decoder) -> Any:
  if isinstance(at, list):
    return tuple(_decode_at(a, decoder) for a in at)
  return at if isinstance(at, str) else decoder.resolved[at["class"]]


def _tuple(entry: Any) -> Any:
  return tuple(entry) if isinstance(entry, list) else entry
