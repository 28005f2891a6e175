"""Saving an isolated call as a self-contained directory, and loading it safely elsewhere.

An artifact is a directory with `manifest.json` (the recipe of the call: for Linen the
module class by import reference and its settings, the variables and the rng state; for
NNX the module's `GraphDef` and its variables; the arguments and saved results; shape,
dtype and SHA-256 of each array; a SHA-256 of the manifest itself) and
`arrays.safetensors` (`_arrays`). Loading treats the directory as hostile: it opens only
regular files (never following a symlink, never blocking on a FIFO), bounds every size
before reading, validates the whole manifest (`_manifest`), checks every referenced
package against the loading policy (`_policy`), reads and verifies every array header
first, and only then imports the checked references and rebuilds the submodel
exactly as isolation built it. docs/artifacts.md documents the format and the policy.
Writes go to a temporary directory renamed into place, so a crash leaves no half
artifact. Flax internals: the rng counters' encoding, through `flaxlens._compat`.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import stat
import tempfile
from collections.abc import Iterable
from typing import Any, BinaryIO

import flax
import jax
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import check_path, check_type, refuse
from flaxlens.core._node import is_call_node, iter_call_nodes
from flaxlens.core._recipe import recipe_of, submodel_from
from flaxlens.core._variables import StateVariableValue
from flaxlens.errors import ArtifactError
from flaxlens.tools.files._arrays import (
  ARRAYS,
  MAX_HEADER_BYTES,
  array_table,
  nbytes,
  read_arrays,
  write_arrays,
)
from flaxlens.tools.files._codec import Decoder, Encoder, resolve_references
from flaxlens.tools.files._manifest import (
  FORMAT,
  FORMAT_VERSION,
  Manifest,
  checksum,
  parse_manifest,
  references_of,
)
from flaxlens.tools.files._policy import LoadPolicy, needs_allowing, package_of
from flaxlens.tools.isolation._replay import IsolatedSubmodel

MANIFEST = "manifest.json"
# Where format 2 and older kept their arrays: overwrite=True replaces such an artifact too.
OLD_ARRAYS = "arrays.npz"
MAX_MANIFEST_BYTES = 64 * 2**20
DEFAULT_MAX_BYTES = 16 * 2**30


def save_isolated(
  isolated: IsolatedSubmodel, path: str | os.PathLike, overwrite: bool = False
) -> None:
  """Writes `isolated` to the directory `path`, atomically.

  The manifest records in `requires` the packages beyond jax, flax, numpy and flaxlens
  that loading will need to be allowed (`load_isolated(path, allow=[...])`).

  Args:
    isolated: from `fl.isolate` (Linen or NNX calls).
    path: the artifact directory to create.
    overwrite: replace an existing flaxlens artifact at `path`; anything else there (a
      file, a symlink, a directory that is not an artifact) is never replaced.

  Raises:
    ArgumentError: `isolated` is not an `fl.IsolatedSubmodel`, `path` not a path, or
      `overwrite` not a bool.
    ArtifactError: if `path` exists (and not `overwrite`, or it is not an artifact), a
      value cannot be saved without pickling code (the message names the value), or the
      directory cannot be written.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp, tempfile
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> x = jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> isolated = fl.isolate(tree, x, "layers_2")
    >>> path = tempfile.mkdtemp() + "/dense"
    >>> fl.save_isolated(isolated, path)
    >>> fl.save_isolated(isolated, path, overwrite=True)
    >>> bool(fl.load_isolated(path).replay())
    True
  """
  check_type(
    isolated,
    IsolatedSubmodel,
    "fl.save_isolated",
    "isolated",
    "an fl.IsolatedSubmodel",
    "Pass what fl.isolate returns.",
  )
  target = pathlib.Path(check_path(path, "fl.save_isolated", "Pass the directory to create."))
  check_type(
    overwrite,
    bool,
    "fl.save_isolated",
    "overwrite",
    "True or False",
    "Pass overwrite=True to replace.",
  )
  check_target(target, overwrite)
  submodel = isolated.submodel
  encoder = Encoder()
  if not is_call_node(submodel):
    raise ArtifactError(
      f"save_isolated saves isolated Linen and NNX calls; this submodel is a"
      f" {type(submodel).__name__}."
    )
  recipe = recipe_of(submodel, isolated.initial_var_values, encoder.encode)
  saved = {
    "args": encoder.encode(tuple(isolated.saved_arg.args), "saved_arg.args"),
    "kwargs": encoder.encode(dict(isolated.saved_arg.kwargs), "saved_arg.kwargs"),
    "side_inputs": encoder.encode(dict(isolated.saved_side_inputs), "saved_side_inputs"),
    "output": encoder.encode(isolated.saved_output, "saved_output"),
    "initial": _encode_values(encoder, isolated.initial_var_values, "initial_var_values"),
    "final": _encode_values(encoder, isolated.final_var_values, "final_var_values"),
  }
  manifest = {
    "format": FORMAT,
    "format_version": FORMAT_VERSION,
    **provenance(),
    "requires": [],
    "call": "/".join(submodel.readable_path()),
    "call_number": isolated.call_number,
    "replay": {"jit": isolated.recorded_compiled},
    "calls": [".".join(n.readable_path()) for n in iter_call_nodes(submodel)],
    "recipe": recipe,
    "saved": saved,
    "arrays": array_table(encoder.arrays),
  }
  manifest["requires"] = requires(references_of(manifest).references)
  manifest["manifest_sha256"] = checksum(manifest)
  raw = json.dumps(manifest, indent=1, allow_nan=False).encode()
  try:
    parse_manifest(raw, str(target))
  except ArtifactError as e:
    raise ArtifactError(f"Cannot save {target}: its manifest would not load ({e}).") from None
  write_atomically(target, raw, encoder.arrays, overwrite)


def provenance() -> dict[str, Any]:
  """The informational `created` and `versions` fields of a manifest being saved."""
  return {
    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "versions": {
      "flaxlens": importlib.metadata.version("flaxlens"),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "python": platform.python_version(),
    },
  }


def requires(references: list[tuple[str, str, str]]) -> list[str]:
  """Packages to allow on load: those a reference needs allowed (`needs_allowing`), and
  default packages whose objects the default policy does not accept in the role they
  play here. Built-in types (`dict`, `float`) need none: `builtins` is never listed."""
  needed = set()
  default = LoadPolicy()
  for ref, role, where in references:
    package = package_of(ref)
    if needs_allowing(ref):
      needed.add(package)
      continue
    try:
      resolve_references(default, [(ref, role, where)])
    except ArtifactError:
      needed.add(package)
  return sorted(needed)


def _encode_values(encoder: Encoder, values: tuple[Any, ...], where: str) -> list:
  return [[v.label, encoder.encode(v.value, f"{where}[{v.label!r}]")] for v in values]


def check_target(target: pathlib.Path, overwrite: bool, file_format: str = FORMAT) -> None:
  """Refuses to write over anything but, with `overwrite`, a flaxlens file of `file_format`."""
  if not os.path.lexists(target):
    return
  if not overwrite:
    raise ArtifactError(f"{target} exists; pass overwrite=True to replace it.")
  refuse = (
    f"{target} is not a flaxlens artifact ({file_format}), so saving with overwrite=True does not"
    " replace it: remove it yourself or choose another path."
  )
  try:
    with Directory(target) as directory:
      others = sorted(set(os.listdir(directory.fd)) - {MANIFEST, ARRAYS, OLD_ARRAYS})
      raw = directory.read(MANIFEST, MAX_MANIFEST_BYTES)
    marker = json.loads(raw).get("format")
  except (ArtifactError, ValueError, AttributeError, RecursionError):
    raise ArtifactError(refuse) from None
  if others:
    raise ArtifactError(f"{refuse} (It holds {others[:5]}.)")
  if marker != file_format:
    raise ArtifactError(refuse)


def write_atomically(
  target: pathlib.Path,
  manifest: bytes,
  arrays: dict[str, np.ndarray],
  overwrite: bool,
  file_format: str = FORMAT,
) -> None:
  """Writes into a fresh hidden directory, then renames it into place.

  Every temporary name is unique (`mkdtemp`), so a leftover from a crash never blocks a
  later save; on any failure the temporaries are removed and an old artifact restored.
  """
  staging = old = None
  try:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    with open(staging / ARRAYS, "wb") as f:
      write_arrays(f, arrays)
      f.flush()
      os.fsync(f.fileno())
    with open(staging / MANIFEST, "wb") as f:
      f.write(manifest)
      f.flush()
      os.fsync(f.fileno())
    if overwrite and os.path.lexists(target):
      check_target(target, overwrite, file_format)
      old = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
      os.replace(target, old)
      try:
        os.replace(staging, target)
      except BaseException:
        os.replace(old, target)
        raise
    else:
      os.replace(staging, target)
    staging = None
  except OSError as e:
    raise ArtifactError(f"Cannot write the artifact {target} ({e}).") from None
  finally:
    for leftover in (staging, old):
      if leftover is not None:
        shutil.rmtree(leftover, ignore_errors=True)


def load_isolated(
  path: str | os.PathLike,
  allow: Iterable[str] | None = None,
  max_bytes: int = DEFAULT_MAX_BYTES,
  import_path: Iterable[str | os.PathLike] | None = None,
) -> IsolatedSubmodel:
  """Reads an artifact written by `save_isolated` and rebuilds the isolated call.

  The artifact is treated as untrusted. Before anything is imported, the whole manifest
  is validated and every package it references must be allowed: jax, flax, numpy and
  flaxlens by default (and from them only Flax modules and data types, and a vetted set
  of functions), plus the packages in `allow`, whose code you thereby trust. Sizes are
  checked before reading and arrays are verified against their checksums (which cover
  shape and dtype). See docs/artifacts.md.

  Args:
    path: the artifact directory.
    allow: top-level packages whose classes and functions the artifact may import, for
      example `["transformers"]` or the package defining your own modules. The refusal
      message names the packages an artifact needs.
    max_bytes: refuse artifacts whose arrays hold more bytes than this.
    import_path: folders to import the allowed packages from, before the current folder
      and the installed packages (`sys.path`): a module of your own (`mymodel.py`) loads
      from the folder that holds it. See docs/artifacts.md, "Where modules are found".

  Raises:
    ArgumentError: `path` is not a path, `allow` not a list of package names,
      `max_bytes` not a non-negative integer, or `import_path` not a list of folders.
    ArtifactError: the artifact is missing files, not regular files, truncated, too
      large, corrupted or tampered with, from another format version, or references code
      the policy does not allow. The message says which, and how to allow a package.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp, tempfile
    >>> model = nn.Sequential([nn.Dense(4), nn.gelu, nn.Dense(2)])
    >>> x = jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> isolated = fl.isolate(tree, x, "")
    >>> path = tempfile.mkdtemp() + "/mlp"
    >>> fl.save_isolated(isolated, path)
    >>> loaded = fl.load_isolated(path, max_bytes=2**20)
    >>> bool(loaded.replay())
    True
  """
  source, policy = load_arguments(
    "fl.load_isolated",
    path,
    allow,
    max_bytes,
    "Pass the directory fl.save_isolated wrote.",
    import_path,
  )
  with Directory(source) as directory:
    manifest = parse_manifest(directory.read(MANIFEST, MAX_MANIFEST_BYTES), str(source))
    named = [ref for ref, _, _ in manifest.references]
    for ref, _, where in manifest.references:
      policy.check_package(ref, where, named)
    arrays = load_arrays(directory, manifest.data["arrays"], max_bytes)
  resolved = resolve_references(policy, manifest.references)
  return _rebuild(source, manifest, Decoder(arrays, resolved))


def load_arguments(
  where: str, path: Any, allow: Any, max_bytes: Any, fix: str, import_path: Any, cli: bool = True
) -> tuple[pathlib.Path, LoadPolicy]:
  """The directory and loading policy of a load (`load_isolated`, `load_interventions`);
  `cli`: whether refusals also name `flaxlens replay`'s flags.

  Raises:
    ArgumentError: `path` is not a path, `allow` not a list of package names,
      `max_bytes` not a non-negative integer, or `import_path` not a list of folders.
  """
  source = pathlib.Path(check_path(path, where, fix))
  policy = LoadPolicy.create(allow, where, import_path, str(source), cli)
  if type(max_bytes) is not int or max_bytes < 0:
    raise refuse(where, "max_bytes", max_bytes, "a non-negative integer", "Pass a number of bytes.")
  return source, policy


def _rebuild(source: pathlib.Path, manifest: Manifest, decoder: Decoder) -> IsolatedSubmodel:
  recipe, saved = manifest.data["recipe"], manifest.data["saved"]
  argument = ArgsAndKwargs(
    args=decoder.decode(saved["args"], "saved.args"),
    kwargs=decoder.decode(saved["kwargs"], "saved.kwargs"),
  )
  side_inputs = decoder.decode(saved["side_inputs"], "saved.side_inputs")
  try:
    submodel, initial = submodel_from(recipe, decoder.decode, argument, side_inputs)
  except (ArtifactError, KeyboardInterrupt):
    raise
  except BaseException as e:  # A model's code that exits (SystemExit) fails the load too.
    raise ArtifactError(
      f"{source}: the saved call cannot be rebuilt ({type(e).__name__}: {e}); the artifact"
      " is inconsistent or needs other versions of the packages it names."
    ) from e
  saved_initial = _decode_values(decoder, saved["initial"])
  if [v.label for v in initial] != [v.label for v in saved_initial]:
    raise ArtifactError(
      f"{source}: the rebuilt call has state {[v.label for v in initial]}, but the artifact"
      f" saved {[v.label for v in saved_initial]}; it was written by an incompatible version."
    )
  return IsolatedSubmodel(
    submodel=submodel,
    saved_arg=argument,
    saved_side_inputs=side_inputs,
    saved_output=decoder.decode(saved["output"], "saved.output"),
    initial_var_values=saved_initial,
    final_var_values=_decode_values(decoder, saved["final"]),
    call_number=manifest.data["call_number"],
    recorded_compiled=bool(manifest.replay_jit),
  )


def _decode_values(decoder: Decoder, entries: list) -> tuple[StateVariableValue, ...]:
  return tuple(StateVariableValue(value=decoder.decode(v), label=label) for label, v in entries)


class Directory:
  """An artifact directory opened without following symlinks; reads only regular files."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    self.fd = -1

  def __enter__(self) -> Directory:
    try:
      mode = os.lstat(self.path).st_mode
    except FileNotFoundError:
      raise ArtifactError(
        f"{self.path} is not an artifact directory (it does not exist)."
      ) from None
    except OSError as e:
      raise ArtifactError(f"{self.path} cannot be read ({e}).") from None
    if stat.S_ISLNK(mode):
      raise ArtifactError(
        f"{self.path} is a symbolic link; artifacts are opened only as real directories."
        " Pass the directory it points to if you trust it."
      )
    if not stat.S_ISDIR(mode):
      raise ArtifactError(f"{self.path} is not an artifact directory.")
    try:
      self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
      raise ArtifactError(f"{self.path} cannot be opened as a directory ({e}).") from None
    return self

  def __exit__(self, *exc: object) -> None:
    os.close(self.fd)

  def open(self, name: str, limit: int) -> tuple[BinaryIO, int]:
    """Opens the regular file `name` of at most `limit` bytes; never blocks or follows."""
    where = f"{self.path}: {name}"
    try:
      mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
      raise ArtifactError(f"{where} is missing; the artifact is incomplete.") from None
    except OSError as e:
      raise ArtifactError(f"{where} cannot be read ({e}).") from None
    if not stat.S_ISREG(mode):
      kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
      raise ArtifactError(f"{where} is {kind}; an artifact holds only regular files.")
    try:
      fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.fd)
    except OSError as e:
      raise ArtifactError(f"{where} cannot be opened ({e}).") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
      os.close(fd)
      raise ArtifactError(
        f"{where} is {'not a regular file' if not stat.S_ISREG(info.st_mode) else 'too large'}"
        f" ({info.st_size} bytes, at most {limit} allowed); it is not a valid artifact file."
      )
    return os.fdopen(fd, "rb"), info.st_size

  def read(self, name: str, limit: int) -> bytes:
    f, _ = self.open(name, limit)
    with f:
      return f.read(limit + 1)


def load_arrays(directory: Directory, expected: dict, max_bytes: int) -> dict[str, np.ndarray]:
  """The arrays the manifest's table `expected` lists, read from the directory's
  `arrays.safetensors` (`_arrays.read_arrays`)."""
  where = f"{directory.path}: {ARRAYS}"
  total = sum(nbytes(info) for info in expected.values())
  f, size = directory.open(ARRAYS, 8 + MAX_HEADER_BYTES + total)
  with f:
    try:
      return read_arrays(f, size, expected, max_bytes, where)
    except OSError as e:
      raise ArtifactError(f"{where} cannot be read ({e}).") from None
