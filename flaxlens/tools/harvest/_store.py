"""The harvest store: one zarr v3 array per site, written and read through TensorStore.

A store is a directory holding a zarr v3 group whose attributes hold the harvest's metadata
(`flaxlens_harvest`), one subgroup per site (`s0`, `s1`, ...) with the arrays `values`
(rows, *features), `index` (rows, 2: the example's place in the stream and the position)
and, when `ids=` was given, `ids` (rows,), and `progress.json`, the record of what is
committed, replaced atomically (temporary file, `os.replace`) only after the writes it
counts have completed and the filesystem was synced (`commit`). Arrays are created with a
bound of `ROW_BOUND` rows (chunks that were never written take no space) and shrunk to the
committed rows, in their metadata only, when the harvest completes. TensorStore is
imported on first use (`pip install "flaxlens[harvest]"`). No Flax internals here.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flaxlens.core._checks import check_path
from flaxlens.errors import ArgumentError, ArtifactError, HarvestError
from flaxlens.tools.files import _schemas

ROW_BOUND = 2**40  # Rows an array can hold while a harvest runs (chunks are written sparsely).
CHUNK_BYTES = 2**20  # About this many bytes per chunk: a row chunk of 2**k rows.
MIN_CHUNK_ROWS = 64  # Chunks aligned with a batch's rows are at least this many rows.
WINDOW_BYTES = 2**28  # What a shuffled iteration holds in memory at most (besides a batch).
GROUP_KEY = "flaxlens_harvest"
PROGRESS = "progress.json"
FORMAT = 1
# Bounds on the JSON files a store is read from: far above what fl.harvest writes (about
# 300 bytes per site, 150 per progress entry), far below what would strain memory.
MAX_METADATA_BYTES = 2**24
MAX_PROGRESS_BYTES = 2**22


def tensorstore() -> Any:
  """The `tensorstore` module; refuses with what to install when the extra is missing."""
  try:
    import tensorstore as ts
  except ImportError as error:
    raise HarvestError(
      "fl.harvest writes and reads its store with TensorStore, which is not installed."
      ' Install the extra: pip install "flaxlens[harvest]".'
    ) from error
  return ts


def chunk_rows(features: Sequence[int], itemsize: int, step: int | None = None) -> int:
  """Rows per chunk: the largest power of two whose chunk holds at most `CHUNK_BYTES`; with
  `step` (the rows one batch writes), at most the largest power of two dividing it (and
  at least `MIN_CHUNK_ROWS`), so that each batch writes whole chunks, not a chunk half
  now and half with the next batch (which writes it twice).

  Example:
    >>> from flaxlens.tools.harvest._store import chunk_rows
    >>> chunk_rows((1024,), 4), chunk_rows((), 8), chunk_rows((256,), 4, step=512)
    (256, 131072, 512)
  """
  row = max(1, int(np.prod(features, dtype=np.int64)) * itemsize)
  rows = 1 << max(0, (CHUNK_BYTES // row).bit_length() - 1)
  if step:
    aligned = step & -step  # the largest power of two dividing the rows of a step
    if aligned >= MIN_CHUNK_ROWS:
      rows = min(rows, aligned)
  return rows


def _spec(path: str, name: str, dtype: str | None = None) -> dict[str, Any]:
  spec: dict[str, Any] = {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": f"{path}/{name}"},
  }
  if dtype is not None:
    spec["dtype"] = dtype
  return spec


def _write_json(path: str, value: Any, sync: bool = True) -> None:
  """Writes `value` to `path` atomically: a temporary file, flushed (and synced, unless a
  sync of the whole store follows), then `os.replace`."""
  temporary = f"{path}.tmp"
  with open(temporary, "w") as file:
    json.dump(value, file, indent=1, sort_keys=True)
    file.flush()
    if sync:
      os.fsync(file.fileno())
  os.replace(temporary, path)


def _read_bounded(file: str, limit: int) -> bytes:
  with open(file, "rb") as opened:
    raw = opened.read(limit + 1)
  if len(raw) > limit:
    raise HarvestError(
      f"{file} holds more than {limit:,} bytes, more than fl.harvest writes there: it is"
      " not a harvest store's file, or it was altered. Harvest into a new path, or again"
      " with overwrite=True."
    )
  return raw


def _checked(raw: bytes, schema: str, file: str) -> Any:
  """`raw` parsed as strict, bounded JSON and validated against the shipped `schema`;
  HarvestError naming the file where it is malformed."""
  fix = "Harvest into a new path, or again with overwrite=True to start the store afresh."
  try:
    data = _schemas.read_json(raw, file, fix)
    _schemas.check_schema(data, schema, file, fix)
  except ArtifactError as error:
    raise HarvestError(f"This harvest store is damaged: {error}") from None
  return data


def read_metadata(path: str) -> dict[str, Any] | None:
  """The harvest metadata of the store at `path`, or None where there is no harvest store
  (no group metadata, or a group without flaxlens's attributes). Metadata of this format
  that does not fit its schema (a damaged store) is refused with `HarvestError`."""
  file = os.path.join(path, "zarr.json")
  try:
    raw = _read_bounded(file, MAX_METADATA_BYTES)
    group = json.loads(raw)
  except (OSError, ValueError, HarvestError):
    return None
  attributes = group.get("attributes") if isinstance(group, dict) else None
  found = attributes.get(GROUP_KEY) if isinstance(attributes, dict) else None
  if not isinstance(found, dict) or found.get("format") != FORMAT:
    return found  # None, or another format (its readers name the format)
  return _checked(raw, "harvest", file)["attributes"][GROUP_KEY]


def read_progress(path: str, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
  """What the store at `path` has committed: nothing when no batch was committed yet.
  Refuses (`HarvestError`) a `progress.json` that does not fit its schema or, given the
  store's `metadata`, counts rows of sites the store does not hold."""
  file = os.path.join(path, PROGRESS)
  try:
    raw = _read_bounded(file, MAX_PROGRESS_BYTES)
  except FileNotFoundError:
    return {"batches": 0, "examples": 0, "rows": {}, "complete": False}
  except OSError as error:
    raise HarvestError(f"Cannot read {file}: {error}.") from error
  progress = _checked(raw, "harvest-progress", file)
  if metadata is not None:
    names = {site["name"] for site in metadata["sites"]}
    unknown = sorted(set(progress["rows"]) - names)
    if unknown:
      raise HarvestError(
        f"This harvest store is damaged: {file} counts rows of {unknown}, which are no"
        f" sites of the store ({sorted(names)}). Harvest into a new path, or again with"
        " overwrite=True to start the store afresh."
      )
  return progress


def write_progress(path: str, progress: dict[str, Any]) -> None:
  _write_json(os.path.join(path, PROGRESS), progress)


@functools.cache
def _syncfs() -> Any:
  """Linux's `syncfs` (every pending write of one filesystem, waited for), or None."""
  try:
    return ctypes.CDLL(None, use_errno=True).syncfs
  except (OSError, AttributeError):
    return None


def syncs_itself() -> bool:
  """Whether `flush` can make a store's writes durable all at once. Where it cannot (no
  `syncfs` nor `os.sync`), TensorStore syncs every chunk it writes instead."""
  return _syncfs() is not None or hasattr(os, "sync")


def flush(path: str) -> None:
  """Makes every write to the filesystem holding `path` durable: called before
  `progress.json` counts rows, as the arrays are written without a sync per chunk (which
  costs more CPU than the harvest's forward can spare on a CPU host). Nothing to do where
  TensorStore syncs every chunk (`syncs_itself`)."""
  syncfs = _syncfs()
  if syncfs is None:
    if hasattr(os, "sync"):
      os.sync()
    return
  descriptor = os.open(path, os.O_RDONLY)
  try:
    if syncfs(descriptor) != 0:
      error = ctypes.get_errno()
      raise HarvestError(f"Could not sync the store at {path}: {os.strerror(error)}.")
  finally:
    os.close(descriptor)


def commit(path: str, progress: dict[str, Any]) -> None:
  """Counts `progress` as committed once the writes it counts are durable."""
  flush(path)
  write_progress(path, progress)


def array_names(site: dict[str, Any]) -> list[str]:
  """The arrays a site's group holds."""
  return ["values", "index", *(["ids"] if site.get("ids") else [])]


def _array_dtype(site: dict[str, Any], name: str) -> str:
  return {"values": site["dtype"], "index": "int64"}.get(name) or site["ids"]


def _array_shape(site: dict[str, Any], name: str) -> list[int]:
  return {"values": site["features"], "index": [2]}.get(name, [])


def create(path: str, metadata: dict[str, Any]) -> None:
  """Creates the store's groups and arrays (empty, `ROW_BOUND` rows) at `path` (absent, or
  an empty directory), all at once: they are made in a new directory beside `path`, which
  then replaces it (`os.rename`), so a creation that fails or is killed leaves `path` as
  it was, never a directory half made. (Where the parent cannot be written, the store is
  made in `path` itself, and what a failed creation made is removed.)"""
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  if not os.access(parent, os.W_OK):
    os.makedirs(path, exist_ok=True)
    try:
      _create_in(path, metadata)
    except BaseException:
      for entry in os.listdir(path):
        shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
      raise
    return
  if os.path.isdir(path) and not os.access(path, os.W_OK):
    raise PermissionError(f"{path} is not writable")
  temporary = os.path.join(parent, f".{name}.creating-{os.getpid()}-{secrets.token_hex(4)}")
  os.mkdir(temporary)
  try:
    _create_in(temporary, metadata)
    os.rename(temporary, path)  # replaces an empty directory at `path`
  except BaseException:
    shutil.rmtree(temporary, ignore_errors=True)
    raise
  descriptor = os.open(parent, os.O_RDONLY)
  try:
    os.fsync(descriptor)  # the rename itself durable
  finally:
    os.close(descriptor)


def _create_in(path: str, metadata: dict[str, Any]) -> None:
  ts = tensorstore()
  together = syncs_itself()  # one sync of everything below, not one per file
  context = ts.Context({"file_io_sync": False} if together else {})
  futures = []
  for site in metadata["sites"]:
    group = os.path.join(path, site["group"])
    os.makedirs(group, exist_ok=True)
    _write_json(
      os.path.join(group, "zarr.json"),
      {"zarr_format": 3, "node_type": "group", "attributes": {"site": site["name"]}},
      sync=not together,
    )
    for name in array_names(site):
      dtype, features = _array_dtype(site, name), _array_shape(site, name)
      # Every array of a site is chunked alike, so a batch's rows touch the same chunks of
      # each (a larger chunk of the small index and ids arrays would be rewritten whole by
      # every batch: 4x the bytes of the rows on the bench's model).
      rows = site["chunk"]
      spec = _spec(group, name, dtype)
      spec["metadata"] = {
        "shape": [ROW_BOUND, *features],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [rows, *features]}},
        # Chunk files side by side (`c.7.0`), not a folder per chunk row (`c/7/0`): a new
        # folder per chunk cost a third of the writes' CPU time (mkdir), taken from the
        # forward on a CPU host.
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
      }
      futures.append(ts.open(spec, create=True, delete_existing=True, context=context))
  for future in futures:
    future.result()
  flush(path)
  # The group's metadata last: a directory without it is no store (nothing to resume).
  _write_json(
    os.path.join(path, "zarr.json"),
    {"zarr_format": 3, "node_type": "group", "attributes": {GROUP_KEY: metadata}},
  )


def open_arrays(path: str, metadata: dict[str, Any], *, write: bool) -> dict[str, dict[str, Any]]:
  """`{site name: {array name: TensorStore}}` of the store at `path`; for writing, each
  array is (again) `ROW_BOUND` rows long."""
  ts = tensorstore()
  # Writing, no sync per chunk where `flush` syncs them all before a commit.
  context = ts.Context({"file_io_sync": False} if write and syncs_itself() else {})
  opened = {}
  for site in metadata["sites"]:
    group = os.path.join(path, site["group"])
    opened[site["name"]] = {
      name: ts.open(_spec(group, name), open=True, read=True, write=write, context=context)
      for name in array_names(site)
    }
  arrays: dict[str, dict[str, Any]] = {}
  for site in metadata["sites"]:
    arrays[site["name"]] = {}
    for name, future in opened[site["name"]].items():
      try:
        array = future.result()
      except ValueError as error:  # TensorStore: a missing or damaged array
        raise HarvestError(
          f"This harvest store is damaged: the array {site['group']}/{name} of {site['name']!r}"
          f" at {path} cannot be opened ({' '.join(str(error).split())[:300]}). Harvest into"
          " a new path, or again with overwrite=True to start the store afresh."
        ) from None
      expected = [*site["features"]] if name == "values" else [2] if name == "index" else []
      if list(array.shape[1:]) != expected or array.dtype.name != _array_dtype(site, name):
        raise HarvestError(
          f"This harvest store is damaged: the array {site['group']}/{name} of"
          f" {site['name']!r} at {path} is {array.dtype.name}{list(array.shape[1:])} per row,"
          f" where the store's metadata says {_array_dtype(site, name)}{expected}. Harvest"
          " into a new path, or again with overwrite=True to start the store afresh."
        )
      arrays[site["name"]][name] = array
  if write:
    for found in arrays.values():
      for name, array in found.items():
        if array.shape[0] != ROW_BOUND:
          found[name] = array.resize(
            exclusive_max=[ROW_BOUND, *[None] * (array.rank - 1)], resize_metadata_only=True
          ).result()
  return arrays


def shrink(arrays: dict[str, dict[str, Any]], rows: dict[str, int]) -> None:
  """Sets each array's shape to its committed rows (metadata only: chunks stay)."""
  futures = [
    array.resize(exclusive_max=[rows[site], *[None] * (array.rank - 1)], resize_metadata_only=True)
    for site, found in arrays.items()
    for array in found.values()
  ]
  for future in futures:
    future.result()


# --- reading ------------------------------------------------------------------------------


def _positions(key: Any, length: int, where: str) -> Any:
  """`key` (an int, a slice or integer positions) as positions within `length` rows,
  negative ones counting from the end, as NumPy reads them; refuses what lies outside."""
  if isinstance(key, slice):
    start, stop, step = key.indices(length)
    return slice(start, stop, step) if len(range(start, stop, step)) else slice(0, 0, 1)
  if isinstance(key, int | np.integer) and not isinstance(key, bool):
    if not -length <= key < length:
      raise IndexError(f"{where}: row {key} is outside the {length} rows committed.")
    return int(key) % length
  positions = np.asarray(key)
  if positions.size == 0 and positions.dtype.kind == "f":  # `[]`: no rows
    positions = positions.astype(np.int64)
  if positions.dtype.kind not in "iu":
    raise ArgumentError(
      f"{where}: rows are read by an int, a slice or integer positions, got"
      f" {type(key).__name__}. Give one of these."
    )
  if positions.size and not (-length <= positions.min() and positions.max() < length):
    raise IndexError(f"{where}: positions outside the {length} rows committed.")
  return positions % max(length, 1)


class Rows:
  """One array of a harvested site, as committed: `len`, and rows by `[int | slice |
  positions]` as NumPy arrays."""

  def __init__(self, array: Any, length: int, where: str):
    self._array = array[:length]
    self._length = length
    self._where = where

  def __len__(self) -> int:
    return self._length

  @property
  def shape(self) -> tuple[int, ...]:
    return (self._length, *self._array.shape[1:])

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self._array.dtype.numpy_dtype)

  def __getitem__(self, key: Any) -> np.ndarray:
    """Rows by an int, a slice or integer positions; a tuple indexes the rows' axes too."""
    rows, rest = (key[0], key[1:]) if isinstance(key, tuple) and key else (key, ())
    positions = _positions(rows, self._length, self._where)
    if isinstance(positions, np.ndarray):
      unique, inverse = np.unique(positions.reshape(-1), return_inverse=True)
      found = self._array.oindex[unique].read().result()
      found = found[inverse].reshape(positions.shape + found.shape[1:])
    else:
      found = self._array[positions].read().result()
    if not rest:
      return found
    axes = (
      positions.ndim if isinstance(positions, np.ndarray) else int(isinstance(positions, slice))
    )
    return found[(*(slice(None),) * axes, *rest)]

  def read(self, start: int, stop: int) -> Any:
    """A TensorStore future of rows `start:stop` (no bounds check)."""
    return self._array[start:stop].read()

  def __repr__(self) -> str:
    return f"Rows({self._where}, shape={self.shape}, dtype={self.dtype})"


class HarvestedSite:
  """The rows of one site of a harvest: `site[i]`, `site[start:stop]` read values;
  `site.index[...]` their `(example, position)` and `site.ids[...]` their ids."""

  def __init__(self, name: str, arrays: dict[str, Any], length: int, chunk: int):
    self.name = name
    self.values = Rows(arrays["values"], length, name)
    self.index = Rows(arrays["index"], length, f"{name} index")
    self.ids = Rows(arrays["ids"], length, f"{name} ids") if "ids" in arrays else None
    self.chunk = chunk

  def __len__(self) -> int:
    return len(self.values)

  def __getitem__(self, key: Any) -> np.ndarray:
    return self.values[key]

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def dtype(self) -> np.dtype:
    return self.values.dtype

  def __repr__(self) -> str:
    return f"HarvestedSite({self.name!r}, shape={self.shape}, dtype={self.dtype})"


class Harvest:
  """A harvest store opened for reading, as of when it was opened.

  `fl.harvest` returns one; `fl.open_harvest(path)` opens one later (read-only). `len`
  is the number of examples committed, `harvest[site]` the rows of one site (values by
  row, `.index` the `(example, position)` of each row, `.ids` the ids given with
  `ids=`), `rows(site, start, stop)` a range of values, `batches(...)` a shuffled,
  batched iterator for training, `source(...)` a random-access data source (for
  `grain.MapDataset.source`). `complete` says whether the harvest ran to the end of its
  batches; a partial store reads the rows committed so far, and its iterators refuse
  unless `partial=True`.

  Attributes:
    path: the store's directory.
    metadata: what the harvest recorded: the model, its sites (name, positions rule,
      stored dtype, feature shape), the ids, and the fingerprint of the call.
    sites: the names of the harvested sites, in call order.
    complete: whether every batch was committed and the harvest finished.
    batches_committed: how many batches of the stream are committed.

  Example:
    >>> import tempfile, flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((4, 5, 2))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> path = tempfile.mkdtemp() + "/store"
    >>> stored = fl.harvest(tree, [x, x + 1], "layers_0", path)
    >>> reopened = fl.open_harvest(path)
    >>> reopened.complete, len(reopened), reopened["layers_0"].shape
    (True, 8, (40, 3))
    >>> bool((reopened["layers_0"][:20] == fl.capture(tree, x, "layers_0")[1]["layers_0"]
    ...       .reshape(20, 3)).all())
    True
  """

  def __init__(self, path: str, metadata: dict[str, Any], progress: dict[str, Any]):
    self.path = path
    self.metadata = metadata
    self.sites = [site["name"] for site in metadata["sites"]]
    self.complete = bool(progress["complete"])
    self.batches_committed = int(progress["batches"])
    self._examples = int(progress["examples"])
    arrays = open_arrays(path, metadata, write=False)
    for site in metadata["sites"]:
      rows = int(progress["rows"].get(site["name"], 0))
      short = [n for n, a in arrays[site["name"]].items() if a.shape[0] < rows]
      if short:
        raise HarvestError(
          f"This harvest store is damaged: {PROGRESS} at {path} counts {rows} rows of"
          f" {site['name']!r}, and its arrays {short} hold fewer. Harvest into a new path,"
          " or again with overwrite=True to start the store afresh."
        )
    self._sites = {
      site["name"]: HarvestedSite(
        site["name"],
        arrays[site["name"]],
        int(progress["rows"].get(site["name"], 0)),
        site["chunk"],
      )
      for site in metadata["sites"]
    }

  def __len__(self) -> int:
    return self._examples

  def __getitem__(self, site: str) -> HarvestedSite:
    return self._site(site, "harvest[site]")

  def _site(self, site: Any, where: str) -> HarvestedSite:
    found = self._sites.get(site) if isinstance(site, str) else None
    if found is None:
      raise ArgumentError(
        f"{where}: {site!r} is no site of the harvest at {self.path}; its sites are"
        f" {self.sites}. Give one of these names."
      )
    return found

  def rows(self, site: str, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The values of rows `start:stop` of `site` (all committed rows by default)."""
    return self._site(site, "Harvest.rows")[start:stop]

  def _chosen(self, sites: Any, where: str, partial: bool) -> list[HarvestedSite]:
    if not self.complete and not partial:
      raise HarvestError(
        f"{where}: the harvest at {self.path} is not complete ({self.batches_committed}"
        " batches committed): it was interrupted or is still running. Run the same"
        " fl.harvest call again to finish it, or pass partial=True to read the rows"
        " committed so far."
      )
    names = self.sites if sites is None else [sites] if isinstance(sites, str) else list(sites)
    chosen = [self._site(name, where) for name in names]
    if not chosen:
      raise ArgumentError(f"{where}: sites= is empty. Give at least one site of {self.sites}.")
    lengths = {site.name: len(site) for site in chosen}
    if len(set(lengths.values())) > 1:
      raise ArgumentError(
        f"{where}: the sites {lengths} hold different numbers of rows, so their rows do not"
        " pair up. Give sites harvested with the same positions rule (sites=[...])."
      )
    return chosen

  def batches(
    self,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    sites: Any = None,
    partial: bool = False,
  ) -> Iterator[dict[str, np.ndarray]]:
    """One pass over the rows, as `{site: values}` batches of `batch_size` rows (the last
    one smaller where the rows do not divide evenly).

    Shuffled (the default), the rows come in a random order drawn from `seed`: blocks of
    whole chunks are visited in a random order, a window of them (at most about 256 MiB)
    is read at once and its rows are shuffled together; each row comes exactly once per
    pass. Rows of several sites stay paired (the sites must have the same number of
    rows). Reading holds one window and one batch in memory, whatever the store's size.

    Args:
      batch_size: rows per batch.
      shuffle: shuffle the rows (default) or read them in order.
      seed: the seed of the order; a new seed per epoch gives a new order.
      sites: a site name or a list of them; every site by default.
      partial: read a store that is not complete (the rows committed so far).

    Raises:
      HarvestError: the store is not complete and `partial` is False.
      ArgumentError: a site is unknown, the sites' row counts differ, or the batch size is
        not a positive int.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise ArgumentError(
        f"Harvest.batches: batch_size must be a positive int, got {batch_size!r}. Give the"
        " number of rows per batch."
      )
    chosen = self._chosen(sites, "Harvest.batches", partial)
    return _batches(chosen, batch_size, shuffle, seed)

  def source(self, *, sites: Any = None, partial: bool = False) -> HarvestSource:
    """A random-access data source over the rows: `len`, `[i]` gives `{site: row}`.

    It has what `grain.MapDataset.source` takes (`__len__`, `__getitem__`), so Grain can
    shuffle, batch and prefetch it: `grain.MapDataset.source(store.source()).shuffle(
    seed=0).batch(256)`.

    Raises:
      HarvestError: the store is not complete and `partial` is False.
    """
    return HarvestSource(self._chosen(sites, "Harvest.source", partial))

  def __repr__(self) -> str:
    state = "complete" if self.complete else f"partial, {self.batches_committed} batches"
    shown = ", ".join(f"{name}: {self._sites[name].shape}" for name in self.sites)
    return f"Harvest({self.path!r}, {len(self)} examples, {state}; {shown})"


class HarvestSource:
  """Rows of a harvest as a random-access data source: `len` and `[i] -> {site: row}`
  (Grain's `RandomAccessDataSource` protocol; `__getitems__` reads many at once)."""

  def __init__(self, sites: list[HarvestedSite]):
    self._sites = sites

  def __len__(self) -> int:
    return len(self._sites[0])

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {site.name: site[index] for site in self._sites}

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
    positions = np.asarray(indices, dtype=np.int64)
    read = {site.name: site[positions] for site in self._sites}
    return [{name: values[i] for name, values in read.items()} for i in range(len(positions))]

  def __repr__(self) -> str:
    return f"HarvestSource({[site.name for site in self._sites]}, {len(self)} rows)"


def _batches(
  sites: list[HarvestedSite], batch_size: int, shuffle: bool, seed: int
) -> Iterator[dict[str, np.ndarray]]:
  length = len(sites[0])
  block = max(site.chunk for site in sites)
  row_bytes = sum(
    int(np.prod(site.shape[1:], dtype=np.int64)) * site.dtype.itemsize for site in sites
  )
  window = max(1, max(batch_size, WINDOW_BYTES // max(row_bytes, 1)) // block) * block
  starts = np.arange(0, length, block)
  rng = np.random.default_rng(seed)
  if shuffle:
    starts = rng.permutation(starts)
  carry: dict[str, np.ndarray] | None = None
  per_window = window // block
  for first in range(0, len(starts), per_window):
    ranges = [(int(s), min(int(s) + block, length)) for s in starts[first : first + per_window]]
    futures = {site.name: [site.values.read(a, b) for a, b in ranges] for site in sites}
    loaded = {
      name: np.concatenate([future.result() for future in found]) for name, found in futures.items()
    }
    if shuffle:
      order = rng.permutation(len(next(iter(loaded.values()))))
      loaded = {name: values[order] for name, values in loaded.items()}
    if carry is not None:
      loaded = {name: np.concatenate([carry[name], values]) for name, values in loaded.items()}
    count = len(next(iter(loaded.values())))
    full = count - count % batch_size
    for start in range(0, full, batch_size):
      yield {name: values[start : start + batch_size] for name, values in loaded.items()}
    carry = {name: values[full:] for name, values in loaded.items()} if full < count else None
  if carry is not None:
    yield carry


def open_harvest(path: Any) -> Harvest:
  """Opens the harvest store at `path` for reading (complete or not).

  Args:
    path: the directory `fl.harvest` wrote.

  Returns:
    The `fl.Harvest` handle; `handle.complete` says whether the harvest finished.

  Raises:
    HarvestError: there is no harvest store at `path`, or TensorStore is not installed.

  Example:
    >>> import tempfile, flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Dense(3), jnp.ones((4, 2))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> path = tempfile.mkdtemp() + "/store"
    >>> _ = fl.harvest(tree, [x], "Dense.__call__", path, positions=None)
    >>> fl.open_harvest(path)["Dense.__call__"].shape
    (4, 3)
  """
  path = check_path(path, "fl.open_harvest", "Pass the directory fl.harvest wrote.")
  tensorstore()
  metadata = read_metadata(path)
  if metadata is None:
    raise HarvestError(
      f"fl.open_harvest: {path} holds no harvest store (no zarr.json with flaxlens harvest"
      " metadata). Give the directory fl.harvest wrote."
    )
  if metadata.get("format") != FORMAT:
    raise HarvestError(
      f"fl.open_harvest: {path} is harvest format {metadata.get('format')!r}; this flaxlens"
      f" reads format {FORMAT}. Harvest again with this version."
    )
  return Harvest(path, metadata, read_progress(path, metadata))
