"""Attribution graphs on third-party Flax models: Hugging Face's Flax GPT-2 and Llama
(random weights, tiny configs), converted as they come. The replacement model finds their
norms, attentions and token embedding on its own; its frozen forward is the model's own
value; and each graph equals a plain-JAX witness written here from the Hugging Face
parameters (not flaxlens's code): the frozen replacement model with every node's write
scaled by its own coefficient, differentiated at one."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl
import flaxlens.dictionaries as fld
import flaxlens.graphs as flg
from flaxlens.tools.graphs._model import Calls, Plan, found_calls, frozen_reads, frozen_shapes

transformers = pytest.importorskip("transformers")

P, D, WIDTH, VOCAB = 8, 32, 64, 64


@dataclasses.dataclass
class Model:
  """A converted Hugging Face model, its parameters and the plain-JAX pieces of its
  forward (`Parts`)."""

  module: Any
  params: dict
  args: tuple
  tree: Any
  mlps: list[str]
  parts: Parts

  @functools.cached_property
  def logits(self):
    """The model's own last-position logits (Flax's `apply`, eager)."""
    return self.module.apply({"params": self.params}, *self.args).logits[0, -1]


@dataclasses.dataclass
class Parts:
  """A pre-norm transformer's forward in plain JAX, from a Hugging Face model's
  parameters. A norm or an attention given its clean scale or pattern uses it (frozen);
  each returns its scale or pattern too."""

  embed: Callable[[Any], Any]  # token ids -> their embedding rows [P, D]
  positional: Any  # what is added to them (constant) [P, D]
  norm: Callable[..., Any]  # (name, x, scale=None) -> (out, scale)
  attention: Callable[..., Any]  # (layer, h, pattern=None) -> (out, pattern)
  mlp: Callable[[int, Any], Any]  # (layer, x) -> out
  unembed: Callable[[Any], Any]  # final norm's output [D] -> logits
  norms: tuple[str, str]  # the names of a layer's two norms, "{layer}" in them
  final: str  # the final norm's name


def _noisy(params, seed):
  """Every parameter moved by noise, so that norm gains and biases are not ones and zeros."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  moved = [
    x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
  ]
  return jax.tree.unflatten(treedef, moved)


def _causal_softmax(scores):
  causal = jnp.tril(jnp.ones((P, P), bool))
  return jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)


def _initialised(model, seed: int, noise: int) -> tuple[tuple, dict]:
  """A Hugging Face Flax model's arguments for one random prompt (ids, mask, positions)
  and its parameters, initialised and made noisy (`_noisy`)."""
  ids = jax.random.randint(jax.random.key(seed), (1, P), 0, VOCAB)
  args = (ids, jnp.ones_like(ids), jnp.arange(P)[None])
  return args, _noisy(jax.jit(model.module.init)(jax.random.key(0), *args)["params"], noise)


def _gpt2() -> Model:
  config = transformers.GPT2Config(
    vocab_size=VOCAB, n_positions=32, n_embd=D, n_layer=2, n_head=2, initializer_range=0.2
  )
  model = transformers.FlaxGPT2LMHeadModel(config, _do_init=False)
  args, params = _initialised(model, 6, 1)
  W = params["transformer"]
  heads, head_dim = config.n_head, D // config.n_head

  def conv(name, x):  # Hugging Face's Flax Conv1D keeps its kernel [out, in]
    c = W[name] if isinstance(name, str) else name
    return x @ c["kernel"].T + c["bias"]

  def norm(name, x, scale=None):
    w = W["ln_f"] if name == "ln_f" else W["h"][name[0]][name[2:]]
    centred = x - x.mean(-1, keepdims=True)
    if scale is None:
      scale = jax.lax.rsqrt((centred**2).mean(-1, keepdims=True) + config.layer_norm_epsilon)
    return centred * scale * w["scale"] + w["bias"], scale

  def attention(layer, h, pattern=None):
    a = W["h"][str(layer)]["attn"]
    q, k, v = jnp.split(conv(a["c_attn"], h), 3, axis=-1)
    q, k, v = (z.reshape(P, heads, head_dim) for z in (q, k, v))
    if pattern is None:
      pattern = _causal_softmax(jnp.einsum("qhe,khe->hqk", q, k) / np.sqrt(head_dim))
    mixed = jnp.einsum("hqk,khe->qhe", pattern, v).reshape(P, D)
    return conv(a["c_proj"], mixed), pattern

  def mlp(layer, x):
    m = W["h"][str(layer)]["mlp"]
    return conv(m["c_proj"], jax.nn.gelu(conv(m["c_fc"], x), approximate=True))

  parts = Parts(
    embed=lambda tokens: W["wte"]["embedding"][tokens],
    positional=W["wpe"]["embedding"][:P],
    norm=norm,
    attention=attention,
    mlp=mlp,
    unembed=lambda h: h @ W["wte"]["embedding"].T,  # tied
    norms=("{layer}/ln_1", "{layer}/ln_2"),
    final="ln_f",
  )
  tree = fl.unflaxify(model.module, {"params": params}, *args)
  mlps = [f"transformer/h/{layer}/mlp" for layer in range(2)]
  return Model(model.module, params, args, tree, mlps, parts)


def _rotary(x, positions):
  """Rotary embedding of `x` `[P, heads, head_dim]`: halves rotated by position angles."""
  half = x.shape[-1] // 2
  frequencies = 1.0 / (10000.0 ** (np.arange(0, x.shape[-1], 2) / x.shape[-1]))
  angles = np.concatenate([positions[:, None] * frequencies] * 2, axis=-1).astype(np.float32)
  sin, cos = np.sin(angles)[:, None], np.cos(angles)[:, None]
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def _llama() -> Model:
  config = transformers.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=D,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,  # grouped-query attention: both heads read one key and value
    max_position_embeddings=32,
    initializer_range=0.2,
  )
  model = transformers.FlaxLlamaForCausalLM(config, _do_init=False)
  args, params = _initialised(model, 7, 2)
  W = params["model"]
  heads, head_dim = config.num_attention_heads, D // config.num_attention_heads
  kv_heads = config.num_key_value_heads

  def norm(name, x, scale=None):
    w = W["norm"] if name == "norm" else W["layers"][name[0]][name[2:]]
    if scale is None:  # in float32, as Hugging Face computes it
      scale = jnp.sqrt((x.astype(jnp.float32) ** 2).mean(-1, keepdims=True) + config.rms_norm_eps)
    return w["weight"] * (x / scale), scale

  def attention(layer, h, pattern=None):
    a = W["layers"][str(layer)]["self_attn"]
    v = (h @ a["v_proj"]["kernel"]).reshape(P, kv_heads, head_dim)
    v = jnp.repeat(v, heads // kv_heads, axis=1)
    if pattern is None:
      positions = np.arange(P)
      q = _rotary((h @ a["q_proj"]["kernel"]).reshape(P, heads, head_dim), positions)
      k = _rotary((h @ a["k_proj"]["kernel"]).reshape(P, kv_heads, head_dim), positions)
      k = jnp.repeat(k, heads // kv_heads, axis=1)
      pattern = _causal_softmax(jnp.einsum("qhe,khe->hqk", q, k) / np.sqrt(head_dim))
    mixed = jnp.einsum("hqk,khe->qhe", pattern, v).reshape(P, D)
    return mixed @ a["o_proj"]["kernel"], pattern

  def mlp(layer, x):
    m = W["layers"][str(layer)]["mlp"]
    gated = jax.nn.silu(x @ m["gate_proj"]["kernel"]) * (x @ m["up_proj"]["kernel"])
    return gated @ m["down_proj"]["kernel"]

  parts = Parts(
    embed=lambda tokens: W["embed_tokens"]["embedding"][tokens],
    positional=jnp.zeros((P, D)),
    norm=norm,
    attention=attention,
    mlp=mlp,
    unembed=lambda h: h @ params["lm_head"]["kernel"],
    norms=("{layer}/input_layernorm", "{layer}/post_attention_layernorm"),
    final="norm",
  )
  tree = fl.unflaxify(model.module, {"params": params}, *args)
  mlps = [f"model/layers/{layer}/mlp" for layer in range(2)]
  return Model(model.module, params, args, tree, mlps, parts)


@pytest.fixture(scope="module")
def models():
  """Each model built and converted once per module."""
  cached: dict = {}

  def get(name):
    if name not in cached:
      cached[name] = {"gpt2": _gpt2, "llama": _llama}[name]()
    return cached[name]

  return get


def _transcoders(skip: bool, seed: int) -> list[fld.Transcoder]:
  """Random transcoders, one per layer, their encoder biases raised so features fire and
  random decoder biases (and skips, with `skip`)."""
  found = []
  for layer in range(2):
    t = fld.Transcoder(D, D, WIDTH, skip=skip, rngs=nnx.Rngs(seed + layer))
    keys = jax.random.split(jax.random.key(100 + seed + layer), 2)
    t.b_enc[...] = jnp.full(WIDTH, 0.3)
    t.b_dec[...] = 0.1 * jax.random.normal(keys[0], (D,))
    if skip:
      t.W_skip[...] = 0.2 * jax.random.normal(keys[1], (D, D))
    found.append(t)
  return found


def _logits(out):
  return out.logits


EXPECTED_CALLS = {
  "gpt2": Calls(
    mlps=("transformer/h/0/mlp", "transformer/h/1/mlp"),
    embed="transformer/wte",
    norms=tuple(f"transformer/h/{i}/ln_{j}" for i in range(2) for j in (1, 2))
    + ("transformer/ln_f",),
    attention=("transformer/h/0/attn", "transformer/h/1/attn"),
  ),
  "llama": Calls(
    mlps=("model/layers/0/mlp", "model/layers/1/mlp"),
    embed="model/embed_tokens",
    norms=tuple(
      f"model/layers/{i}/{n}"
      for i in range(2)
      for n in ("input_layernorm", "post_attention_layernorm")
    )
    + ("model/norm",),
    attention=("model/layers/0/self_attn", "model/layers/1/self_attn"),
  ),
}


# Llama's tests are marked slow to keep the default run short (CI still runs them).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=SLOW)])
def test_the_replacement_model_finds_the_norms_attentions_and_embedding(models, name):
  model = models(name)
  assert found_calls(model.tree, model.mlps, None, None, "test") == EXPECTED_CALLS[name]


@pytest.mark.parametrize(
  ("name", "skip"), [("gpt2", False), pytest.param("llama", True, marks=SLOW)]
)
def test_the_frozen_forward_is_the_models_own_value(models, name, skip):
  model = models(name)
  calls = found_calls(model.tree, model.mlps, None, None, "test")
  plan = Plan(calls=calls, shapes=frozen_shapes(model.tree, model.args, calls), logits_of=_logits)
  skips = jnp.stack([t.W_skip[...] for t in _transcoders(True, 0)]) if skip else None
  zeros = (jnp.zeros((P, D)), jnp.zeros((2, P, D)))
  # Eager on both sides: the same operations, so the same bits (a compiled program of
  # each may fuse differently and differ in the last bits).
  _, last = frozen_reads(model.tree, model.args, plan, skips, zeros)
  np.testing.assert_array_equal(last, model.logits)
  np.testing.assert_array_equal(last, fl.run(model.tree, model.args, jit=False).logits[0, -1])


def _witness(model: Model, transcoders: list[fld.Transcoder]) -> dict[str, Any]:
  """The frozen replacement model in plain JAX: the clean run's norm scales, patterns,
  MLP inputs and outputs, features (position 0 zeroed) and errors; and `frozen_run(alphas)`,
  the MLP inputs `[layers, P, D]` and the last position's logits with each node's write
  scaled by its coefficient (`alphas`: features, errors by (layer, position), tokens)."""
  parts, tokens = model.parts, np.asarray(model.args[0])[0]
  first, second = parts.norms

  def skip(layer, x):
    t = transcoders[layer]
    return x @ t.W_skip[...] if t.config.skip else 0.0

  @jax.jit
  def clean_run():
    resid = parts.embed(tokens) + parts.positional
    frozen, xs, outs = [], [], []
    for layer in range(2):
      h, s1 = parts.norm(first.format(layer=layer), resid)
      attended, pattern = parts.attention(layer, h)
      resid = resid + attended
      x, s2 = parts.norm(second.format(layer=layer), resid)
      out = parts.mlp(layer, x)
      frozen.append((s1, pattern, s2))
      xs.append(x)
      outs.append(out)
      resid = resid + out
    final, final_scale = parts.norm(parts.final, resid)
    features = jnp.stack(
      [jax.nn.relu(x @ t.W_enc[...] + t.b_enc[...]) for t, x in zip(transcoders, xs, strict=True)]
    )
    features = features.at[:, 0].set(0)
    errors, constants = [], []
    for layer, t in enumerate(transcoders):
      decoded = features[layer] @ t.W_dec[...]
      error = (outs[layer] - decoded - t.b_dec[...] - skip(layer, xs[layer])).at[0].set(0)
      errors.append(error)
      constants.append(outs[layer] - skip(layer, xs[layer]) - decoded - error)
    return frozen, final_scale, features, errors, constants, parts.unembed(final[-1])

  frozen, final_scale, features, errors, constants, clean_logits = clean_run()
  active = np.argwhere(np.asarray(features) != 0)  # (layer, position, feature), in order
  activations = features[tuple(active.T)]
  n = len(active)

  def frozen_run(alphas):
    a_features, a_tokens = alphas[:n] * activations, alphas[n + 2 * P :]
    a_errors = alphas[n : n + 2 * P].reshape(2, P)
    resid = a_tokens[:, None] * parts.embed(tokens) + parts.positional
    reads = []
    for layer, t in enumerate(transcoders):
      s1, pattern, s2 = frozen[layer]
      h, _ = parts.norm(first.format(layer=layer), resid, s1)
      resid = resid + parts.attention(layer, h, pattern)[0]
      x, _ = parts.norm(second.format(layer=layer), resid, s2)
      reads.append(x)
      mine = active[:, 0] == layer
      decoded = a_features[mine][:, None] * t.W_dec[...][active[mine, 2]]
      writes = jnp.zeros((P, D)).at[active[mine, 1]].add(decoded)
      error = a_errors[layer][:, None] * errors[layer]
      resid = resid + skip(layer, x) + constants[layer] + writes + error
    final, _ = parts.norm(parts.final, resid, final_scale)
    return jnp.stack(reads), parts.unembed(final[-1])

  return {
    "active": active,
    "activations": activations,
    "clean_logits": clean_logits,
    "n_alphas": n + 3 * P,
    "frozen_run": frozen_run,
  }


GRAPHS = [
  ("gpt2", False),
  ("gpt2", True),
  pytest.param("llama", False, marks=SLOW),
  pytest.param("llama", True, marks=SLOW),
]


@pytest.mark.parametrize(("name", "skip"), GRAPHS)
def test_the_graph_equals_the_plain_jax_witness(models, name, skip):
  model = models(name)
  transcoders = _transcoders(skip, 10)
  graph = flg.attribute(model.tree, model.args, transcoders, model.mlps, logits=_logits)
  witness = _witness(model, transcoders)
  active = witness["active"]
  np.testing.assert_array_equal(graph.active_features, active)
  np.testing.assert_allclose(graph.activations, witness["activations"], rtol=1e-5, atol=1e-6)
  assert len(active) > 50 and set(active[:, 0]) == {0, 1}
  # The witness's clean run is the model's own forward.
  np.testing.assert_allclose(witness["clean_logits"], model.logits, rtol=1e-5, atol=1e-5)
  assert graph.targets.ids[0] == int(jnp.argmax(witness["clean_logits"]))
  W_enc = np.stack([np.asarray(t.W_enc[...]) for t in transcoders])
  encoder_rows = W_enc[active[:, 0], :, active[:, 2]]  # [features, D]
  directions = np.eye(VOCAB, dtype=np.float32)[graph.targets.ids] - 1.0 / VOCAB

  def targets(alphas):
    reads, logits = witness["frozen_run"](alphas)
    pre = jnp.einsum("nd,nd->n", reads[active[:, 0], active[:, 1]], encoder_rows)
    return jnp.concatenate([pre, directions @ logits])

  rows = jax.jit(jax.jacfwd(targets))(jnp.ones(witness["n_alphas"]))
  n, k = len(active), len(graph.targets.ids)
  expected = np.zeros((graph.n_nodes, graph.n_nodes), np.float32)
  expected[:n, : n + 3 * P] = rows[:n]
  expected[graph.n_nodes - k :, : n + 3 * P] = rows[n:]
  scale = np.abs(expected).max()
  np.testing.assert_allclose(graph.adjacency, expected, rtol=0, atol=1e-5 * scale)
  # Many feature-to-feature edges are large: the comparison is not one of near-zeros.
  assert np.count_nonzero(np.abs(expected[:n, :n]) > 1e-3 * scale) > 10
