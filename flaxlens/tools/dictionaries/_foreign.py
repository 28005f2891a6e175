"""Loading the dictionaries other libraries publish: SAELens, Gemma Scope, circuit-tracer.

Each loader reads the library's saved layout itself, as data: JSON strictly and bounded,
safetensors header first (`read_safetensors`: the header validated, the byte ranges tiling
the file, every size checked before a byte of data is read), `.npz` archives member by
member with their `.npy` headers checked against the member sizes and pickles refused.
Their weights are renamed and transposed into flaxlens's convention (`x @ W_enc + b_enc`,
`features @ W_dec + b_dec`, `x @ W_skip`) and handed to `assemble`, which checks every
tensor's shape against the config and refuses NaN. What the library's file describes but
a flaxlens dictionary cannot compute (an input normalisation, a gated or matryoshka
architecture) is refused, naming the config key. Layouts follow SAELens 6.x
(`cfg.json`, `sae_weights.safetensors`), Gemma Scope's `params.npz`, and circuit-tracer
0.5 (`layer_{i}.safetensors` per-layer transcoders, `W_enc_{i}`/`W_dec_{i}` CLT files).
No Flax internals here.
"""

from __future__ import annotations

import os
import pathlib
import re
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from flaxlens.errors import ArgumentError, ArtifactError
from flaxlens.tools.dictionaries._files import (
  DEFAULT_MAX_BYTES,
  assemble,
  check_tensors,
  expected_tensors,
)
from flaxlens.tools.dictionaries._modules import Dictionary, DictionaryConfig, Transcoder
from flaxlens.tools.files._arrays import MAX_HEADER_BYTES
from flaxlens.tools.files._artifact import Directory
from flaxlens.tools.files._schemas import check_schema, read_json

# safetensors dtypes a published dictionary holds, as numpy dtypes (bfloat16 via ml_dtypes).
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64"}
_MAX_TENSORS = 256
_MAX_CONFIG_BYTES = 2**20
_CHUNK = 2**20
SAELENS_CONFIG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
GEMMA_SCOPE = "params.npz"
# The .npy header readers by format version (they bound the header's size themselves).
_NPY_HEADERS = {
  (1, 0): np.lib.format.read_array_header_1_0,
  (2, 0): np.lib.format.read_array_header_2_0,
}


def _split(path: str | os.PathLike) -> tuple[pathlib.Path, str]:
  path = pathlib.Path(path)
  return path.parent, path.name


def read_safetensors(
  directory: Directory, name: str, max_bytes: int, fix: str
) -> dict[str, np.ndarray]:
  """Every tensor of the safetensors file `name` in `directory`, read as data.

  Refused (ArtifactError naming the file, ending with `fix`): a header over 64 MiB or not
  strict JSON of the safetensors schema, more than 256 tensors, a dtype other than F64,
  F32, F16, BF16 or I64, byte ranges that do not tile the data exactly or disagree with
  the shapes, more than `max_bytes` of data, a file shorter than its header says.
  """
  where = f"{directory.path}: {name}"
  f, size = directory.open(name, 8 + MAX_HEADER_BYTES + max_bytes)
  with f:
    try:
      length = int.from_bytes(f.read(8), "little")
      if size < 8 or length > min(MAX_HEADER_BYTES, size - 8):
        raise ArtifactError(
          f"{where} is truncated or no safetensors file: it declares a {length}-byte header"
          f" in {size} bytes. {fix}"
        )
      header = read_json(f.read(length), f"{where}: the header", fix)
      check_schema(header, "safetensors-header", f"{where}: the header", fix)
      header.pop("__metadata__", None)
      order = _check_ranges(header, size - 8 - length, where, fix)
      arrays = {}
      for tensor in order:
        info = header[tensor]
        data = np.empty(info["data_offsets"][1] - info["data_offsets"][0], np.uint8)
        view, position = memoryview(data), 0
        while position < len(data):
          read = f.readinto(view[position : position + _CHUNK])
          if not read:
            raise ArtifactError(f"{where}: tensor {tensor!r} is truncated. {fix}")
          position += read
        arrays[tensor] = data.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    except OSError as e:
      raise ArtifactError(f"{where} cannot be read ({e}).") from None
  return arrays


def _check_ranges(header: dict, data_bytes: int, where: str, fix: str) -> list[str]:
  """The tensors in the order of their bytes, after checking dtypes, sizes and tiling."""
  if len(header) > _MAX_TENSORS:
    raise ArtifactError(f"{where} holds {len(header)} tensors, more than {_MAX_TENSORS}. {fix}")
  for tensor, info in header.items():
    if info["dtype"] not in _DTYPES:
      raise ArtifactError(
        f"{where}: tensor {tensor!r} is {info['dtype']}; a dictionary's tensors are"
        f" {sorted(_DTYPES)}. {fix}"
      )
  ranges = sorted((tuple(info["data_offsets"]), tensor) for tensor, info in header.items())
  end = 0
  for (begin, stop), tensor in ranges:
    info = header[tensor]
    need = int(np.prod(info["shape"], dtype=object)) * np.dtype(_DTYPES[info["dtype"]]).itemsize
    if begin != end or stop - begin != need:
      raise ArtifactError(
        f"{where}: tensor {tensor!r} takes bytes [{begin}, {stop}), where the tensors"
        f" before it end at {end} and its shape needs {need}; the file is damaged. {fix}"
      )
    end = stop
  if end != data_bytes:
    raise ArtifactError(
      f"{where} holds {data_bytes} bytes of data but its tensors take {end}; it is truncated"
      f" or damaged. {fix}"
    )
  return [tensor for _, tensor in ranges]


def _field(cfg: Mapping, key: str, kind: type | tuple[type, ...], where: str, fix: str) -> Any:
  value = cfg.get(key)
  if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
    raise ArtifactError(f"{where}: {key}={value!r} is missing or not a {kind}. {fix}")
  return value


_SAELENS = {
  # architecture: (kind, activation, skip)
  "standard": ("sae", "relu", False),
  "jumprelu": ("sae", "jumprelu", False),
  "topk": ("sae", "topk", False),
  "transcoder": ("transcoder", "relu", False),
  "skip_transcoder": ("transcoder", "relu", True),
  "jumprelu_transcoder": ("transcoder", "jumprelu", False),
  "jumprelu_skip_transcoder": ("transcoder", "jumprelu", True),
}


def load_saelens(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Dictionary:
  """A dictionary saved by SAELens (`sae.save_model(path)`, `save_inference_model`):
  the folder's `cfg.json` and `sae_weights.safetensors`.

  Architectures: "standard" (ReLU), "jumprelu", "topk" (with `rescale_acts_by_decoder_norm`
  folded into the weights), BatchTopK (SAELens saves it for inference as "jumprelu"),
  "transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder". An
  SAE's `apply_b_dec_to_input` becomes `center_input`; `reshape_activations="hook_z"` is
  kept as a flat `d_in` (give it the heads flattened). Refused, naming the key:
  `normalize_activations` other than "none" (a run-time normalisation the file cannot
  carry: fold it into the weights in SAELens first) and other architectures (gated,
  matryoshka, temporal, ...). The sites it read (`metadata.hook_name`) are SAELens's
  TransformerLens names, not flaxlens sites: splice it at the matching site yourself.

  Raises:
    ArtifactError: a file is missing, damaged, too large or describes what flaxlens
      cannot compute, naming the file and the key.

  Example:
    >>> import json, os, tempfile, numpy as np, flaxlens.dictionaries as fld
    >>> from safetensors.numpy import save_file
    >>> folder = tempfile.mkdtemp()
    >>> save_file({"W_enc": np.ones((4, 8), np.float32), "b_enc": np.zeros(8, np.float32),
    ...            "W_dec": np.ones((8, 4), np.float32), "b_dec": np.zeros(4, np.float32)},
    ...           os.path.join(folder, "sae_weights.safetensors"))
    >>> with open(os.path.join(folder, "cfg.json"), "w") as f:
    ...   json.dump({"architecture": "topk", "k": 2, "d_in": 4, "d_sae": 8}, f)
    >>> sae = fld.load_saelens(folder)
    >>> sae.config.activation, sae.config.k, sae.config.center_input
    ('topk', 2, True)
  """
  with Directory(pathlib.Path(path)) as directory:
    where = f"{directory.path}: {SAELENS_CONFIG}"
    fix = "Load a folder SAELens saved (cfg.json and sae_weights.safetensors)."
    cfg = read_json(directory.read(SAELENS_CONFIG, _MAX_CONFIG_BYTES), where, fix)
    if not isinstance(cfg, dict):
      raise ArtifactError(f"{where} is no JSON object. {fix}")
    config, fold = _saelens_config(cfg, where, fix)
    weights = read_safetensors(directory, SAELENS_WEIGHTS, max_bytes, fix)
  arrays = dict(weights)
  if "log_threshold" in arrays:  # SAELens before 6 trained log thresholds.
    arrays["threshold"] = np.exp(arrays.pop("log_threshold"))
  if config.skip and "W_skip" in arrays:  # SAELens's W_skip is [d_out, d_in].
    arrays["W_skip"] = arrays["W_skip"].T
  if "threshold" in arrays:
    arrays["activation.threshold"] = arrays.pop("threshold")
  labels = {"activation.threshold": "threshold"}
  where = f"{directory.path}: {SAELENS_WEIGHTS}"
  if fold:  # TopK on pre-activations scaled by the decoder norms, decoded unscaled.
    shapes = {name: array.shape for name, array in arrays.items()}
    check_tensors(expected_tensors(config), shapes, where, config, fix, labels)
    norms = np.linalg.norm(arrays["W_dec"].astype(np.float64), axis=-1)
    dtype = arrays["W_enc"].dtype
    arrays["W_enc"] = (arrays["W_enc"] * norms).astype(dtype)
    arrays["b_enc"] = (arrays["b_enc"] * norms).astype(dtype)
    arrays["W_dec"] = (arrays["W_dec"] / norms[:, None]).astype(dtype)
  return assemble(config, arrays, where, fix, labels)


def _saelens_config(cfg: dict, where: str, fix: str) -> tuple[DictionaryConfig, bool]:
  """Our config for SAELens's `cfg`, and whether TopK's decoder norms must be folded."""
  kwargs = cfg.get("activation_fn_kwargs")
  old_k = kwargs.get("k") if isinstance(kwargs, dict) else None
  default = "topk" if cfg.get("activation_fn") == "topk" and old_k is not None else "standard"
  architecture = cfg.get("architecture", default)
  if architecture not in _SAELENS:
    raise ArtifactError(
      f"{where}: architecture={architecture!r} is not one flaxlens represents; it loads"
      f" {sorted(_SAELENS)} (BatchTopK as SAELens saves it, 'jumprelu'). Convert the"
      " dictionary to one of those in SAELens first."
    )
  kind, activation, skip = _SAELENS[architecture]
  normalize = cfg.get("normalize_activations", "none")
  if normalize not in ("none", None):
    raise ArtifactError(
      f"{where}: normalize_activations={normalize!r} normalises inputs at run time, which"
      " a flaxlens dictionary does not do. Fold the normalisation into the weights in"
      " SAELens (fold_activation_norm_scaling_factor) and save it again."
    )
  d_in = _field(cfg, "d_in", int, where, fix)
  d_out = _field(cfg, "d_out", int, where, fix) if kind == "transcoder" else d_in
  k = None
  if activation == "topk":
    k = _field(cfg, "k", int, where, fix) if "k" in cfg else old_k
  center = bool(cfg.get("apply_b_dec_to_input", True)) and kind == "sae"
  dtype = cfg.get("dtype", "float32")
  dtype = dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype
  try:
    config = DictionaryConfig(
      kind, d_in, d_out, _field(cfg, "d_sae", int, where, fix), activation, k, skip=skip,
      center_input=center, dtype=dtype,
    )  # fmt: skip
  except ArgumentError as error:
    raise ArtifactError(f"{where} describes no valid dictionary: {error} {fix}") from None
  return config, bool(cfg.get("rescale_acts_by_decoder_norm", False)) and activation == "topk"


def load_gemma_scope(
  path: str | os.PathLike, *, transcoder: bool = False, max_bytes: int = DEFAULT_MAX_BYTES
) -> Dictionary:
  """A Gemma Scope dictionary: `params.npz` with `W_enc [d_in, width]`, `W_dec [width,
  d_out]`, `b_enc`, `b_dec`, `threshold` (JumpReLU, the input not centred).

  Args:
    path: the `params.npz` file, or the folder holding it.
    transcoder: load it as a `Transcoder` (Gemma Scope's MLP transcoders) rather than an
      `SAE`.
    max_bytes: the most bytes of weights to read.

  The archive is read member by member: each `.npy` header (no pickled object arrays,
  `allow_pickle=False`) is checked against the member's size before its data is read.

  Raises:
    ArtifactError: the file is missing, damaged, holds pickles or unexpected arrays.

  Example:
    >>> import os, tempfile, numpy as np, flaxlens.dictionaries as fld
    >>> path = os.path.join(tempfile.mkdtemp(), "params.npz")
    >>> np.savez(path, W_enc=np.ones((4, 8), np.float32), W_dec=np.ones((8, 4), np.float32),
    ...          b_enc=np.zeros(8, np.float32), b_dec=np.zeros(4, np.float32),
    ...          threshold=np.full(8, 0.5, np.float32))
    >>> sae = fld.load_gemma_scope(path)
    >>> sae.config.kind, sae.config.activation, sae.config.center_input
    ('sae', 'jumprelu', False)
  """
  path = pathlib.Path(path)
  folder, name = (path, GEMMA_SCOPE) if path.is_dir() else _split(path)
  fix = "Load Gemma Scope's params.npz (W_enc, W_dec, b_enc, b_dec, threshold)."
  with Directory(folder) as directory:
    where = f"{directory.path}: {name}"
    f, _ = directory.open(name, max_bytes + 2**20)
    with f:
      arrays = _read_npz(f, where, max_bytes, fix)
  d_in, width = _shape(arrays, "W_enc", 2, where, fix)
  d_out = _shape(arrays, "W_dec", 2, where, fix)[1]
  kind = "transcoder" if transcoder else "sae"
  dtype = arrays["W_enc"].dtype.name
  try:
    config = DictionaryConfig(kind, d_in, d_out, width, "jumprelu", center_input=False, dtype=dtype)
  except ArgumentError as error:
    raise ArtifactError(f"{where} describes no valid dictionary: {error} {fix}") from None
  if "threshold" in arrays:
    arrays["activation.threshold"] = arrays.pop("threshold")
  return assemble(config, arrays, where, fix, {"activation.threshold": "threshold"})


def _shape(arrays: dict, name: str, ndim: int, where: str, fix: str) -> tuple[int, ...]:
  if name not in arrays or arrays[name].ndim != ndim:
    found = list(arrays[name].shape) if name in arrays else "missing"
    raise ArtifactError(f"{where}: {name} should have {ndim} axes; it is {found}. {fix}")
  return arrays[name].shape


def _read_npz(f: Any, where: str, max_bytes: int, fix: str) -> dict[str, np.ndarray]:
  """The arrays of an `.npz` archive, each header checked before its data is read."""
  try:
    archive = zipfile.ZipFile(f)
  except (zipfile.BadZipFile, OSError) as e:
    raise ArtifactError(f"{where} is no .npz archive ({e}). {fix}") from None
  arrays, total = {}, 0
  with archive:
    members = archive.infolist()
    if len(members) > _MAX_TENSORS:
      raise ArtifactError(f"{where} holds {len(members)} members. {fix}")
    for member in members:
      if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\.npy", member.filename):
        raise ArtifactError(f"{where} holds {member.filename!r}, not a .npy array. {fix}")
      total += member.file_size
      if total > max_bytes:
        raise ArtifactError(f"{where} holds more than max_bytes={max_bytes} bytes. {fix}")
      try:
        with archive.open(member) as stream:
          version = np.lib.format.read_magic(stream)
          if version not in _NPY_HEADERS:
            raise ArtifactError(f"{where}: {member.filename} is .npy version {version}. {fix}")
          shape, fortran, dtype = _NPY_HEADERS[version](stream)
          if dtype.hasobject or dtype.kind not in "fiu":
            raise ArtifactError(
              f"{where}: {member.filename} holds {dtype} values (pickled objects or"
              f" records); only numbers are read, never pickles. {fix}"
            )
          need = int(np.prod(shape, dtype=object)) * dtype.itemsize
          if need > member.file_size:
            raise ArtifactError(
              f"{where}: {member.filename} declares {need} bytes in a {member.file_size}-byte"
              f" member; it is damaged. {fix}"
            )
          data = np.frombuffer(stream.read(need), dtype, count=-1)
      except (ValueError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise ArtifactError(f"{where}: {member.filename} is damaged ({e}). {fix}") from None
      if data.size * dtype.itemsize != need:
        raise ArtifactError(f"{where}: {member.filename} is truncated. {fix}")
      order = "F" if fortran else "C"
      arrays[member.filename[:-4]] = data.reshape(shape, order=order)
  return arrays


def load_circuit_tracer(
  path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> Dictionary | list[Transcoder]:
  """circuit-tracer's transcoders: a cross-layer transcoder, a set of per-layer ones, or one.

  Args:
    path: a folder of `W_enc_{i}.safetensors` and `W_dec_{i}.safetensors` (a CLT, as its
      `CrossLayerTranscoder.to_safetensors` writes), a folder of `layer_{i}.safetensors`
      (per-layer transcoders, `TranscoderSet.to_safetensors`), or one such file.
    max_bytes: the most bytes of weights to read from each file.

  Returns:
    A `CrossLayerTranscoder`, a list of `Transcoder`s (one per layer, in layer order), or a
    `Transcoder`. Its `W_enc` (`[width, d_model]` there, `F.linear`) and `W_skip` (`x @
    W_skip.T` in per-layer files) are transposed into flaxlens's convention; a CLT's
    decoders (`[width, layers - l, d_model]`) are as they are.

  circuit-tracer's TopK keeps the `k` largest pre-activations even when negative, where
  flaxlens's keeps their ReLU: features agree wherever a row has `k` positive
  pre-activations. A JumpReLU threshold below 0 (which passes negative values there) is
  refused. A CLT's skip weights are not in its files (circuit-tracer does not save them).

  Raises:
    ArtifactError: files missing, damaged, disagreeing in shape, or a negative threshold.

  Example:
    >>> import os, tempfile, numpy as np, flaxlens.dictionaries as fld
    >>> from safetensors.numpy import save_file
    >>> folder = tempfile.mkdtemp()
    >>> for layer in range(2):
    ...   save_file({"W_enc": np.ones((8, 4), np.float32), "b_enc": np.zeros(8, np.float32),
    ...              "W_dec": np.ones((8, 4), np.float32), "b_dec": np.zeros(4, np.float32)},
    ...             os.path.join(folder, f"layer_{layer}.safetensors"))
    >>> [t.W_enc.shape for t in fld.load_circuit_tracer(folder)]
    [(4, 8), (4, 8)]
  """
  path = pathlib.Path(path)
  fix = "Load a folder or file circuit-tracer's to_safetensors wrote."
  if not path.is_dir():
    folder, name = _split(path)
    with Directory(folder) as directory:
      return _plt(read_safetensors(directory, name, max_bytes, fix), f"{directory.path}: {name}")
  with Directory(path) as directory:
    names = set(os.listdir(directory.fd))
    if "W_enc_0.safetensors" in names:
      return _clt(directory, names, max_bytes, fix)
    layers = _numbered(names, "layer_", directory.path, fix)
    return [
      _plt(
        read_safetensors(directory, f"layer_{i}.safetensors", max_bytes, fix),
        f"{directory.path}: layer_{i}.safetensors",
      )
      for i in range(layers)
    ]


def _numbered(names: set[str], prefix: str, where: Any, fix: str) -> int:
  """How many files `{prefix}{i}.safetensors` there are, numbered 0..n-1 without gaps."""
  found = {int(m[1]) for n in names if (m := re.fullmatch(rf"{prefix}(\d+)\.safetensors", n))}
  if not found or found != set(range(len(found))):
    raise ArtifactError(
      f"{where} holds the files {sorted(found)[:8]} of {prefix}{{i}}.safetensors; they must be"
      f" numbered 0, 1, ... without a gap. {fix}"
    )
  return len(found)


def _plt(tensors: dict[str, np.ndarray], where: str) -> Transcoder:
  """A `Transcoder` from one per-layer file's tensors."""
  fix = "Load a file circuit-tracer's SingleLayerTranscoder.to_safetensors wrote."
  arrays = dict(tensors)
  k = arrays.pop("k", None)
  width, d_in = _shape(arrays, "W_enc", 2, where, fix)
  d_out = _shape(arrays, "W_dec", 2, where, fix)[1]
  activation = "relu"
  if "activation_function.threshold" in arrays:
    activation = "jumprelu"
    arrays["activation.threshold"] = _threshold(arrays.pop("activation_function.threshold"), where)
  if k is not None:
    activation = "topk"
    if k.size != 1 or k.dtype.kind != "i":
      raise ArtifactError(f"{where}: k is {k.dtype}{list(k.shape)}, not one integer. {fix}")
    k = int(k.reshape(()))
  arrays["W_enc"] = arrays["W_enc"].T
  if "W_skip" in arrays:
    arrays["W_skip"] = arrays["W_skip"].T
  dtype = arrays["W_enc"].dtype.name
  try:
    config = DictionaryConfig(
      "transcoder", d_in, d_out, width, activation, k, skip="W_skip" in arrays, dtype=dtype
    )
  except ArgumentError as error:
    raise ArtifactError(f"{where} describes no valid transcoder: {error} {fix}") from None
  labels = {"activation.threshold": "activation_function.threshold"}
  return assemble(config, arrays, where, fix, labels)


def _threshold(threshold: np.ndarray, where: str) -> np.ndarray:
  if (threshold < 0).any():
    raise ArtifactError(
      f"{where}: a JumpReLU threshold is negative, where circuit-tracer passes negative"
      " pre-activations and flaxlens's JumpReLU does not; the features would differ. Clip"
      " the thresholds at 0 in circuit-tracer (if the features allow) and save again."
    )
  return threshold


def _clt(directory: Directory, names: set[str], max_bytes: int, fix: str) -> Dictionary:
  """A `CrossLayerTranscoder` from circuit-tracer's `W_enc_{i}`/`W_dec_{i}` files."""
  layers = _numbered(names, "W_enc_", directory.path, fix)
  encoders, decoders = [], []
  for i in range(layers):
    encoder = read_safetensors(directory, f"W_enc_{i}.safetensors", max_bytes, fix)
    decoder = read_safetensors(directory, f"W_dec_{i}.safetensors", max_bytes, fix)
    for tensors, file, want in (
      (encoder, f"W_enc_{i}", {f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}", f"threshold_{i}"}),
      (decoder, f"W_dec_{i}", {f"W_dec_{i}"}),
    ):
      if not set(tensors) <= want or f"{file}" not in tensors:
        raise ArtifactError(
          f"{directory.path}: {file}.safetensors holds {sorted(tensors)}; circuit-tracer"
          f" writes {sorted(want)}. {fix}"
        )
    encoders.append(encoder)
    decoders.append(decoder[f"W_dec_{i}"])
  where = f"{directory.path}: W_enc_0.safetensors"
  width, d_in = _shape(encoders[0], "W_enc_0", 2, where, fix)
  d_out = _shape({"W_dec_0": decoders[0]}, "W_dec_0", 3, where, fix)[2]
  jump = "threshold_0" in encoders[0]

  def stacked(stem: str) -> np.ndarray:
    parts = [e.get(f"{stem}_{i}") for i, e in enumerate(encoders)]
    missing = [i for i, part in enumerate(parts) if part is None]
    shapes = {part.shape for part in parts if part is not None}
    if missing or len(shapes) != 1:
      raise ArtifactError(
        f"{directory.path}: the files W_enc_{{i}}.safetensors disagree on {stem}_{{i}}"
        f" (missing in {missing}, shapes {sorted(shapes)}). {fix}"
      )
    return np.stack(parts)

  arrays = {
    "W_enc": np.swapaxes(stacked("W_enc"), -1, -2),
    "b_enc": stacked("b_enc"),
    "b_dec": stacked("b_dec"),
    **{f"W_dec.{i}": decoder for i, decoder in enumerate(decoders)},
  }
  if jump:
    arrays["activation.threshold"] = _threshold(stacked("threshold"), where)
  dtype = arrays["W_enc"].dtype.name
  activation = "jumprelu" if jump else "relu"
  try:
    config = DictionaryConfig("clt", d_in, d_out, width, activation, layers=layers, dtype=dtype)
  except ArgumentError as error:
    raise ArtifactError(f"{directory.path} describes no valid CLT: {error} {fix}") from None
  labels = {f"W_dec.{i}": f"W_dec_{i}" for i in range(layers)}
  return assemble(config, arrays, str(directory.path), fix, labels)
