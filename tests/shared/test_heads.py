"""Attention heads as sites (`fl.heads`, `fl.attention_pattern`), against native Flax.

Each behaviour is checked on a hand-written two-block attention model, Linen and NNX,
against the same model run natively with the edit written by hand: Linen through
`nn.intercept_methods` around the attention's `out` projection, NNX through a copy whose
`out` projection's class edits its input. Head ablation and patching equal editing those
columns of the `out` projection's input natively, bit for bit; captured heads are that
input; patterns are the weights Flax sows with `sow_weights=True`; a heads sweep equals
the native patch of each head at each position; a merged-heads call (a Hugging Face
`c_proj`) is split by `heads=n` or by its module's settings.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl

FEATURES, HEADS, DIM = 16, 4, 4


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, sow=False):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    attn = nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attn")
    return x + attn(nn.LayerNorm(name="ln")(x), mask=mask, sow_weights=sow)


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x, sow=False):
    for i in range(2):
      x = LinenBlock(name=f"block_{i}")(x, sow)
    return nn.Dense(8, name="head")(x)


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(FEATURES, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=rngs)

  def __call__(self, x, sow=False):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    return x + self.attn(self.ln(x), mask=mask, sow_weights=sow)


class NNXModel(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])
    self.head = nnx.Linear(FEATURES, 8, rngs=rngs)

  def __call__(self, x, sow=False):
    for block in self.blocks:
      x = block(x, sow)
    return self.head(x)


X = jax.random.normal(jax.random.key(1), (2, 5, FEATURES))
X2 = jax.random.normal(jax.random.key(2), (2, 5, FEATURES))


@dataclasses.dataclass
class Setup:
  """A converted model and its native runs with the `out` projections' inputs edited."""

  tree: Any
  attn: Callable[[int], str]  # the site name of block i's attention
  native: Callable[..., Any]  # native(x, {block: fn of out's input}) -> output, jitted
  patterns: Callable[[Any], list]  # the weights Flax sows, per block, jitted
  native_output: Callable[..., Any]  # (x, block, name, fn of name's output) -> output


def _linen() -> Setup:
  model = LinenModel()
  variables = model.init(jax.random.key(0), X)

  def native(x, edits):
    def edit_out_input(next_fun, args, kwargs, context):
      path = context.module.path
      if context.method_name == "__call__" and path[-1:] == ("out",):
        block = int(path[0].split("_")[1])
        if block in edits:
          return next_fun(edits[block](args[0]), *args[1:], **kwargs)
      return next_fun(*args, **kwargs)

    def run(x):
      with nn.intercept_methods(edit_out_input):
        return model.apply(variables, x)

    return jax.jit(run)(x)

  def patterns(x):
    apply = jax.jit(lambda x: model.apply(variables, x, sow=True, mutable="intermediates"))
    _, state = apply(x)
    inter = state["intermediates"]
    return [inter[f"block_{i}"]["attn"]["attention_weights"][0] for i in range(2)]

  def native_output(x, block, name, fn):
    def edit_output(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      path = context.module.path
      if context.method_name == "__call__" and path == (f"block_{block}", "attn", name):
        return fn(out)
      return out

    def run(x):
      with nn.intercept_methods(edit_output):
        return model.apply(variables, x)

    return jax.jit(run)(x)

  tree = fl.unflaxify(model, variables, X)
  return Setup(tree, lambda i: f"block_{i}/attn", native, patterns, native_output)


def _edited_class(cls: type, fn: Callable) -> type:
  def __call__(self, x, *args, **kwargs):
    return cls.__call__(self, fn(x), *args, **kwargs)

  return type(f"Edited{cls.__name__}", (cls,), {"__call__": __call__})


def _output_edited_class(cls: type, fn: Callable) -> type:
  def __call__(self, *args, **kwargs):
    return fn(cls.__call__(self, *args, **kwargs))

  return type(f"OutputEdited{cls.__name__}", (cls,), {"__call__": __call__})


def _nnx() -> Setup:
  model = NNXModel(nnx.Rngs(0))
  tree = fl.unflaxify(model, X)

  def native(x, edits):
    copy = nnx.clone(model)
    for block, fn in edits.items():
      out = copy.blocks[block].attn.out
      object.__setattr__(out, "__class__", _edited_class(type(out), fn))
    return nnx.jit(lambda m, x: m(x))(copy, x)

  def patterns(x):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, x):
      copy = nnx.merge(graphdef, state)
      copy(x, sow=True)
      return [copy.blocks[i].attn.attention_weights.get_value()[0] for i in range(2)]

    return run(state, x)

  def native_output(x, block, name, fn):
    copy = nnx.clone(model)
    call = getattr(copy.blocks[block].attn, name)
    object.__setattr__(call, "__class__", _output_edited_class(type(call), fn))
    return nnx.jit(lambda m, x: m(x))(copy, x)

  return Setup(tree, lambda i: f"blocks/{i}/attn", native, patterns, native_output)


@pytest.fixture(scope="module", params=["linen", "nnx"])
def setup(request) -> Setup:
  return {"linen": _linen, "nnx": _nnx}[request.param]()


def _bits_equal(a: Any, b: Any) -> None:
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)


def test_ablating_heads_equals_zeroing_their_columns_natively(setup):
  out = fl.run(setup.tree, X, interventions=[fl.ablate(fl.heads(setup.attn(1), [1, 3]))])
  expected = setup.native(X, {1: lambda v: v.at[..., jnp.array([1, 3]), :].set(0.0)})
  _bits_equal(out, expected)


def test_ablating_a_head_at_one_position_equals_zeroing_it_natively(setup):
  edit = fl.ablate(fl.heads(setup.attn(0), 2), where=jnp.s_[:, 3])
  out = fl.run(setup.tree, X, interventions=[edit])
  _bits_equal(out, setup.native(X, {0: lambda v: v.at[:, 3, 2, :].set(0.0)}))


def test_captured_heads_are_the_out_projection_input(setup):
  site = fl.heads(setup.attn(0))
  _, cache = fl.capture(setup.tree, X, at=site)
  value = cache[f"{setup.attn(0)}:heads"]
  assert value.shape == (2, 5, HEADS, DIM)
  # Natively, the out projection's input minus the capture is zero everywhere exactly
  # when the capture is that input: the run then equals ablating every head.
  native = setup.native(X, {0: lambda v: v - value})
  ablated = fl.run(setup.tree, X, interventions=[fl.ablate(site)])
  _bits_equal(native, ablated)


def test_capturing_named_heads_keeps_those_heads_only(setup):
  _, cache = fl.capture(
    setup.tree, X, at=[fl.heads(setup.attn(1), [3, 0]), fl.heads(setup.attn(1))]
  )
  key = f"{setup.attn(1)}:heads"
  assert cache[key].shape[-2:] == (HEADS, DIM)
  _, named = fl.capture(setup.tree, X, at=fl.heads(setup.attn(1), [3, 0]))
  _bits_equal(named[key], cache[key][..., [3, 0], :])


def test_patching_heads_from_another_runs_capture_equals_setting_them_natively(setup):
  site = fl.heads(setup.attn(1), [2, 0])
  _, other = fl.capture(setup.tree, X2, at=site)
  value = other[f"{setup.attn(1)}:heads"]  # (batch, seq, 2, dim): heads 2 and 0, in order
  out = fl.run(setup.tree, X, interventions=[fl.patch(site, value)])
  expected = setup.native(X, {1: lambda v: v.at[..., jnp.array([2, 0]), :].set(value)})
  _bits_equal(out, expected)


def test_steering_a_head_equals_adding_to_its_columns_natively(setup):
  vector = jnp.arange(DIM, dtype=jnp.float32)
  out = fl.run(setup.tree, X, interventions=[fl.steer(fl.heads(setup.attn(0), 1), vector, 2.0)])
  expected = setup.native(X, {0: lambda v: v.at[..., 1, :].set(v[..., 1, :] + 2.0 * vector)})
  _bits_equal(out, expected)


def test_attention_pattern_equals_the_weights_flax_sows(setup):
  _, cache = fl.capture(setup.tree, X, at=fl.attention_pattern("**"))
  sown = setup.patterns(X)
  for i in range(2):
    pattern = cache[f"{setup.attn(i)}:pattern"]
    assert pattern.shape == (2, HEADS, 5, 5)
    _bits_equal(pattern, sown[i])


def test_attention_pattern_of_named_heads(setup):
  _, cache = fl.capture(setup.tree, X, at=fl.attention_pattern(setup.attn(0), [2]))
  _bits_equal(cache[f"{setup.attn(0)}:pattern"], setup.patterns(X)[0][:, [2]])


def test_heads_sweep_equals_patching_each_head_and_position_natively(setup):
  site = fl.heads(setup.attn(1))

  def metric(out):
    return out[:, -1, 0].sum()

  positions = (1, 4)
  result = fl.sweep(setup.tree, X2, X, site, metric, positions=positions)
  assert result.sites == tuple(f"{setup.attn(1)} head {h}" for h in range(HEADS))
  assert result.values.shape == (HEADS, len(positions))
  _, clean = fl.capture(setup.tree, X2, at=site)
  clean = clean[f"{setup.attn(1)}:heads"]
  for h in range(HEADS):
    for j, p in enumerate(positions):
      native = setup.native(X, {1: lambda v, h=h, p=p: v.at[:, p, h].set(clean[:, p, h])})
      np.testing.assert_allclose(result.values[h, j], metric(native), rtol=1e-6, atol=1e-6)


def test_heads_sweep_keeps_the_native_clean_and_corrupted_metrics(setup):
  def metric(out):
    return out[:, -1, 0]

  result = fl.sweep(setup.tree, X2, X, fl.heads(setup.attn(1)), metric, per_example=True)
  np.testing.assert_array_equal(result.clean_per_example, metric(setup.native(X2, {})))
  np.testing.assert_array_equal(result.corrupted_per_example, metric(setup.native(X, {})))
  np.testing.assert_allclose(result.per_example.mean(-1), result.values, rtol=1e-6, atol=1e-6)


def test_layer_head_grid_sweep_has_a_row_per_layer_and_head(setup):
  result = fl.sweep(
    setup.tree, X2, X, fl.heads(setup.attn(0).replace("0", "*")), lambda o: o[0, -1, 0]
  )
  assert result.sites == tuple(f"{setup.attn(i)} head {h}" for i in range(2) for h in range(HEADS))
  single = fl.sweep(setup.tree, X2, X, fl.heads(setup.attn(1), 3), lambda o: o[0, -1, 0])
  assert single.sites == (f"{setup.attn(1)} head 3",)
  np.testing.assert_allclose(result.values[-1], single.values[0], rtol=1e-6, atol=1e-6)


def test_a_heads_sweep_plots_as_a_grid_of_layers_by_heads(setup):
  pytest.importorskip("matplotlib")
  site = fl.heads([setup.attn(0), setup.attn(1)])
  result = fl.sweep(setup.tree, X2, X, site, lambda o: o[:, -1, 0].sum())
  axes = result.plot().axes[0]
  (image,) = axes.images
  np.testing.assert_array_equal(image.get_array(), result.normalised().reshape(2, HEADS))
  assert axes.get_xlabel() == "head"
  assert [t.get_text() for t in axes.get_xticklabels()] == [str(h) for h in range(HEADS)]
  rows = [t.get_text() for t in axes.get_yticklabels()]
  assert len(rows) == 2 and rows[0] != rows[1]  # one row per layer


# --- merged heads: a call whose feature axis holds heads * head_dim ----------------------


def _merged_attention(x, heads):
  """Causal attention over (batch, seq, heads * dim), heads merged back on the last axis."""
  b, s, f = x.shape
  q = x.reshape(b, s, heads, f // heads)
  w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, q) + jnp.triu(jnp.full((s, s), -1e9), 1))
  return jnp.einsum("bhqk,bkhd->bqhd", w, q).reshape(b, s, f)


@dataclasses.dataclass(frozen=True)
class Config:
  n_head: int


class LinenMerged(nn.Module):  # as Hugging Face's Flax GPT-2: c_attn, then c_proj
  config: Config

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(FEATURES, name="c_attn")(x)
    return nn.Dense(FEATURES, name="c_proj")(_merged_attention(h, self.config.n_head))


class NNXMerged(nnx.Module):
  def __init__(self, rngs):
    self.num_heads = HEADS
    self.c_attn = nnx.Linear(FEATURES, FEATURES, rngs=rngs)
    self.c_proj = nnx.Linear(FEATURES, FEATURES, rngs=rngs)

  def __call__(self, x):
    return self.c_proj(_merged_attention(self.c_attn(x), self.num_heads))


@pytest.fixture(scope="module", params=["linen", "nnx"])
def merged(request):
  """The tree and a native run with c_proj's input edited: native(x, fn) -> output."""
  if request.param == "linen":
    model = LinenMerged(Config(HEADS))
    variables = model.init(jax.random.key(0), X)

    def native(x, fn):
      def icpt(next_fun, args, kwargs, context):
        if context.module.name == "c_proj":
          return next_fun(fn(args[0]), *args[1:], **kwargs)
        return next_fun(*args, **kwargs)

      def run(x):
        with nn.intercept_methods(icpt):
          return model.apply(variables, x)

      return jax.jit(run)(x)

    return fl.unflaxify(model, variables, X), native
  model = NNXMerged(nnx.Rngs(0))

  def native(x, fn):
    copy = nnx.clone(model)
    object.__setattr__(copy.c_proj, "__class__", _edited_class(type(copy.c_proj), fn))
    return nnx.jit(lambda m, x: m(x))(copy, x)

  return fl.unflaxify(model, X), native


def test_merged_heads_split_by_the_given_count(merged):
  tree, native = merged
  site = fl.heads("c_proj", [0, 2], heads=HEADS, on="input")
  out = fl.run(tree, X, interventions=[fl.ablate(site)])
  expected = native(X, lambda v: v.at[..., 0:DIM].set(0.0).at[..., 2 * DIM : 3 * DIM].set(0.0))
  _bits_equal(out, expected)


def test_merged_heads_count_read_from_the_module_settings(merged):
  tree, native = merged
  _, cache = fl.capture(tree, X, at=fl.heads("c_proj", on="input"))  # n_head / num_heads
  value = cache["c_proj:heads"]
  assert value.shape == (2, 5, HEADS, DIM)
  out = fl.run(tree, X, interventions=[fl.ablate(fl.heads("c_proj", 1, on="input"))])
  _bits_equal(out, native(X, lambda v: v.at[..., DIM : 2 * DIM].set(0.0)))


def test_merged_heads_on_a_projection_output(merged):
  tree, native = merged
  _, cache = fl.capture(tree, X, at=["c_attn", fl.heads("c_attn", heads=2)])
  _bits_equal(cache["c_attn:heads"], cache["c_attn"].reshape(2, 5, 2, FEATURES // 2))


# --- projections whose output holds the heads on their own axis ---------------------------


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_heads_of_a_projection_declaring_heads_and_head_dim_are_its_heads_axis(setup, name):
  # Flax's query/key/value projections output (..., heads, head_dim): head 1 is [..., 1, :]
  site = fl.heads(f"{setup.attn(1)}/{name}", 1)
  out = fl.run(setup.tree, X, interventions=[fl.ablate(site)])
  _bits_equal(out, setup.native_output(X, 1, name, lambda q: q.at[..., 1, :].set(0.0)))


def test_captured_query_heads_are_the_native_query_heads_patched_back(setup):
  site = fl.heads(f"{setup.attn(0)}/query", [2, 0])
  _, cache = fl.capture(setup.tree, X2, at=site)
  assert cache[f"{setup.attn(0)}/query:heads"].shape == (2, 5, 2, DIM)
  out = fl.run(setup.tree, X, interventions=[fl.patch(site, cache[f"{setup.attn(0)}/query:heads"])])
  _, other = fl.capture(setup.tree, X2, at=f"{setup.attn(0)}/query")
  source = other[f"{setup.attn(0)}/query"]
  expected = setup.native_output(
    X, 0, "query", lambda q: q.at[..., jnp.array([2, 0]), :].set(source[..., jnp.array([2, 0]), :])
  )
  _bits_equal(out, expected)


def test_heads_on_the_out_projection_input_are_its_heads_axis(setup):
  site = fl.heads(f"{setup.attn(1)}/out", 3, on="input")
  out = fl.run(setup.tree, X, interventions=[fl.ablate(site)])
  _bits_equal(out, setup.native(X, {1: lambda v: v.at[..., 3, :].set(0.0)}))


def test_a_head_count_that_disagrees_with_a_projections_declared_heads_is_refused(setup):
  with pytest.raises(
    fl.HeadsError, match=r"/query: .* \(heads, head_dim\) with 4 heads, but heads= says 2"
  ):
    fl.capture(setup.tree, X, at=fl.heads(f"{setup.attn(0)}/query", heads=2))


def test_a_projection_declaring_more_than_two_feature_axes_is_refused():
  class FusedQKV(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.DenseGeneral((3, 2, 4), name="qkv")(x)

  model, x = FusedQKV(), jnp.ones((1, 3, 8))
  tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  with pytest.raises(fl.HeadsError, match=r"^qkv: .* last 3 axes \(3, 2, 4\) .* ambiguous"):
    fl.capture(tree, x, at=fl.heads("qkv", heads=2))


# --- attention modules whose own __call__ calls Flax's (nn.SelfAttention, subclasses) ---


class LinenSuperAttention(nn.MultiHeadDotProductAttention):
  def __call__(self, x, **kwargs):
    return super().__call__(x, x, **kwargs) * 2.0


class NNXSuperAttention(nnx.MultiHeadAttention):
  def __call__(self, x, **kwargs):
    return super().__call__(x, **kwargs) * 2.0


def _nested_attention(kind: str):
  """A tree of an attention module calling Flax's own `__call__` from its own, its
  arguments, and native(fn of out's input) -> (output, sown weights (Linen)), jitted."""
  x = X[..., :8]
  mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
  if kind in ("SelfAttention", "subclass"):
    cls = nn.SelfAttention if kind == "SelfAttention" else LinenSuperAttention
    model = cls(num_heads=2, name="attn")
    variables = model.init(jax.random.key(0), x, mask=mask)

    def native(fn):
      def icpt(next_fun, args, kwargs, context):
        if context.module.name == "out" and context.method_name == "__call__":
          return next_fun(fn(args[0]), *args[1:], **kwargs)
        return next_fun(*args, **kwargs)

      def run(x):
        with nn.intercept_methods(icpt):
          return model.apply(variables, x, mask=mask, sow_weights=True, mutable="intermediates")

      out, state = jax.jit(run)(x)
      return out, state["intermediates"]["attention_weights"][0]

    tree = fl.unflaxify(model, variables, x, mask=mask)
    return tree, x, mask, native
  model = NNXSuperAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
  tree = fl.unflaxify(model, x, mask=mask)

  def native(fn):
    copy = nnx.clone(model)
    object.__setattr__(copy.out, "__class__", _edited_class(type(copy.out), fn))
    return nnx.jit(lambda m, x: m(x, mask=mask))(copy, x), None

  return tree, x, mask, native


@pytest.mark.parametrize("kind", ["SelfAttention", "subclass", "nnx subclass"])
def test_heads_of_an_attention_module_calling_flaxs_own_call(kind):
  tree, x, mask, native = _nested_attention(kind)
  site = fl.heads("**", 1)
  out = fl.run(tree, fl.ArgsAndKwargs.capture(x, mask=mask), interventions=[fl.ablate(site)])
  expected, _ = native(lambda v: v.at[..., 1, :].set(0.0))
  _bits_equal(out, expected)


@pytest.mark.parametrize("kind", ["SelfAttention", "subclass"])
def test_pattern_of_an_attention_module_calling_flaxs_own_call(kind):
  tree, x, mask, native = _nested_attention(kind)
  site = fl.attention_pattern("**")
  _, cache = fl.capture(tree, fl.ArgsAndKwargs.capture(x, mask=mask), at=site)
  (pattern,) = cache.values()
  _, sown = native(lambda v: v)
  _bits_equal(pattern, sown)


def test_pattern_of_an_nnx_subclass_overriding_call_is_refused():
  # NNX records no call of Flax's own __call__ inside the subclass's: its mask is unknown
  tree, x, mask, _ = _nested_attention("nnx subclass")
  with pytest.raises(fl.HeadsError, match=r"overrides __call__, .* mask .* not known"):
    fl.capture(tree, fl.ArgsAndKwargs.capture(x, mask=mask), at=fl.attention_pattern("**"))


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("site", "says"),
  [
    (lambda: fl.heads("c_proj", heads=5, on="input"), "16 features, which 5 heads do not divide"),
    (lambda: fl.heads("c_proj", 7, on="input"), "heads [7] are out of range"),
    (lambda: fl.heads("c_proj", [1, -3], on="input"), "names a head twice"),
  ],
)
def test_bad_head_counts_on_merged_calls_raise_before_running(merged, site, says):
  tree, _ = merged
  with pytest.raises(fl.HeadsError) as error:
    fl.run(tree, X, interventions=[fl.ablate(site())])
  assert says in str(error.value)
  assert str(error.value).startswith("c_proj: ")


def test_a_head_count_that_disagrees_with_the_attention_module_is_refused(setup):
  with pytest.raises(fl.HeadsError, match=r"heads=8, but this attention module has 4 heads"):
    fl.capture(setup.tree, X, at=fl.heads(setup.attn(0), heads=8))


def test_a_call_with_no_known_head_count_is_refused(setup):
  name = "head"
  with pytest.raises(fl.HeadsError, match=r"no head count is known .* Pass heads=n"):
    fl.run(setup.tree, X, interventions=[fl.ablate(fl.heads(name))])


@pytest.mark.parametrize("count", [0, -2, 2.5, True])
def test_a_head_count_that_is_not_a_positive_int_is_refused(count):
  with pytest.raises(fl.HeadsError, match="is no head count"):
    fl.heads("attn", heads=count)


def test_a_pattern_of_a_custom_attention_function_is_refused():
  def attention(query, key, value, **kwargs):
    return nn.dot_product_attention(query, key, value)

  model = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=attention)
  x = jnp.ones((1, 3, 4))
  tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  with pytest.raises(fl.HeadsError, match=r"its attention_fn is \S*attention, so"):
    fl.capture(tree, x, at=fl.attention_pattern("**"))


def test_hugging_face_gpt2_heads_are_read_from_its_config():
  transformers = pytest.importorskip("transformers")
  transformers.utils.logging.set_verbosity_error()
  config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2)
  module = transformers.FlaxGPT2LMHeadModel(config, _do_init=False).module
  ids = jnp.array([[5, 17, 42, 8]])
  inputs = (ids, jnp.ones_like(ids), jnp.arange(4)[None])
  variables = {"params": jax.jit(module.init)(jax.random.key(0), *inputs)["params"]}
  tree = fl.unflaxify(module, variables, *inputs)
  site = fl.heads("transformer/h/0/attn/c_proj", 1, on="input")  # n_head=2 of 16 features
  out = fl.run(tree, inputs, interventions=[fl.ablate(site)])

  def zero_head_1(next_fun, args, kwargs, context):
    if context.module.name == "c_proj" and context.module.path[-2] == "attn":
      return next_fun(args[0].at[..., 16:32].set(0.0), *args[1:], **kwargs)
    return next_fun(*args, **kwargs)

  def native(variables, *inputs):
    with nn.intercept_methods(zero_head_1):
      return module.apply(variables, *inputs)

  assert not np.array_equal(out.logits, fl.run(tree, inputs).logits)  # the edit acts
  _bits_equal(out.logits, jax.jit(native)(variables, *inputs).logits)


@pytest.mark.parametrize("on", ["input", "output"])
def test_on_is_refused_for_a_flax_attention_module(setup, on):
  with pytest.raises(fl.HeadsError, match=rf"on='{on}' would name the module's own {on}"):
    fl.capture(setup.tree, X, at=fl.heads(setup.attn(0), on=on))


class HandWrittenAttention(nn.Module):  # fused qkv, einsum attention: not a Flax class
  num_heads: int = 2

  @nn.compact
  def __call__(self, x):
    b, s, f = x.shape
    q, k, v = jnp.split(nn.Dense(3 * f, name="qkv")(x), 3, axis=-1)
    q, k, v = (a.reshape(b, s, self.num_heads, -1) for a in (q, k, v))
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
    return nn.Dense(f, name="o")(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, f))


def test_a_hand_written_attention_module_is_refused_naming_its_out_projection():
  model, x = HandWrittenAttention(), X[..., :8]
  tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  with pytest.raises(fl.HeadsError, match=r"num_heads setting .* fl.heads\('o', h, on='input'\)"):
    fl.run(tree, x, interventions=[fl.ablate(fl.heads(HandWrittenAttention, 1))])


def test_a_partial_attention_function_is_named_in_the_refusal():
  attention = functools.partial(nn.dot_product_attention, broadcast_dropout=False)
  model = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=attention)
  x = jnp.ones((1, 3, 4))
  tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  says = r"attention_fn is functools.partial\(\S*dot_product_attention, broadcast_dropout=False\)"
  with pytest.raises(fl.HeadsError, match=says):
    fl.capture(tree, x, at=fl.attention_pattern("**"))


class GroupedQuery(nn.Module):
  """Grouped-query attention written by hand: 4 query heads, 2 key/value heads."""

  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = 4

  @nn.compact
  def __call__(self, x):
    b, s, _ = x.shape
    d = 4
    q = nn.Dense(self.num_heads * d, name="q_proj")(x).reshape(b, s, self.num_heads, d)
    k = nn.Dense(self.num_kv_heads * d, name="k_proj")(x).reshape(b, s, self.num_kv_heads, d)
    v = nn.Dense(self.num_kv_heads * d, name="v_proj")(x).reshape(b, s, self.num_kv_heads, d)
    k, v = (jnp.repeat(a, self.num_heads // self.num_kv_heads, axis=2) for a in (k, v))
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0, -1)
    return nn.Dense(x.shape[-1], name="o_proj")(
      jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, -1)
    )


class GroupedModel(nn.Module):
  head_dim: int | None = 4

  @nn.compact
  def __call__(self, x):
    return x + GroupedQuery(head_dim=self.head_dim, name="attn")(x)


def _grouped(head_dim):
  model, x = GroupedModel(head_dim), jnp.linspace(-1.0, 1.0, 48).reshape(1, 6, 8)
  variables = model.init(jax.random.key(0), x)
  return model, variables, x, fl.unflaxify(model, variables, x)


def test_key_heads_of_grouped_query_attention_are_refused_naming_their_count():
  _, _, x, tree = _grouped(4)
  says = r"attn/k_proj: .*4 heads of head_dim 4 \(16 features\).* has 8: 2 key/value.*heads=2"
  with pytest.raises(fl.HeadsError, match=says):
    fl.capture(tree, x, at=fl.heads("attn/k_proj"))
  _, cache = fl.capture(tree, x, at=fl.heads("attn/k_proj", heads=2))
  model, variables, _, _ = _grouped(4)
  _, native = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
  keys = native["intermediates"]["attn"]["k_proj"]["__call__"][0]
  np.testing.assert_array_equal(cache["attn/k_proj:heads"], keys.reshape(1, 6, 2, 4))
  _, queries = fl.capture(tree, x, at=fl.heads("attn/q_proj"))  # 4 heads of 4: as declared
  assert queries["attn/q_proj:heads"].shape == (1, 6, 4, 4)


def test_grouped_query_attention_without_a_head_dim_setting_asks_for_the_count():
  _, _, x, tree = _grouped(None)
  with pytest.raises(fl.HeadsError, match=r"two head counts, 4 heads and num_kv_heads=2"):
    fl.capture(tree, x, at=fl.heads("attn/q_proj"))


# --- the output of an output projection holds no heads -----------------------------------


def test_heads_on_a_flax_out_projections_output_are_refused_showing_the_input_form(setup):
  # Linen's nn.MultiHeadDotProductAttention and NNX's nnx.MultiHeadAttention: `out`
  # contracts (heads, head_dim); its output is the merged features.
  out = f"{setup.attn(1)}/out"
  says = rf"^{out}: .* its output holds no heads.* fl\.heads\('{out}', \[1\], on='input'\)\."
  with pytest.raises(fl.HeadsError, match=says):
    fl.run(setup.tree, X, interventions=[fl.ablate(fl.heads(out, 1))])
  # The form it shows runs, as the native edit of out's input.
  shown = fl.run(setup.tree, X, interventions=[fl.ablate(fl.heads(out, [1], on="input"))])
  _bits_equal(shown, setup.native(X, {1: lambda v: v.at[..., 1, :].set(0.0)}))


def test_heads_on_a_merged_out_projections_output_are_refused(merged):
  # c_proj, the last projection of the module with the head count, merges its heads.
  tree, _ = merged
  with pytest.raises(fl.HeadsError, match=r"^c_proj: it is the last projection of .* on='input'"):
    fl.capture(tree, X, at=fl.heads("c_proj", heads=HEADS))


def test_a_sweep_of_a_list_mixing_heads_and_sites_equals_patching_each_natively(setup):
  query = f"{setup.attn(0)}/query"
  sites = [query, fl.heads(setup.attn(1), [0, 2])]

  def metric(out):
    return out[:, -1, 0].sum()

  result = fl.sweep(setup.tree, X2, X, sites, metric)
  assert result.sites == (query, f"{setup.attn(1)} head 0", f"{setup.attn(1)} head 2")
  _, clean = fl.capture(setup.tree, X2, at=[query, fl.heads(setup.attn(1))])
  heads = clean[f"{setup.attn(1)}:heads"]
  expected = [metric(setup.native_output(X, 0, "query", lambda q: clean[query]))]
  for h in (0, 2):
    expected.append(
      metric(setup.native(X, {1: lambda v, h=h: v.at[..., h, :].set(heads[..., h, :])}))
    )
  np.testing.assert_allclose(result.values, np.stack(expected), rtol=1e-6, atol=1e-6)
