"""A harvest store's metadata: what the call that made it was (the model and a fingerprint of
its variables, the sites and their rules, the inputs' structure and a fingerprint of the
first batch, the random streams) and what each site stores (dtype, feature shape, chunk
rows, ids dtype). A fingerprint of the compared settings tells a store of this call
(resumed) from another's (refused, `differences` saying what differs). No Flax internals
here.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata as package_metadata
from typing import Any

import jax
import numpy as np

from flaxlens.core._node import CallNode
from flaxlens.core._variables import Uninitialized, variables_in
from flaxlens.errors import ArgumentError
from flaxlens.tools.harvest import _store
from flaxlens.tools.harvest._fingerprints import STABLE_TEXT, fingerprint
from flaxlens.tools.harvest._plan import HarvestPlan, SitePlan
from flaxlens.tools.harvest._step import is_array_like, row_features

_SETTINGS = ("model", "sites", "ids", "inputs", "first_batch", "random_streams")


def store_metadata(
  tree: CallNode,
  batch: Any,
  plan: HarvestPlan,
  shapes: dict[str, Any] | None,
  random_streams: Any,
  stored: list[dict[str, Any]] | None = None,
  updates: list[str] | None = None,
  variables: list[tuple[str, Any]] | None = None,
) -> dict[str, Any]:
  """The store's metadata for this call. The sites' dtypes, feature shapes, chunking and
  ids dtypes come from `shapes` (the step's output, or its abstract value), or, with
  `shapes` None, from the sites `stored` in a store: they follow from the settings that
  are compared (the model, the sites and rules, the first batch's shapes and dtypes), so a
  store whose other settings are this call's has this call's (and every batch is checked
  against them before it is written). `variables` are the model's (`model_variables`),
  taken before a step that may update them; `updates` the state variables a run updates."""
  if variables is None:
    variables = model_variables(tree)
  leaves, treedef = jax.tree_util.tree_flatten(batch)
  arrays = [leaf for leaf in leaves if is_array_like(leaf)]
  # Leaves that are no arrays (a Python number given as an argument) are inputs too.
  values = [STABLE_TEXT.values([leaf]) for leaf in leaves if not is_array_like(leaf)]
  streams = jax.tree_util.tree_leaves(random_streams)
  found = {
    "format": _store.FORMAT,
    "flaxlens": package_metadata.version("flaxlens"),
    "model": {
      "call": tree.where(),
      "class": tree.module_type.__qualname__,
      "variables": len(variables),
      "fingerprint": fingerprint(variables),
    },
    "sites": [_site_entry(k, site, shapes, stored) for k, site in enumerate(plan.sites)],
    "ids": None if plan.ids is None else STABLE_TEXT.function(plan.ids),
    "inputs": {
      "structure": str(treedef),
      "arrays": [[np.dtype(a.dtype).name, np.ndim(a)] for a in arrays],
      **({"values": values} if values else {}),
    },
    "first_batch": fingerprint([(str(i), a) for i, a in enumerate(arrays)]),
    "random_streams": fingerprint([(str(i), s) for i, s in enumerate(streams)])
    if streams
    else None,
  }
  settings = json.dumps({key: found[key] for key in _SETTINGS}, sort_keys=True)
  found["fingerprint"] = hashlib.sha256(settings.encode()).hexdigest()[:32]
  if updates:
    found["updates"] = list(updates)  # state a run updates: skipped batches are run again
  return found


def _site_entry(
  k: int, site: SitePlan, shapes: dict[str, Any] | None, stored: list[dict[str, Any]] | None
) -> dict[str, Any]:
  """Site `k`'s entry in the metadata, what it stores read from `shapes` or, with `shapes`
  None, from the `stored` sites of a store (see `store_metadata`)."""
  entry = {"name": site.name, "group": f"s{k}", "positions": _rule_text(site.rule)}
  entry.update(_part_entry(site))
  if shapes is None:
    derived = ("dtype", "features", "chunk", "ids")
    there = stored[k] if stored is not None and k < len(stored) else {}
    entry.update({key: there.get(key) for key in derived})
    if site.dtype is not None:
      entry["dtype"] = site.dtype.name
    return entry
  found = shapes[site.name]
  dtype = np.dtype(found["values"].dtype)
  features = row_features(found)
  if 0 in features:
    raise ArgumentError(
      f"{site.name}: fl.harvest stores rows of the site's features, and its rows have the"
      f" feature shape {tuple(features)}, which holds no value. Harvest a site"
      " whose rows hold values."
    )
  rows = None if "count" in found else found["values"].shape[0]
  entry["dtype"] = dtype.name
  entry["features"] = features
  entry["chunk"] = _store.chunk_rows(features, dtype.itemsize, rows)
  entry["ids"] = np.dtype(found["ids"].dtype).name if "ids" in found else None
  return entry


def _rule_text(rule: Any) -> Any:
  return f"mask {STABLE_TEXT.function(rule)}" if callable(rule) else rule


def _part_entry(site: SitePlan) -> dict[str, Any]:
  """A site's `part` in the metadata: absent for the whole output (as stores made before
  `part=` existed record it), so that their fingerprints stay theirs."""
  return {} if site.part is None else {"part": site.part}


def model_variables(tree: CallNode) -> list[tuple[str, Any]]:
  """The model's variables as `(label, array)`, as the store's model fingerprint sums them
  (taken before a step that may update the model's state)."""
  return [
    (v.label or str(i), leaf)  # a boxed value (nn.Partitioned) by its array
    for i, v in enumerate(variables_in(tree))
    if not isinstance(v.value, Uninitialized)
    for leaf in jax.tree_util.tree_leaves(v.value)
  ]


def differences(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
  """What differs between a store's metadata (`there`) and this call's (`here`), in words;
  nothing where the store is this call's."""
  if there.get("format") != here["format"]:
    return [f"format: {there.get('format')!r} there, {here['format']!r} now"]
  found = [
    f"{key}: {json.dumps(there.get(key))} there, {json.dumps(here[key])} now"
    for key in _SETTINGS
    if there.get(key) != here[key]
  ]
  if there.get("model") != here["model"] and there.get("updates"):
    found.append(
      f"(the model's state is part of it, and a run of this model updates {there['updates'][:3]}:"
      " each harvest or call of the model advances it, as the model's own calls do)"
    )
  return found
