"""An edited Hugging Face Flax GPT-2 goes back into its own class and round-trips.

The model's Linen module is converted with `model.params`, a parameter edit steers it
(a vector added to one block's MLP output bias), and `model.params` is replaced by the
exported parameters. `save_pretrained` then writes it, and a fresh process's
`from_pretrained` must compute the steered tree's logits bit for bit. Interventions
folded into the parameters (`fl.fold`) go the same way, and the reloaded model must
compute what the tree computes with the interventions, within folding's tolerance.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl

pytestmark = pytest.mark.slow

BIAS = "params:transformer/h/0/mlp/c_proj/bias"
LOAD = """
import sys, numpy as np, jax.numpy as jnp, transformers
model = transformers.FlaxGPT2LMHeadModel.from_pretrained(sys.argv[1])
data = np.load(sys.argv[2])
ids = jnp.asarray(data["ids"])
logits = model(ids, attention_mask=jnp.ones_like(ids)).logits
want, got = data["logits"], np.asarray(logits)
print("match:", got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)))
print("max abs:", float(np.max(np.abs(got - want))))
"""


def _gpt2(transformers):
  transformers.utils.logging.set_verbosity_error()
  config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
  model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
  ids = jax.random.randint(jax.random.key(6), (2, 8), 0, 100)
  return model, ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(8), (2, 8))


def _reload(tmp_path, model, ids, logits) -> str:
  """`save_pretrained`, then `from_pretrained` and a call in a fresh process; its report."""
  model.save_pretrained(tmp_path / "edited")
  np.savez(tmp_path / "data.npz", ids=np.asarray(ids), logits=np.asarray(logits))
  result = subprocess.run(
    [sys.executable, "-c", LOAD, str(tmp_path / "edited"), str(tmp_path / "data.npz")],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=pathlib.Path(__file__).parent,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_a_steered_gpt2_saves_with_save_pretrained_and_loads_in_a_fresh_process(tmp_path):
  model, ids, mask, positions = _gpt2(pytest.importorskip("transformers"))
  tree = fl.unflaxify(model.module, {"params": model.params}, ids, mask, positions)
  (bias,) = [v for v in fl.variables_in(tree) if v.label == BIAS]
  bias.value = bias.value + jax.random.normal(jax.random.key(3), bias.value.shape)
  steered = tree(fl.ArgsAndKwargs.capture(ids, mask, positions)).logits
  original = np.asarray(model(ids, attention_mask=mask).logits)
  assert not np.array_equal(np.asarray(steered), original)

  model.params = tree.export()["params"]
  assert "match: True" in _reload(tmp_path, model, ids, steered)


def test_interventions_folded_into_gpt2_save_and_load_computing_the_intervened_tree(tmp_path):
  model, ids, mask, positions = _gpt2(pytest.importorskip("transformers"))
  tree = fl.unflaxify(model.module, {"params": model.params}, ids, mask, positions)
  edits = [
    fl.steer("transformer/h/0/mlp/c_proj", jax.random.normal(jax.random.key(3), (32,)), 4.0),
    fl.ablate("transformer/h/1/attn/c_proj", on="input", where=jnp.s_[..., 16:]),  # head 1
  ]
  intervened = fl.run(tree, (ids, mask, positions), interventions=edits).logits
  original = np.asarray(model(ids, attention_mask=mask).logits)
  assert np.max(np.abs(np.asarray(intervened) - original)) > 0.1

  model.params = fl.fold(tree, (ids, mask, positions), edits).export()["params"]
  report = _reload(tmp_path, model, ids, intervened)
  assert float(report.split("max abs:")[1]) <= 1e-5, report
