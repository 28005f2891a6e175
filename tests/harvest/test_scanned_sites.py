"""A site inside an `nn.scan`/`nnx.scan` or vmap body: `fl.capture` stacks its values along
the iterations (or members), first; `fl.harvest` keeps a row per example (and position)
whose value holds every iteration, `(rows, iterations, ...)`, so that each row is one
example's, as for any other site."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx
from frameworks import LINEN, NNX

import flaxlens as fl

# (framework, corpus case): the call inside the body, and the body's iterations or members.
STACKED = {
  (LINEN, "scan"): ("layers/Dense_0", 3),
  (NNX, "scan"): ("blocks/linear", 4),
  (LINEN, "vmap"): ("ensemble", 3),
  (NNX, "vmap_ensemble"): ("members", 3),
}


@pytest.mark.parametrize("positions", ["all", None])
@pytest.mark.parametrize("setting", list(STACKED), ids=lambda s: f"{s[0].name}-{s[1]}")
def test_harvest_rows_of_a_call_in_a_scan_or_vmap_hold_every_iteration(
  setting, positions, corpora, tmp_path
):
  framework, name = setting
  case = corpora[framework][name]
  if setting == (NNX, "scan"):  # its blocks hold a Dropout
    case = dataclasses.replace(case, model=nnx.view(case.model, deterministic=True))
  tree = framework.convert(case)
  site, iterations = STACKED[setting]
  x = case.args[0]
  batches = [x, -x]
  store = fl.harvest(tree, batches, site, str(tmp_path / "h"), positions=positions)
  stacked = [np.asarray(fl.capture(tree, batch, site)[1][site]) for batch in batches]
  assert stacked[0].shape[0] == iterations  # the capture: iterations first
  behind = 1 if positions is None else 2
  rows = [np.moveaxis(s, 0, behind) for s in stacked]
  rows = [r.reshape(-1, *r.shape[behind:]) for r in rows]
  np.testing.assert_array_equal(store[site][:], np.concatenate(rows))
  assert store[site].shape[1] == iterations
