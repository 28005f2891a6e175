"""Dictionary files: save a dictionary and load it again, bit for bit, running no code.

`save(dictionary, path)` writes a directory of two files: `config.json`, the dictionary's
`DictionaryConfig`, the sites it was trained on and a table of its tensors (shape, dtype,
SHA-256), validated on load against the shipped schema `dictionary.schema.json`; and
`weights.safetensors`, one tensor per variable, named by its attribute path (`W_enc`,
`W_dec.0` for a cross-layer transcoder's first decoder, `activation.threshold`), readable
by the `safetensors` library. `load(path)` reads the config (bounded, strict JSON, the
schema), checks the table against the tensors the config's dictionary has before reading
a byte of weights, reads them through the checks of flaxlens's other files (header first,
byte ranges tiling the data, checksums) and refuses NaN. `assemble` builds a dictionary
from named arrays after the same checks: the loaders of other libraries' files
(`_foreign.py`) use it. No Flax internals here.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxlens._compat import nnx_variables
from flaxlens.errors import ArgumentError, ArtifactError
from flaxlens.tools.dictionaries._modules import Dictionary, DictionaryConfig, make_dictionary
from flaxlens.tools.files._arrays import MAX_HEADER_BYTES, array_table, read_arrays, write_arrays
from flaxlens.tools.files._artifact import Directory
from flaxlens.tools.files._schemas import check_schema, read_json

FORMAT = "flaxlens-dictionary"
FORMAT_VERSION = 1
CONFIG = "config.json"
WEIGHTS = "weights.safetensors"
# A config holds a few hundred bytes plus ~120 per tensor and the site names.
MAX_CONFIG_BYTES = 2**20
DEFAULT_MAX_BYTES = 16 * 2**30
_FIX = "The file is damaged or not a flaxlens dictionary; save the dictionary again."


def weights_of(dictionary: Dictionary) -> dict[str, np.ndarray]:
  """The dictionary's variables (parameters and statistics) as host arrays, each under its
  attribute path joined by dots (`W_enc`, `W_dec.0`, `activation.threshold`)."""
  flat = nnx.to_flat_state(nnx.state(dictionary))
  return {_name(path): np.asarray(jax.device_get(nnx_variables.value(var))) for path, var in flat}


def _name(path: tuple[Any, ...]) -> str:
  return ".".join(str(part) for part in path)


def save(
  dictionary: Dictionary,
  path: str | os.PathLike,
  *,
  reads: Iterable[str] = (),
  writes: Iterable[str] = (),
  overwrite: bool = False,
) -> None:
  """Saves `dictionary` as the directory `path` (`config.json`, `weights.safetensors`).

  Args:
    dictionary: any `fld.Dictionary` built from its config (`SAE`, `Transcoder`,
      `CrossLayerTranscoder`, trained or loaded).
    path: the directory to write; written whole into a temporary directory beside it,
      then renamed into place.
    reads: the sites it was trained to read (recorded for whoever loads it).
    writes: the sites it was trained to write.
    overwrite: replace an existing saved dictionary at `path` (nothing else is replaced).

  Raises:
    ArgumentError: `dictionary` is no `Dictionary`, or holds NaN.
    ArtifactError: `path` exists (without `overwrite`) or cannot be written.

  Example:
    >>> import tempfile, flaxlens.dictionaries as fld, jax.numpy as jnp
    >>> from flax import nnx
    >>> sae = fld.SAE(4, 16, activation="jumprelu", rngs=nnx.Rngs(0))
    >>> folder = tempfile.mkdtemp() + "/sae"
    >>> fld.save(sae, folder, reads=["layers_0"])
    >>> loaded = fld.load(folder)
    >>> bool((loaded.encode(jnp.ones((2, 4))) == sae.encode(jnp.ones((2, 4)))).all())
    True
  """
  if not isinstance(dictionary, Dictionary):
    raise ArgumentError(
      f"fld.save: dictionary is a {type(dictionary).__name__}, not a fld.Dictionary."
      " Pass an SAE, Transcoder or CrossLayerTranscoder."
    )
  sites = {}
  for name, given in (("reads", reads), ("writes", writes)):
    if isinstance(given, str) or not all(isinstance(site, str) for site in given):
      raise ArgumentError(
        f"fld.save: {name}={given!r} is not a list of site names. Pass e.g. {name}=['layers_0']."
      )
    sites[name] = list(given)
  arrays = weights_of(dictionary)
  for name, array in arrays.items():
    if np.isnan(array).any():
      raise ArgumentError(
        f"fld.save: the dictionary's {name} holds NaN; a file of it could not be loaded."
        " Train it again (or fix the weights) before saving."
      )
  content = {
    "format": FORMAT,
    "format_version": FORMAT_VERSION,
    "config": dictionary.config.to_dict(),
    **sites,
    "arrays": array_table(arrays),
  }
  check_schema(content, "dictionary", f"fld.save: the config of {path}", "Report this bug.")
  _write(pathlib.Path(path), json.dumps(content, indent=1).encode(), arrays, overwrite)


def _write(target: pathlib.Path, config: bytes, arrays: dict, overwrite: bool) -> None:
  """Writes the two files into a fresh hidden directory, then renames it into place."""
  if os.path.lexists(target):
    if not overwrite:
      raise ArtifactError(f"fld.save: {target} exists. Pass overwrite=True to replace it.")
    held = set(os.listdir(target)) if target.is_dir() and not target.is_symlink() else None
    if held is None or not held <= {CONFIG, WEIGHTS}:
      raise ArtifactError(
        f"fld.save: {target} is not a saved dictionary, so overwrite=True does not replace"
        " it. Remove it yourself or choose another path."
      )
  staging = None
  try:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    with open(staging / WEIGHTS, "wb") as f:
      write_arrays(f, arrays)
    (staging / CONFIG).write_bytes(config)
    if os.path.lexists(target):
      shutil.rmtree(target)
    os.replace(staging, target)
    staging = None
  except OSError as e:
    raise ArtifactError(f"fld.save: cannot write {target} ({e}).") from None
  finally:
    if staging is not None:
      shutil.rmtree(staging, ignore_errors=True)


def load(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Dictionary:
  """The dictionary saved at `path` by `fld.save`, bit for bit.

  Loading runs no code: the config is strict JSON of at most 1 MiB, validated against
  `dictionary.schema.json`; the tensors it lists must be exactly those of the dictionary
  the config describes, with their shapes and dtype, before the weights are read; the
  weights file must hold exactly those bytes (checksums), and no NaN.

  Args:
    path: the directory `fld.save` wrote.
    max_bytes: the most bytes of weights to read (16 GiB by default).

  Returns:
    The dictionary (an `SAE`, `Transcoder` or `CrossLayerTranscoder`), in inference mode.

  Raises:
    ArtifactError: the directory is missing, foreign, damaged or too large, naming the
      file and what to do.

  Example:
    >>> import tempfile, flaxlens.dictionaries as fld
    >>> from flax import nnx
    >>> clt = fld.CrossLayerTranscoder(2, 4, 4, 8, activation="topk", k=2, rngs=nnx.Rngs(0))
    >>> folder = tempfile.mkdtemp() + "/clt"
    >>> fld.save(clt, folder)
    >>> fld.load(folder).config == clt.config
    True
  """
  with Directory(pathlib.Path(path)) as directory:
    where = f"{directory.path}: {CONFIG}"
    data = _read_config(directory, where)
    config = _config_of(data["config"], where)
    table = data["arrays"]
    expected = expected_tensors(config)
    check_tensors(expected, {n: tuple(i["shape"]) for n, i in table.items()}, where, config)
    for name, info in table.items():
      if info["dtype"] != config.dtype:
        raise ArtifactError(
          f"{where}: tensor {name!r} is {info['dtype']}, but the config's dtype is"
          f" {config.dtype}. {_FIX}"
        )
    total = sum(int(np.prod(i["shape"], dtype=object)) for i in table.values())
    limit = 8 + MAX_HEADER_BYTES + total * jnp.dtype(config.dtype).itemsize
    f, size = directory.open(WEIGHTS, limit)
    with f:
      try:
        arrays = read_arrays(f, size, table, max_bytes, f"{directory.path}: {WEIGHTS}")
      except OSError as e:
        raise ArtifactError(f"{directory.path}: {WEIGHTS} cannot be read ({e}).") from None
  return assemble(config, arrays, f"{directory.path}: {WEIGHTS}")


def _read_config(directory: Directory, where: str) -> dict:
  """The config file's content, strict, bounded and schema-valid."""
  try:
    raw = directory.read(CONFIG, MAX_CONFIG_BYTES)
  except ArtifactError:
    names = set(os.listdir(directory.fd))
    if {"cfg.json", "sae_weights.safetensors"} <= names:
      raise ArtifactError(
        f"{directory.path} is a SAELens dictionary, not a flaxlens one. Load it with"
        " fld.load_saelens(path)."
      ) from None
    if "params.npz" in names:
      raise ArtifactError(
        f"{directory.path} holds a Gemma Scope params.npz, not a flaxlens dictionary."
        " Load it with fld.load_gemma_scope(path)."
      ) from None
    raise
  data = read_json(raw, where, _FIX)
  found = data.get("format") if isinstance(data, dict) else None
  if found != FORMAT:
    raise ArtifactError(f"{where} is not a flaxlens dictionary config (format={found!r}). {_FIX}")
  version = data.get("format_version")
  if isinstance(version, int) and version > FORMAT_VERSION:
    raise ArtifactError(
      f"{where} has format_version {version}; this flaxlens reads up to {FORMAT_VERSION}."
      " Upgrade flaxlens."
    )
  check_schema(data, "dictionary", where, _FIX)
  return data


def _config_of(fields: dict, where: str) -> DictionaryConfig:
  try:
    return DictionaryConfig(**fields)
  except ArgumentError as error:
    raise ArtifactError(f"{where}: the config is inconsistent: {error} {_FIX}") from None


def expected_tensors(config: DictionaryConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """The tensors a dictionary of `config` has, by name, built abstractly (no memory)."""
  abstract = _abstract(config)
  flat = nnx.to_flat_state(nnx.state(abstract))
  return {_name(path): nnx_variables.value(var) for path, var in flat}


def _abstract(config: DictionaryConfig) -> Dictionary:
  """The dictionary of `config` with abstract arrays; ArtifactError if it cannot be built."""
  try:
    return nnx.eval_shape(lambda: make_dictionary(config))
  except ArgumentError as error:
    raise ArtifactError(f"The file describes no valid dictionary: {error} {_FIX}") from None


def check_tensors(
  expected: Mapping[str, jax.ShapeDtypeStruct],
  shapes: Mapping[str, tuple[int, ...]],
  where: str,
  config: DictionaryConfig,
  fix: str = _FIX,
  labels: Mapping[str, str] | None = None,
) -> None:
  """Refuses (ArtifactError naming `where`, ending with `fix`) tensors missing, extra or
  of the wrong shape for a dictionary of `config`; `labels` gives each tensor's name in
  the file."""
  labels = labels or {}
  missing = sorted(set(expected) - set(shapes))
  extra = sorted(set(shapes) - set(expected))
  described = (
    f"a {config.kind} (d_in={config.d_in}, d_out={config.d_out}, width={config.width},"
    f" layers={config.layers}, activation={config.activation!r}, skip={config.skip})"
  )
  if missing:
    raise ArtifactError(
      f"{where} lacks the tensors {[labels.get(n, n) for n in missing]} that {described} has. {fix}"
    )
  if extra:
    raise ArtifactError(
      f"{where} holds the tensors {[labels.get(n, n) for n in extra]}, which {described}"
      f" does not have. {fix}"
    )
  for name, want in expected.items():
    if tuple(shapes[name]) != tuple(want.shape):
      raise ArtifactError(
        f"{where}: tensor {labels.get(name, name)!r} has shape {list(shapes[name])}, but"
        f" {described} needs {list(want.shape)}: the config and the weights disagree. {fix}"
      )


def assemble(
  config: DictionaryConfig,
  arrays: Mapping[str, np.ndarray],
  where: str,
  fix: str = _FIX,
  labels: Mapping[str, str] | None = None,
) -> Dictionary:
  """The dictionary of `config` holding `arrays` (by our names, cast to the config's
  dtype), after `check_tensors` and a NaN check; ArtifactError naming `where`."""
  expected = expected_tensors(config)
  shapes = {n: tuple(a.shape) for n, a in arrays.items()}
  check_tensors(expected, shapes, where, config, fix, labels)
  for name, array in arrays.items():
    if np.isnan(array).any():
      raise ArtifactError(
        f"{where}: tensor {(labels or {}).get(name, name)!r} holds NaN; the dictionary"
        " diverged or the file is damaged. Use another file."
      )
  graphdef, state = nnx.split(_abstract(config))
  flat = [
    (path, var.replace(jnp.asarray(arrays[_name(path)], config.dtype)))
    for path, var in nnx.to_flat_state(state)
  ]
  return nnx.merge(graphdef, nnx.from_flat_state(flat))
