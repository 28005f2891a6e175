"""Induction heads, end to end: examples/induction_heads.py's findings hold on three seeds.

Three two-layer attention-only transformers (Flax's `nn.MultiHeadDotProductAttention`,
4 heads in layer 0, one in layer 1) are trained here on random tokens with one segment
repeated at a random length and distance (about 80 s of CPU for the three, in one
compiled program), then analysed with
the public API only, as the example does. Each test states one finding for every seed;
the two tools whose values the findings rest on (a head's ablation, the hand-written path
patching) are compared against native Flax computations.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import flax.linen as nn
import jax
import pytest

import flaxlens as fl

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "induction_heads.py"


def _load_example():
  spec = importlib.util.spec_from_file_location("induction_heads", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def example():
  yield _load_example()
  sys.modules.pop("induction_heads")


@pytest.fixture(scope="module")
def trained(example):
  variables, _ = example.train(list(SEEDS))
  return [jax.tree.map(lambda v, i=i: v[i], variables) for i in range(len(SEEDS))]


@pytest.fixture(scope="module")
def findings(example, trained):
  return [example.analyse(v, jax.random.key(1000 + s)) for s, v in zip(SEEDS, trained, strict=True)]


def _native(example, variables, tokens, edits=None, keep=()):
  """The model's own `apply`, jitted, with `edits[(path, "input"|"output")]` (a function of
  the value) applied to the named calls by Flax's method interception; returns the logits
  and the values named in `keep` (after the edits)."""
  edits = edits or {}

  def apply(variables, tokens):
    kept = {}

    def interceptor(next_fun, args, kwargs, context):
      path = "/".join(context.module.scope.path)
      if context.method_name != "__call__":
        return next_fun(*args, **kwargs)
      if (path, "input") in edits:
        args = (edits[path, "input"](args[0]), *args[1:])
      if (path, "input") in keep:
        kept[path, "input"] = args[0]
      out = next_fun(*args, **kwargs)
      out = edits[path, "output"](out) if (path, "output") in edits else out
      if (path, "output") in keep:
        kept[path, "output"] = out
      return out

    with nn.intercept_methods(interceptor):
      return example.MODEL.apply(variables, tokens), kept

  return jax.jit(apply)(variables, tokens)


def test_the_models_learn_to_predict_repeated_tokens(findings):
  for f in findings:
    assert f.repeated < 0.3 * f.unrepeated, (f.repeated, f.unrepeated)


def test_ablating_a_head_equals_zeroing_its_slice_of_the_output_projection_natively(
  example, trained
):
  batch = example.make_batch(jax.random.key(7), 8)
  tree = fl.unflaxify(example.MODEL, trained[0], batch.tokens)
  ablated = fl.run(tree, batch.tokens, interventions=[example.ablate_head(0, 2)])
  zero_head = lambda x: x.at[:, :, 2].set(0.0)
  native, _ = _native(example, trained[0], batch.tokens, {("block_0/attn/out", "input"): zero_head})
  assert (ablated == native).all()


def test_path_patching_equals_a_native_three_run_computation(example, trained, findings):
  sender, receiver = findings[0].previous_token_head, list(findings[0].induction_heads)
  k_clean, k_corrupted = jax.random.split(jax.random.key(8))
  batch, corrupted = example.make_batch(k_clean, 16), example.make_batch(k_corrupted, 16).tokens
  tree = fl.unflaxify(example.MODEL, trained[0], batch.tokens)
  out_input, key_output = ("block_0/attn/out", "input"), ("block_1/attn/key", "output")
  _, dirty = _native(example, trained[0], corrupted, keep=[out_input])
  patch_sender = lambda x: x.at[:, :, sender].set(dirty[out_input][:, :, sender])
  _, keys = _native(example, trained[0], batch.tokens, {out_input: patch_sender}, [key_output])
  patch_keys = lambda x: x.at[:, :, receiver].set(keys[key_output][:, :, receiver])
  logits, _ = _native(example, trained[0], batch.tokens, {key_output: patch_keys})
  expected = example.losses(logits, batch)[0]
  patched = example.path_patch_keys(tree, batch, corrupted, receiver)[sender]
  assert patched == pytest.approx(expected, rel=1e-5)
  assert patched > example.losses(fl.run(tree, batch.tokens), batch)[0] + 0.5  # it matters


def test_the_layer_one_head_attends_like_an_induction_head_and_layer_zero_does_not(findings):
  for f in findings:
    assert f.induction_heads == (0,), f.induction[1]
    assert f.induction[1][0] > 0.5, f.induction[1]
    assert (f.induction[0] < 0.2).all(), f.induction[0]  # one layer cannot do induction


def test_ablating_the_induction_head_hurts_repeated_tokens_more_than_any_other_head(findings):
  for f in findings:
    assert f.ablated[1][0] > f.ablated[0].max() + 1.0, (f.ablated[0], f.ablated[1])


def test_path_patching_into_the_induction_heads_keys_finds_a_previous_token_head(findings):
  for f in findings:
    assert f.previous[0][f.previous_token_head] > 0.25, f.previous[0]
    assert f.fraction(f.path_patched.max()) > 0.2, f.path_patched


def test_ablating_the_induction_head_takes_repeated_tokens_most_of_the_way_back(findings):
  for f in findings:
    assert f.fraction(f.ablated[1][0]) >= 0.8, f.ablated[1]
