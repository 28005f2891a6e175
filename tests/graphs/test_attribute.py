"""Attribution graphs against the reference: circuit-tracer 0.5.0's own graphs and pruning
on the fixtures (`reference.py`), on the Linen and the NNX port of each model; and a
plain-JAX recomputation of the frozen replacement model (not flaxlens's code) as a second
witness of completeness: every target's incoming edges plus its constant terms are its
value on the clean run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import compilations
from safetensors.numpy import load_file

import flaxlens as fl
import flaxlens.dictionaries as fld
import flaxlens.graphs as flg

from .reference import CASES, FIXTURES, load_case

RUNS = [(case, run) for case in CASES for run in ("default", "given", "capped")]
# Linen on every run; NNX on the default runs of a per-layer and a cross-layer case (the
# same models as Linen's; CI time).
CHECKED = [(c, r, "linen") for c, r in RUNS] + [(c, "default", "nnx") for c in ("plt_ln", "clt_ln")]


@pytest.fixture(scope="module")
def cases():
  """Cases, trees and graphs loaded or computed once per module (each tree's programs
  are compiled once, then shared by the runs of its case)."""
  cached: dict = {}

  def get(name, run=None, framework=None):
    if ("case", name) not in cached:
      cached["case", name] = load_case(name)
    case = cached["case", name]
    if run is None:
      return case
    if ("tree", name, framework) not in cached:
      cached["tree", name, framework] = _tree(case, framework)
    if ("graph", name, run, framework) not in cached:
      tree, sites = cached["tree", name, framework]
      cached["graph", name, run, framework] = _graph(case, run, tree, sites)
    return case, cached["graph", name, run, framework]

  return get


def _tree(case, framework):
  if framework == "linen":
    return fl.unflaxify(case.linen_model, case.linen_variables, case.tokens), case.linen_mlp_sites
  return fl.unflaxify(case.nnx_model, case.tokens), case.nnx_mlp_sites


def _graph(case, run, tree, sites):
  arguments = case.graphs[run].arguments
  return flg.attribute(
    tree,
    case.tokens,
    case.transcoders,
    sites,
    targets=arguments.attribution_targets,
    max_n_logits=arguments.max_n_logits,
    desired_logit_prob=arguments.desired_logit_prob,
    max_feature_nodes=arguments.max_feature_nodes,
    batch_size=BATCH if arguments.max_feature_nodes is None else arguments.batch_size,
    update_interval=arguments.update_interval,
  )


BATCH = 64


@pytest.mark.parametrize(("name", "run", "framework"), CHECKED)
def test_graphs_equal_circuit_tracers(cases, name, run, framework):
  if run not in cases(name).graphs:
    pytest.skip(f"{name} has no {run!r} run in its fixtures")
  case, graph = cases(name, run, framework)
  expected = case.graphs[run]
  np.testing.assert_array_equal(graph.active_features, expected.active_features)
  np.testing.assert_allclose(graph.activations, expected.activation_values, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(graph.selected, expected.selected_features)
  np.testing.assert_array_equal(graph.targets.ids, expected.logit_targets)
  np.testing.assert_allclose(graph.targets.probabilities, expected.logit_probabilities, rtol=1e-5)
  scale = np.abs(expected.adjacency_matrix).max()
  np.testing.assert_allclose(graph.adjacency, expected.adjacency_matrix, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize(("name", "run"), [r for r in RUNS if r[1] != "given"])
def test_pruning_equals_circuit_tracers(cases, name, run):
  if run not in cases(name).graphs:
    pytest.skip(f"{name} has no {run!r} run in its fixtures")
  case, graph = cases(name, run, "linen")
  expected = case.graphs[run].pruning
  pruned = flg.prune(graph)
  np.testing.assert_array_equal(pruned.nodes, expected.node_mask)
  dense = np.zeros(expected.edge_mask.shape, bool)
  dense[graph.row_nodes] = pruned.edges
  np.testing.assert_array_equal(dense, expected.edge_mask)
  np.testing.assert_allclose(pruned.cumulative, expected.cumulative_scores, atol=1e-5)


# --- the second witness: the frozen replacement model in plain JAX --------------------------


def _norm(x, w, b, eps, rms, scale=None):
  centred = x if rms else x - x.mean(-1, keepdims=True)
  if scale is None:
    scale = jax.lax.rsqrt((centred**2).mean(-1, keepdims=True) + eps)
  out = centred * scale * w
  return (out if b is None else out + b), scale


def _frozen_witness(name, case, t, scores=None):
  """MLP inputs `[layers, P, d]` and last logits of the replacement model with every node's
  write scaled by `t` (tokens, feature decodes, errors; constants kept), in plain JAX
  from TransformerLens's weights: clean norm scales and attention patterns, MLP outputs
  `skip(x_t) + constant + t * writes`."""
  W = {k: jnp.asarray(v) for k, v in load_file(FIXTURES / name / "model.safetensors").items()}
  c = case.config
  rms = c.normalization_type == "RMS"
  tokens = np.asarray(case.tokens)[0]
  P = len(tokens)
  tc = case.transcoders
  clt = isinstance(tc, fld.CrossLayerTranscoder)
  causal = jnp.tril(jnp.ones((P, P), bool))

  def ln(prefix, x, scale=None):
    return _norm(x, W[f"{prefix}.w"], W.get(f"{prefix}.b"), c.eps, rms, scale)

  def attention(layer, h, pattern=None):
    a = {
      k: W[f"blocks.{layer}.attn.{k}"]
      for k in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")
    }
    if pattern is None:
      q = jnp.einsum("pd,hde->hpe", h, a["W_Q"]) + a["b_Q"][:, None]
      k = jnp.einsum("pd,hde->hpe", h, a["W_K"]) + a["b_K"][:, None]
      pattern = jax.nn.softmax(
        jnp.where(causal, jnp.einsum("hqe,hke->hqk", q, k) / c.attn_scale, -jnp.inf), -1
      )
    v = jnp.einsum("pd,hde->hpe", h, a["W_V"]) + a["b_V"][:, None]
    return jnp.einsum("hqk,hke,hed->qd", pattern, v, a["W_O"]) + a["b_O"], pattern

  def mlp(layer, x):
    m = {k: W[f"blocks.{layer}.mlp.{k}"] for k in ("W_in", "b_in", "W_out", "b_out")}
    act = (lambda z: jax.nn.gelu(z, approximate=False)) if c.act_fn == "gelu" else jax.nn.silu
    if c.gated_mlp:
      hidden = act(x @ W[f"blocks.{layer}.mlp.W_gate"]) * (x @ m["W_in"]) + m["b_in"]
    else:
      hidden = act(x @ m["W_in"] + m["b_in"])
    return hidden @ m["W_out"] + m["b_out"]

  def skip(layer, x):
    if clt:
      return x @ tc.W_skip[...][layer] if tc.config.skip else 0.0
    return tc[layer].skip_of(x) if tc[layer].config.skip else 0.0

  # The clean run: scales, patterns, MLP inputs and outputs.
  resid = W["embed.W_E"][tokens] + W["pos_embed.W_pos"][:P]
  frozen, xs, outs = [], [], []
  for layer in range(c.n_layers):
    h, s1 = ln(f"blocks.{layer}.ln1", resid)
    attn, pattern = attention(layer, h)
    resid = resid + attn
    x, s2 = ln(f"blocks.{layer}.ln2", resid)
    out = mlp(layer, x)
    frozen.append((s1, pattern, s2))
    xs.append(x)
    outs.append(out)
    resid = resid + out
  _, final_scale = ln("ln_final", resid)
  xs = jnp.stack(xs)
  if clt:
    features = tc.encode(xs).at[:, 0].set(0)
    decodes = tc.decode(features) - tc.b_dec[...][:, None]
  else:
    features = jnp.stack([t_.encode(x) for t_, x in zip(tc, xs, strict=True)]).at[:, 0].set(0)
    decodes = jnp.stack([f @ t_.W_dec[...] for t_, f in zip(tc, features, strict=True)])
  writes = []
  for layer in range(c.n_layers):
    error = (
      outs[layer]
      - decodes[layer]
      - (tc.b_dec[...][layer] if clt else tc[layer].b_dec[...])
      - skip(layer, xs[layer])
    )
    writes.append((decodes[layer] + error).at[0].set(0))
  # The frozen run with every write scaled by t.
  resid = t * W["embed.W_E"][tokens] + W["pos_embed.W_pos"][:P]
  reads = []
  for layer in range(c.n_layers):
    s1, pattern, s2 = frozen[layer]
    h, _ = ln(f"blocks.{layer}.ln1", resid, s1)
    if scores is not None:
      q = (
        jnp.einsum("pd,hde->hpe", h, W[f"blocks.{layer}.attn.W_Q"])
        + W[f"blocks.{layer}.attn.b_Q"][:, None]
      )
      k = (
        jnp.einsum("pd,hde->hpe", h, W[f"blocks.{layer}.attn.W_K"])
        + W[f"blocks.{layer}.attn.b_K"][:, None]
      )
      scores.append(jnp.einsum("hqe,hke->hqk", q, k) / c.attn_scale)
    resid = resid + attention(layer, h, pattern)[0]
    x, _ = ln(f"blocks.{layer}.ln2", resid, s2)
    reads.append(x)
    constant = outs[layer] - skip(layer, xs[layer]) - writes[layer]
    resid = resid + skip(layer, x) + constant + t * writes[layer]
  final, _ = ln("ln_final", resid, final_scale)
  logits = final[-1] @ W["unembed.W_U"] + W["unembed.b_U"]
  return jnp.stack(reads), logits


@pytest.mark.parametrize("name", CASES)
def test_every_target_is_explained_by_its_incoming_edges(cases, name):
  case, graph = cases(name, "default", "linen")
  reads_1, logits_1 = _frozen_witness(name, case, 1.0)
  reads_0, logits_0 = _frozen_witness(name, case, 0.0)
  tc = case.transcoders
  W_enc = (
    tc.W_enc[...]
    if isinstance(tc, fld.CrossLayerTranscoder)
    else jnp.stack([t.W_enc[...] for t in tc])
  )
  layer, position, feature = graph.active_features[graph.selected].T
  explained = np.einsum(
    "nd,nd->n", np.asarray(reads_1 - reads_0)[layer, position], np.asarray(W_enc)[layer, :, feature]
  )
  incoming = graph.rows.sum(axis=1)
  scale = np.abs(graph.rows).max()
  np.testing.assert_allclose(incoming[: graph.n_features], explained, atol=2e-5 * scale)
  logit_change = graph.targets.directions @ np.asarray(logits_1 - logits_0)
  np.testing.assert_allclose(incoming[graph.n_features :], logit_change, atol=2e-5 * scale)
  # And incoming edges plus the constant terms are the clean value: the pre-activation
  # less the encoder bias (the witness's clean run is the model itself at t = 1).
  pre = np.einsum(
    "nd,nd->n", np.asarray(reads_1)[layer, position], np.asarray(W_enc)[layer, :, feature]
  )
  np.testing.assert_allclose(
    incoming[: graph.n_features] + graph.bias[: graph.n_features], pre, atol=2e-5 * scale
  )


def test_a_second_prompt_of_the_same_length_compiles_nothing(cases):
  case, _ = cases("clt_ln", "default", "linen")  # compiled for this tree and batch
  tree, sites = _tree(case, "linen")
  flg.attribute(tree, case.tokens, case.transcoders, sites, batch_size=BATCH)
  other = (case.tokens + 7) % case.config.d_vocab
  with compilations() as compiled:
    graph = flg.attribute(tree, other, case.transcoders, sites, batch_size=BATCH)
  assert graph.n_features > 0
  assert compiled == []


def test_a_budget_splits_rows_and_columns_into_the_same_graph(cases):
  case, whole = cases("plt_skip_ln", "default", "linen")
  tree, sites = _tree(case, "linen")
  budgeted = flg.attribute(tree, case.tokens, case.transcoders, sites, budget=400_000)
  np.testing.assert_allclose(budgeted.rows, whole.rows, atol=1e-6)
  with pytest.raises(fl.FlaxlensError, match="too small for one row"):
    flg.attribute(tree, case.tokens, case.transcoders, sites, budget=1000)


@pytest.mark.parametrize("name", ["plt_skip_ln", "clt_ln"])
def test_attention_shares_add_up_to_the_scores_change_along_the_writes(cases, name):
  case = cases(name)
  tree, sites = _tree(case, "linen")
  head, query, key = 1, 6, 3
  share = flg.attention_share(
    tree, case.tokens, case.transcoders, sites, "blocks_1/attn", (head, query, key)
  )

  def score(t):
    found = []
    _frozen_witness(name, case, t, found)
    return found[1][head, query, key], found[1][head, query, : query + 1].max()

  value, row_max = score(1.0)
  assert share.score == pytest.approx(float(value - row_max), abs=1e-4)  # the exponent
  total = share.features.sum() + share.errors.sum() + share.tokens.sum()
  assert total == pytest.approx(float(jax.grad(lambda t: score(t)[0])(1.0)), rel=1e-4, abs=1e-4)
  assert np.count_nonzero(share.features) > 0
  with pytest.raises(fl.FlaxlensError, match="outside"):
    flg.attention_share(tree, case.tokens, case.transcoders, sites, "blocks_1/attn", (0, 9, 0))
  with pytest.raises(fl.FlaxlensError, match="not one of the attention calls"):
    flg.attention_share(tree, case.tokens, case.transcoders, sites, "blocks_1/mlp", (0, 1, 0))
