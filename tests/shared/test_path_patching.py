"""Path patching equals the three runs written by hand in native Flax.

The reference runs each model natively with hooks on chosen calls (Linen:
`nn.intercept_methods`; NNX: the module's class swapped for a subclass on a copy of the
model), and writes the three runs of path patching out for each scenario: (1) clean and
corrupted runs keep values, (2) a clean run with the sender corrupted and the other
components frozen records the receivers, (3) a clean run with the receivers patched
gives the metric. No flaxlens in the expected values.

Two models per framework, the same paths in both: a residual stack of Dense "attn" and
"mlp" writers whose weights and inputs are multiples of 1/4 (every float32 operation
exact, so the fused program must agree bit for bit), and a two-block transformer with
Flax's own attention modules, whose heads are senders and receivers (to rounding: the
reference is three programs, path patching one, and XLA may round them differently).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from frameworks import LINEN, NNX

import flaxlens as fl

WIDTH = 4


def _quarters(x):
  return jnp.clip(jnp.round(x * 4) / 4, -1.0, 1.0)


# --- models: the same module paths in Linen and NNX ---------------------------------------


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + nn.Dense(WIDTH, name="attn")(x)
    return x + nn.Dense(WIDTH, name="mlp")(nn.relu(x))


class LinenStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = LinenBlock(name=f"block_{i}")(x)
    return nn.Dense(2, name="readout")(x)


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.attn = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.mlp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x)
    return x + self.mlp(nnx.relu(x))


class NNXStack(nnx.Module):
  def __init__(self, rngs):
    self.block_0 = NNXBlock(rngs)
    self.block_1 = NNXBlock(rngs)
    self.block_2 = NNXBlock(rngs)
    self.readout = nnx.Linear(WIDTH, 2, rngs=rngs)

  def __call__(self, x):
    for block in (self.block_0, self.block_1, self.block_2):
      x = block(x)
    return self.readout(x)


class LinenAttentionBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h, h)
    return x + nn.Dense(8, name="mlp")(nn.relu(x))


class LinenTransformer(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = LinenAttentionBlock(name="block_0")(x)
    x = LinenAttentionBlock(name="block_1")(x)
    return nn.Dense(3, name="readout")(x)


class NNXAttentionBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
    self.mlp = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm(x))
    return x + self.mlp(nnx.relu(x))


class NNXTransformer(nnx.Module):
  def __init__(self, rngs):
    self.block_0 = NNXAttentionBlock(rngs)
    self.block_1 = NNXAttentionBlock(rngs)
    self.readout = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.readout(self.block_1(self.block_0(x)))


class Native:
  """A model run natively with hooks: `run(x, hooks)`, where `hooks[path](call, first)`
  computes the output of the call at `path` (`call(first)` runs it natively)."""

  def __init__(self, framework, model, variables=None):
    self.framework, self.model, self.variables = framework, model, variables

  def run(self, x, hooks=None):
    hooks = hooks or {}
    if self.framework is LINEN:

      def interceptor(next_fun, args, kwargs, context):
        hook = hooks.get("/".join(context.module.path))
        if hook is None or context.method_name != "__call__":
          return next_fun(*args, **kwargs)
        return hook(lambda first: next_fun(first, *args[1:], **kwargs), args[0])

      with nn.intercept_methods(interceptor):
        return self.model.apply(self.variables, x)
    model = nnx.clone(self.model)
    for path, hook in hooks.items():
      module = model
      for key in path.split("/"):
        module = getattr(module, key)
      object.__setattr__(module, "__class__", _hooked(type(module), hook))
    return model(x)

  def tree(self, x):
    if self.framework is LINEN:
      return fl.unflaxify(self.model, self.variables, x)
    return fl.unflaxify(self.model, x)


def _hooked(cls, hook):
  class Hooked(cls):
    def __call__(self, first, *args, **kwargs):
      return hook(lambda a: super(Hooked, self).__call__(a, *args, **kwargs), first)

  return Hooked


def _stack(framework):
  x = _quarters(jax.random.normal(jax.random.key(5), (2, WIDTH)) * 2)
  if framework is LINEN:
    model = LinenStack()
    variables = jax.tree_util.tree_map(_quarters, model.init(jax.random.key(0), x))
    return Native(framework, model, variables), x
  model = NNXStack(nnx.Rngs(0))
  for number, (_, variable) in enumerate(nnx.iter_graph(model)):
    if isinstance(variable, nnx.Param):
      noise = jax.random.normal(jax.random.key(number), variable.value.shape)
      variable.value = _quarters(noise)
  return Native(framework, model), x


def _transformer(framework):
  x = jax.random.normal(jax.random.key(3), (2, 5, 8))
  if framework is LINEN:
    model = LinenTransformer()
    return Native(framework, model, model.init(jax.random.key(0), x)), x
  return Native(framework, NNXTransformer(nnx.Rngs(0))), x


def _recording(store, name):
  """A hook keeping the call's output (and its first argument) in `store`."""

  def hook(call, first):
    store[f"{name}:input"] = first
    store[name] = call(first)
    return store[name]

  return hook


def _values(native, x, paths):
  store = {}
  native.run(x, {p: _recording(store, p) for p in paths})
  return store


def _metric(out):
  return out[..., 0]


# --- the residual stack: exact arithmetic -------------------------------------------------

ATTN = [f"block_{i}/attn" for i in range(3)]


def _stack_to_readout(native, clean, corrupted, sender):
  """Sender: one "attn" writer; receiver: the readout's output; the other writers frozen."""
  c, k = _values(native, clean, ATTN), _values(native, corrupted, ATTN)
  recorded = {}

  def frozen(path):
    return lambda call, first: k[path] if path == sender else c[path]

  hooks = {p: frozen(p) for p in ATTN}
  hooks["readout"] = _recording(recorded, "readout")
  native.run(clean, hooks)
  return _metric(native.run(clean, {"readout": lambda call, first: recorded["readout"]}))


def _stack_to_attention_input(native, clean, corrupted, sender):
  """Sender: an "attn" writer; receiver: block_2/attn's input; the writers frozen (the
  receiver's own output included), the mlps recompute."""
  c, k = _values(native, clean, ATTN), _values(native, corrupted, ATTN)
  recorded = {}

  def frozen(path):
    def hook(call, first):
      if path == "block_2/attn":
        recorded["input"] = first
      return k[path] if path == sender else c[path]

    return hook

  native.run(clean, {p: frozen(p) for p in ATTN})
  out = native.run(clean, {"block_2/attn": lambda call, first: call(recorded["input"])})
  return _metric(out)


@pytest.mark.parametrize("framework", [LINEN, NNX])
@pytest.mark.parametrize(
  "senders, receivers, by_hand",
  [
    (ATTN, "readout", _stack_to_readout),
    (ATTN[:2], fl.Sites("block_2/attn", on="input"), _stack_to_attention_input),
  ],
  ids=["to_readout", "to_attention_input"],
)
def test_path_patch_equals_the_three_runs_by_hand_bit_for_bit_where_arithmetic_is_exact(
  framework, senders, receivers, by_hand
):
  native, clean = _stack(framework)
  corrupted = clean[::-1]
  tree = native.tree(clean)
  result = fl.path_patch(tree, clean, corrupted, senders, receivers, _metric)
  expected = np.stack([by_hand(native, clean, corrupted, s) for s in senders])
  assert result.sites == tuple(senders)
  assert not np.array_equal(expected[0], _metric(native.run(clean)))  # the path matters
  np.testing.assert_array_equal(result.values, expected)


# --- heads of Flax's attention modules ----------------------------------------------------

HEADS = [jnp.s_[..., h, :] for h in range(2)]


def _heads_to_query_head(native, clean, corrupted, head):
  """Sender: head `head` of block_0's attention (its slice of the out projection's
  input), the other head frozen; receiver: head 0 of block_1's query projection; block_0's
  mlp frozen too (freeze=), block_1's query frozen after recording."""
  paths = ["block_0/attn/out", "block_0/mlp", "block_1/attn/query"]
  c, k = _values(native, clean, paths), _values(native, corrupted, paths)
  recorded = {}

  def sender(call, first):
    mixed = (
      c["block_0/attn/out:input"].at[..., head, :].set(k["block_0/attn/out:input"][..., head, :])
    )
    return call(mixed)

  def receiver(call, first):
    recorded["query"] = call(first)
    return c["block_1/attn/query"]

  native.run(
    clean,
    {
      "block_0/attn/out": sender,
      "block_0/mlp": lambda call, first: c["block_0/mlp"],
      "block_1/attn/query": receiver,
    },
  )

  def patched(call, first):
    return call(first).at[..., 0, :].set(recorded["query"][..., 0, :])

  return _metric(native.run(clean, {"block_1/attn/query": patched}))


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_heads_as_senders_and_receiver_equal_the_three_runs_natively(framework):
  native, clean = _transformer(framework)
  corrupted = -clean
  tree = native.tree(clean)
  senders = fl.Sites("block_0/attn/out", on="input", where=HEADS)
  receiver = fl.Sites("block_1/attn/query", where=jnp.s_[..., 0, :])
  result = fl.path_patch(tree, clean, corrupted, senders, receiver, _metric, freeze="block_0/mlp")
  expected = np.stack([_heads_to_query_head(native, clean, corrupted, h) for h in range(2)])
  assert result.sites == (
    "block_0/attn/out:input[..., 0, :]",
    "block_0/attn/out:input[..., 1, :]",
  )
  assert result.receivers == ("block_1/attn/query[..., 0, :]",)
  assert not np.allclose(expected[0], _metric(native.run(clean)), atol=1e-4)
  np.testing.assert_allclose(result.values, expected, rtol=1e-5, atol=1e-6)
  # fl.heads names the same senders: the attention module's heads, one per row.
  by_heads = fl.path_patch(
    tree, clean, corrupted, fl.heads("block_0/attn"), receiver, _metric, freeze="block_0/mlp"
  )
  np.testing.assert_array_equal(by_heads.values, result.values)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_heads_as_senders_label_their_rows_as_a_heads_sweep_does(framework):
  native, clean = _transformer(framework)
  tree = native.tree(clean)
  receiver = fl.Sites("block_1/attn/query", where=jnp.s_[..., 0, :])
  result = fl.path_patch(tree, clean, -clean, fl.heads("block_0/attn"), receiver, _metric)
  assert result.sites == ("block_0/attn head 0", "block_0/attn head 1")
  assert result.heads == (("block_0/attn", 0), ("block_0/attn", 1))
  swept = fl.sweep(tree, clean, -clean, fl.heads("block_0/attn"), lambda out: out.sum())
  assert swept.sites == result.sites and swept.heads == result.heads


# --- the direction of the effect: 0 no effect, 1 the whole effect --------------------------


class LinenSilentAndCarrier(nn.Module):
  """Two writers read by the readout: "silent" (zero weights: writes 0 on every input)
  and "carrier" (the only path from the input to the readout)."""

  @nn.compact
  def __call__(self, x):
    written = nn.Dense(WIDTH, name="silent")(x) + nn.Dense(WIDTH, name="carrier")(x)
    return nn.Dense(2, name="readout")(written)


class NNXSilentAndCarrier(nnx.Module):
  def __init__(self, rngs):
    self.silent = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.carrier = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.readout = nnx.Linear(WIDTH, 2, rngs=rngs)

  def __call__(self, x):
    return self.readout(self.silent(x) + self.carrier(x))


def _silent_and_carrier(framework):
  """The model with "silent" zeroed and the other weights 1/4, and clean and corrupted
  inputs (the corrupted one larger by 1: every example's metric rises), batch 6."""
  clean = _quarters(jax.random.normal(jax.random.key(5), (6, WIDTH)))
  if framework is LINEN:
    model = LinenSilentAndCarrier()
    variables = model.init(jax.random.key(0), clean)
    params = {
      name: jax.tree_util.tree_map(
        lambda v, name=name: jnp.full_like(v, 0.0 if name == "silent" else 0.25), layer
      )
      for name, layer in variables["params"].items()
    }
    native = Native(framework, model, {"params": params})
  else:
    model = NNXSilentAndCarrier(nnx.Rngs(0))
    for layer, value in ((model.silent, 0.0), (model.carrier, 0.25), (model.readout, 0.25)):
      layer.kernel.value = jnp.full_like(layer.kernel.value, value)
      layer.bias.value = jnp.full_like(layer.bias.value, value)
    native = Native(framework, model)
  return native, clean, clean + 1


def _mean_metric(out):
  return _metric(out).mean()


def _path_by_hand(native, clean, corrupted, sender):
  """Run 3 by hand: the readout's output recorded in a clean run whose `sender` writes
  its corrupted value (the other writer frozen clean), then set in a clean run."""
  writers = ["silent", "carrier"]
  c, k = _values(native, clean, writers), _values(native, corrupted, writers)
  recorded = {}
  hooks = {w: (lambda call, first, w=w: k[w] if w == sender else c[w]) for w in writers}
  hooks["readout"] = _recording(recorded, "readout")
  native.run(clean, hooks)
  return _metric(native.run(clean, {"readout": lambda call, first: recorded["readout"]}))


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_path_effect_is_0_for_a_sender_that_does_nothing_and_1_for_one_carrying_everything(
  framework,
):
  native, clean, corrupted = _silent_and_carrier(framework)
  result = fl.path_patch(
    native.tree(clean), clean, corrupted, ["silent", "carrier"], "readout", _mean_metric
  )
  clean_metric = np.float64(_metric(native.run(clean)).mean())
  corrupted_metric = np.float64(_metric(native.run(corrupted)).mean())
  patched = np.asarray(
    [_path_by_hand(native, clean, corrupted, s).mean() for s in ("silent", "carrier")],
    np.float64,
  )
  expected = (clean_metric - patched) / (clean_metric - corrupted_metric)
  np.testing.assert_array_equal(expected, [0.0, 1.0])
  np.testing.assert_array_equal(result.normalised(), expected)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_path_statistics_measure_from_the_clean_run(framework):
  """p-values test patched against clean, and the bootstrap resamples the same effect."""
  native, clean, corrupted = _silent_and_carrier(framework)
  result = fl.path_patch(
    native.tree(clean),
    clean,
    corrupted,
    ["silent", "carrier"],
    "readout",
    _metric,
    per_example=True,
  )
  differences = np.asarray(
    [
      _path_by_hand(native, clean, corrupted, s) - _metric(native.run(clean))
      for s in ("silent", "carrier")
    ]
  )
  assert not differences[0].any() and (differences[1] > 0).all()
  # Exact over 6 examples: no change gives p = 1; six of one sign, 2 / 2**6.
  np.testing.assert_array_equal(result.p_values(), [1.0, 2 / 2**6])
  lower, upper = result.bootstrap(normalised=True)
  np.testing.assert_array_equal([lower, upper], [[0.0, 1.0], [0.0, 1.0]])


def test_a_path_patch_plot_says_that_0_is_the_clean_run_and_1_the_corrupted_run():
  pytest.importorskip("matplotlib")
  native, clean, corrupted = _silent_and_carrier(LINEN)
  result = fl.path_patch(
    native.tree(clean), clean, corrupted, ["silent", "carrier"], "readout", _mean_metric
  )
  figure = result.plot()
  (image,) = figure.axes[0].images
  np.testing.assert_array_equal(image.get_array()[:, 0], [0.0, 1.0])
  assert "0: no effect (clean run)\n1: corrupted run reached" in figure.axes[1].get_ylabel()


def test_a_path_patch_plot_of_raw_values_centres_on_the_clean_metric():
  pytest.importorskip("matplotlib")
  native, clean, corrupted = _silent_and_carrier(LINEN)
  result = fl.path_patch(
    native.tree(clean), clean, corrupted, ["silent", "carrier"], "readout", _mean_metric
  )
  figure = result.plot(normalised=False)
  (image,) = figure.axes[0].images
  assert image.norm.vcenter == pytest.approx(float(_mean_metric(native.run(clean))))
  assert "centre: clean" in figure.axes[1].get_ylabel()


def test_per_example_path_patch_refuses_a_metric_whose_leading_axis_is_not_the_batch():
  """One value per position of example 0 (shape (5,), batch 2) is not one per example."""
  native, clean = _transformer(LINEN)
  said = r"^fl.path_patch: per_example=True .* shape \(5,\), .*\(args\[0\]: \(2, 5, 8\)\)"
  with pytest.raises(fl.ArgumentError, match=said):
    fl.path_patch(
      native.tree(clean),
      clean,
      -clean,
      "block_0/attn",
      "block_1/attn",
      lambda out: out[0, :, 0],
      per_example=True,
    )


def _head_and_mlp_to_query_head(native, clean, corrupted, sender):
  """Senders: head 1 of block_0's attention (its slice of the out projection's input) and
  block_0's mlp (its output); receiver: head 0 of block_1's query projection. In each
  sender's forward the other sender's call is frozen clean, the query recorded and then
  frozen; run 3 patches the query's head 0 with the recorded one."""
  paths = ["block_0/attn/out", "block_0/mlp", "block_1/attn/query"]
  c, k = _values(native, clean, paths), _values(native, corrupted, paths)
  recorded = {}

  def out(call, first):
    heads = c["block_0/attn/out:input"]
    if sender == "head":
      heads = heads.at[..., 1, :].set(k["block_0/attn/out:input"][..., 1, :])
    return call(heads)

  def receiver(call, first):
    recorded["query"] = call(first)
    return c["block_1/attn/query"]

  mlp = k["block_0/mlp"] if sender == "mlp" else c["block_0/mlp"]
  hooks = {
    "block_0/attn/out": out,
    "block_0/mlp": lambda call, first: mlp,
    "block_1/attn/query": receiver,
  }
  native.run(clean, hooks)

  def patched(call, first):
    return call(first).at[..., 0, :].set(recorded["query"][..., 0, :])

  return _metric(native.run(clean, {"block_1/attn/query": patched}))


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_senders_mixing_heads_and_sites_of_other_layers_equal_the_three_runs_natively(framework):
  native, clean = _transformer(framework)
  corrupted = -clean
  tree = native.tree(clean)
  senders = [fl.heads("block_0/attn", 1), fl.Sites("block_0/mlp")]
  receiver = fl.Sites("block_1/attn/query", where=jnp.s_[..., 0, :])
  result = fl.path_patch(tree, clean, corrupted, senders, receiver, _metric)
  expected = np.stack(
    [_head_and_mlp_to_query_head(native, clean, corrupted, s) for s in ("head", "mlp")]
  )
  assert result.sites == ("block_0/attn head 1", "block_0/mlp")
  assert not np.allclose(expected, _metric(native.run(clean)), atol=1e-4)
  np.testing.assert_allclose(result.values, expected, rtol=1e-5, atol=1e-6)


def _mlp_to_head_and_mlp(native, clean, corrupted):
  """Sender: block_0's mlp; receivers, one at a time: head 0 of block_1's attention (its
  out projection's input) and block_1's mlp output, each recorded in run 2 and then
  frozen clean; run 3 patches one receiver with what was recorded."""
  paths = ["block_0/mlp", "block_1/attn/out", "block_1/mlp"]
  c, k = _values(native, clean, paths), _values(native, corrupted, paths)
  recorded = {}

  def out(call, first):
    recorded["heads"] = first
    return call(c["block_1/attn/out:input"])

  def mlp(call, first):
    recorded["mlp"] = call(first)
    return c["block_1/mlp"]

  hooks = {"block_0/mlp": lambda call, first: k["block_0/mlp"], "block_1/attn/out": out}
  native.run(clean, {**hooks, "block_1/mlp": mlp})
  head = native.run(
    clean,
    {
      "block_1/attn/out": lambda call, first: call(
        first.at[..., 0, :].set(recorded["heads"][..., 0, :])
      )
    },
  )
  whole = native.run(clean, {"block_1/mlp": lambda call, first: recorded["mlp"]})
  return np.stack([_metric(head), _metric(whole)])[None]  # (senders, receivers, ...)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_receivers_mixing_heads_and_sites_equal_the_three_runs_natively(framework):
  native, clean = _transformer(framework)
  tree = native.tree(clean)
  receivers = [fl.heads("block_1/attn", 0), fl.Sites("block_1/mlp")]
  result = fl.path_patch(tree, clean, -clean, "block_0/mlp", receivers, _metric, each_receiver=True)
  expected = _mlp_to_head_and_mlp(native, clean, -clean)
  assert result.receivers == ("block_1/attn head 0", "block_1/mlp")
  assert not np.allclose(expected[0, 0], _metric(native.run(clean)), atol=1e-4)
  np.testing.assert_allclose(result.values, expected, rtol=1e-5, atol=1e-6)


def test_a_call_named_on_two_sides_by_one_role_is_refused():
  native, clean = _transformer(LINEN)
  senders = [fl.heads("block_0/attn", 1), fl.Sites("block_0/attn/out")]
  with pytest.raises(fl.SelectionError, match=r"senders: block_0/attn/out is named on two sides"):
    fl.path_patch(native.tree(clean), clean, -clean, senders, "readout", _metric)


# --- sweeps and grids ---------------------------------------------------------------------


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_the_sender_sweep_equals_a_loop_of_single_path_patches(framework):
  native, clean = _stack(framework)
  tree = native.tree(clean)
  receivers = fl.Sites(["block_2/attn", "block_2/mlp"], on="input")
  swept = fl.path_patch(tree, clean, clean[::-1], ATTN[:2], receivers, _metric)
  # Alone, a sender freezes the other senders only when told to: they are the components.
  single = [
    fl.path_patch(tree, clean, clean[::-1], s, receivers, _metric, freeze=ATTN[:2])
    for s in ATTN[:2]
  ]
  np.testing.assert_array_equal(swept.values, np.concatenate([r.values for r in single]))


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_each_receiver_grid_equals_one_receiver_at_a_time(framework):
  native, clean = _stack(framework)
  tree = native.tree(clean)
  receivers = ["block_1/attn", "block_2/attn", "readout"]
  grid = fl.path_patch(
    tree, clean, clean[::-1], ATTN[:2], fl.Sites(receivers, on="input"), _metric, each_receiver=True
  )
  # One receiver alone freezes the other receivers' calls as components, as the grid does.
  columns = [
    fl.path_patch(
      tree, clean, clean[::-1], ATTN[:2], fl.Sites(r, on="input"), _metric, freeze=receivers
    ).values
    for r in receivers[1:]
  ]
  assert grid.values.shape == (2, 3, 2)
  assert grid.receivers == tuple(f"{r}:input" for r in receivers)
  np.testing.assert_array_equal(grid.values[:, 1:], np.stack(columns, axis=1))
  # block_1/attn starts before block_1/attn ends: that cell changes nothing.
  np.testing.assert_array_equal(grid.values[1, 0], _metric(native.run(clean)))


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_path_patch_keeps_the_native_clean_and_corrupted_metrics(framework):
  native, clean = _stack(framework)
  corrupted = clean[::-1] + 0.25
  result = fl.path_patch(
    native.tree(clean), clean, corrupted, ATTN, "readout", _metric, per_example=True
  )
  np.testing.assert_array_equal(result.clean_per_example, _metric(native.run(clean)))
  np.testing.assert_array_equal(result.corrupted_per_example, _metric(native.run(corrupted)))
  np.testing.assert_array_equal(result.values, result.per_example.mean(-1))


def test_all_senders_of_one_receiver_compile_once():
  native, clean = _stack(LINEN)
  tree = native.tree(clean)
  traces = []

  def counted(out):
    traces.append(None)
    return _metric(out)

  for shift in (0.25, 0.5):
    result = fl.path_patch(tree, clean, clean[::-1] + shift, ATTN, "readout", counted)
  assert len(result.sites) == 3
  assert len(traces) == 1  # the metric traced once: one program for every sender


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_path_patch_leaves_the_tree_and_its_state_unchanged(framework):
  native, clean = _transformer(framework)
  tree = native.tree(clean)
  before = [v.value for v in fl.variables_in(tree)]
  fl.path_patch(tree, clean, -clean, "block_0/attn", "block_1/attn", _metric)
  assert all(a is b.value for a, b in zip(before, fl.variables_in(tree), strict=True))


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "senders, receivers, options, error, said",
  [
    (
      "block_2/attn",
      "block_1/mlp",
      {},
      fl.SelectionError,
      r"the sender\(s\) \['block_2/attn'\] run after every receiver \['block_1/mlp'\].*"
      r"Choose senders that run before the receivers",
    ),
    (
      "block_1/attn",
      fl.Sites("block_1/attn", on="input"),
      {},
      fl.SelectionError,
      r"sender\(s\) \['block_1/attn'\] run after every receiver \['block_1/attn:input'\]",
    ),
    (
      ATTN,
      "block_*/attn",
      {},
      fl.SelectionError,
      r"the receiver block_0/attn is the sender block_0/attn's own call and side.*fl.sweep",
    ),
    (
      "block_*/atn",
      "readout",
      {},
      fl.SelectionError,
      r"fl.path_patch senders: No call of .* matches the site 'block_\*/atn'. Closest",
    ),
    (
      "block_0/attn",
      "readot",
      {},
      fl.SelectionError,
      r"fl.path_patch receivers: No call .* 'readot'.*Closest: \['readout'",
    ),
    (
      [],
      "readout",
      {},
      fl.SelectionError,
      r"fl.path_patch senders: An empty list of sites selects no call",
    ),
    (
      "block_0/attn",
      fl.Sites(["block_0/mlp", "block_0/attn"], on="input"),
      {"each_receiver": True},
      fl.SelectionError,
      r"no sender reaches the receiver\(s\) \['block_0/attn:input'\]",
    ),
    (
      "block_0/attn",
      "readout",
      {"freeze": "block_9"},
      fl.SelectionError,
      r"fl.path_patch freeze: No call .* 'block_9'",
    ),
  ],
  ids=[
    "receiver_before_sender",
    "receiver_input_of_the_sender",
    "receiver_is_sender",
    "unknown_sender",
    "unknown_receiver",
    "no_sender",
    "receiver_no_sender_reaches",
    "unknown_frozen",
  ],
)
@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_path_patch_refuses_paths_it_cannot_follow(
  framework, senders, receivers, options, error, said
):
  native, clean = _stack(framework)
  tree = native.tree(clean)
  with pytest.raises(error, match=said):
    fl.path_patch(tree, clean, clean[::-1], senders, receivers, _metric, **options)


def test_sites_refuse_a_side_that_is_no_side_and_an_empty_list_of_slices():
  with pytest.raises(fl.ArgumentError, match=r"on= is 'output' or 'input'.*Pass one"):
    fl.Sites("block_0/attn", on="outputs")
  with pytest.raises(fl.ArgumentError, match=r"where= is an empty list.*leave it out"):
    fl.Sites("block_0/attn", where=[])


def test_a_slice_outside_the_value_is_refused_naming_the_site():
  native, clean = _transformer(LINEN)
  tree = native.tree(clean)
  senders = fl.Sites("block_0/attn/out", on="input", where=[jnp.s_[..., 5, :]])
  with pytest.raises(fl.ArgumentError, match=re.escape("block_0/attn/out: where=[..., 5, :]")):
    fl.path_patch(tree, clean, -clean, senders, "readout", _metric)
