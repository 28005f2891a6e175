"""`fld.splice`: SAEs, transcoders and CLTs in a tiny Linen and NNX transformer.

With the error term the model's output is the native model's, bit for bit (eager and
compiled). A feature ablated, steered or captured equals the same edit written natively:
the model's MLP outputs replaced, inside the Flax model's own forward
(`nn.intercept_methods` for Linen, the MLP submodules wrapped for NNX), by values
computed by hand in plain JAX from the dictionary's weights.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl
import flaxlens.dictionaries as fld

D, VOCAB, LAYERS, WIDTH = 8, 11, 2, 16
TOKENS = jnp.array([[1, 4, 2, 7, 3], [5, 0, 9, 2, 6]])


class LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(x)))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, h):
    h = h + nn.SelfAttention(num_heads=2)(nn.LayerNorm()(h))
    return h + LinenMlp(name="mlp")(nn.LayerNorm()(h))


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(VOCAB, D)(tokens)
    for i in range(LAYERS):
      h = LinenBlock(name=f"block_{i}")(h)
    return nn.Dense(VOCAB)(nn.LayerNorm()(h))


class NNXMlp(nnx.Module):
  def __init__(self, rngs):
    self.up, self.down = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.gelu(self.up(x)))


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm1, self.norm2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, D, decode=False, rngs=rngs)
    self.mlp = NNXMlp(rngs)

  def __call__(self, h):
    h = h + self.attn(self.norm1(h))
    return h + self.mlp(self.norm2(h))


class NNXModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([NNXBlock(rngs) for _ in range(LAYERS)])
    self.norm, self.head = nnx.LayerNorm(D, rngs=rngs), nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    for block in self.blocks:
      h = block(h)
    return self.head(self.norm(h))


class Hooked(nnx.Module):
  """An NNX MLP whose output goes through `edit(layer, input, output)`."""

  def __init__(self, mlp, layer, edit):
    self.mlp, self.layer, self.edit = mlp, layer, edit

  def __call__(self, x):
    return self.edit(self.layer, x, self.mlp(x))


class Linen:
  name = "linen"
  mlps = [f"block_{i}/mlp" for i in range(LAYERS)]

  def __init__(self):
    self.model = LinenModel()
    self.variables = self.model.init(jax.random.key(0), TOKENS)
    self.tree = fl.unflaxify(self.model, self.variables, TOKENS)

  def native(self, edit=None, jit=False):
    """The model's output, each MLP's output `y` of layer `j` and input `x` replaced by
    `edit(j, x, y)`."""

    def hook(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if edit is None or not isinstance(context.module, LinenMlp):
        return out
      if context.method_name != "__call__":
        return out
      return edit(int(context.module.parent.name.split("_")[1]), args[0], out)

    def forward(variables, tokens):
      with nn.intercept_methods(hook):
        return self.model.apply(variables, tokens)

    return (jax.jit(forward) if jit else forward)(self.variables, TOKENS)


class NNX:
  name = "nnx"
  mlps = [f"blocks/{i}/mlp" for i in range(LAYERS)]

  def __init__(self):
    self.model = NNXModel(nnx.Rngs(0))
    self.tree = fl.unflaxify(self.model, TOKENS)

  def native(self, edit=None, jit=False):
    model = nnx.clone(self.model)
    if edit is not None:
      for j, block in enumerate(model.blocks):
        block.mlp = Hooked(block.mlp, j, edit)
    if jit:
      return nnx.jit(lambda m, t: m(t))(model, TOKENS)
    return model(TOKENS)


class Cached:
  """A framework's model with its clean native outputs computed once (eager, compiled)."""

  def __init__(self, framework):
    self.framework, self.clean = framework, {}
    self.tree, self.mlps = framework.tree, framework.mlps

  def native(self, edit=None, jit=False):
    if edit is not None:
      return self.framework.native(edit, jit)
    if jit not in self.clean:
      self.clean[jit] = self.framework.native(jit=jit)
    return self.clean[jit]


@pytest.fixture(scope="module", params=[Linen, NNX], ids=["linen", "nnx"])
def fw(request):
  return Cached(request.param())


def assert_equal(a, b):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def relu_features(x, w, b):
  return jax.nn.relu(x @ w + b)


def clt_edit(clt, feature_edit, record=None):
  """The native CLT splice: each MLP's output `y_j` becomes `y_j - (clean_j - edited_j)`,
  `clean_j`/`edited_j` the reconstructions from every layer `l <= j`'s features, clean
  and as `feature_edit(l, f)` changes them (all plain JAX on the CLT's weights);
  `record[j]` gets the MLP's own output `y_j` (what capturing the call gives)."""
  w_enc, b_enc, b_dec = clt.W_enc[...], clt.b_enc[...], clt.b_dec[...]
  w_dec = [clt.W_dec[layer][...] for layer in range(LAYERS)]
  store = {}

  def edit(j, x, y):
    f = relu_features(x, w_enc[j], b_enc[j])
    store[j] = (f, feature_edit(j, f))
    recon = []
    for which in (0, 1):
      out = b_dec[j]
      for source in range(j + 1):
        out = out + store[source][which] @ w_dec[source][:, j - source]
      recon.append(out if not clt.config.skip else out + x @ clt.W_skip[...][j])
    new = y - (recon[0] - recon[1])
    if record is not None:
      record[j] = y
    return new

  return edit


def make_clt(skip=False):
  clt = fld.CrossLayerTranscoder(LAYERS, D, D, WIDTH, skip=skip, rngs=nnx.Rngs(1))
  clt.b_enc[...] = jax.random.normal(jax.random.key(2), clt.b_enc.shape) * 0.3
  clt.b_dec[...] = jax.random.normal(jax.random.key(3), clt.b_dec.shape) * 0.1
  if skip:
    clt.W_skip[...] = jax.random.normal(jax.random.key(4), clt.W_skip.shape) * 0.1
  return clt


def make_transcoder(skip):
  transcoder = fld.Transcoder(D, D, WIDTH, skip=skip, rngs=nnx.Rngs(5))
  transcoder.b_enc[...] = jnp.full((WIDTH,), 0.2)
  if skip:
    transcoder.W_skip[...] = jax.random.normal(jax.random.key(6), (D, D)) * 0.1
  return transcoder


def test_a_clt_with_its_error_term_leaves_the_output_bit_for_bit_unchanged(fw):
  spliced = fld.splice(fw.tree, make_clt(skip=True), fw.mlps)
  assert_equal(fl.run(spliced, TOKENS, jit=False), fw.native())
  assert_equal(fl.run(spliced, TOKENS, jit=True), fw.native(jit=True))
  assert_equal(fl.variable_jit(lambda t: t(fl.ArgsAndKwargs.capture(TOKENS)))(spliced),
               fw.native(jit=True))  # fmt: skip


@pytest.mark.parametrize("skip", [False, True])
def test_a_transcoder_with_its_error_term_leaves_the_output_bit_for_bit_unchanged(fw, skip):
  spliced = fld.splice(fw.tree, make_transcoder(skip), fw.mlps[0])
  assert_equal(fl.run(spliced, TOKENS, jit=False), fw.native())
  assert_equal(fl.run(spliced, TOKENS, jit=True), fw.native(jit=True))


def test_a_transcoder_at_every_mlp_runs_compiled_and_each_layers_features_are_sites(fw):
  spliced = fw.tree
  for j, site in enumerate(fw.mlps):
    spliced = fld.splice(spliced, make_transcoder(skip=j == 0), site)
  features = [f"{site}/transcoder/activation" for site in fw.mlps]
  out, cache = fl.capture(spliced, TOKENS, features, jit=True)
  assert_equal(out, fw.native(jit=True))
  assert sorted(cache) == sorted(features)


@pytest.mark.parametrize("jit", [False, True])
def test_ablating_a_clt_feature_of_layer_0_changes_every_later_mlp_as_native(fw, jit):
  clt = make_clt(skip=True)
  spliced = fld.splice(fw.tree, clt, fw.mlps)
  ablate = fl.ablate(f"{fw.mlps[0]}/clt/activation", where=jnp.s_[..., 3])
  out, cache = fl.capture(spliced, TOKENS, fw.mlps, interventions=[ablate], jit=jit)
  record = {}
  expected = fw.native(clt_edit(clt, lambda j, f: f.at[..., 3].set(0.0) if j == 0 else f, record))
  if jit:  # compiled: the same computation, up to XLA's fusion
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  else:
    assert_equal(out, expected)
    for j, site in enumerate(fw.mlps):
      assert_equal(cache[site], record[j])
  assert not np.array_equal(out, fw.native())


def test_steering_a_clt_feature_of_layer_1_leaves_layer_0_and_equals_native(fw):
  clt = make_clt()
  spliced = fld.splice(fw.tree, clt, fw.mlps)
  steer = fl.steer(f"{fw.mlps[1]}/clt", jnp.asarray(2.0), where=jnp.s_[..., 5])
  out, cache = fl.capture(spliced, TOKENS, fw.mlps, interventions=[steer], jit=False)
  record = {}
  expected = fw.native(clt_edit(clt, lambda j, f: f.at[..., 5].add(2.0) if j == 1 else f, record))
  assert_equal(out, expected)
  _, clean = fl.capture(fw.tree, TOKENS, fw.mlps[0], jit=False)
  assert_equal(cache[fw.mlps[0]], clean[fw.mlps[0]])


def test_captured_clt_features_equal_the_native_encoder_on_the_native_inputs(fw):
  clt = make_clt()
  spliced = fld.splice(fw.tree, clt, fw.mlps)
  features = [f"{site}/clt/activation" for site in fw.mlps]
  _, cache = fl.capture(spliced, TOKENS, features, jit=False)
  _, inputs = fl.capture(fw.tree, TOKENS, fw.mlps, inputs=True, jit=False)
  for j, site in enumerate(fw.mlps):
    native = relu_features(inputs[f"{site}:input"], clt.W_enc[...][j], clt.b_enc[...][j])
    assert_equal(cache[features[j]], native)


@pytest.mark.parametrize("skip", [False, True])
def test_ablating_a_transcoder_feature_equals_the_native_edit(fw, skip):
  transcoder = make_transcoder(skip)
  spliced = fld.splice(fw.tree, transcoder, fw.mlps[1])
  ablate = fl.ablate(f"{fw.mlps[1]}/transcoder/activation", where=jnp.s_[..., 2])
  out = fl.run(spliced, TOKENS, interventions=[ablate], jit=False)
  w_enc, b_enc = transcoder.W_enc[...], transcoder.b_enc[...]
  w_dec, b_dec = transcoder.W_dec[...], transcoder.b_dec[...]

  def edit(j, x, y):
    if j != 1:
      return y
    f = relu_features(x, w_enc, b_enc)
    recon = [g @ w_dec + b_dec for g in (f, f.at[..., 2].set(0.0))]
    if skip:
      recon = [r + x @ transcoder.W_skip[...] for r in recon]
    return y - (recon[0] - recon[1])

  assert_equal(out, fw.native(edit))
  assert not np.array_equal(out, fw.native())


def test_an_sae_feature_ablated_equals_the_native_edit(fw):
  sae = fld.SAE(D, WIDTH, rngs=nnx.Rngs(7))
  sae.b_enc[...] = jnp.full((WIDTH,), 0.3)
  spliced = fld.splice(fw.tree, sae, fw.mlps[1])
  ablate = fl.ablate(f"{fw.mlps[1]}/sae/activation", where=jnp.s_[..., 4])
  out = fl.run(spliced, TOKENS, interventions=[ablate], jit=False)
  w_enc, b_enc, w_dec, b_dec = sae.W_enc[...], sae.b_enc[...], sae.W_dec[...], sae.b_dec[...]

  def edit(j, x, y):
    if j != 1:
      return y
    f = relu_features(y - b_dec, w_enc, b_enc)
    return y - ((f @ w_dec + b_dec) - (f.at[..., 4].set(0.0) @ w_dec + b_dec))

  assert_equal(out, fw.native(edit))


def test_without_the_error_term_each_mlp_output_is_the_clt_reconstruction(fw):
  clt = make_clt(skip=True)
  out = fl.run(fld.splice(fw.tree, clt, fw.mlps, error=False), TOKENS, jit=False)
  w_enc, b_enc, b_dec = clt.W_enc[...], clt.b_enc[...], clt.b_dec[...]
  store = {}

  def edit(j, x, y):
    store[j] = relu_features(x, w_enc[j], b_enc[j])
    recon = b_dec[j]
    for source in range(j + 1):
      recon = recon + store[source] @ clt.W_dec[source][...][:, j - source]
    return recon + x @ clt.W_skip[...][j]

  assert_equal(out, fw.native(edit))


def test_replacement_run_gives_each_layers_inputs_features_outputs_and_errors(fw):
  clt = make_clt(skip=True)
  run = fld.replacement_run(fw.tree, clt, fw.mlps, TOKENS, jit=False)
  _, clean = fl.capture(fw.tree, TOKENS, fw.mlps, inputs=True, jit=False)
  for j, site in enumerate(fw.mlps):
    x = clean[f"{site}:input"]
    assert_equal(run.inputs[j], x)
    assert_equal(run.outputs[j], clean[site])
    assert_equal(run.features[j], relu_features(x, clt.W_enc[...][j], clt.b_enc[...][j]))
  assert_equal(run.errors, run.outputs - run.reconstructions)
  np.testing.assert_allclose(run.reconstructions, clt(run.inputs), rtol=1e-6, atol=1e-6)


def test_refusals_name_the_site_and_the_fix(fw):
  with pytest.raises(fl.ArgumentError, match=r"list of 2 calls"):
    fld.splice(fw.tree, make_clt(), fw.mlps[:1])
  with pytest.raises(fl.ArgumentError, match=rf"d_in is 6.*{fw.mlps[0]}.*build the"):
    fld.splice(fw.tree, fld.CrossLayerTranscoder(LAYERS, 6, D, WIDTH, rngs=nnx.Rngs(0)), fw.mlps)
  with pytest.raises(fl.ArgumentError, match=rf"d_out is 5.*{fw.mlps[1]}"):
    fld.splice(fw.tree, fld.Transcoder(D, 5, WIDTH, rngs=nnx.Rngs(0)), fw.mlps[1])
  with pytest.raises(fl.ArgumentError, match=r"d_out is 4"):
    fld.splice(fw.tree, fld.SAE(4, WIDTH, rngs=nnx.Rngs(0)), fw.mlps[1])
  with pytest.raises(fl.ArgumentError, match=r"layer order"):
    fld.splice(fw.tree, make_clt(), fw.mlps[::-1])
  with pytest.raises(fl.ArgumentError, match=r"not a fld.Dictionary"):
    fld.splice(fw.tree, nnx.Linear(D, D, rngs=nnx.Rngs(0)), fw.mlps[0])


class KeywordCall(nnx.Module):
  def __init__(self, rngs):
    self.mlp = NNXMlp(rngs)

  def __call__(self, h):
    return self.mlp(x=h)


def test_a_call_without_positional_input_is_refused_naming_it():
  x = jnp.ones((2, D))
  tree = fl.unflaxify(KeywordCall(nnx.Rngs(0)), x)
  with pytest.raises(fl.ArgumentError, match=r"first positional argument of mlp.*positionally"):
    fld.splice(tree, make_transcoder(False), "mlp")
  clt = fld.CrossLayerTranscoder(1, D, D, WIDTH, rngs=nnx.Rngs(0))
  with pytest.raises(fl.ArgumentError, match=r"a CLT layer reads .* of mlp"):
    fld.splice(tree, clt, ["mlp"])


@pytest.mark.parametrize(
  "activation, k", [("jumprelu", None), ("topk", 3), ("batchtopk", 3)], ids=lambda v: str(v)
)
def test_each_layers_features_are_the_clts_own_encoding_for_every_activation(activation, k):
  fw = NNX()
  clt = fld.CrossLayerTranscoder(LAYERS, D, D, WIDTH, activation=activation, k=k,
                                 rngs=nnx.Rngs(1))  # fmt: skip
  state = nnx.state(clt.activation)  # distinct per-layer thresholds
  nnx.update(
    clt.activation,
    jax.tree.map(lambda v: jax.random.uniform(jax.random.key(8), v.shape) * 0.3, state),
  )
  features = [f"{site}/clt/activation" for site in fw.mlps]
  _, cache = fl.capture(fld.splice(fw.tree, clt, fw.mlps), TOKENS, features, jit=False)
  _, inputs = fl.capture(fw.tree, TOKENS, fw.mlps, inputs=True, jit=False)
  native = clt.encode(jnp.stack([inputs[f"{site}:input"] for site in fw.mlps]))
  for j, name in enumerate(features):
    np.testing.assert_allclose(cache[name], native[j], rtol=1e-6, atol=1e-6)
    assert (cache[name] != 0).any()
