"""Isolation only NNX has: rng counts in modules, NNX objects as arguments, saved NNX calls.

Isolation behaviours both frameworks share are in tests/shared/test_isolate.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import NNX

import flaxlens as fl

from .corpus import FLAX_RELEASE

# flax 0.12.0's layers keep their initializers (closures, which an artifact refuses) as
# static attributes, and jax 0.7.x cannot rebuild a saved pytree definition.
SAVES_NNX_CALLS = pytest.mark.skipif(
  FLAX_RELEASE < (0, 12, 1), reason="saving NNX calls needs flax 0.12.1 (and jax 0.8) or newer"
)


def test_dropout_state_is_saved_so_the_mask_replays(cases):
  isolated = NNX.isolate(cases["convnet_train"], "drop")
  labels = [v.label for v in isolated.initial_var_values]
  assert any(label.startswith("RngCount:") for label in labels)
  assert not np.array_equal(isolated.saved_output, isolated.saved_arg.args[0])
  assert isolated.replay()


def test_a_call_receiving_nnx_objects_is_refused_with_the_reason(cases):
  case = cases["rngs_argument"]
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="drop.__call__: the call receives NNX"):
    NNX.isolate(case, "drop")


@pytest.mark.parametrize(
  "name, path",
  [
    ("convnet_train", "drop"),
    ("convnet_train", "norm"),
    ("attention_decode", None),
    ("linen_bridge", None),
    ("sow_outside_capture", None),
    ("shared_submodule", None),  # The GraphDef names the shared module again (a NodeRef).
  ],
)
@SAVES_NNX_CALLS
def test_a_saved_nnx_call_loads_and_replays_exactly(cases, tmp_path, name, path):
  isolated = NNX.isolate(cases[name], path)
  fl.save_isolated(isolated, tmp_path / "call")
  loaded = fl.load_isolated(tmp_path / "call", allow=["nnx"])
  assert loaded.replay()
  assert_trees_equal(loaded.saved_output, isolated.saved_output)


@SAVES_NNX_CALLS
def test_a_saved_scan_iteration_loads_and_replays_exactly(cases, tmp_path):
  case = cases["scan"]
  found = NNX.isolate(case, "blocks/linear", every=True)
  fl.save_isolated(found[2], tmp_path / "iteration")
  loaded = fl.load_isolated(tmp_path / "iteration", allow=["nnx"])
  assert loaded.call_number == 2
  assert loaded.replay()


@pytest.mark.parametrize("name", ["jit_method", "nnx_jit_inside"])
def test_a_call_running_nnx_jit_isolates_and_replays_its_native_output(cases, name):
  # nnx.jit hands back every variable it is given as a new array: no update.
  isolated = NNX.isolate(cases[name], None)
  assert isolated.replay()
  assert_trees_equal(isolated.saved_output, NNX.native(cases[name])[0])


@SAVES_NNX_CALLS
def test_saving_a_call_receiving_an_rngs_names_the_nnx_object_and_the_fix(cases, tmp_path):
  isolated = NNX.isolate(cases["rngs_argument"], None)
  with pytest.raises(
    fl.ArtifactError, match=r"saved_arg.kwargs\['rngs'\]: it is an NNX object"
  ) as e:
    fl.save_isolated(isolated, tmp_path / "call")
  assert "keep the nnx.Rngs (or module) in the model" in str(e.value)
  assert not (tmp_path / "call").exists()
