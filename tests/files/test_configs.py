"""Finding 4: modules whose fields are configuration objects save, load and replay exactly.

Fast tests cover each built-in value codec (dataclasses, NamedTuples, enums, dtypes,
`functools.partial`) and the policy around registered codecs; the slow ones save one
block of each Hugging Face Flax model family (tiny random configs, no downloads) and
replay it in a fresh process with `flaxlens replay --allow transformers`.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import flaxlens as fl

from .conftest import read_manifest, write_manifest


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  features: int
  activation: Callable = nn.gelu


class Widths(NamedTuple):
  hidden: int
  out: int


class ConfiguredBlock(nn.Module):
  config: BlockConfig
  widths: Widths = Widths(4, 2)

  @nn.compact
  def __call__(self, x):
    x = self.config.activation(nn.Dense(self.config.features)(x))
    return nn.Dense(self.widths.out)(nn.Dense(self.widths.hidden)(x))


X = jax.random.normal(jax.random.key(2), (2, 3))

FLAX_MODULES = {
  "dtype_and_precision_enum": nn.Dense(3, dtype=jnp.bfloat16, precision=jax.lax.Precision.HIGHEST),
  "partial_of_an_allowed_function": nn.MultiHeadDotProductAttention(
    num_heads=1, attention_fn=functools.partial(nn.dot_product_attention, broadcast_dropout=False)
  ),
}


@pytest.mark.parametrize("name", FLAX_MODULES)
def test_flax_module_settings_round_trip_without_allowing_anything(tmp_path, name):
  module = FLAX_MODULES[name]
  x = X[:, None, :] if name.startswith("partial") else X
  isolated = fl.isolate(fl.unflaxify(module, module.init(jax.random.key(0), x), x), x, "")
  fl.save_isolated(isolated, tmp_path / "a")
  loaded = fl.load_isolated(tmp_path / "a")
  assert repr(loaded.submodel.module) == repr(module)  # A partial compares by identity.
  assert loaded.replay().bitwise


def test_a_dataclass_config_and_a_namedtuple_of_an_allowed_package_round_trip(tmp_path):
  module = ConfiguredBlock(BlockConfig(5, nn.silu), Widths(6, 1))
  isolated = fl.isolate(fl.unflaxify(module, module.init(jax.random.key(0), X), X), X, "")
  fl.save_isolated(isolated, tmp_path / "a")
  assert read_manifest(tmp_path / "a")["requires"] == ["files"]
  loaded = fl.load_isolated(tmp_path / "a", allow=["files"])
  assert loaded.submodel.module.config == module.config
  assert loaded.submodel.module.widths == module.widths
  assert loaded.replay().bitwise


def test_a_config_of_a_package_not_allowed_is_refused(tmp_path):
  module = ConfiguredBlock(BlockConfig(5))
  tree = fl.unflaxify(module, module.init(jax.random.key(0), X), X)
  fl.save_isolated(fl.isolate(tree, X, ""), tmp_path / "a")
  with pytest.raises(fl.ArtifactError, match=r"allow=\['files'\]"):
    fl.load_isolated(tmp_path / "a")


def test_a_registered_codec_needs_its_package_allowed(artifact):
  manifest = read_manifest(artifact)
  manifest["saved"]["kwargs"] = {
    "dict": [
      [
        "config",
        {
          "object": "hf_config",
          "class": "transformers.models.gpt2:GPT2Config",
          "data": {"dict": []},
        },
      ]
    ]
  }
  manifest["requires"] = ["transformers"]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"allow=\['transformers'\]"):
    fl.load_isolated(artifact)


def test_a_codec_class_must_subclass_the_codec_base(artifact):
  manifest = read_manifest(artifact)
  manifest["saved"]["kwargs"] = {
    "dict": [["x", {"object": "hf_config", "class": "flax.linen:Dense", "data": {"dict": []}}]]
  }
  manifest["requires"] = []
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match="transformers"):
    fl.load_isolated(artifact, allow=["transformers"])


def _hf_blocks():
  """(name, module, args, kwargs, isolated path) per model family; built on demand."""
  transformers = pytest.importorskip("transformers")
  transformers.utils.logging.set_verbosity_error()
  from transformers.models.bert import modeling_flax_bert as bert
  from transformers.models.clip import modeling_flax_clip as clip
  from transformers.models.gpt2 import modeling_flax_gpt2 as gpt2
  from transformers.models.llama import modeling_flax_llama as llama
  from transformers.models.t5 import modeling_flax_t5 as t5
  from transformers.models.vit import modeling_flax_vit as vit
  from transformers.models.whisper import modeling_flax_whisper as whisper

  small = dict(hidden_size=16, num_attention_heads=2, intermediate_size=32, num_hidden_layers=1)
  x = jax.random.normal(jax.random.key(1), (2, 5, 16))
  mask = jnp.ones((2, 5), jnp.int32)
  t5_config = transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_heads=2, num_layers=1)
  t5_config.causal = False  # Set by the T5 stack on its blocks' config.
  whisper_config = transformers.WhisperConfig(
    d_model=16, encoder_attention_heads=2, encoder_ffn_dim=32, encoder_layers=1
  )
  llama_config = transformers.LlamaConfig(
    **small, num_key_value_heads=2, max_position_embeddings=16
  )
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  return {
    "bert": (
      bert.FlaxBertLayer(transformers.BertConfig(**small)),
      (x, mask[:, None, None, :].astype(jnp.float32), None),
      {"deterministic": True},
      "attention",
    ),
    "gpt2": (
      gpt2.FlaxGPT2Block(transformers.GPT2Config(n_embd=16, n_head=2, n_layer=1, n_positions=8)),
      (x,),
      {"attention_mask": mask},
      "attn",
    ),
    # Without relative attention bias: its bucketing calls jnp.clip(a_max=), gone from JAX.
    "t5": (t5.FlaxT5Block(t5_config), (x,), {}, "0/SelfAttention"),
    "llama": (
      llama.FlaxLlamaDecoderLayer(llama_config),
      (x,),
      {"attention_mask": mask, "position_ids": positions},
      "self_attn",
    ),
    "vit": (vit.FlaxViTLayer(transformers.ViTConfig(**small)), (x,), {}, "attention"),
    "clip": (
      clip.FlaxCLIPEncoderLayer(transformers.CLIPTextConfig(**small)),
      (x, mask),
      {},
      "self_attn",
    ),
    "whisper": (whisper.FlaxWhisperEncoderLayer(whisper_config), (x, None), {}, "self_attn"),
  }


HF = ["bert", "gpt2", "t5", "llama", "vit", "clip", "whisper"]


def _save_hf_block(name, path):
  module, args, kwargs, at = _hf_blocks()[name]
  variables = module.init(jax.random.key(0), *args, **kwargs)
  tree = fl.unflaxify(module, variables, *args, **kwargs)
  fl.save_isolated(fl.isolate(tree, fl.ArgsAndKwargs.capture(*args, **kwargs), at), path)


def _replay_in_fresh_process(path, *flags):
  return subprocess.run(
    [sys.executable, "-m", "flaxlens.cli", "replay", str(path), *flags],
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.slow
@pytest.mark.parametrize("name", HF)
def test_a_hugging_face_block_replays_exactly_in_a_fresh_process(tmp_path, name):
  _save_hf_block(name, tmp_path / name)
  assert read_manifest(tmp_path / name)["requires"] == ["transformers"]
  result = _replay_in_fresh_process(tmp_path / name, "--allow", "transformers")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "exact replay" in result.stdout


@pytest.mark.slow
def test_a_hugging_face_block_needs_transformers_allowed(tmp_path):
  _save_hf_block("gpt2", tmp_path / "gpt2")
  result = _replay_in_fresh_process(tmp_path / "gpt2")
  assert result.returncode == 2
  assert "--allow transformers" in result.stderr
