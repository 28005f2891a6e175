"""From a checkpoint to a tree: the two roads a JAX language model takes to flaxlens.

Run: python examples/your_model.py (random weights; nothing is downloaded). The page
docs/your-model.md says, library by library, which road its models take.

(a) A MaxText-like NNX decoder: its layers are made once with `nnx.vmap` (every weight
    stacked along a leading layer axis) and run with `jax.lax.scan` over a rematerialized
    body that merges one layer's slice of the weights, as MaxText's NNX decoder does. Its
    state is saved with Orbax, restored into an abstract model (`nnx.eval_shape`), and
    converted; then a capture of every layer, a capture and an ablation of one layer of
    the scan (the site `decoder/layers[2]`), a per-layer patching sweep and a harvest.
(b) A Llama-like NNX model whose weights come from a safetensors file written with Hugging
    Face's names and layout (`model.layers.0.self_attn.q_proj.weight`, `[out, in]` as
    PyTorch stores a Linear), mapped onto the NNX model by a table of name patterns, as
    Bonsai's and Tunix's loaders do; then converted and checked against the model.
"""

import dataclasses
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import safetensors.numpy
from flax import nnx

import flaxlens as fl


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 32
  heads: int = 4
  mlp_dim: int = 64
  layers: int = 4


def causal_attention(q, k, v, heads):
  """Softmax attention of `(batch, length, dim)` queries, keys and values, causal."""
  b, t, d = q.shape
  q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, d)


# --- (a) a MaxText-like decoder: stacked layers, run by a scan --------------------------


class Attention(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    dense = lambda: nnx.Linear(config.dim, config.dim, use_bias=False, rngs=rngs)
    self.query, self.key, self.value, self.out = dense(), dense(), dense(), dense()
    self.heads = config.heads

  def __call__(self, x):
    return self.out(causal_attention(self.query(x), self.key(x), self.value(x), self.heads))


class Mlp(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.wi_0 = nnx.Linear(config.dim, config.mlp_dim, use_bias=False, rngs=rngs)
    self.wi_1 = nnx.Linear(config.dim, config.mlp_dim, use_bias=False, rngs=rngs)
    self.wo = nnx.Linear(config.mlp_dim, config.dim, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.wo(nnx.silu(self.wi_0(x)) * self.wi_1(x))


class DecoderLayer(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.pre_self_attention_norm = nnx.RMSNorm(config.dim, rngs=rngs)
    self.self_attention = Attention(config, rngs)
    self.mlp = Mlp(config, rngs)

  def __call__(self, x):
    normed = self.pre_self_attention_norm(x)
    return x + self.self_attention(normed) + self.mlp(normed)


class Decoder(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(layer_rngs):
      return DecoderLayer(config, layer_rngs)

    self.layers = create(rngs.split(config.layers))  # weights: (layers, ...)
    self.decoder_norm = nnx.RMSNorm(config.dim, rngs=rngs)

  def __call__(self, x):
    graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)

    def layer_fn(carry, layer_state):
      return nnx.merge(graphdef, *layer_state)(carry), None

    x, _ = jax.lax.scan(jax.checkpoint(layer_fn), x, (params, rest))
    return self.decoder_norm(x)


class Transformer(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.token_embedder = nnx.Embed(config.vocab, config.dim, rngs=rngs)
    self.decoder = Decoder(config, rngs)

  def __call__(self, tokens):
    return self.token_embedder.attend(self.decoder(self.token_embedder(tokens)))


def restore(path: pathlib.Path, config: Config) -> Transformer:
  """The model saved at `path`, restored the documented NNX way: an abstract model (no
  weights computed), its state's shapes given to Orbax, the restored state merged back."""
  abstract = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  state = ocp.StandardCheckpointer().restore(path, abstract_state)
  return nnx.merge(graphdef, state)


def save_and_restore(path: pathlib.Path, config: Config) -> tuple[Transformer, Transformer]:
  """A freshly made model, saved with Orbax as a training library saves `nnx.state`, and
  the model restored from that checkpoint."""
  made = Transformer(config, nnx.Rngs(0))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, nnx.state(made))
  checkpointer.wait_until_finished()
  return made, restore(path, config)


# --- (b) weights from safetensors in Hugging Face's naming ------------------------------


class LlamaAttention(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    dense = lambda: nnx.Linear(config.dim, config.dim, use_bias=False, rngs=rngs)
    self.q_proj, self.k_proj, self.v_proj, self.o_proj = dense(), dense(), dense(), dense()
    self.heads = config.heads

  def __call__(self, x):
    attended = causal_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads)
    return self.o_proj(attended)


class LlamaMlp(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.gate_proj = nnx.Linear(config.dim, config.mlp_dim, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(config.dim, config.mlp_dim, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(config.mlp_dim, config.dim, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.input_layernorm = nnx.RMSNorm(config.dim, rngs=rngs)
    self.self_attn = LlamaAttention(config, rngs)
    self.post_attention_layernorm = nnx.RMSNorm(config.dim, rngs=rngs)
    self.mlp = LlamaMlp(config, rngs)

  def __call__(self, x):
    x = x + self.self_attn(self.input_layernorm(x))
    return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nnx.Module):
  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.embed_tokens = nnx.Embed(config.vocab, config.dim, rngs=rngs)
    self.layers = nnx.List([LlamaLayer(config, rngs) for _ in range(config.layers)])
    self.norm = nnx.RMSNorm(config.dim, rngs=rngs)
    self.lm_head = nnx.Linear(config.dim, config.vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed_tokens(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(self.norm(x))


# Hugging Face's name -> the NNX path, and whether the array is a PyTorch Linear's
# `[out, in]` weight (transposed to NNX's `[in, out]` kernel).
HF_NAMES = (
  (r"model\.embed_tokens\.weight", "embed_tokens/embedding", False),
  (r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight", r"layers/\1/\2/\3/kernel", True),
  (r"model\.layers\.(\d+)\.(\w+_layernorm)\.weight", r"layers/\1/\2/scale", False),
  (r"model\.norm\.weight", "norm/scale", False),
  (r"lm_head\.weight", "lm_head/kernel", True),
)


def nnx_path(hf_name: str) -> tuple[str, bool]:
  for pattern, path, transposed in HF_NAMES:
    if re.fullmatch(pattern, hf_name):
      return re.sub(pattern, path, hf_name), transposed
  raise ValueError(f"{hf_name}: no NNX weight has this name; add a row to HF_NAMES.")


def hf_names(config: Config) -> list[str]:
  """The weight names of a Hugging Face Llama checkpoint of `config`'s size."""
  layer_parts = [
    "input_layernorm",
    "post_attention_layernorm",
    *(f"self_attn.{p}_proj" for p in "qkvo"),
    *(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
  ]
  per_layer = [
    f"model.layers.{i}.{part}.weight" for i in range(config.layers) for part in layer_parts
  ]
  return ["model.embed_tokens.weight", *per_layer, "model.norm.weight", "lm_head.weight"]


def load_safetensors(path: pathlib.Path, config: Config) -> Llama:
  """A `Llama` whose every weight is read from the safetensors file at `path` (reading a
  safetensors file runs no code); names, shapes and completeness are checked."""
  abstract = nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  expected = {"/".join(map(str, k)): v.shape for k, v in nnx.to_flat_state(state)}
  loaded = {}
  for hf_name, array in safetensors.numpy.load_file(path).items():
    where, transposed = nnx_path(hf_name)
    array = array.T if transposed else array
    if expected.get(where) != array.shape:
      raise ValueError(f"{hf_name} -> {where} {array.shape}: no such weight in the model.")
    loaded[where] = array
  if missing := set(expected) - set(loaded):
    raise ValueError(f"{path}: no weights for {sorted(missing)}.")
  for key, variable in nnx.to_flat_state(state):
    variable.set_value(jnp.asarray(loaded["/".join(map(str, key))]))
  return nnx.merge(graphdef, state)


def write_hf_checkpoint(path: pathlib.Path, config: Config, seed: int = 0) -> None:
  """A safetensors file as a PyTorch-trained Llama is published: Hugging Face's names,
  `[out, in]` Linear weights, random values."""
  rng = np.random.default_rng(seed)
  abstract = nnx.state(nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0))))
  shapes = {"/".join(map(str, k)): v.shape for k, v in nnx.to_flat_state(abstract)}
  hf_weights = {}
  for hf_name in hf_names(config):
    where, transposed = nnx_path(hf_name)
    shape = shapes[where][::-1] if transposed else shapes[where]
    hf_weights[hf_name] = rng.normal(0, 0.3, shape).astype(np.float32)
  safetensors.numpy.save_file(hf_weights, path)


def main() -> None:
  config = Config()
  workdir = pathlib.Path(tempfile.mkdtemp())
  _, model = save_and_restore(workdir / "checkpoint", config)
  clean = jax.random.randint(jax.random.key(1), (2, 8), 0, config.vocab)
  corrupted = clean.at[:, 3].set((clean[:, 3] + 1) % config.vocab)
  tree = fl.unflaxify(model, clean)
  same = (fl.run(tree, clean) == nnx.jit(lambda m, t: m(t))(model, clean)).all()
  print("(a) restored, converted; equal to the model bit for bit:", bool(same))

  # 1. Capture: a call inside the scan is one site, its values stacked along the layers.
  _, cache = fl.capture(tree, clean, "decoder/layers")
  residual = cache["decoder/layers"]  # (layers, batch, length, dim): layer i's output is [i]
  print("    residual stream after each layer:", residual.shape)

  # One layer of the scan is a site of its own: `decoder/layers[2]` (as the sweep names its
  # rows) captures layer 2's output alone, and an intervention there edits layer 2 only.
  _, cache = fl.capture(tree, clean, "decoder/layers[2]")
  print("    layer 2's output alone:", cache["decoder/layers[2]"].shape)
  ablated = fl.run(tree, clean, interventions=[fl.ablate("decoder/layers[2]")])
  print("    logits with layer 2's output ablated:", ablated.shape)

  # 2. A sweep patches each layer of the scan alone: one row per layer, `decoder/layers[i]`.
  difference = lambda logits: (logits[:, -1, 5] - logits[:, -1, 6]).mean()
  sweep = fl.sweep(tree, clean, corrupted, "decoder/layers", difference, positions=range(8))
  print("    sweep rows:", sweep.sites, "values", sweep.values.shape)

  # 3. Harvest every layer's output over a stream of batches: a row per token holds all
  # layers, (rows, layers, dim); layer i's rows are [:, i].
  batches = [jax.random.randint(jax.random.key(i), (2, 8), 0, config.vocab) for i in range(3)]
  store = fl.harvest(tree, batches, "decoder/layers", str(workdir / "harvest"))
  print(
    "    harvested rows:",
    store["decoder/layers"].shape,
    "layer 2's:",
    store["decoder/layers"][:, 2].shape,
  )

  write_hf_checkpoint(workdir / "model.safetensors", config)
  llama = load_safetensors(workdir / "model.safetensors", config)
  tree = fl.unflaxify(llama, clean)
  same = (fl.run(tree, clean) == nnx.jit(lambda m, t: m(t))(llama, clean)).all()
  print("(b) loaded from safetensors, converted; equal to the model bit for bit:", bool(same))
  _, cache = fl.capture(tree, clean, "layers/*/mlp")
  print("    each layer's MLP output:", {site: x.shape for site, x in cache.items()})


if __name__ == "__main__":
  main()
