"""Saving an isolated call as a self-contained directory, and loading it elsewhere.

An artifact is a directory with `manifest.json` (format version, library versions, the
recipe of the call: for Linen the module class by import reference and its settings,
the variables and the rng state; for NNX the module's `GraphDef`, whose classes are
import references too, and its variables; then the method, arguments and saved
results, and shapes, dtypes and a SHA-256 per array) and
`arrays.npz` (each array as raw bytes; loaded with `allow_pickle=False`). Loading
verifies every checksum and imports only the classes and functions the manifest names,
then rebuilds the submodel exactly as isolation built it. Writes go to a temporary
directory renamed into place, so a crash leaves no half artifact. Flax internals: the rng
counters' encoding, through `flaxlens._flax_internals`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform
import shutil
import tempfile
import zipfile
from typing import Any

import flax
import jax
import numpy as np

import flaxlens
from flaxlens import _flax_internals as fi
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._calls import iter_call_nodes
from flaxlens.core._variables import StateVariableValue, bind_variables
from flaxlens.linen._tree import InterceptedFlaxModuleMethod, RngSnapshot, _gather
from flaxlens.tools._codec import ArtifactError, Decoder, Encoder
from flaxlens.tools._isolate import IsolatedSubmodel, linen_submodel

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = "arrays.npz"


def save_isolated(
  isolated: IsolatedSubmodel, path: str | os.PathLike, overwrite: bool = False
) -> None:
  """Writes `isolated` to the directory `path`, atomically.

  Args:
    isolated: from `fl.isolate_submodel` (Linen or NNX calls).
    path: the artifact directory to create.
    overwrite: replace an existing artifact at `path`.

  Raises:
    ArtifactError: if `path` exists (and not `overwrite`) or a value cannot be saved
      without pickling code (the message names the value).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp, tempfile
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> x = jnp.ones((1, 3))
    >>> isolated = fl.isolate(model, model.init(jax.random.key(0), x), x, at="layers_2")
    >>> path = tempfile.mkdtemp() + "/dense"
    >>> fl.save_isolated(isolated, path)
    >>> bool(fl.load_isolated(path).replay())
    True
  """
  from flaxlens.nnx._tree import InterceptedNNXModuleMethod

  target = pathlib.Path(path)
  if target.exists() and not overwrite:
    raise ArtifactError(f"{target} exists; pass overwrite=True to replace it.")
  submodel = isolated.submodel
  encoder = Encoder()
  if isinstance(submodel, InterceptedFlaxModuleMethod):
    recipe = _linen_recipe(encoder, submodel, isolated.initial_var_values)
  elif isinstance(submodel, InterceptedNNXModuleMethod):
    recipe = _nnx_recipe(encoder, submodel, isolated.initial_var_values)
  else:
    raise ArtifactError(
      f"save_isolated saves isolated Linen and NNX calls; this submodel is a"
      f" {type(submodel).__name__}."
    )
  saved = {
    "args": encoder.encode(tuple(isolated.saved_arg.args), "saved_arg.args"),
    "kwargs": encoder.encode(dict(isolated.saved_arg.kwargs), "saved_arg.kwargs"),
    "side_inputs": encoder.encode(dict(isolated.saved_side_inputs), "saved_side_inputs"),
    "output": encoder.encode(isolated.saved_output, "saved_output"),
    "initial": _encode_values(encoder, isolated.initial_var_values, "initial_var_values"),
    "final": _encode_values(encoder, isolated.final_var_values, "final_var_values"),
  }
  manifest = {
    "format": "flaxlens-isolated",
    "format_version": FORMAT_VERSION,
    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "versions": {
      "flaxlens": flaxlens.__version__,
      "jax": jax.__version__,
      "flax": flax.__version__,
      "python": platform.python_version(),
    },
    "call": "/".join(submodel.readable_path()),
    "call_number": isolated.call_number,
    "replay": {"jit": isolated.recorded_compiled},
    "calls": [".".join(n.readable_path()) for n in iter_call_nodes(submodel)],
    "recipe": recipe,
    "saved": saved,
    "arrays": {
      name: {
        "shape": list(a.shape),
        "dtype": a.dtype.name,
        "sha256": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(),
      }
      for name, a in encoder.arrays.items()
    },
  }
  _write_atomically(target, manifest, encoder.arrays, overwrite)


def _linen_recipe(encoder: Encoder, submodel: Any, initial: tuple[Any, ...]) -> dict:
  snapshot = submodel.scope_data.rngs
  variables = _gather(bind_variables(submodel, initial)).variables
  return {
    "kind": "linen",
    "module": encoder.encode(submodel.module, "module"),
    "method": encoder.encode(submodel.method_name, "method"),
    "variables": encoder.encode(variables, "variables"),
    "rngs": None
    if snapshot is None
    else {
      "keys": encoder.encode(dict(snapshot.keys), "rng keys"),
      "suffixes": encoder.encode(dict(snapshot.suffixes), "rng suffixes"),
      "counters": fi.counters_to_data(snapshot.counters),
    },
    "mutable": list(submodel.mutable),
    "capture_intermediates": encoder.encode(submodel.capture_intermediates, "capture"),
  }


def _nnx_recipe(encoder: Encoder, submodel: Any, initial: tuple[Any, ...]) -> dict:
  """An NNX call by its module's `GraphDef` and variable values (merge order)."""
  from flaxlens.nnx._tree import _Gathered

  bound = bind_variables(submodel, initial)
  values = _Gathered(bound).values(submodel._where())
  definition = submodel.definition
  return {
    "kind": "nnx",
    "graphdef": encoder.encode(definition.graphdef, "graphdef"),
    "leaves": encoder.encode([values[p] for p in definition.leaf_paths], "variables"),
    "method": encoder.encode(submodel.method_name, "method"),
  }


def _encode_values(encoder: Encoder, values: tuple[Any, ...], where: str) -> list:
  return [[v.label, encoder.encode(v.value, f"{where}[{v.label!r}]")] for v in values]


def _write_atomically(
  target: pathlib.Path, manifest: dict, arrays: dict[str, np.ndarray], overwrite: bool
) -> None:
  target.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
  try:
    raw = {
      name: np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8) for name, a in arrays.items()
    }
    with open(staging / ARRAYS, "wb") as f:
      np.savez(f, **raw)
      f.flush()
      os.fsync(f.fileno())
    with open(staging / MANIFEST, "w") as f:
      json.dump(manifest, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    if target.exists() and overwrite:
      old = target.with_name(f".{target.name}.old")
      os.replace(target, old)
      os.replace(staging, target)
      shutil.rmtree(old)
    else:
      os.replace(staging, target)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def load_isolated(path: str | os.PathLike) -> IsolatedSubmodel:
  """Reads an artifact written by `save_isolated` and rebuilds the isolated call.

  Raises:
    ArtifactError: if the artifact is missing files, truncated, corrupted or tampered
      with (a checksum differs), from a newer format, or names a class that cannot be
      imported. The message says which.
  """
  source = pathlib.Path(path)
  manifest = _read_manifest(source)
  arrays = _read_arrays(source, manifest)
  decoder = Decoder(arrays)
  recipe, saved = manifest["recipe"], manifest["saved"]
  argument = ArgsAndKwargs(
    args=decoder.decode(saved["args"]), kwargs=decoder.decode(saved["kwargs"])
  )
  side_inputs = decoder.decode(saved["side_inputs"])
  kind = recipe.get("kind")
  if kind == "linen":
    submodel, initial = _linen_submodel(source, decoder, recipe, argument, side_inputs)
  elif kind == "nnx":
    submodel, initial = _nnx_submodel(source, decoder, recipe, argument)
  else:
    raise ArtifactError(f"{source}: unknown artifact kind {kind!r}.")
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
    saved_output=decoder.decode(saved["output"]),
    initial_var_values=saved_initial,
    final_var_values=_decode_values(decoder, saved["final"]),
    call_number=manifest.get("call_number", 0),
    recorded_compiled=manifest.get("replay", {}).get("jit", False) is True,
  )


def _nnx_submodel(source, decoder, recipe, argument):
  from flax import nnx

  from flaxlens.tools._isolate_nnx import nnx_submodel

  graphdef = decoder.decode(recipe["graphdef"])
  if not isinstance(graphdef, nnx.graph.GraphDef):
    raise ArtifactError(f"{source}: the recipe's graphdef is not an NNX GraphDef.")
  try:
    module = nnx.merge(graphdef, list(decoder.decode(recipe["leaves"])))
  except Exception as e:
    raise ArtifactError(f"{source}: the NNX module cannot be rebuilt ({e}).") from None
  if not isinstance(module, nnx.Module):
    raise ArtifactError(f"{source}: the recipe does not describe an nnx.Module.")
  return nnx_submodel(module, decoder.decode(recipe["method"]), argument)


def _linen_submodel(source, decoder, recipe, argument, side_inputs):
  module = decoder.decode(recipe["module"])
  if not isinstance(module, flax.linen.Module):
    raise ArtifactError(f"{source}: the recipe's module is not a flax.linen.Module.")
  rngs = recipe["rngs"]
  snapshot = None
  if rngs is not None:
    snapshot = RngSnapshot(
      keys=decoder.decode(rngs["keys"]),
      suffixes=tuple(sorted(decoder.decode(rngs["suffixes"]).items())),
      counters=fi.counters_from_data(rngs["counters"]),
    )
  return linen_submodel(
    module,
    decoder.decode(recipe["method"]),
    decoder.decode(recipe["variables"]),
    argument,
    snapshot if snapshot is not None else side_inputs.get("random_streams"),
    list(recipe["mutable"]),
    decoder.decode(recipe["capture_intermediates"]),
  )


def _decode_values(decoder: Decoder, entries: list) -> tuple[StateVariableValue, ...]:
  return tuple(StateVariableValue(value=decoder.decode(v), label=label) for label, v in entries)


def _read_manifest(source: pathlib.Path) -> dict:
  if not source.is_dir():
    raise ArtifactError(f"{source} is not an artifact directory (it does not exist).")
  try:
    manifest = json.loads((source / MANIFEST).read_text())
  except FileNotFoundError:
    raise ArtifactError(f"{source}: {MANIFEST} is missing; the artifact is incomplete.") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ArtifactError(f"{source}: {MANIFEST} is corrupted or truncated ({e}).") from None
  if not isinstance(manifest, dict) or manifest.get("format") != "flaxlens-isolated":
    raise ArtifactError(f"{source}: {MANIFEST} is not a flaxlens artifact manifest.")
  version = manifest.get("format_version")
  if not isinstance(version, int) or version > FORMAT_VERSION:
    raise ArtifactError(
      f"{source} uses artifact format {version!r}, newer than this flaxlens reads"
      f" ({FORMAT_VERSION}). Upgrade flaxlens to load it."
    )
  for key in ("recipe", "saved", "arrays"):
    if key not in manifest:
      raise ArtifactError(f"{source}: {MANIFEST} lacks {key!r}; the artifact is corrupted.")
  return manifest


def _read_arrays(source: pathlib.Path, manifest: dict) -> dict[str, np.ndarray]:
  expected = manifest["arrays"]
  try:
    with np.load(source / ARRAYS, allow_pickle=False) as npz:
      raw = {name: npz[name] for name in npz.files}
  except FileNotFoundError:
    raise ArtifactError(f"{source}: {ARRAYS} is missing; the artifact is incomplete.") from None
  except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
    raise ArtifactError(f"{source}: {ARRAYS} is corrupted or truncated ({e}).") from None
  if set(raw) != set(expected):
    raise ArtifactError(
      f"{source}: {ARRAYS} holds arrays {sorted(raw)[:5]}..., but the manifest lists"
      f" {sorted(expected)[:5]}...; the artifact is corrupted or was tampered with."
    )
  arrays = {}
  for name, info in expected.items():
    data = raw[name]
    if hashlib.sha256(data.tobytes()).hexdigest() != info["sha256"]:
      raise ArtifactError(
        f"{source}: array {name!r} does not match its checksum; the artifact is corrupted"
        " or was tampered with."
      )
    dtype = jax.numpy.dtype(info["dtype"])
    arrays[name] = data.view(dtype).reshape(info["shape"])
  return arrays
