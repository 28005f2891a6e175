"""From a checkpoint to a tree (docs/your-model.md), checked against the models themselves.

examples/your_model.py's two roads: a MaxText-like NNX decoder (layers stacked by
`nnx.vmap`, run by `jax.lax.scan` over a rematerialized body) saved and restored with Orbax,
and a Llama-like NNX model read from a safetensors file in Hugging Face's naming. Then the
libraries installed here on the same roads: google-tunix's Llama3 through tunix's own
safetensors loader, and Hugging Face's Flax Llama (transformers 4) from a PyTorch-named
safetensors file. Every value is compared with the model's own call or a hand-written
native recomputation (`nnx.merge` of one layer's slice of the stacked weights).
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl

pytestmark = pytest.mark.slow

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "your_model.py"
B, T = 2, 8


@pytest.fixture(scope="module")
def example():
  """examples/your_model.py as a module (its `main` does not run)."""
  pytest.importorskip("orbax.checkpoint")
  spec = importlib.util.spec_from_file_location("your_model", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules["your_model"] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def decoder(example, tmp_path_factory):
  """The made model, the model restored from its Orbax checkpoint, and its tree."""
  config = example.Config()
  made, model = example.save_and_restore(tmp_path_factory.mktemp("orbax") / "ckpt", config)
  clean = jax.random.randint(jax.random.key(1), (B, T), 0, config.vocab)
  return made, model, fl.unflaxify(model, clean), clean


def _native_layers(model, x, edit=None):
  """The decoder's layers unrolled by hand: layer i is `nnx.merge` of the i-th slice of the
  stacked weights; `edit(i, output)` may change a layer's output. Each layer's output."""
  graphdef, state = nnx.split(model.decoder.layers)
  outputs = []
  for i in range(model.decoder.layers.mlp.wo.kernel.shape[0]):
    layer = nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, i=i: a[i], state))
    x = layer(x)
    x = x if edit is None else edit(i, x)
    outputs.append(x)
  return outputs


def _native_scan(model, tokens):
  """The decoder's own scan (`jax.lax.scan` over the rematerialized merge of each layer's
  slice), written out by hand to keep each layer's output as the scan's `ys`."""
  graphdef, params, rest = nnx.split(model.decoder.layers, nnx.Param, ...)

  def layer_fn(carry, layer_state):
    output = nnx.merge(graphdef, *layer_state)(carry)
    return output, output

  _, outputs = jax.lax.scan(jax.checkpoint(layer_fn), model.token_embedder(tokens), (params, rest))
  return outputs


def _native_logits(model, tokens, edit=None):
  x = _native_layers(model, model.token_embedder(tokens), edit)[-1]
  return model.token_embedder.attend(model.decoder.decoder_norm(x))


def test_the_restored_decoder_is_the_saved_one_and_its_tree_computes_it_bit_for_bit(decoder):
  made, model, tree, clean = decoder
  assert_trees_equal(nnx.state(model), nnx.state(made))
  assert model.decoder.layers.mlp.wo.kernel.shape[0] == 4  # stacked: (layers, in, out)
  native = nnx.jit(lambda m, t: m(t))(model, clean)
  assert_trees_equal(fl.run(tree, clean), native)


def test_capture_of_the_scanned_layer_stacks_each_layers_output(decoder):
  _, model, tree, clean = decoder
  _, cache = fl.capture(tree, clean, "decoder/layers")
  assert_trees_equal(cache["decoder/layers"], nnx.jit(_native_scan)(model, clean))
  assert cache["decoder/layers"].shape == (4, B, T, 32)


def test_sweep_patches_each_layer_of_the_scan_as_a_native_edit(decoder):
  _, model, tree, clean = decoder
  corrupted = clean.at[:, 3].set((clean[:, 3] + 1) % 64)
  metric = lambda logits: (logits[:, -1, 5] - logits[:, -1, 6]).mean()
  result = fl.sweep(tree, clean, corrupted, "decoder/layers", metric, positions=range(T))
  kept = _native_layers(model, model.token_embedder(clean))

  def patched(layer, position):
    def edit(i, x):
      return jnp.where(i == layer, x.at[:, position].set(kept[i][:, position]), x)

    return metric(_native_logits(model, corrupted, edit))

  layers, positions = jnp.meshgrid(jnp.arange(4), jnp.arange(T), indexing="ij")
  expected = jax.jit(jax.vmap(jax.vmap(patched)))(layers, positions)
  assert result.sites == tuple(f"decoder/layers[{i}]" for i in range(4))
  np.testing.assert_allclose(result.values, expected, rtol=1e-5, atol=1e-6)


def _native_scan_edited(model, tokens, layer, edit):
  """The decoder's own scan with `edit` applied to the output of layer `layer` only: the
  iteration number rides along with each layer's slice, as a hand-written native edit."""
  graphdef, params, rest = nnx.split(model.decoder.layers, nnx.Param, ...)

  def layer_fn(carry, sliced):
    layer_state, i = sliced
    output = nnx.merge(graphdef, *layer_state)(carry)
    return jnp.where(i == layer, edit(output), output), None

  x, _ = jax.lax.scan(
    jax.checkpoint(layer_fn), model.token_embedder(tokens), ((params, rest), jnp.arange(4))
  )
  return model.token_embedder.attend(model.decoder.decoder_norm(x))


def test_one_layer_of_the_scan_is_a_site_ablated_and_captured_alone(decoder):
  _, model, tree, clean = decoder
  ablated = fl.run(tree, clean, interventions=[fl.ablate("decoder/layers[2]")])
  native = nnx.jit(_native_scan_edited, static_argnums=(2, 3))(model, clean, 2, jnp.zeros_like)
  assert_trees_equal(ablated, native)
  steer = fl.steer("decoder/layers[1]", jnp.ones(32), alpha=0.5)
  eager = fl.run(tree, clean, interventions=[steer], jit=False)
  add = lambda x: x + 0.5 * jnp.ones(32)
  assert_trees_equal(eager, _native_scan_edited(model, clean, 1, add))
  _, cache = fl.capture(tree, clean, "decoder/layers[2]")
  assert_trees_equal(cache["decoder/layers[2]"], nnx.jit(_native_scan)(model, clean)[2])


def test_harvest_of_the_scanned_layer_keeps_every_layer_in_each_tokens_row(decoder, tmp_path):
  _, _, tree, clean = decoder
  batches = [clean, (clean + 7) % 64]
  keep = lambda tokens: tokens % 3 != 0
  store = fl.harvest(
    tree, batches, ["decoder/layers", "decoder/decoder_norm"], str(tmp_path / "h"), positions=keep
  )
  offset = 0
  for batch in batches:
    _, cache = fl.capture(tree, batch, ["decoder/layers", "decoder/decoder_norm"])
    mask = np.asarray(keep(batch))
    rows = slice(offset, offset + mask.sum())
    by_token = np.moveaxis(
      np.asarray(cache["decoder/layers"]), 0, 2
    )  # (batch, length, layers, dim)
    np.testing.assert_array_equal(store["decoder/layers"][rows], by_token[mask])
    norm = np.asarray(cache["decoder/decoder_norm"])[mask]
    np.testing.assert_array_equal(store["decoder/decoder_norm"][rows], norm)
    offset += mask.sum()
  assert store["decoder/layers"].shape == (offset, 4, 32)


# --- weights from safetensors in Hugging Face's naming ------------------------------------


@pytest.fixture(scope="module")
def llama(example, tmp_path_factory):
  config = example.Config()
  path = tmp_path_factory.mktemp("hf") / "model.safetensors"
  example.write_hf_checkpoint(path, config)
  return example.load_safetensors(path, config), path


def test_every_hf_weight_lands_on_its_nnx_parameter_transposed_as_torch_stores_it(llama):
  model, path = llama
  stored = safetensors.numpy.load_file(path)
  q = stored["model.layers.1.self_attn.q_proj.weight"]
  np.testing.assert_array_equal(model.layers[1].self_attn.q_proj.kernel.get_value(), q.T)
  norm = stored["model.layers.2.post_attention_layernorm.weight"]
  np.testing.assert_array_equal(model.layers[2].post_attention_layernorm.scale.get_value(), norm)
  np.testing.assert_array_equal(model.lm_head.kernel.get_value(), stored["lm_head.weight"].T)
  assert len(stored) == len(nnx.to_flat_state(nnx.state(model)))


def test_the_loaded_model_converts_and_its_captures_are_the_models_values(llama):
  model, _ = llama
  tokens = jax.random.randint(jax.random.key(2), (B, T), 0, 64)
  tree = fl.unflaxify(model, tokens)
  assert_trees_equal(fl.run(tree, tokens), nnx.jit(lambda m, t: m(t))(model, tokens))

  def mlp_outputs(m, t):
    x, outputs = m.embed_tokens(t), []
    for layer in m.layers:
      x = x + layer.self_attn(layer.input_layernorm(x))
      outputs.append(layer.mlp(layer.post_attention_layernorm(x)))
      x = x + outputs[-1]
    return outputs

  _, cache = fl.capture(tree, tokens, "layers/*/mlp")
  expected = nnx.jit(mlp_outputs)(model, tokens)
  assert_trees_equal([cache[f"layers/{i}/mlp"] for i in range(4)], expected)


def test_the_loader_refuses_a_name_it_cannot_place(example, tmp_path):
  config = example.Config()
  path = tmp_path / "model.safetensors"
  example.write_hf_checkpoint(path, config)
  weights = safetensors.numpy.load_file(path)
  weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  safetensors.numpy.save_file(weights, path)
  with pytest.raises(ValueError, match="rotary_emb.inv_freq: no NNX weight"):
    example.load_safetensors(path, config)
  del weights["model.layers.0.self_attn.rotary_emb.inv_freq"], weights["model.norm.weight"]
  safetensors.numpy.save_file(weights, path)
  with pytest.raises(ValueError, match=r"no weights for \['norm/scale'\]"):
    example.load_safetensors(path, config)


# --- the libraries installed here, on the same roads --------------------------------------


def _hf_llama_weights(layers, dim, kv_dim, mlp_dim, vocab, seed=0):
  """Random weights under a Hugging Face Llama checkpoint's names, `[out, in]` Linears."""
  shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,)}
  shapes["lm_head.weight"] = (vocab, dim)
  per_layer = {
    "input_layernorm": (dim,),
    "post_attention_layernorm": (dim,),
    "self_attn.q_proj": (dim, dim),
    "self_attn.k_proj": (kv_dim, dim),
    "self_attn.v_proj": (kv_dim, dim),
    "self_attn.o_proj": (dim, dim),
    "mlp.gate_proj": (mlp_dim, dim),
    "mlp.up_proj": (mlp_dim, dim),
    "mlp.down_proj": (dim, mlp_dim),
  }
  for i in range(layers):
    shapes |= {f"model.layers.{i}.{name}.weight": s for name, s in per_layer.items()}
  rng = np.random.default_rng(seed)
  return {k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in shapes.items()}


def test_tunix_llama3_read_by_tunixs_own_safetensors_loader_converts_bit_for_bit(tmp_path):
  from ._tunix import load_llama3, tunix_settings

  llama3 = load_llama3()  # registers tunix's packages without their __init__ imports
  params = importlib.import_module("tunix.models.llama3.params")
  config = llama3.ModelConfig(
    num_layers=2,
    vocab_size=64,
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
    rope_theta=10_000,
    norm_eps=1e-5,
  )
  weights = _hf_llama_weights(2, 32, 16, 64, 64)
  safetensors.numpy.save_file(weights, tmp_path / "model.safetensors")
  with tunix_settings():
    model = params.create_model_from_safe_tensors(str(tmp_path), config, mode="original")
    q = weights["model.layers.1.self_attn.q_proj.weight"].T.reshape(32, 4, 8)
    np.testing.assert_array_equal(model.layers[1].attn.q_proj.w.get_value(), q)
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, 64)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.tril(jnp.ones((T, T), jnp.bool_))[None].repeat(B, 0)
    args = (tokens, positions, None, mask)
    tree = fl.unflaxify(model, *args)
    assert_trees_equal(tree(fl.ArgsAndKwargs.capture(*args)), model(*args))


def test_hugging_face_flax_llama_from_a_pytorch_safetensors_file_converts_bit_for_bit(tmp_path):
  transformers = pytest.importorskip("transformers")
  config = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=False,
  )
  config.save_pretrained(tmp_path)
  weights = _hf_llama_weights(2, 32, 16, 64, 64)
  metadata = {"format": "pt"}
  safetensors.numpy.save_file(weights, tmp_path / "model.safetensors", metadata=metadata)
  model = transformers.FlaxLlamaForCausalLM.from_pretrained(tmp_path, from_pt=True)
  kernel = model.params["model"]["layers"]["1"]["mlp"]["down_proj"]["kernel"]
  np.testing.assert_array_equal(kernel, weights["model.layers.1.mlp.down_proj.weight"].T)
  tokens = jax.random.randint(jax.random.key(2), (B, T), 0, 64)
  args = (tokens, jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(T), (B, T)))
  tree = fl.unflaxify(model.module, {"params": model.params}, *args)
  native = jax.jit(lambda p, *a: model.module.apply({"params": p}, *a))(model.params, *args)
  assert_trees_equal(fl.run(tree, args), native)
