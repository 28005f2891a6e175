"""circuit-tracer's reference graphs, and Flax ports of the TransformerLens models they ran on.

`fixtures/make_fixtures.py` (run with torch, TransformerLens and circuit-tracer) wrote, for
each case, a tiny random `HookedTransformer`, its transcoders in circuit-tracer's layout,
TransformerLens's logits on a prompt and the graphs circuit-tracer's `attribute` computed
(with `prune_graph`'s result). `load_case(name)` reads one case back: the model as a Linen
module with its variables and as an NNX module (the same weights), the transcoders as
flaxlens dictionaries, the names of the MLP sites in each converted tree, and the expected
arrays.

The ports replicate `HookedTransformer.forward` for these configs (pre-norm blocks,
learned positional embeddings, no folding): token and positional embeddings (`Embed`
called on ids), then per block `x + attn(ln1(x))`, then `x + mlp(ln2(x))`, then the final
norm and the unembedding (with its bias). Norms are Flax's own `LayerNorm` / `RMSNorm`
with TransformerLens's epsilon; attention's pattern is `jax.nn.softmax` of the causally
masked scores divided by `attn_scale`. Each block's `mlp` submodule takes the normalised
input (`blocks.{l}.mlp.hook_in`, what the transcoders read) and returns its output
(`blocks.{l}.mlp.hook_out`, what they write), so the MLP sites are `blocks_{l}/mlp`
(Linen) and `blocks/{l}/mlp` (NNX).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

import flaxlens.dictionaries as fld

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CASES = ("plt_ln", "plt_skip_ln", "clt_ln", "plt_rms")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The TransformerLens config fields the ports read (the rest are TL's defaults)."""

  n_layers: int
  d_model: int
  n_heads: int
  d_head: int
  d_mlp: int
  d_vocab: int
  n_ctx: int
  act_fn: str  # "gelu" (exact) or "silu"
  normalization_type: str  # "LN" or "RMS"
  eps: float
  gated_mlp: bool
  attn_scale: float


class AttributeArguments(NamedTuple):
  """The arguments circuit-tracer's `attribute` ran with (targets as token ids, or None
  for the default: the most probable logits)."""

  attribution_targets: list[int] | None
  max_n_logits: int
  desired_logit_prob: float
  max_feature_nodes: int | None
  batch_size: int
  update_interval: int


class Pruning(NamedTuple):
  """`prune_graph(graph, node_threshold=0.8, edge_threshold=0.98)`'s result."""

  node_mask: np.ndarray  # [nodes] bool
  edge_mask: np.ndarray  # [nodes, nodes] bool, [target, source]
  cumulative_scores: np.ndarray  # [nodes] float32


class Graph(NamedTuple):
  """What circuit-tracer's `attribute` returned, as numpy arrays.

  Nodes: `[selected features | errors (layer-major) | tokens | logits]`, the adjacency
  indexed `[target, source]`; `active_features` rows are `(layer, position, feature)` of
  every active feature, `selected_features` the indices into them that are nodes."""

  adjacency_matrix: np.ndarray  # [nodes, nodes] float32
  active_features: np.ndarray  # [active, 3] int64
  activation_values: np.ndarray  # [active] float32
  selected_features: np.ndarray  # [selected] int64
  logit_targets: np.ndarray  # [targets] int64 token ids
  logit_probabilities: np.ndarray  # [targets] float32
  input_tokens: np.ndarray  # [P] int64
  n_pos: int
  arguments: AttributeArguments
  pruning: Pruning


class Case(NamedTuple):
  """One reference case (`load_case`)."""

  name: str
  config: ModelConfig
  linen_model: nn.Module
  linen_variables: dict[str, Any]
  nnx_model: nnx.Module
  tokens: jax.Array  # [1, P] int32
  transcoders: Any  # list[fld.Transcoder] (one per layer) or an fld.CrossLayerTranscoder
  linen_mlp_sites: list[str]
  nnx_mlp_sites: list[str]
  logits: np.ndarray  # TransformerLens's, [1, P, vocab]
  graphs: dict[str, Graph]  # by run name ("default", "given", "capped")
  feature_input_hook: str  # TransformerLens hook the transcoders read, under blocks.{l}
  feature_output_hook: str  # and the one they write


def _activation(config: ModelConfig):
  return {"gelu": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu}[config.act_fn]


def _causal_attention(config: ModelConfig, x, W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, b_O):
  """TransformerLens's attention on `x` `[batch, P, d_model]`, weights as it holds them
  (`W_Q` `[heads, d_model, d_head]`, `W_O` `[heads, d_head, d_model]`)."""
  q = jnp.einsum("bpd,hde->bphe", x, W_Q) + b_Q
  k = jnp.einsum("bpd,hde->bphe", x, W_K) + b_K
  v = jnp.einsum("bpd,hde->bphe", x, W_V) + b_V
  scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / config.attn_scale
  positions = x.shape[1]
  causal = jnp.tril(jnp.ones((positions, positions), bool))
  pattern = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  z = jnp.einsum("bhqk,bkhe->bqhe", pattern, v)
  return z.reshape(z.shape[:2] + (-1,)) @ W_O.reshape(-1, W_O.shape[-1]) + b_O


def _mlp(config: ModelConfig, x, W_in, b_in, W_out, b_out, W_gate=None):
  """TransformerLens's MLP (gated: `act(x @ W_gate) * (x @ W_in) + b_in`)."""
  act = _activation(config)
  hidden = act(x @ W_gate) * (x @ W_in) + b_in if config.gated_mlp else act(x @ W_in + b_in)
  return hidden @ W_out + b_out


# Linen.


class LinenAttention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    heads = (c.n_heads, c.d_model, c.d_head)
    zeros = nn.initializers.zeros
    weights = {}
    for name in ("Q", "K", "V"):
      weights[f"W_{name}"] = self.param(f"W_{name}", zeros, heads)
      weights[f"b_{name}"] = self.param(f"b_{name}", zeros, (c.n_heads, c.d_head))
    weights["W_O"] = self.param("W_O", zeros, (c.n_heads, c.d_head, c.d_model))
    weights["b_O"] = self.param("b_O", zeros, (c.d_model,))
    return _causal_attention(c, x, **weights)


class LinenMLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    zeros = nn.initializers.zeros
    weights = {
      "W_in": self.param("W_in", zeros, (c.d_model, c.d_mlp)),
      "b_in": self.param("b_in", zeros, (c.d_mlp,)),
      "W_out": self.param("W_out", zeros, (c.d_mlp, c.d_model)),
      "b_out": self.param("b_out", zeros, (c.d_model,)),
    }
    if c.gated_mlp:
      weights["W_gate"] = self.param("W_gate", zeros, (c.d_model, c.d_mlp))
    return _mlp(c, x, **weights)


def _linen_norm(config: ModelConfig, name: str) -> nn.Module:
  if config.normalization_type == "RMS":
    return nn.RMSNorm(epsilon=config.eps, name=name)
  return nn.LayerNorm(epsilon=config.eps, use_fast_variance=False, name=name)


class LinenBlock(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    x = x + LinenAttention(self.config, name="attn")(_linen_norm(self.config, "ln1")(x))
    return x + LinenMLP(self.config, name="mlp")(_linen_norm(self.config, "ln2")(x))


class LinenTransformer(nn.Module):
  """A TransformerLens `HookedTransformer` (these configs) in Linen: token ids `[B, P]`
  in, logits `[B, P, vocab]` out."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    x = nn.Embed(c.d_vocab, c.d_model, name="embed")(tokens)
    x = x + nn.Embed(c.n_ctx, c.d_model, name="pos_embed")(jnp.arange(tokens.shape[-1]))
    for layer in range(c.n_layers):
      x = LinenBlock(c, name=f"blocks_{layer}")(x)
    return nn.Dense(c.d_vocab, name="unembed")(_linen_norm(c, "ln_final")(x))


def _norm_params(config: ModelConfig, weights: dict, prefix: str) -> dict:
  if config.normalization_type == "RMS":
    return {"scale": weights[f"{prefix}.w"]}
  return {"scale": weights[f"{prefix}.w"], "bias": weights[f"{prefix}.b"]}


def linen_params(config: ModelConfig, weights: dict[str, np.ndarray]) -> dict:
  """TransformerLens's parameters (its state-dict names) as the Linen port's params."""
  params = {
    "embed": {"embedding": weights["embed.W_E"]},
    "pos_embed": {"embedding": weights["pos_embed.W_pos"]},
    "ln_final": _norm_params(config, weights, "ln_final"),
    "unembed": {"kernel": weights["unembed.W_U"], "bias": weights["unembed.b_U"]},
  }
  for layer in range(config.n_layers):
    block = f"blocks.{layer}"
    params[f"blocks_{layer}"] = {
      "ln1": _norm_params(config, weights, f"{block}.ln1"),
      "ln2": _norm_params(config, weights, f"{block}.ln2"),
      "attn": _leaves(weights, f"{block}.attn."),
      "mlp": _leaves(weights, f"{block}.mlp."),
    }
  return jax.tree.map(jnp.asarray, params)


def _leaves(weights: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
  return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


# NNX.


class NNXAttention(nnx.Module):
  def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
    self.config = config
    for name, value in weights.items():
      setattr(self, name, nnx.Param(jnp.asarray(value)))

  def __call__(self, x):
    names = ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_O", "b_O")
    return _causal_attention(self.config, x, **{n: getattr(self, n)[...] for n in names})


class NNXMLP(nnx.Module):
  def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
    self.config = config
    self.names = tuple(sorted(weights))
    for name, value in weights.items():
      setattr(self, name, nnx.Param(jnp.asarray(value)))

  def __call__(self, x):
    return _mlp(self.config, x, **{n: getattr(self, n)[...] for n in self.names})


def _nnx_norm(config: ModelConfig, weights: dict, prefix: str) -> nnx.Module:
  rngs = nnx.Rngs(0)
  if config.normalization_type == "RMS":
    norm = nnx.RMSNorm(config.d_model, epsilon=config.eps, rngs=rngs)
  else:
    norm = nnx.LayerNorm(config.d_model, epsilon=config.eps, use_fast_variance=False, rngs=rngs)
    norm.bias[...] = jnp.asarray(weights[f"{prefix}.b"])
  norm.scale[...] = jnp.asarray(weights[f"{prefix}.w"])
  return norm


class NNXBlock(nnx.Module):
  def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], layer: int):
    block = f"blocks.{layer}"
    self.ln1 = _nnx_norm(config, weights, f"{block}.ln1")
    self.attn = NNXAttention(config, _leaves(weights, f"{block}.attn."))
    self.ln2 = _nnx_norm(config, weights, f"{block}.ln2")
    self.mlp = NNXMLP(config, _leaves(weights, f"{block}.mlp."))

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class NNXTransformer(nnx.Module):
  """The same model in NNX, built from TransformerLens's parameters (state-dict names)."""

  def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
    rngs = nnx.Rngs(0)
    self.embed = nnx.Embed(config.d_vocab, config.d_model, rngs=rngs)
    self.embed.embedding[...] = jnp.asarray(weights["embed.W_E"])
    self.pos_embed = nnx.Embed(config.n_ctx, config.d_model, rngs=rngs)
    self.pos_embed.embedding[...] = jnp.asarray(weights["pos_embed.W_pos"])
    self.blocks = nnx.List([NNXBlock(config, weights, i) for i in range(config.n_layers)])
    self.ln_final = _nnx_norm(config, weights, "ln_final")
    self.unembed = nnx.Linear(config.d_model, config.d_vocab, rngs=rngs)
    self.unembed.kernel[...] = jnp.asarray(weights["unembed.W_U"])
    self.unembed.bias[...] = jnp.asarray(weights["unembed.b_U"])

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
    for block in self.blocks:
      x = block(x)
    return self.unembed(self.ln_final(x))


# Loading.


def _transcoders(folder: pathlib.Path, kind: str) -> Any:
  """The case's transcoders as flaxlens reads circuit-tracer's files; a CLT gets its skip
  (not in circuit-tracer's files) from `clt_skip.safetensors`."""
  loaded = fld.load_circuit_tracer(folder / "transcoders")
  if kind != "clt":
    return loaded
  c = loaded.config
  clt = fld.CrossLayerTranscoder(
    c.layers, c.d_in, c.d_out, c.width, activation=c.activation, skip=True, rngs=nnx.Rngs(0)
  )
  nnx.update(clt, nnx.state(loaded))
  clt.W_skip[...] = jnp.asarray(load_file(folder / "clt_skip.safetensors")["W_skip"])
  return clt


def _graph(path: pathlib.Path, arguments: dict) -> Graph:
  arrays = load_file(path)
  return Graph(
    adjacency_matrix=arrays["adjacency_matrix"],
    active_features=arrays["active_features"],
    activation_values=arrays["activation_values"],
    selected_features=arrays["selected_features"],
    logit_targets=arrays["logit_targets"],
    logit_probabilities=arrays["logit_probabilities"],
    input_tokens=arrays["input_tokens"],
    n_pos=int(arrays["n_pos"]),
    arguments=AttributeArguments(**{k: arguments[k] for k in AttributeArguments._fields}),
    pruning=Pruning(
      arrays["prune_node_mask"], arrays["prune_edge_mask"], arrays["prune_cumulative_scores"]
    ),
  )


def load_case(name: str) -> Case:
  """One reference case by name (one of `CASES`).

  Example:
    >>> case = load_case("plt_ln")
    >>> case.tokens.shape, case.linen_mlp_sites, sorted(case.graphs)
    ((1, 8), ['blocks_0/mlp', 'blocks_1/mlp'], ['default'])
  """
  folder = FIXTURES / name
  description = json.loads((folder / "case.json").read_text())
  fields = {field.name for field in dataclasses.fields(ModelConfig)}
  config = ModelConfig(**{k: v for k, v in description["config"].items() if k in fields})
  weights = load_file(folder / "model.safetensors")
  expected = load_file(folder / "expected.safetensors")
  linen_model = LinenTransformer(config)
  return Case(
    name=name,
    config=config,
    linen_model=linen_model,
    linen_variables={"params": linen_params(config, weights)},
    nnx_model=NNXTransformer(config, weights),
    tokens=jnp.asarray(expected["tokens"], jnp.int32),
    transcoders=_transcoders(folder, description["transcoders"]),
    linen_mlp_sites=[f"blocks_{layer}/mlp" for layer in range(config.n_layers)],
    nnx_mlp_sites=[f"blocks/{layer}/mlp" for layer in range(config.n_layers)],
    logits=expected["logits"],
    graphs={
      run: _graph(folder / f"graph_{run}.safetensors", arguments)
      for run, arguments in description["runs"].items()
    },
    feature_input_hook=description["feature_input_hook"],
    feature_output_hook=description["feature_output_hook"],
  )
