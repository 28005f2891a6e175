"""`fl.harvest`: stream captured activations over a dataset into a resumable on-disk store.

Each batch runs through one compiled program (`fl.variable_jit` of `fl.run`'s capture
plus the selection of rows: the positions rule, the cast to the stored dtype, the
example and position of each row), so only the selected rows leave the device, shard by
shard. The writes of a batch go to TensorStore as futures while the next batch's forward
runs; a batch counts as committed (`progress.json`, replaced atomically) only once its
writes have completed, and a run of the same call resumes after the committed batches.
No Flax internals here.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from importlib import metadata as package_metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._checks import check_path
from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.core._selectors import path_matches
from flaxlens.core._variables import Uninitialized, variables_in
from flaxlens.errors import ArgumentError, HarvestError
from flaxlens.tools.analysis._calling import model_arguments
from flaxlens.tools.analysis._interventions import nodes_by_name, run, select_sites
from flaxlens.tools.harvest import _store
from flaxlens.tools.harvest._store import Harvest

IN_FLIGHT = 2  # Batches whose writes may be pending at once (host memory: this many batches).
_RULES = ("all", "last", None)
_SETTINGS = ("model", "sites", "ids", "inputs", "first_batch", "random_streams")

# --- the plan: what each site keeps ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SitePlan:
  name: str
  rule: Any  # "all", "last", None, or a function of the batch giving a (batch, positions) mask
  dtype: Any  # the stored dtype, or None to keep the captured one


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What the compiled step does; static (hashable) so one program serves every batch of a
  shape."""

  capture: Any
  sites: tuple[_SitePlan, ...]
  ids: Callable[[Any], Any] | None


def _per_site(value: Any, names: list[str], what: str, check: Callable[[Any], Any]) -> list[Any]:
  """`value` for each site name: one value for all, or `{pattern: value}` (first match)."""
  if not isinstance(value, dict):
    return [check(value)] * len(names)
  chosen = []
  for name in names:
    key = next((k for k in value if k == name or path_matches(str(k), name)), _MISSING)
    if key is _MISSING:
      raise ArgumentError(
        f"fl.harvest: {what}= gives no value for the site {name!r} (its keys:"
        f" {list(value)}). Add a key matching it, or '**' for every other site."
      )
    chosen.append(check(value[key]))
  return chosen


_MISSING = object()


def _check_rule(rule: Any) -> Any:
  if callable(rule) or (isinstance(rule, str | type(None)) and rule in _RULES):
    return rule
  raise ArgumentError(
    f"fl.harvest: positions= is 'all', 'last', None (no position axis) or a function of"
    f" the batch giving a boolean (batch, positions) mask, got {rule!r}. Give one of these,"
    " or a dict of them by site."
  )


def _check_dtype(dtype: Any) -> Any:
  if dtype is None:
    return None
  try:
    return np.dtype(jnp.dtype(dtype))
  except TypeError as error:
    raise ArgumentError(
      f"fl.harvest: dtype={dtype!r} is no dtype. Give one (jnp.bfloat16, 'float32') or"
      " None to store what the site computes."
    ) from error


def _plan(tree: CallNode, at: Any, positions: Any, dtype: Any, ids: Any) -> _Plan:
  if isinstance(at, list):
    at = tuple(at)
  names = [site.name for site in select_sites(tree, at)]
  _, capture = nodes_by_name(tree, (), at)
  rules = _per_site(positions, names, "positions", _check_rule)
  dtypes = _per_site(dtype, names, "dtype", _check_dtype)
  if ids is not None and not callable(ids):
    raise ArgumentError(
      f"fl.harvest: ids= must be a function of the batch giving an integer array of shape"
      f" (batch,) or (batch, positions), got {type(ids).__name__}. For token ids:"
      " ids=lambda tokens: tokens."
    )
  sites = tuple(_SitePlan(n, r, d) for n, r, d in zip(names, rules, dtypes, strict=True))
  return _Plan(capture, sites, ids)


# --- the compiled step: capture and select rows -------------------------------------------------


def _rows(tree: CallNode, batch: Any, plan: _Plan, random_streams: Any) -> dict[str, Any]:
  """For each site: its selected rows (`values`), each row's `(example, position)` within
  the batch (`index`), `ids`, and `count` (the rows a mask selects); `sizes` is the
  batch's (examples, positions)."""
  _, captured = run(
    tree, model_arguments(batch), capture=plan.capture, jit=False, random_streams=random_streams
  )
  ids = None if plan.ids is None else jnp.asarray(plan.ids(batch))
  masks: dict[int, Any] = {}
  found: dict[str, Any] = {}
  sizes = None
  for site in plan.sites:
    value = captured[site.name]
    if not isinstance(value, jax.Array) or value.ndim < (1 if site.rule is None else 2):
      shape = f"shape {tuple(value.shape)}" if isinstance(value, jax.Array) else "no array"
      raise ArgumentError(
        f"{site.name}: fl.harvest stores a site's output as rows, and this output has {shape}"
        f" ({type(value).__name__}). Give a site whose output is one array of shape (batch,"
        " positions, ...) (or (batch, ...) with positions=None)."
      )
    size = value.shape[:1] if site.rule is None else value.shape[:2]
    if sizes is None or len(size) > len(sizes):
      if sizes is not None and size[0] != sizes[0]:
        raise _unbatched(plan, captured)
      sizes = size
    elif size[0] != sizes[0]:
      raise _unbatched(plan, captured)
    found[site.name] = _select(site, value, batch, ids, masks)
  found["sizes"] = jnp.asarray([sizes[0], sizes[1] if len(sizes) > 1 else 1], jnp.int32)
  return found


def _unbatched(plan: _Plan, captured: dict[str, Any]) -> ArgumentError:
  shapes = {s.name: tuple(captured[s.name].shape) for s in plan.sites}
  return ArgumentError(
    f"fl.harvest: the sites' outputs {shapes} do not share a leading batch axis. Harvest"
    " sites whose outputs have the batch first (one harvest per batch layout)."
  )


def _select(site: _SitePlan, value: Any, batch: Any, ids: Any, masks: dict[int, Any]) -> Any:
  examples = value.shape[0]
  if site.rule is None:
    index = jnp.stack([jnp.arange(examples), jnp.full(examples, -1)], 1)
    row_ids = _ids_of(site, ids, examples, None)
    out = {"values": value, "index": index, "ids": row_ids}
  else:
    length = value.shape[1]
    positions = jnp.broadcast_to(jnp.arange(length), (examples, length))
    example = jnp.broadcast_to(jnp.arange(examples)[:, None], (examples, length))
    row_ids = _ids_of(site, ids, examples, length)
    if site.rule == "last":
      out = {
        "values": value[:, -1],
        "index": jnp.stack([example[:, -1], positions[:, -1]], 1),
        "ids": None if row_ids is None else row_ids[:, -1],
      }
    else:
      rows = examples * length
      flat = {
        "values": value.reshape(rows, *value.shape[2:]),
        "index": jnp.stack([example.reshape(rows), positions.reshape(rows)], 1),
        "ids": None if row_ids is None else row_ids.reshape(rows),
      }
      if site.rule == "all":
        out = flat
      else:
        mask = masks.get(id(site.rule))
        if mask is None:
          mask = masks[id(site.rule)] = jnp.asarray(site.rule(batch))
        if mask.shape != (examples, length) or mask.dtype != jnp.bool_:
          raise ArgumentError(
            f"{site.name}: positions= gave a {mask.dtype}{list(mask.shape)} mask, where the"
            f" site's output has {examples} examples of {length} positions. Give a function"
            f" returning a boolean mask of shape ({examples}, {length})."
          )
        keep = mask.reshape(rows)
        order = jnp.argsort(~keep, stable=True)  # Selected rows first, in stream order.
        out = {k: None if v is None else v[order] for k, v in flat.items()}
        out["count"] = keep.sum(dtype=jnp.int32)
  if site.dtype is not None:
    out["values"] = out["values"].astype(site.dtype)
  return {k: v for k, v in out.items() if v is not None}


def _ids_of(site: _SitePlan, ids: Any, examples: int, length: int | None) -> Any:
  if ids is None:
    return None
  if ids.shape == (examples,) and length is not None:
    return jnp.broadcast_to(ids[:, None], (examples, length))
  if ids.shape == ((examples,) if length is None else (examples, length)):
    return ids
  wanted = f"({examples},)" if length is None else f"({examples},) or ({examples}, {length})"
  raise ArgumentError(
    f"{site.name}: ids= gave an array of shape {tuple(ids.shape)}, where the site's rows"
    f" take ids of shape {wanted}. Give one id per example or per position."
  )


_step = variable_jit(_rows)


def _traced_leaf(leaf: Any) -> bool:
  return isinstance(leaf, jax.Array | np.ndarray | np.generic) or hasattr(leaf, "__array__")


def _as_arrays(batch: Any) -> Any:
  """The batch with array-likes (a tf.data tensor, a list of numbers stays) as arrays."""
  return jax.tree_util.tree_map(
    lambda leaf: (
      leaf
      if isinstance(leaf, jax.Array | np.ndarray) or not _traced_leaf(leaf)
      else np.asarray(leaf)
    ),
    batch,
  )


def _shapes(tree: CallNode, batch: Any, plan: _Plan, random_streams: Any) -> dict[str, Any]:
  """The step's output shapes for `batch`, traced abstractly (nothing computed)."""
  leaves, treedef = jax.tree_util.tree_flatten(batch)
  arrays = [i for i, leaf in enumerate(leaves) if _traced_leaf(leaf)]

  def rows(values: list[Any]) -> Any:
    filled = list(leaves)
    for i, value in zip(arrays, values, strict=True):
      filled[i] = value
    return _rows(tree, jax.tree_util.tree_unflatten(treedef, filled), plan, random_streams)

  return jax.eval_shape(rows, [leaves[i] for i in arrays])


# --- metadata and fingerprints --------------------------------------------------------------


@jax.jit
def _checksums(leaves: list[Any]) -> Any:
  """Two 32-bit sums per array of its bits (plain and position-weighted), on device."""
  sums = []
  for leaf in leaves:
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    if leaf.dtype == jnp.bool_ or leaf.dtype.itemsize == 1:
      bits = leaf.astype(jnp.uint32)
    else:
      unsigned = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
      bits = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)
    bits = bits.reshape(-1)
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) % 65521) + 1
    sums.append(jnp.stack([bits.sum(dtype=jnp.uint32), (bits * weights).sum(dtype=jnp.uint32)]))
  return jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)


def _fingerprint(named: list[tuple[str, Any]]) -> str:
  """A checksum of named arrays: their names, shapes, dtypes and bits (not cryptographic)."""
  arrays = [jnp.asarray(value) for _, value in named]
  sums = np.asarray(_checksums(arrays)) if arrays else np.zeros((0, 2), np.uint32)
  digest = hashlib.sha256()
  for (name, _), array, pair in zip(named, arrays, sums, strict=True):
    digest.update(f"{name}|{array.dtype}|{tuple(array.shape)}|{pair.tolist()};".encode())
  return digest.hexdigest()[:32]


def _function_id(fn: Any) -> str:
  """A function by its qualified name and the hash of its code (not of the values it closes
  over, nor its module's name, which differs between a script and its import)."""
  code = getattr(fn, "__code__", None)
  name = getattr(fn, "__qualname__", type(fn).__name__)
  if code is None:
    return name
  text = f"{code.co_code.hex()}|{code.co_consts!r}|{code.co_names!r}"
  return f"{name}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _rule_text(rule: Any) -> Any:
  return f"mask {_function_id(rule)}" if callable(rule) else rule


def _metadata(
  tree: CallNode, batch: Any, plan: _Plan, shapes: dict[str, Any], random_streams: Any
) -> dict[str, Any]:
  variables = [
    (v.label or str(i), v.value)
    for i, v in enumerate(variables_in(tree))
    if not isinstance(v.value, Uninitialized)
  ]
  leaves, treedef = jax.tree_util.tree_flatten(batch)
  arrays = [leaf for leaf in leaves if _traced_leaf(leaf)]
  sites = []
  for k, site in enumerate(plan.sites):
    found = shapes[site.name]
    values = found["values"]
    dtype = np.dtype(values.dtype)
    sites.append(
      {
        "name": site.name,
        "group": f"s{k}",
        "positions": _rule_text(site.rule),
        "dtype": dtype.name,
        "features": list(values.shape[1:]),
        "chunk": _store.chunk_rows(values.shape[1:], dtype.itemsize),
        "ids": np.dtype(found["ids"].dtype).name if "ids" in found else None,
      }
    )
  streams = jax.tree_util.tree_leaves(random_streams)
  found = {
    "format": _store.FORMAT,
    "flaxlens": package_metadata.version("flaxlens"),
    "model": {
      "call": tree.where(),
      "class": tree.module_type.__qualname__,
      "variables": len(variables),
      "fingerprint": _fingerprint(variables),
    },
    "sites": sites,
    "ids": None if plan.ids is None else _function_id(plan.ids),
    "inputs": {
      "structure": str(treedef),
      "arrays": [[np.dtype(np.asarray(a).dtype).name, np.ndim(a)] for a in arrays],
    },
    "first_batch": _fingerprint([(str(i), a) for i, a in enumerate(arrays)]),
    "random_streams": _fingerprint([(str(i), s) for i, s in enumerate(streams)])
    if streams
    else None,
  }
  settings = json.dumps({key: found[key] for key in _SETTINGS}, sort_keys=True)
  found["fingerprint"] = hashlib.sha256(settings.encode()).hexdigest()[:32]
  return found


def _differences(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
  if there.get("format") != here["format"]:
    return [f"format: {there.get('format')!r} there, {here['format']!r} now"]
  return [
    f"{key}: {json.dumps(there.get(key))} there, {json.dumps(here[key])} now"
    for key in _SETTINGS
    if there.get(key) != here[key]
  ]


# --- the store on disk ------------------------------------------------------------------------


def _prepare(path: str, metadata: dict[str, Any], overwrite: bool) -> dict[str, Any]:
  """Creates the store, or checks the one at `path` was made by this call; its progress."""
  if os.path.lexists(path) and not os.path.isdir(path):
    raise HarvestError(
      f"fl.harvest: {path} exists and is not a directory. Give a new path or a harvest"
      " store's directory."
    )
  existing = _store.read_metadata(path) if os.path.isdir(path) else None
  if existing is None and os.path.isdir(path) and os.listdir(path):
    raise HarvestError(
      f"fl.harvest: {path} is a directory holding other files, not a harvest store; nothing"
      " was written. Give a new path or an empty directory."
    )
  if existing is not None:
    differences = _differences(existing, metadata)
    if not differences:
      _check_writable(path)
      return _store.read_progress(path)
    if not overwrite:
      raise HarvestError(
        f"fl.harvest: the store at {path} was made by another call; nothing was"
        f" overwritten. What differs: {'; '.join(differences)}. Give another path, run the"
        " call that made it to resume, or pass overwrite=True to start it afresh."
      )
    _check_writable(path)
    shutil.rmtree(path)
  try:
    _store.create(path, metadata)
  except (OSError, ValueError) as error:
    raise HarvestError(
      f"fl.harvest: cannot write the store at {path}: {error}. Give a directory you can write to."
    ) from error
  return _store.read_progress(path)


def _check_writable(path: str) -> None:
  probe = os.path.join(path, ".write-check")
  try:
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as error:
    raise HarvestError(
      f"fl.harvest: cannot write to the store at {path}: {error}. Give a directory you can"
      " write to."
    ) from error


# --- moving rows off the device ------------------------------------------------------------------


def _bucket(count: int, size: int) -> int:
  """The smallest power of two at least `count`, at most `size`: one slice per bucket."""
  return min(size, 1 << max(0, count - 1).bit_length()) if count else 0


def _pieces(array: Any, count: int) -> list[tuple[tuple[slice, ...], np.ndarray]]:
  """`(region, host values)` of the first `count` rows of `array`, one per distinct
  addressable shard (a batch sharded over devices is copied shard by shard, never
  gathered)."""
  if not isinstance(array, jax.Array) or len(array.sharding.device_set) == 1:
    return [((slice(0, count),), np.asarray(array)[:count])] if count else []
  pieces, seen = [], set()
  for shard in array.addressable_shards:
    region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(shard.index, array.shape, strict=True))
    key = tuple((s.start, s.stop) for s in region)
    if key in seen or region[0].start >= count:
      continue
    seen.add(key)
    keep = min(region[0].stop, count) - region[0].start
    data = np.asarray(shard.data)[:keep]
    pieces.append(((slice(region[0].start, region[0].start + keep), *region[1:]), data))
  return pieces


class _Written:
  """The pending writes of one batch, and what the store holds once they complete."""

  def __init__(self, futures: list[Any], progress: dict[str, Any], held: list[Any]):
    self.futures = futures
    self.progress = progress
    self.held = held  # host arrays a write reads from, kept until it completes

  def done(self) -> bool:
    return all(future.commit.done() for future in self.futures)

  def wait(self) -> None:
    for future in self.futures:
      future.commit.result()  # written to the files, not only copied out of `held`


def _write(
  arrays: dict[str, dict[str, Any]],
  out: dict[str, Any],
  plan: _Plan,
  example: int,
  rows: dict[str, int],
) -> tuple[list[Any], list[Any], dict[str, int], int]:
  """Issues the writes of one batch at rows `rows` (by site), its first example being
  `example`; returns the futures, the host arrays, the rows written and the bytes."""
  counts = {s.name: int(out[s.name]["count"]) for s in plan.sites if "count" in out[s.name]}
  futures, held, written, size = [], [], {}, 0
  for site in plan.sites:
    found, target, start = out[site.name], arrays[site.name], rows[site.name]
    total = found["values"].shape[0]
    count = counts.get(site.name, total)
    for name in ("values", "index", "ids"):
      if name not in found:
        continue
      array = found[name]
      if site.name in counts:
        array = array[: _bucket(count, total)]  # only the selected rows leave the device
      for region, data in _pieces(array, count):
        if name == "index":
          data = data.astype(np.int64) + np.asarray([example, 0], np.int64)
        first = slice(start + region[0].start, start + region[0].stop)
        futures.append(target[name][(first, *region[1:])].write(data))
        held.append(data)
        size += data.nbytes
    written[site.name] = count
  return futures, held, written, size


# --- progress display -------------------------------------------------------------------------


class _Display:
  """A rich progress bar (batches, examples, tokens/s, bytes written) or nothing."""

  def __init__(self, show: bool, total: int | None, committed: int):
    self._progress = None
    self._start = time.perf_counter()
    self._tokens = 0
    if not show:
      return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    self._progress = Progress(
      TextColumn("harvest"),
      BarColumn(),
      TextColumn("{task.completed}/{task.total} batches" if total else "{task.completed} batches"),
      TextColumn("{task.fields[examples]} examples"),
      TextColumn("{task.fields[rate]} tok/s"),
      TextColumn("{task.fields[size]}"),
      TimeElapsedColumn(),
      console=Console(file=sys.stderr),
    )
    self._task = self._progress.add_task(
      "harvest", total=total, completed=committed, examples=0, rate="-", size="0 B"
    )
    self._progress.start()

  def update(self, batches: int, examples: int, tokens: int, size: int) -> None:
    if self._progress is None:
      return
    self._tokens += tokens
    rate = self._tokens / max(time.perf_counter() - self._start, 1e-9)
    self._progress.update(
      self._task, completed=batches, examples=examples, rate=f"{rate:,.0f}", size=_bytes(size)
    )

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()


def _bytes(size: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if size < 1024 or unit == "GiB":
      return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
    size /= 1024
  return f"{size:.1f} TiB"


# --- fl.harvest ---------------------------------------------------------------------------------


def harvest(
  tree: CallNode,
  batches: Iterable[Any],
  at: Any,
  path: Any,
  /,
  *,
  positions: Any = "all",
  dtype: Any = None,
  ids: Callable[[Any], Any] | None = None,
  random_streams: Any = None,
  progress: bool | None = None,
  overwrite: bool = False,
) -> Harvest:
  """Streams the activations of `at` over `batches` into a store at `path`.

  Each batch (the model's arguments as one value, as `fl.run` takes them: an array, a
  tuple, or `fl.ArgsAndKwargs`) runs through one compiled program per input shape,
  which captures the sites, keeps the rows `positions` selects, casts them to `dtype`
  and records each row's example (its place in the stream) and position; only those
  rows leave the device. Each site's rows go to one zarr v3 array, `(rows, *features)`,
  written by TensorStore while the next batch's forward runs; at most two batches'
  writes are pending, so memory does not grow with the dataset. A batch is committed
  once its writes have completed; running the same call again after an interruption
  skips the committed batches of `batches` and continues, with no row missing or
  repeated. The store is `complete` only once `batches` is exhausted and every write is
  done. See docs/harvest.md for the layout and the reasons behind it.

  Args:
    tree: a converted tree (`fl.unflaxify`).
    batches: an iterable of batches (a list, a generator, a Grain or tf.data iterator);
      each is the model's arguments as one value. Every batch's sites must give the
      same feature shapes; batch size and sequence length may vary (each new input
      shape compiles once).
    at: the sites, as `fl.capture` takes them; each site's output must be one array
      with the batch as its first axis.
    path: the store's directory (created; an existing store of the same call resumes).
    positions: which rows of a `(batch, positions, ...)` output to keep: `"all"` (every
      position, rows in example-then-position order), `"last"` (the last position),
      None (one row per example: the whole output but its first axis), or a function of
      the batch giving a boolean `(batch, positions)` mask (for example
      `lambda tokens: tokens != PAD`). A dict `{site pattern: rule}` gives rules per site.
    dtype: the stored dtype (`jnp.bfloat16`), or None for what the site computes; a dict
      `{site pattern: dtype}` gives one per site. The cast happens on device.
    ids: a function of the batch giving one integer id per example `(batch,)` or per
      position `(batch, positions)` (token ids: `lambda tokens: tokens`), stored beside
      each row; None: none.
    random_streams: as for a tree call (Linen: `{"dropout": key}`), the same for every
      batch.
    progress: show a progress bar (batches, examples, tokens/s, bytes written) on
      stderr; None (default): only when stderr is a terminal.
    overwrite: where `path` holds a store made by another call, delete it and start
      afresh (otherwise that is refused).

  Returns:
    The `fl.Harvest` handle of the complete store.

  Raises:
    SelectionError: a site matches no call.
    ArgumentError: an option is of the wrong kind, or a site's output cannot be stored as
      rows (not one array, no batch axis, a mask of another shape).
    HarvestError: `path` cannot be written, holds another call's store (what differs is
      listed; nothing is overwritten) or something else, a batch gives other feature
      shapes or dtypes than the store holds, `batches` is empty, or TensorStore is not
      installed.

  Example:
    >>> import tempfile, flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((4, 5, 2))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> batches = [x, 2 * x, 3 * x]
    >>> stored = fl.harvest(tree, batches, "layers_0", tempfile.mkdtemp() + "/acts",
    ...                     positions="last", dtype=jnp.bfloat16)
    >>> stored["layers_0"].shape, stored["layers_0"].dtype, len(stored)
    ((12, 3), dtype(bfloat16), 12)
    >>> stored["layers_0"].index[5].tolist()  # example 5 (second batch), position 4
    [5, 4]
  """
  check_tree(tree, "fl.harvest")
  _store.tensorstore()
  path = os.path.abspath(
    check_path(path, "fl.harvest", "Pass the directory to write the store to.", "path")
  )
  if not isinstance(batches, Iterable) or isinstance(batches, str | bytes | jax.Array | np.ndarray):
    raise ArgumentError(
      f"fl.harvest: batches must be an iterable of batches (a list, a generator, a data"
      f" loader), got {type(batches).__name__}. Pass [x] for one batch."
    )
  if progress not in (None, True, False):
    raise ArgumentError(f"fl.harvest: progress= is True, False or None, got {progress!r}.")
  plan = _plan(tree, at, positions, dtype, ids)
  random_streams = resolve_random_streams(random_streams, tree.where())
  total = len(batches) if hasattr(batches, "__len__") else None
  stream = iter(batches)
  first = next(stream, _MISSING)
  if first is _MISSING:
    raise HarvestError(
      f"fl.harvest: batches gave no batch, so there is nothing to harvest into {path}."
      " Pass at least one batch."
    )
  first = _as_arrays(first)
  shapes = _shapes(tree, first, plan, random_streams)
  metadata = _metadata(tree, first, plan, shapes, random_streams)
  state = _prepare(path, metadata, overwrite)
  if state["complete"]:
    return _store.open_harvest(path)
  show = sys.stderr.isatty() if progress is None else progress
  display = _Display(show, total, state["batches"])
  try:
    _run(tree, first, stream, plan, random_streams, path, metadata, state, display)
  finally:
    display.close()
  return _store.open_harvest(path)


def _run(
  tree: CallNode,
  first: Any,
  stream: Any,
  plan: _Plan,
  random_streams: Any,
  path: str,
  metadata: dict[str, Any],
  state: dict[str, Any],
  display: _Display,
) -> None:
  arrays = _store.open_arrays(path, metadata, write=True)
  expected = {s["name"]: s for s in metadata["sites"]}
  skip = state["batches"]
  batches, examples = state["batches"], state["examples"]
  rows = {site.name: int(state["rows"].get(site.name, 0)) for site in plan.sites}
  pending: collections.deque[_Written] = collections.deque()
  written_bytes = 0

  def commit(written: _Written) -> None:
    written.wait()
    _store.write_progress(path, written.progress)

  try:
    for number, batch in enumerate(_chain(first, stream)):
      if number < skip:
        continue
      batch = _as_arrays(batch)
      out = _step(tree, batch, plan, random_streams)  # dispatched: runs while writes go on
      _check_batch(out, expected, number, path, batches)
      while pending and (len(pending) >= IN_FLIGHT or pending[0].done()):
        commit(pending.popleft())
      sizes = np.asarray(out["sizes"])
      futures, held, counts, size = _write(arrays, out, plan, examples, rows)
      examples += int(sizes[0])
      rows = {name: rows[name] + counts[name] for name in rows}
      batches = number + 1
      written_bytes += size
      progress = {"batches": batches, "examples": examples, "rows": rows, "complete": False}
      pending.append(_Written(futures, progress, held))
      display.update(batches, examples, int(sizes[0]) * int(sizes[1]), written_bytes)
    while pending:
      commit(pending.popleft())
  finally:
    # Whatever stopped the run, batches whose writes complete are committed; a write that
    # fails leaves its batch uncommitted, and the error that stopped the run propagates.
    try:
      while pending:
        commit(pending.popleft())
    except Exception:
      pending.clear()
  _store.shrink(arrays, rows)
  _store.write_progress(
    path, {"batches": batches, "examples": examples, "rows": rows, "complete": True}
  )


def _chain(first: Any, stream: Any) -> Any:
  yield first
  yield from stream


def _check_batch(
  out: dict[str, Any], expected: dict[str, Any], number: int, path: str, committed: int
) -> None:
  """Refuses a batch whose rows do not fit the store (another feature shape or dtype)."""
  for name, site in expected.items():
    values = out[name]["values"]
    features, dtype = list(values.shape[1:]), np.dtype(values.dtype).name
    ids = out[name].get("ids")
    ids_dtype = None if ids is None else np.dtype(ids.dtype).name
    if features != site["features"] or dtype != site["dtype"] or ids_dtype != site["ids"]:
      raise HarvestError(
        f"fl.harvest: batch {number} gives rows of {dtype}{features} at {name} (ids:"
        f" {ids_dtype}), where the store at {path} holds {site['dtype']}{site['features']}"
        f" (ids: {site['ids']}); nothing of this batch was written, and the {committed}"
        " batches before it are committed. Give batches whose sites have the same feature"
        " shapes (pad or bucket sequence lengths only along the positions axis)."
      )
