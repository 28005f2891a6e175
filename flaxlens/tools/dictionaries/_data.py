"""What a dictionary trains and is evaluated on: the `DictionaryData` protocol and two
sources of it, a harvest store (`from_harvest`) and arrays in memory (`from_arrays`).

A source yields `Rows(inputs, targets)` batches, one pass (epoch) per `batches` call in an
order drawn from its seed: `[B, d_in]`/`[B, d_out]` rows for an SAE (targets are the
inputs) or a transcoder, `[B, layers, d_in]`/`[B, layers, d_out]` for a cross-layer
transcoder (one site per layer, stacked on axis 1). `check_data` refuses data whose widths
or layers do not match a dictionary. No Flax internals here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from flaxlens.errors import ArgumentError, HarvestError
from flaxlens.tools.dictionaries._modules import Dictionary
from flaxlens.tools.harvest._store import Harvest, open_harvest


class Rows(NamedTuple):
  """One batch of training rows.

  Attributes:
    inputs: what the dictionary reads, `[B, d_in]` (`[B, layers, d_in]` for a CLT).
    targets: what it should write, `[B, d_out]` (`[B, layers, d_out]`); the inputs for an
      SAE.
  """

  inputs: Any
  targets: Any


@runtime_checkable
class DictionaryData(Protocol):
  """What `fld.train` and `fld.evaluate` read: rows in shuffled batches, and their shape.

  Attributes:
    d_in: the width of the inputs.
    d_out: the width of the targets.
    layers: the layers of each row (a CLT's; 1 otherwise, and the rows are then 2-D).
    reads: the site names the inputs come from (for messages and files).
    writes: the site names the targets come from.

  Example:
    A source of one's own (here: random rows, a new draw per epoch):

    >>> import numpy as np, flaxlens.dictionaries as fld
    >>> class Noise:
    ...   d_in = d_out = 4
    ...   layers = 1
    ...   reads = writes = ("noise",)
    ...   def batches(self, batch_size, *, seed):
    ...     rows = np.random.default_rng(seed).normal(size=(8 * batch_size, 4))
    ...     for start in range(0, len(rows), batch_size):
    ...       yield fld.Rows(rows[start : start + batch_size], rows[start : start + batch_size])
    >>> isinstance(Noise(), fld.DictionaryData), next(Noise().batches(2, seed=0)).inputs.shape
    (True, (2, 4))
  """

  d_in: int
  d_out: int
  layers: int
  reads: tuple[str, ...]
  writes: tuple[str, ...]

  def batches(self, batch_size: int, *, seed: int) -> Iterator[Rows]:
    """One pass over the rows in batches of `batch_size` (the last may be smaller),
    shuffled by `seed`."""
    ...


class ArrayData:
  """Rows held in memory (`from_arrays`): each pass is a permutation drawn from the seed,
  in batches of exactly `batch_size` rows (the remainder of a pass is left out)."""

  def __init__(self, inputs: np.ndarray, targets: np.ndarray, reads, writes):
    self.inputs, self.targets = inputs, targets
    self.d_in, self.d_out = inputs.shape[-1], targets.shape[-1]
    self.layers = inputs.shape[1] if inputs.ndim == 3 else 1
    self.reads, self.writes = reads, writes

  def __len__(self) -> int:
    return len(self.inputs)

  def batches(self, batch_size: int, *, seed: int) -> Iterator[Rows]:
    order = np.random.default_rng(seed).permutation(len(self.inputs))
    for start in range(0, len(order) - batch_size + 1, batch_size):
      chosen = order[start : start + batch_size]
      yield Rows(self.inputs[chosen], self.targets[chosen])

  def __repr__(self) -> str:
    return (
      f"ArrayData({len(self)} rows, d_in={self.d_in}, d_out={self.d_out}, layers={self.layers})"
    )


def from_arrays(inputs: Any, targets: Any = None) -> ArrayData:
  """Training data from arrays in memory.

  Args:
    inputs: `[rows, d_in]` (or `[rows, layers, d_in]` for a cross-layer transcoder).
    targets: `[rows, d_out]` (`[rows, layers, d_out]`); the inputs by default (an SAE).

  Returns:
    A `DictionaryData` whose passes are permutations of the rows drawn from the seed.

  Raises:
    ArgumentError: the arrays are not 2-D or 3-D, or their rows or layers differ.

  Example:
    >>> import numpy as np, flaxlens.dictionaries as fld
    >>> data = fld.from_arrays(np.ones((10, 4), np.float32))
    >>> (data.d_in, data.d_out, data.layers), [len(b.inputs) for b in data.batches(4, seed=0)]
    ((4, 4, 1), [4, 4])
  """
  inputs = np.asarray(inputs)
  targets = inputs if targets is None else np.asarray(targets)
  for name, array in (("inputs", inputs), ("targets", targets)):
    if array.ndim not in (2, 3) or 0 in array.shape:
      raise ArgumentError(
        f"fld.from_arrays: {name} has shape {array.shape}; give [rows, width] rows (or"
        " [rows, layers, width] for a cross-layer transcoder), none empty."
      )
  if inputs.shape[:-1] != targets.shape[:-1]:
    raise ArgumentError(
      f"fld.from_arrays: inputs {inputs.shape} and targets {targets.shape} differ in rows or"
      " layers. Give targets row for row with the inputs."
    )
  return ArrayData(
    inputs, targets, ("inputs",), ("targets",) if targets is not inputs else ("inputs",)
  )


class HarvestData:
  """Rows of a harvest store (`from_harvest`): `Harvest.batches` pairs the sites' rows; a
  CLT's sites are stacked on axis 1 in the order given."""

  def __init__(self, harvest: Harvest, reads: tuple[str, ...], writes: tuple[str, ...]):
    self.harvest, self.reads, self.writes = harvest, reads, writes
    self.d_in = harvest[reads[0]].shape[-1]
    self.d_out = harvest[writes[0]].shape[-1]
    self.layers = len(reads)

  def batches(self, batch_size: int, *, seed: int) -> Iterator[Rows]:
    sites = list(dict.fromkeys(self.reads + self.writes))
    for batch in self.harvest.batches(batch_size, seed=seed, sites=sites):
      yield Rows(self._rows(batch, self.reads), self._rows(batch, self.writes))

  def _rows(self, batch: dict[str, np.ndarray], names: tuple[str, ...]) -> np.ndarray:
    if len(names) == 1 and self.layers == 1:
      return batch[names[0]]
    return np.stack([batch[name] for name in names], axis=1)

  def __repr__(self) -> str:
    return (
      f"HarvestData({self.harvest.path!r}, reads={list(self.reads)}, writes={list(self.writes)})"
    )


def _site_names(value: Any, argument: str) -> tuple[str, ...]:
  names = (
    (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Sequence) else None
  )
  if not names or not all(isinstance(name, str) for name in names):
    raise ArgumentError(
      f"fld.from_harvest: {argument}={value!r} is not a site name or a list of them. Give"
      " the harvested site(s) by name."
    )
  return names


def from_harvest(harvest: Any, reads: Any, writes: Any = None) -> HarvestData:
  """Training data from a harvest store (`fl.harvest`, `fl.open_harvest`).

  Args:
    harvest: an opened store (`fl.Harvest`) or its directory.
    reads: the site the dictionary reads; for a cross-layer transcoder, one site per layer.
    writes: the site(s) it writes (a transcoder's MLP output, a CLT's MLP outputs, one per
      layer); `reads` by default (an SAE).

  Returns:
    A `DictionaryData` over the store's rows, shuffled by `Harvest.batches`.

  Raises:
    HarvestError: a named site is not in the store (the message lists those that are), or
      the store is not complete.
    ArgumentError: the sites' widths or row counts differ, or reads and writes differ in
      number.

  Example:
    >>> import tempfile, flaxlens as fl, flaxlens.dictionaries as fld, flax.linen as nn
    >>> import jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((4, 5, 2))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> store = fl.harvest(tree, [x], ["layers_0", "layers_2"], tempfile.mkdtemp() + "/s")
    >>> data = fld.from_harvest(store, "layers_0", "layers_2")
    >>> data.d_in, data.d_out, next(data.batches(8, seed=0)).targets.shape
    (3, 2, (8, 2))
  """
  if not isinstance(harvest, Harvest):
    harvest = open_harvest(harvest)
  reads = _site_names(reads, "reads")
  writes = reads if writes is None else _site_names(writes, "writes")
  if len(reads) != len(writes):
    raise ArgumentError(
      f"fld.from_harvest: reads has {len(reads)} sites and writes {len(writes)}; a"
      " cross-layer transcoder reads and writes one site per layer. Give as many of each."
    )
  for argument, names in (("reads", reads), ("writes", writes)):
    missing = [name for name in names if name not in harvest.sites]
    if missing:
      raise HarvestError(
        f"fld.from_harvest: {argument}= names {missing}, which the harvest at"
        f" {harvest.path} does not hold (its sites: {harvest.sites}). Give sites it holds,"
        " or harvest those sites first."
      )
    widths = {name: harvest[name].shape[1:] for name in names}
    if len(set(widths.values())) > 1 or any(len(shape) != 1 for shape in widths.values()):
      raise ArgumentError(
        f"fld.from_harvest: the {argument}= sites have row shapes {widths}; a dictionary"
        " reads rows of one width. Give sites of one width, harvested as [rows, width]."
      )
  lengths = {name: len(harvest[name]) for name in reads + writes}
  if len(set(lengths.values())) > 1:
    raise ArgumentError(
      f"fld.from_harvest: the sites hold {lengths} rows, which do not pair up. Harvest them"
      " with the same positions rule."
    )
  return HarvestData(harvest, reads, writes)


def check_data(dictionary: Dictionary, data: Any, where: str) -> None:
  """Refuses `data` that is no `DictionaryData` or whose widths or layers do not match
  `dictionary`'s config."""
  if not isinstance(dictionary, Dictionary):
    raise ArgumentError(
      f"{where}: dictionary is a {type(dictionary).__name__}, not a fld.Dictionary. Give"
      " fld.SAE(...), fld.Transcoder(...) or fld.CrossLayerTranscoder(...)."
    )
  if not isinstance(data, DictionaryData):
    raise ArgumentError(
      f"{where}: data is a {type(data).__name__}, not a fld.DictionaryData. Give"
      " fld.from_harvest(store, reads, writes), fld.from_arrays(inputs, targets) or"
      " fld.stream(...)."
    )
  config = dictionary.config
  found = {"d_in": data.d_in, "d_out": data.d_out, "layers": data.layers}
  wanted = {"d_in": config.d_in, "d_out": config.d_out, "layers": config.layers}
  wrong = {name: value for name, value in found.items() if value != wanted[name]}
  if wrong:
    sites = {"d_in": data.reads, "d_out": data.writes, "layers": data.reads}
    said = "; ".join(
      f"{name} is {wanted[name]} in the dictionary but {value} in the data (sites"
      f" {list(sites[name])})"
      for name, value in wrong.items()
    )
    raise ArgumentError(
      f"{where}: the data does not fit the {config.kind}: {said}. Build the dictionary for"
      " the sites' widths, or give the sites it was built for."
    )
