"""A Linen run given random streams is not split to fit `budget=`: each chunk would draw the
random numbers that Flax draws once for the whole batch (NNX models keep their random
state in variables, whose update refuses the split: tests/shared/test_budget.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from frameworks import LINEN

import flaxlens as fl


def test_a_run_given_random_streams_is_not_split(corpora):
  case = corpora[LINEN]["dropout"]
  tree = LINEN.convert(case)
  argument = LINEN.argument(case)
  _, cache = fl.capture(tree, argument, random_streams=case.rngs)
  size = sum(np.asarray(v).nbytes for v in jax.tree_util.tree_leaves(cache))
  with pytest.raises(fl.BudgetError, match="every chunk of the batch would draw the same"):
    fl.capture(tree, argument, random_streams=case.rngs, budget=size - 1)
