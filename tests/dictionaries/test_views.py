"""`fld.feature_views`: top contexts, histograms and promoted tokens of a dictionary's
features, checked against plain NumPy recomputations; the page in a real browser; the
`flaxlens features` command.

The model is a tiny token model (an embedding, a projection, a norm, an unembedding with a
nonzero bias); its projection's output is harvested, and an SAE with nonzero encoder
biases (features of every sparsity) reads it. References come from the stored rows and
the dictionary's weights by NumPy alone.
"""

from __future__ import annotations

import json
import string

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from view.test_html import browser  # noqa: F401 (the fixture)

import flaxlens as fl
import flaxlens.dictionaries as fld
from flaxlens import cli

VOCABULARY = [f"{letter}{letter}" for letter in string.ascii_lowercase[:16]]
SITE, HEAD = "layers_1", "layers_3"
WIDTH, BATCH = 24, 7  # BATCH: many batches, the last one short, over the 60 rows.


def _model():
  return nn.Sequential(
    [
      nn.Embed(16, 6),
      nn.Dense(6),
      nn.LayerNorm(),
      nn.Dense(16, bias_init=nn.initializers.normal(1.0)),
    ]
  )


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
  """The tree, its variables, the tokens (6 examples of 10), the store, the SAE."""
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (6, 10), 0, 16), np.int32)
  model = _model()
  variables = model.init(jax.random.key(0), tokens[:3])
  tree = fl.unflaxify(model, variables, tokens[:3])
  path = tmp_path_factory.mktemp("views") / "store"
  store = fl.harvest(tree, [tokens[:3], tokens[3:]], SITE, str(path), progress=False)
  sae = fld.SAE(6, WIDTH, rngs=nnx.Rngs(2))
  sae.b_enc[...] = jax.random.normal(jax.random.key(3), (WIDTH,)) * 0.5
  # Feature 9 never fires and features 0 and 4 do (the page test reads both kinds).
  sae.b_enc[...] = sae.b_enc[...].at[9].set(-100.0).at[jnp.array([0, 4])].add(2.0)
  sae.b_dec[...] = jax.random.normal(jax.random.key(4), (6,)) * 0.1
  return tree, variables, tokens, store, sae


def _features_by_numpy(sae, rows):
  """The SAE's features on `rows`, recomputed with NumPy from its weights."""
  weights = {name: np.asarray(getattr(sae, name)[...]) for name in ("W_enc", "b_enc", "b_dec")}
  return np.maximum((rows - weights["b_dec"]) @ weights["W_enc"] + weights["b_enc"], 0)


def test_top_contexts_are_the_largest_rows_with_their_tokens(setting):
  _, _, tokens, store, sae = setting
  chosen = [0, 5, 11, 23]
  views = fld.feature_views(
    sae, store, SITE, chosen, tokens=tokens, vocabulary=VOCABULARY, top=5, before=2, after=1,
    batch_size=BATCH,
  )  # fmt: skip
  rows = store[SITE][:]
  index = store[SITE].index[:]
  features = _features_by_numpy(sae, rows)
  for feature in chosen:
    value = features[:, feature]
    active = np.flatnonzero(value)
    order = active[np.lexsort((active, -value[active]))][:5]
    contexts = views[feature].contexts
    assert [c.row for c in contexts] == order.tolist()
    np.testing.assert_allclose([c.activation for c in contexts], value[order], rtol=1e-5)
    for context, row in zip(contexts, order, strict=True):
      example, position = index[row]
      assert (context.example, context.position) == (example, position)
      first = max(0, position - 2)
      expected = tokens[example, first : position + 2]
      assert context.ids == tuple(expected.tolist())
      assert context.texts == tuple(VOCABULARY[t] for t in expected)
      assert context.ids[context.center] == tokens[example, position]


def test_histogram_is_numpys_over_the_nonzero_values(setting):
  _, _, _, store, sae = setting
  views = fld.feature_views(sae, store, SITE, [3, 7], bins=9, batch_size=BATCH)
  features = _features_by_numpy(sae, store[SITE][:])
  for feature in (3, 7):
    value = features[:, feature]
    counts, edges = np.histogram(value[value != 0], bins=9)
    histogram = views[feature].histogram
    np.testing.assert_array_equal(histogram.counts, counts)
    np.testing.assert_allclose(histogram.edges, edges, rtol=1e-5)
    assert histogram.rows == len(value) == 60
    assert histogram.fraction_active == np.count_nonzero(value) / 60


@pytest.mark.parametrize("given", ["array", "call"])
def test_promoted_tokens_are_the_argsort_of_the_decoder_through_the_unembedding(setting, given):
  tree, variables, _, store, sae = setting
  kernel = np.asarray(variables["params"][HEAD]["kernel"])
  unembedding = {"array": dict(unembedding=kernel), "call": dict(unembedding=HEAD, tree=tree)}
  views = fld.feature_views(sae, store, SITE, [1, 4], top_tokens=4, **unembedding[given])
  for feature in (1, 4):
    logits = np.asarray(sae.W_dec[...])[feature] @ kernel
    view = views[feature]
    assert [s.id for s in view.promoted] == np.argsort(-logits)[:4].tolist()
    assert [s.id for s in view.suppressed] == np.argsort(logits)[:4].tolist()
    np.testing.assert_allclose([s.logit for s in view.promoted], np.sort(logits)[::-1][:4], 1e-5)


class _Tied(nnx.Module):
  """An NNX token model whose unembedding is an `nnx.Linear` (`tied=False`) or the
  embedding's `attend` (`tied=True`)."""

  def __init__(self, tied: bool):
    self.embed = nnx.Embed(16, 6, rngs=nnx.Rngs(0))
    self.proj = nnx.Linear(6, 6, rngs=nnx.Rngs(1))
    self.head = None if tied else nnx.Linear(6, 16, rngs=nnx.Rngs(2))

  def __call__(self, ids):
    h = self.proj(self.embed(ids))
    return self.embed.attend(h) if self.head is None else self.head(h)


@pytest.mark.parametrize("tied", [False, True])
def test_an_nnx_linear_or_a_tied_attend_is_the_unembedding(tmp_path, tied):
  model, ids = _Tied(tied), jnp.arange(16).reshape(2, 8)
  tree = fl.unflaxify(model, ids)
  store = fl.harvest(tree, [ids], "proj", str(tmp_path / "store"), progress=False)
  sae = fld.SAE(6, 8, rngs=nnx.Rngs(0))
  call = "embed.attend" if tied else "head"
  views = fld.feature_views(sae, store, "proj", [2], unembedding=call, tree=tree, top_tokens=3)
  matrix = np.asarray(model.embed.embedding[...]).T if tied else np.asarray(model.head.kernel[...])
  logits = np.asarray(sae.W_dec[...])[2] @ matrix
  assert [s.id for s in views[2].promoted] == np.argsort(-logits)[:3].tolist()


def test_a_cross_layer_transcoders_layer_reads_its_own_encoder(setting):
  _, _, _, store, _ = setting
  clt = fld.CrossLayerTranscoder(2, 6, 4, 8, rngs=nnx.Rngs(0))
  clt.b_enc[...] = jax.random.normal(jax.random.key(5), (2, 8)) * 0.5
  unembedding = np.asarray(jax.random.normal(jax.random.key(6), (4, 16)))
  views = fld.feature_views(
    clt, store, SITE, [0, 6], layer=0, unembedding=unembedding, top=4, batch_size=BATCH
  )
  rows = store[SITE][:]
  features = np.maximum(rows @ np.asarray(clt.W_enc[0]) + np.asarray(clt.b_enc[0]), 0)
  written = np.asarray(clt.W_dec[0][...]).sum(axis=1)  # into layers 0 and 1
  for feature in (0, 6):
    value = features[:, feature]
    active = np.flatnonzero(value)
    assert [c.row for c in views[feature].contexts] == active[np.lexsort((active, -value[active]))][
      :4
    ].tolist()
    logits = written[feature] @ unembedding
    assert [s.id for s in views[feature].promoted] == np.argsort(-logits)[:10].tolist()


def test_the_views_are_json_ready(setting):
  _, _, tokens, store, sae = setting
  views = fld.feature_views(sae, store, SITE, [2], tokens=tokens, top=2, bins=3)
  data = json.loads(json.dumps(views.to_dict()))
  assert data["site"] == SITE and data["dictionary"]["width"] == WIDTH
  assert len(data["views"][0]["histogram"]["counts"]) == 3
  assert data["views"][0]["contexts"][0]["row"] == views[2].contexts[0].row


@pytest.mark.parametrize(
  "change, words",
  [
    (dict(features=[WIDTH]), "feature 24 is out of range"),
    (dict(features=[1, 1]), "names a feature twice"),
    (dict(site="layers_0"), "is no site of the harvest"),
    (dict(dictionary=fld.SAE(5, 8, rngs=nnx.Rngs(0))), "d_in=5"),
    (dict(tokens=np.zeros((2, 10), np.int32)), "holds 2 examples"),
    (dict(unembedding=np.zeros((5, 16))), "d_out=6"),
    (dict(unembedding="layers_2", tree=True), "not linear"),  # True: the tree
    (dict(unembedding=HEAD), "must be a converted tree"),
    (dict(layer=0), "is for a cross-layer transcoder"),
    (dict(vocabulary=["a"]), "outside the vocabulary"),
  ],
)
def test_bad_input_is_refused_naming_what_to_change(setting, change, words):
  tree, _, tokens, store, sae = setting
  arguments = dict(dictionary=sae, site=SITE, features=[1], tokens=tokens) | change
  if change.get("tree") is True:
    arguments["tree"] = tree
  with pytest.raises(fl.FlaxlensError, match=words):
    fld.feature_views(
      arguments.pop("dictionary"), store, arguments.pop("site"), arguments.pop("features"),
      **arguments,
    )  # fmt: skip


_SHOWN = """
const [feature] = arguments;
const section = document.getElementById(`feature-${feature}`);
const texts = (selector) => [...section.querySelectorAll(selector)].map((e) => e.innerText);
return [texts(".promoted td.text"), texts(".token.center"),
  section.querySelectorAll("svg.histogram rect").length, section.innerText];
"""


def test_the_page_opens_from_the_file_and_shows_each_features_tokens(
  setting,
  browser,  # noqa: F811 (the fixture)
  tmp_path,
):
  tree, variables, tokens, store, sae = setting
  views = fld.feature_views(
    sae, store, SITE, [0, 4, 9], tokens=tokens, vocabulary=VOCABULARY, unembedding=HEAD,
    tree=tree, top=4, bins=6, top_tokens=3,
  )  # fmt: skip
  page = tmp_path / "features.html"
  assert views.to_html(page) == page.read_text(encoding="utf-8")
  assert "http://" not in page.read_text() and "https://" not in page.read_text()
  browser.get(page.as_uri())
  assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
  kernel = np.asarray(variables["params"][HEAD]["kernel"])
  index = store[SITE].index[:]
  for feature, active in ((0, True), (4, True), (9, False)):  # 9 is never active.
    promoted, centers, bars, text = browser.execute_script(_SHOWN, feature)
    logits = np.asarray(sae.W_dec[...])[feature] @ kernel
    assert promoted == [VOCABULARY[t] for t in np.argsort(-logits)[:3]]
    places = [index[c.row] for c in views[feature].contexts]
    assert centers == [VOCABULARY[tokens[e, p]] for e, p in places]
    assert bool(centers) == active and ("never active" in text) != active
    assert bars == 6


def test_the_features_command_writes_the_page(setting, tmp_path, capsys):
  _, variables, tokens, store, sae = setting
  saved = tmp_path / "sae"
  fld.save(sae, saved)
  np.save(tmp_path / "tokens.npy", tokens)
  np.save(tmp_path / "unembedding.npy", np.asarray(variables["params"][HEAD]["kernel"]))
  (tmp_path / "vocabulary.json").write_text(json.dumps(VOCABULARY))
  out = tmp_path / "pages" / "features.html"
  command = [
    "features", store.path, str(saved), "--site", SITE, "--features", "3,8", "--out", str(out),
    "--tokens", str(tmp_path / "tokens.npy"), "--unembedding", str(tmp_path / "unembedding.npy"),
    "--vocabulary", str(tmp_path / "vocabulary.json"), "--top", "3", "--no-cache",
  ]  # fmt: skip
  assert cli.main(command) == 0
  page = out.read_text(encoding="utf-8")
  assert 'id="feature-3"' in page and 'id="feature-8"' in page
  expected = fld.feature_views(sae, store, SITE, [3, 8], tokens=tokens, top=3)
  shown = json.loads(page.split('id="flaxlens-features">')[1].split("</script>")[0])
  assert [c["row"] for c in shown["views"][1]["contexts"]] == [c.row for c in expected[8].contexts]
  assert cli.main([*command[:6], "1,x", *command[7:]]) == 2
  assert "--features '1,x' is not a list" in capsys.readouterr().err
