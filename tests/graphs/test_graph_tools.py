"""Graph files, the intervention check, and the refusals of `flaxlens.graphs`."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl
import flaxlens.dictionaries as fld
import flaxlens.graphs as flg
from flaxlens.tools.graphs._demo import DemoLM


@pytest.fixture(scope="module")
def demo():
  tree, tokens, transcoders, mlps = flg.demo_model()
  return tree, tokens, transcoders, mlps, flg.demo_graph()


# --- files ----------------------------------------------------------------------------------


def test_the_file_holds_the_pruned_graph_with_ids_that_cannot_collide(demo, tmp_path):
  *_, graph = demo
  pruned = flg.prune(graph, node_threshold=1.0, edge_threshold=1.0)  # every node
  data = flg.graph_json(graph, slug="demo", pruned=pruned)
  ids = [node["node_id"] for node in data["nodes"]]
  assert len(ids) == len(set(ids)) == int(pruned.nodes.sum())
  # The reference's ids for these nodes would collide: an error (l, p) is "0_{l}_{p}",
  # which is also layer 0's feature l at position p.
  features = {tuple(f) for f in graph.active_features[graph.selected]}
  reference_error_ids = {f"0_{layer}_{p}" for layer in range(graph.layers) for p in range(8)}
  reference_feature_ids = {f"{layer}_{f}_{p}" for layer, p, f in features}
  assert reference_error_ids & reference_feature_ids  # the quirk is there in this graph
  errors = [n for n in data["nodes"] if n["feature_type"] == "mlp reconstruction error"]
  assert errors and all(n["node_id"].startswith("err_") for n in errors)
  # Links are the graph's own entries, [target, source].
  adjacency = graph.adjacency
  order = {n["node_id"]: k for k, n in enumerate(data["nodes"])}
  kept = np.flatnonzero(pruned.nodes)
  for link in data["links"][:50]:
    t, s = kept[order[link["target"]]], kept[order[link["source"]]]
    assert link["weight"] == pytest.approx(float(adjacency[t, s]))
  path = flg.save(data, tmp_path)
  assert flg.load(path) == json.loads(path.read_text())
  listing = json.loads((tmp_path / "graph-metadata.json").read_text())
  assert [g["slug"] for g in listing["graphs"]] == ["demo"]
  assert flg.graph_page(flg.load(path)).startswith("<!DOCTYPE html>")


@pytest.mark.parametrize(
  ("damage", "match"),
  [
    (lambda text: text[: len(text) // 2], "corrupted or truncated"),
    (lambda text: text.replace('"weight": ', '"weight": NaN, "w": ', 1), "corrupted|malformed"),
    (lambda text: text.replace('"nodes"', '"nodez"', 1), "malformed"),
  ],
  ids=["truncated", "nan", "no_nodes"],
)
def test_damaged_files_are_refused(demo, tmp_path, damage, match):
  *_, graph = demo
  path = flg.save(flg.graph_json(graph, slug="g"), tmp_path)
  path.write_text(damage(path.read_text()))
  with pytest.raises(fl.FlaxlensError, match=match):
    flg.load(path)


def test_files_with_unknown_or_repeated_nodes_are_refused(demo, tmp_path):
  *_, graph = demo
  data = flg.graph_json(graph, slug="g")
  data["links"].append({"source": "nowhere", "target": data["nodes"][0]["node_id"], "weight": 1.0})
  path = tmp_path / "g.json"
  path.write_text(json.dumps(data))
  with pytest.raises(fl.FlaxlensError, match="'nowhere'"):
    flg.load(path)
  data["links"].pop()
  data["nodes"].append(dict(data["nodes"][0]))
  path.write_text(json.dumps(data))
  with pytest.raises(fl.FlaxlensError, match="repeats node ids"):
    flg.load(path)


# --- checking a graph's claims ----------------------------------------------------------------


def _native_response(tokens, variables, transcoder, layer, position, feature, direction):
  """The demeaned target logit's change when the feature's decode is taken out of layer
  `layer`'s MLP output at `position`, in Flax itself (`nn.intercept_methods`)."""
  model = DemoLM()
  features = []

  def edit(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.module.name == "mlp" and context.module.parent.name == f"block_{layer}":
      a = transcoder.encode(args[0])[0, position, feature]
      features.append(a)
      out = out.at[0, position].add(-a * transcoder.W_dec[...][feature])
    return out

  clean = model.apply(variables, tokens)[0, -1] @ direction
  with nn.intercept_methods(edit):
    edited = model.apply(variables, tokens)[0, -1] @ direction
  return float(edited - clean)


def test_check_measures_the_models_response_and_reads_the_graphs_edge(demo):
  tree, tokens, transcoders, mlps, graph = demo
  model = DemoLM()
  variables = model.init(jax.random.key(0), tokens)  # demo_model's weights
  for node in (0, graph.n_features - 1):
    layer, position, feature = graph.active_features[graph.selected[node]]
    result = flg.check(graph, tree, tokens, transcoders, mlps, (layer, position, feature))
    assert result.direct == -graph.adjacency[graph.n_nodes - len(graph.targets.ids), node]
    direction = graph.targets.directions[0]
    native = _native_response(
      tokens, variables, transcoders[layer], layer, position, feature, direction
    )
    assert result.measured == pytest.approx(native, abs=2e-5)
  with pytest.raises(fl.FlaxlensError, match="no node of the graph"):
    flg.check(graph, tree, tokens, transcoders, mlps, (0, 0, 0))  # position 0: no nodes


# --- refusals ---------------------------------------------------------------------------------


class ScaleNorm(nn.Module):
  """A "norm" with no square root: nothing to freeze."""

  @nn.compact
  def __call__(self, x):
    return x * self.param("scale", nn.initializers.ones, (x.shape[-1],))


class LinearAttention(nn.Module):
  """An attention with no softmax: no pattern to freeze."""

  @nn.compact
  def __call__(self, x):
    q, k, v = (nn.Dense(x.shape[-1], name=n)(x) for n in ("q", "k", "v"))
    return jnp.einsum("bqk,bkd->bqd", jnp.tril(jnp.einsum("bqd,bkd->bqk", q, k)), v)


class TwoHeads(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.SelfAttention(num_heads=2)(x)


class Odd(nn.Module):
  norm: type = nn.LayerNorm
  attention: type = TwoHeads

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(16, 8, name="embed")(tokens)
    x = x + self.attention(name="attn")(self.norm(name="ScaleNorm_ln")(x))
    x = x + nn.Dense(8, name="mlp")(nn.LayerNorm(name="ln_2")(x))
    return nn.Dense(16, name="unembed")(x)


def _odd(norm, attention):
  tokens = jnp.arange(1, 7)[None]
  model = Odd(norm=norm, attention=attention)
  return fl.unflaxify(model, model.init(jax.random.key(1), tokens), tokens), tokens


def _transcoders(n=1, d=8, **kwargs):
  return [fld.Transcoder(d, d, 16, rngs=nnx.Rngs(i), **kwargs) for i in range(n)]


def test_a_norm_or_attention_that_cannot_be_frozen_is_refused():
  class ScaleLayerNorm(ScaleNorm):
    pass

  class Attention(LinearAttention):  # found by its class name
    pass

  tree, tokens = _odd(ScaleLayerNorm, TwoHeads)
  with pytest.raises(
    fl.UnsupportedFlaxFeatureError, match=r"ScaleNorm_ln: .*no pow/rsqrt/sqrt.*flg\.Freeze"
  ):
    flg.attribute(tree, tokens, _transcoders(), ["mlp"])
  tree, tokens = _odd(nn.LayerNorm, Attention)
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match=r"attn: .*no exp.*pattern"):
    flg.attribute(tree, tokens, _transcoders(), ["mlp"])


class Normalizer(nn.Module):
  """An RMS norm under a name no rule finds: left unfrozen, its scale is not affine."""

  @nn.compact
  def __call__(self, x):
    scale = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return x * scale * self.param("scale", nn.initializers.ones, (x.shape[-1],))


def test_a_norm_left_unfrozen_is_refused_until_it_is_named():
  tree, tokens = _odd(Normalizer, TwoHeads)
  for _ in range(2):  # the check runs while compiling; a refused program is not kept
    with pytest.raises(
      fl.UnsupportedFlaxFeatureError, match=r"not linear in the nodes' writes: .*rsqrt.*Freeze"
    ):
      flg.attribute(tree, tokens, _transcoders(), ["mlp"])
  freeze = flg.Freeze(norms=["ScaleNorm_ln", "ln_2"])
  graph = flg.attribute(tree, tokens, _transcoders(), ["mlp"], freeze=freeze)
  assert graph.rows.shape[1] == graph.n_nodes


def test_refusals_name_the_problem_and_the_fix(demo):
  tree, tokens, transcoders, mlps, _ = demo
  cases = [
    (
      dict(at=["block_0/nothing", "block_1/mlp"]),
      "No call of DemoLM.__call__ matches the site 'block_0/nothing'",
    ),
    (
      dict(at=["block_0/mlp/*", "block_1/mlp"]),
      r"at\[0\]='block_0/mlp/\*' names 2 calls .* one MLP call",
    ),
    (dict(transcoders=transcoders[:1]), "1 transcoders for 2 MLP calls"),
    (
      dict(transcoders=_transcoders(2, d=12)),
      "inputs of width 12 and write outputs of width 12, but the MLP calls",
    ),
    (dict(transcoders=transcoders[0]), "list of fld.Transcoder"),
    (dict(targets=[3, 99]), r"target token ids \[99\] are outside the vocabulary"),
    (dict(args=jnp.concatenate([tokens, tokens])), "a graph is of one prompt"),
    (dict(budget=100), "too small for one row"),
    (dict(freeze=flg.Freeze(norms=["**/nonorm"])), r"matches the site '\*\*/nonorm'"),
  ]
  base = dict(tree=tree, args=tokens, transcoders=transcoders, at=mlps)
  for change, match in cases:
    arguments = {**base, **change}
    with pytest.raises(fl.FlaxlensError, match=match):
      flg.attribute(
        arguments.pop("tree"),
        arguments.pop("args"),
        arguments.pop("transcoders"),
        arguments.pop("at"),
        **arguments,
      )
  clt = fld.CrossLayerTranscoder(3, 16, 16, 32, rngs=nnx.Rngs(0))
  with pytest.raises(fl.FlaxlensError, match="CLT spans 3 layers and at= names 2"):
    flg.attribute(tree, tokens, clt, mlps)


def test_a_scanned_mlp_is_refused():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + nn.Dense(8, name="mlp")(nn.LayerNorm(name="ln")(x)), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(16, 8, name="embed")(tokens)
      stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
      x, _ = stack(name="layers")(x, None)
      return nn.Dense(16, name="unembed")(x)

  tokens = jnp.arange(1, 6)[None]
  model = Scanned()
  tree = fl.unflaxify(model, model.init(jax.random.key(0), tokens), tokens)
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="inside a scanned body"):
    flg.attribute(tree, tokens, _transcoders(), ["layers/mlp"])
