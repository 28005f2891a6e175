"""`fl.harvest`'s compiled step: `fl.run`'s capture of the plan's sites, then, on device, the
selection of each site's rows (the positions rule, in blocks of examples for a mask), the
cast to the stored dtype and each row's id, so that only the kept rows leave the device.
One program per input shape (`compiled_step`). No Flax internals here.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode
from flaxlens.errors import ArgumentError
from flaxlens.tools.base._calling import model_arguments
from flaxlens.tools.base._parts import one_array
from flaxlens.tools.base._probed import run
from flaxlens.tools.harvest._plan import HarvestPlan, SitePlan


def step_rows(
  tree: CallNode, batch: Any, plan: HarvestPlan, random_streams: Any, groups: int
) -> dict[str, Any]:
  """For each site: its rows (`values`) and their `ids`; `sizes` is the batch's examples,
  then each site's positions (1 with `positions=None`). A mask's rows are selected within
  each of `groups` equal blocks of examples (the blocks the batch is sharded in, so each
  device keeps its own rows): `(groups, rows per block, ...)`, each block's selected rows
  first, with each row's `(example, position)` within the batch (`index`) and `count`,
  the rows each block selects."""
  _, captured = run(
    tree, model_arguments(batch), capture=plan.capture, jit=False, random_streams=random_streams
  )
  ids = None if plan.ids is None else jnp.asarray(plan.ids(batch))
  masks: dict[int, Any] = {}
  found: dict[str, Any] = {}
  sizes, lengths = None, []
  for site in plan.sites:
    value = one_array(captured[site.name], site.part, site.name, "output")
    stacked = 0 if site.once_ndim is None else max(0, value.ndim - site.once_ndim)
    if value.ndim - stacked < (1 if site.rule is None else 2):
      raise ArgumentError(
        f"{site.name}: fl.harvest stores a site's output as rows, and this output has shape"
        f" {tuple(value.shape)}. Give a site whose output is one array of shape (batch,"
        " positions, ...) (or (batch, ...) with positions=None)."
      )
    value = _iterations_behind(site, value, stacked)
    size = value.shape[:1] if site.rule is None else value.shape[:2]
    lengths.append(1 if site.rule is None else value.shape[1])
    if sizes is None or len(size) > len(sizes):
      if sizes is not None and size[0] != sizes[0]:
        raise _unbatched(plan, captured)
      sizes = size
    elif size[0] != sizes[0]:
      raise _unbatched(plan, captured)
    found[site.name] = _select(site, value, batch, ids, masks, groups)
  found["sizes"] = jnp.asarray([sizes[0], *lengths], jnp.int32)
  return found


def _iterations_behind(site: SitePlan, value: Any, stacked: int) -> Any:
  """`value` with the `stacked` axes a capture stacked it along (a call inside scan or vmap
  bodies: `(layers, batch, positions, ...)`) moved behind the example and positions, so
  that each row holds every iteration's value: `(batch, positions, layers, ...)`."""
  if not stacked:
    return value
  kept = 1 if site.rule is None else 2
  return jnp.moveaxis(value, range(stacked), range(kept, kept + stacked))


def row_features(found: dict[str, Any]) -> list[int]:
  """A site's feature shape, from the step's output for it (a mask's rows come in blocks)."""
  return list(found["values"].shape[2 if "count" in found else 1 :])


def _unbatched(plan: HarvestPlan, captured: dict[str, Any]) -> ArgumentError:
  shapes = {s.name: tuple(captured[s.name].shape) for s in plan.sites}
  return ArgumentError(
    f"fl.harvest: the sites' outputs {shapes} do not share a leading batch axis. Harvest"
    " sites whose outputs have the batch first (one harvest per batch layout)."
  )


def _select(
  site: SitePlan, value: Any, batch: Any, ids: Any, masks: dict[int, Any], groups: int
) -> Any:
  """A site's rows: `values` and `ids`; with a mask, also each row's `index` and the rows'
  `count` per block (without one, the host knows each row's example and position)."""
  examples = value.shape[0]
  if site.rule is None:
    out = {"values": value, "ids": _ids_of(site, ids, examples, None)}
  elif site.rule == "last":
    if value.shape[1] == 0:
      raise ArgumentError(
        f"{site.name}: positions='last' keeps the last position, and this batch has none"
        f" (the site's output has shape {tuple(value.shape)}). Give batches of at least one"
        " position, or drop the empty ones."
      )
    row_ids = _ids_of(site, ids, examples, value.shape[1])
    out = {"values": value[:, -1], "ids": None if row_ids is None else row_ids[:, -1]}
  else:
    length = value.shape[1]
    rows = examples * length
    row_ids = _ids_of(site, ids, examples, length)
    out = {
      "values": value.reshape(rows, *value.shape[2:]),
      "ids": None if row_ids is None else row_ids.reshape(rows),
    }
    if site.rule != "all":
      out = _masked(site, out, batch, masks, groups, examples, length)
  if site.dtype is not None:
    out["values"] = out["values"].astype(site.dtype)
  return {k: v for k, v in out.items() if v is not None}


def _masked(
  site: SitePlan,
  flat: dict[str, Any],
  batch: Any,
  masks: dict[int, Any],
  groups: int,
  examples: int,
  length: int,
) -> dict[str, Any]:
  """The rows a mask selects, within each of `groups` blocks of whole examples."""
  mask = masks.get(id(site.rule))
  if mask is None:
    mask = masks[id(site.rule)] = jnp.asarray(site.rule(batch))
  if mask.shape != (examples, length) or mask.dtype != jnp.bool_:
    raise ArgumentError(
      f"{site.name}: positions= gave a {mask.dtype}{list(mask.shape)} mask, where the"
      f" site's output has {examples} examples of {length} positions. Give a function"
      f" returning a boolean mask of shape ({examples}, {length})."
    )
  rows = examples * length
  flat["index"] = jnp.stack(
    [jnp.arange(rows, dtype=jnp.int32) // length, jnp.arange(rows, dtype=jnp.int32) % length], 1
  )
  groups = math.gcd(groups, examples)
  keep = mask.reshape(groups, rows // groups)
  order = jnp.argsort(~keep, axis=1, stable=True)  # Selected rows first, in stream order.
  block = jnp.arange(groups)[:, None]
  out = {
    k: None if v is None else v.reshape(groups, rows // groups, *v.shape[1:])[block, order]
    for k, v in flat.items()
  }
  out["count"] = keep.sum(axis=1, dtype=jnp.int32)
  return out


def _ids_of(site: SitePlan, ids: Any, examples: int, length: int | None) -> Any:
  if ids is None:
    return None
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ArgumentError(
      f"{site.name}: ids= gave an array of {ids.dtype}, where ids are integers"
      " (an example's number, a token id). Return an integer array (.astype(jnp.int32))."
    )
  if ids.shape == (examples,) and length is not None:
    return jnp.broadcast_to(ids[:, None], (examples, length))
  if ids.shape == ((examples,) if length is None else (examples, length)):
    return ids
  wanted = f"({examples},)" if length is None else f"({examples},) or ({examples}, {length})"
  raise ArgumentError(
    f"{site.name}: ids= gave an array of shape {tuple(ids.shape)}, where the site's rows"
    f" take ids of shape {wanted}. Give one id per example or per position."
  )


compiled_step = variable_jit(step_rows)


def is_array_like(leaf: Any) -> bool:
  """Whether a batch's leaf is an array (a traced input of the step), not a Python value."""
  return isinstance(leaf, jax.Array | np.ndarray | np.generic) or hasattr(leaf, "__array__")


def as_arrays(batch: Any) -> Any:
  """The batch with array-likes (a tf.data tensor, a list of numbers stays) as arrays."""
  return jax.tree_util.tree_map(
    lambda leaf: (
      leaf
      if isinstance(leaf, jax.Array | np.ndarray) or not is_array_like(leaf)
      else np.asarray(leaf)
    ),
    batch,
  )
