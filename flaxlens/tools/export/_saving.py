"""Saving an exported model with Orbax or to safetensors, and restoring it into a template.

What `export()` returns (a Linen variables dict, an NNX module) is saved as its arrays,
one per variable, named by its path (`"params/Dense_0/kernel"`, `"linear/kernel"`). The
static part (the module, boxes such as `nn.LogicallyPartitioned`, NNX variable types
and metadata, the shardings) is not saved: restoring takes a template of the same
kind, the model as built by its own code (concrete, or abstract from `jax.eval_shape` /
`nnx.eval_shape`), and returns a new one with the saved arrays in the template's
structure and placed with the template's shardings. Orbax (`orbax-checkpoint`) writes
a directory and restores each array straight onto its devices; safetensors writes one
file readable from PyTorch and Hugging Face tools. Both are the optional `export`
extra. No Flax internals here.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import stat
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from flaxlens.core._adapter import adapter_for_exported
from flaxlens.core._checks import check_path, refuse
from flaxlens.core._names import join_name
from flaxlens.core._node import CallNode
from flaxlens.errors import ExportError

FORMATS = ("orbax", "safetensors")
# The files every Orbax checkpoint save_exported writes holds (Orbax's own layout).
_ORBAX_FILES = ("_METADATA", "manifest.ocdbt")
# The safetensors metadata entry holding the SHA-256 of the saved arrays (`_digest`).
_CHECKSUM = "flaxlens_sha256"
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
# The dtypes the safetensors library writes and reads back into NumPy exactly. It writes
# float8 too but cannot read it into NumPy (safetensors 0.8), and knows no int4/uint4.
_SAFETENSORS_DTYPES = frozenset(
  ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
  + ["float16", "bfloat16", "float32", "float64", "complex64"]
)


def save_exported(exported: Any, path: str | os.PathLike, *, format: str = "orbax") -> None:
  """Saves an exported model's arrays, with Orbax (a directory) or to a safetensors file.

  Args:
    exported: what `tree.export()` returns: a Linen variables dict or an NNX module
      (any such dict or module works, exported or not).
    path: the directory (Orbax) or file (safetensors) to write; it must not exist.
      Missing parent folders are made.
    format: `"orbax"` or `"safetensors"`. Orbax saves every dtype JAX has, but no
      model without arrays and no array of size zero; safetensors saves those, but not
      float8 or int4/uint4 arrays.

  Raises:
    ArgumentError: `exported` is not an exported model, `path` not a path, or `format`
      not one of the two.
    ExportError: for an existing path, a value that is not an array, an array the
      format cannot save (the message names it and the format that can), a path that
      cannot be written, or a missing `orbax-checkpoint`/`safetensors` package.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp, tempfile
    >>> from flax import nnx
    >>> tree = fl.unflaxify(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 3)))
    >>> tree.scope_data.parameters["bias"].value += 1.0
    >>> path = tempfile.mkdtemp() + "/linear.safetensors"
    >>> fl.save_exported(tree.export(), path, format="safetensors")
    >>> fl.load_exported(path, like=nnx.Linear(3, 2, rngs=nnx.Rngs(0))).bias[...]
    Array([1., 1.], dtype=float32)
  """
  where = "fl.save_exported"
  state = _state_of(exported, where, "exported")
  path = check_path(path, where, "Pass the directory (Orbax) or file (safetensors) to write.")
  if format not in FORMATS:
    raise refuse(where, "format", format, f"one of {list(FORMATS)}", "Pass format='orbax'.")
  if os.path.lexists(path):
    raise ExportError(f"{path}: already exists; save_exported never overwrites. Remove it first.")
  leaves, _ = _named_leaves(state, "save_exported")
  arrays = {name: _storable(leaf) for name, leaf in leaves.items()}
  if format == "orbax":
    _check_orbax_arrays(path, arrays)
  else:
    _check_safetensors_arrays(path, arrays)
  try:  # Orbax would make them too, but it reports failures from a background thread.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  except OSError as e:
    raise _unwritable(path, e) from e
  if format == "orbax":
    _save_orbax(path, arrays)
  else:
    _save_safetensors(path, arrays)


def _unwritable(path: str, error: Exception) -> ExportError:
  return ExportError(
    f"fl.save_exported({path!r}): cannot write there ({' '.join(str(error).split())[:300]})."
    " Give a path in a folder you can write to."
  )


def _check_orbax_arrays(path: str, arrays: Mapping[str, Any]) -> None:
  """Refuses what Orbax cannot save: no arrays at all, or an array of size zero."""
  if not arrays:
    raise ExportError(
      f"fl.save_exported({path!r}): the model holds no arrays (no parameters or state),"
      " and an Orbax checkpoint cannot be empty. Save it with format='safetensors', which"
      " writes a file of no arrays that load_exported restores, or skip saving it."
    )
  for name, array in arrays.items():
    if 0 in array.shape:
      raise ExportError(
        f"fl.save_exported({path!r}): {name!r} is {_described(array)}, an array of size"
        " zero, which Orbax cannot save. Save the model with format='safetensors', which"
        " saves it."
      )


def _save_orbax(path: str, arrays: Mapping[str, Any]) -> None:
  """Writes the checkpoint; on failure, removes the temporary folder Orbax leaves."""
  ocp = _orbax("save_exported")
  where = os.path.abspath(path)
  leftovers = f"{glob.escape(where)}.orbax-checkpoint-tmp*"
  before = set(glob.glob(leftovers))
  try:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(where, dict(arrays))
    checkpointer.wait_until_finished()
  except Exception as e:
    for folder in set(glob.glob(leftovers)) - before:
      shutil.rmtree(folder, ignore_errors=True)
    raise _unwritable(path, e) from e


def _check_safetensors_arrays(path: str, arrays: Mapping[str, Any]) -> None:
  """Refuses the dtypes safetensors cannot save and read back exactly."""
  for name, array in arrays.items():
    if np.dtype(array.dtype).name not in _SAFETENSORS_DTYPES:
      raise ExportError(
        f"fl.save_exported({path!r}): {name!r} is {_described(array)}, and safetensors"
        f" cannot store {array.dtype.name} so that it reads back exactly (it stores"
        f" {sorted(_SAFETENSORS_DTYPES)}). Save the model with format='orbax', which"
        " restores it exactly."
      )


def _save_safetensors(path: str, arrays: Mapping[str, Any]) -> None:
  _safetensors("save_exported")
  from safetensors import SafetensorError
  from safetensors.numpy import save_file

  tensors = {n: np.asarray(a) for n, a in arrays.items()}
  try:
    save_file(tensors, path, metadata={"by": "flaxlens", _CHECKSUM: _digest(tensors)})
  except (OSError, SafetensorError) as e:
    raise _unwritable(path, e) from e


def _described(array: Any) -> str:
  """`float32[0, 4]`, as messages write an array."""
  return f"{np.dtype(array.dtype).name}{list(array.shape)}"


def load_exported(path: str | os.PathLike, like: Any) -> Any:
  """Restores what `save_exported` wrote into a new model shaped as `like`.

  The format is read from what `path` is: a directory was written by Orbax, a file is
  safetensors. `like` gives everything but the arrays: for Linen a variables dict (from
  `module.init`, or abstract from `jax.eval_shape(module.init, ...)`), whose boxes
  (`nn.Partitioned`, ...) the result keeps; for NNX a module (or `nnx.eval_shape(lambda:
  Model(...))`), whose variable types and metadata the result keeps. Each array is
  placed with the sharding of `like`'s leaf when it has one (Orbax reads each shard
  straight onto its device). `like` is not modified.

  Raises:
    ArgumentError: `path` is not a path, or `like` not a Linen variables dict or an NNX
      module.
    ExportError: if the saved arrays do not match `like`'s variables (names, shapes
      or dtypes), or `path` is not a complete, readable saved exported model (a
      damaged or truncated checkpoint, a directory or file of another kind).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp, tempfile
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> path = tempfile.mkdtemp() + "/dense"
    >>> fl.save_exported(fl.unflaxify(model, variables, x).export(), path)
    >>> restored = fl.load_exported(path, like=jax.eval_shape(model.init, jax.random.key(0), x))
    >>> bool((model.apply(restored, x) == model.apply(variables, x)).all())
    True
  """
  where = "fl.load_exported"
  path = check_path(path, where, "Pass the directory or file fl.save_exported wrote.")
  state = _state_of(like, where, "like")
  template, treedef = _named_leaves(state, "load_exported")
  if os.path.isdir(path):
    loaded = _load_orbax(path, template)
  elif os.path.isfile(path):
    loaded = _load_safetensors(path)
  elif os.path.lexists(path):
    raise ExportError(
      f"{path}: {_kind(path)}, not a regular file or a directory. Pass the file or"
      " directory fl.save_exported wrote."
    )
  else:
    raise ExportError(f"{path}: no such file or directory. Pass what save_exported wrote.")
  missing = sorted(set(template) - set(loaded))
  extra = sorted(set(loaded) - set(template))
  if missing or extra:
    raise ExportError(
      f"{path}: the saved arrays do not match the variables of `like`: missing"
      f" {missing[:6]}, not in `like` {extra[:6]}. Pass a `like` built as the saved model"
      " was (same architecture and settings)."
    )
  leaves = [_restored(path, name, loaded[name], leaf) for name, leaf in template.items()]
  restored = jax.tree_util.tree_unflatten(treedef, leaves)
  return _with_state(like, restored)


def _kind(path: str) -> str:
  """What `path` is when it is neither a file nor a directory: a device, a FIFO, ..."""
  if not os.path.exists(path):
    return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
  mode = os.stat(path).st_mode
  kinds = {stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISSOCK: "a socket"}
  kinds.update({stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"})
  kind = next((said for test, said in kinds.items() if test(mode)), "a special file")
  return f"a symbolic link to {kind}" if os.path.islink(path) else kind


def _state_of(model: Any, where: str, name: str) -> Any:
  """The pytree of an exported model's variables (a Linen dict itself, an NNX state)."""
  adapter = adapter_for_exported(model)
  if adapter is None:
    raise refuse(
      where,
      name,
      model,
      "what tree.export() returns (a Linen variables dict or an NNX module)",
      "Export the tree first: tree.export()."
      if isinstance(model, CallNode)
      else "Pass a Linen variables dict (module.init) or an NNX module.",
    )
  return adapter.exported_variables(model)


def _with_state(like: Any, state: Any) -> Any:
  return adapter_for_exported(like).with_exported_variables(like, state)


def _named_leaves(state: Any, where: str) -> tuple[dict[str, Any], Any]:
  """`({name: leaf}, treedef)`; names join the path's keys and indices with "/"."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  named: dict[str, Any] = {}
  for path, leaf in flat:
    keys = [_key(k) for k in path]
    name = join_name(tuple(k for k in keys if k is not None))
    if name in named:
      raise ExportError(f"{where}: two variables are both named {name!r}; cannot save them.")
    named[name] = leaf
  return named, treedef


def _key(entry: Any) -> Any:
  """A path entry's name; None for an attribute (a box's or an NNX variable's value)."""
  if isinstance(entry, jax.tree_util.DictKey):
    return str(entry.key)
  if isinstance(entry, jax.tree_util.SequenceKey):
    return str(entry.idx)
  if isinstance(entry, jax.tree_util.FlattenedIndexKey):
    return str(entry.key)
  return None


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _storable(leaf: Any) -> Any:
  if _is_key(leaf):
    return jax.random.key_data(leaf)
  if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
    raise ExportError(
      f"save_exported: a variable holds a {type(leaf).__name__}, not an array; only"
      " arrays can be saved. Store it as an array (jnp.asarray)."
    )
  return leaf


def _load_orbax(path: str, template: dict[str, Any]) -> dict[str, Any]:
  """The arrays of the Orbax checkpoint `path`; any fault in it is an `ExportError`."""
  ocp = _orbax("load_exported")
  with ocp.StandardCheckpointer() as checkpointer:
    try:
      saved = checkpointer.metadata(os.path.abspath(path)).item_metadata
    except Exception as e:
      raise _unreadable(path, f"{type(e).__name__}: {e}") from e
    items = getattr(saved, "items", None)  # Orbax's TreeMetadata, a mapping by name.
    saved = dict(items()) if callable(items) else {}
    if not saved:
      raise _unreadable(path, "Orbax finds no saved arrays in it")
    target = {}
    for name, meta in saved.items():
      shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
      if not isinstance(name, str) or not isinstance(shape, tuple) or dtype is None:
        raise _unreadable(path, f"its entry {name!r} is not an array saved by fl.save_exported")
      leaf = template.get(name)
      sharding = getattr(leaf, "sharding", None)
      if leaf is None or _is_key(leaf) or shape != leaf.shape or dtype != leaf.dtype:
        sharding = None  # Restored as saved; checked against `like` afterwards.
      target[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    try:
      return dict(checkpointer.restore(os.path.abspath(path), target))
    except Exception as e:
      raise _unreadable(path, f"reading its arrays failed: {type(e).__name__}: {e}") from e


def _unreadable(path: str, why: str) -> ExportError:
  """The refusal of a directory that is not a complete checkpoint `save_exported` wrote."""
  try:
    held = sorted(os.listdir(path))
  except OSError:
    held = []
  lacking = [name for name in _ORBAX_FILES if name not in held]
  found = f"; it holds {held[:8]}" if held else "; it is empty"
  if held and lacking:
    found += f" and lacks {lacking}"
  said = " ".join(why.split())
  return ExportError(
    f"{path}: not a complete Orbax checkpoint written by fl.save_exported"
    f" ({said[:300]}{found}). Pass the directory fl.save_exported wrote (it holds"
    f" {list(_ORBAX_FILES)}); if it was damaged, truncated or copied in part, save the"
    " model again with fl.save_exported(tree.export(), path)."
  )


def _load_safetensors(path: str) -> dict[str, Any]:
  """The arrays of the safetensors file `path`, checked against the checksum flaxlens
  saves in its metadata (files written by other tools have none)."""
  _safetensors("load_exported")
  from safetensors import SafetensorError, safe_open

  try:
    with safe_open(path, framework="numpy") as f:
      metadata = f.metadata() or {}
      arrays = {name: f.get_tensor(name) for name in f.keys()}
  # AttributeError: an array of a dtype NumPy lacks (float8), in a file of another tool.
  except (SafetensorError, OSError, ValueError, TypeError, KeyError, AttributeError) as e:
    raise ExportError(
      f"{path}: not a readable safetensors file ({' '.join(str(e).split())[:300]}). Pass"
      " the file fl.save_exported(..., format='safetensors') wrote; if it was damaged or"
      " truncated, save the model again."
    ) from e
  expected = metadata.get(_CHECKSUM)
  if expected is not None and expected != _digest(arrays):
    raise ExportError(
      f"{path}: its arrays do not match the checksum fl.save_exported recorded; the file"
      " is damaged. Save the model again with fl.save_exported(tree.export(), path,"
      " format='safetensors')."
    )
  return arrays


def _digest(arrays: Mapping[str, np.ndarray]) -> str:
  """SHA-256 over every array's name, dtype, shape and bytes, in name order."""
  digest = hashlib.sha256()
  for name in sorted(arrays):
    a = np.ascontiguousarray(arrays[name])
    digest.update(f"{name} {a.dtype.name} {list(a.shape)}\n".encode())
    digest.update(a.tobytes())
  return digest.hexdigest()


def _restored(path: str, name: str, array: Any, like: Any) -> Any:
  """`array` as the variable `like` holds it: a PRNG key if `like` is one, on its devices."""
  want_shape, want_dtype = like.shape, like.dtype
  if _is_key(like):
    impl = _key_impl(like.dtype)
    try:
      array = jax.random.wrap_key_data(np.asarray(array), impl=impl)
    except (TypeError, ValueError) as e:
      raise ExportError(
        f"{path}: {name!r} holds {array.dtype}{list(array.shape)}, which is not the data of"
        f" {impl} PRNG keys of shape {list(want_shape)} as `like` holds ({e}). Pass a `like`"
        " built as the saved model was."
      ) from e
  if array.shape != want_shape or array.dtype != want_dtype:
    raise ExportError(
      f"{path}: {name!r} was saved as {array.dtype}{list(array.shape)} but `like` holds"
      f" {want_dtype}{list(want_shape)}. Pass a `like` built as the saved model was."
    )
  sharding = getattr(like, "sharding", None)
  if sharding is not None and getattr(array, "sharding", None) != sharding:
    return jax.device_put(array, sharding)
  return array if isinstance(array, jax.Array) else jax.numpy.asarray(array)


def _key_impl(dtype: Any) -> str:
  for impl in _KEY_IMPLS:
    if jax.random.key(0, impl=impl).dtype == dtype:
      return impl
  raise ExportError(f"load_exported: PRNG keys of type {dtype} cannot be restored.")


def _orbax(where: str) -> Any:
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ExportError(
      f"{where}: format 'orbax' needs orbax-checkpoint: pip install 'flaxlens[export]'."
    ) from e
  return ocp


def _safetensors(where: str) -> None:
  try:
    import safetensors  # noqa: F401
  except ImportError as e:
    raise ExportError(
      f"{where}: format 'safetensors' needs safetensors: pip install 'flaxlens[export]'."
    ) from e
