"""Sweeps, attribution patching and gradients at calls, against native Flax.

A one-call patching sweep equals the loop of single patches made natively (the model's
call wrapped with `nn.intercept_methods` or an NNX subclass, under `jax.jit`); sweeping
the iterations of an `nn.scan`/`nnx.scan` body equals patching that layer of the model
unrolled by hand; attribution patching equals its definition computed with `jax.grad`
through natively wrapped calls; gradients at calls equal Flax's own `perturb`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from frameworks import LINEN, NNX, Wrap
from linen import corpus as linen_corpus

import flaxlens as fl

# Per framework: a corpus case, the sites swept, and a metric of the output.
SWEEPS = {
  "linen": ("transformer", ["TransformerBlock_0", "TransformerBlock_1"], lambda o: o[:, -1, 0]),
  "nnx": ("list", ["layers/0", "layers/1", "layers/2"], lambda o: o[:, 0]),
}


def _setting(framework, corpora):
  name, sites, metric = SWEEPS[framework.name]
  clean = corpora[framework][name]
  corrupted = dataclasses.replace(clean, args=(clean.args[0][::-1],))
  return clean, corrupted, sites, metric


def _native_clean(framework, case, site):
  """The site's output in a native call of the case, compiled as the sweep compiles it."""

  def run(x):
    seen = []
    record = Wrap(site, lambda out, *args: seen.append(out) or out)
    framework.native(dataclasses.replace(case, args=(x,)), wrap=record)
    return seen[-1]

  return jax.jit(run)(case.args[0])


def _native_patched(framework, case, site, clean, position):
  """The metric's input: a native jitted call with the site's output patched."""

  def patch(out, *args):
    return clean if position is None else out.at[:, position].set(clean[:, position])

  output, _ = framework.native(case, jit=True, wrap=Wrap(site, patch))
  return output


@pytest.mark.parametrize("framework", [LINEN, NNX])
@pytest.mark.parametrize("positions", [None, range(4)], ids=["whole", "positions"])
def test_batched_sweep_equals_the_loop_of_native_single_patches(framework, corpora, positions):
  # Batching N forwards into one changes the shapes XLA reduces over, and the native
  # reference compiles its own program, so results may round differently (measured: at
  # most a float32 ulp or two); the next test shows the values routed are the same.
  clean, corrupted, sites, metric = _setting(framework, corpora)
  tree = framework.convert(clean)
  result = fl.sweep(
    tree, clean.args, corrupted.args, sites, metric, positions=positions, share_prefix=False
  )
  cleans = {s: _native_clean(framework, clean, s) for s in sites}
  expected = [
    [metric(_native_patched(framework, corrupted, s, cleans[s], p)) for p in positions or [None]]
    for s in sites
  ]
  expected = np.asarray(expected)
  assert result.sites == tuple(sites)
  expected = expected if positions else expected[:, 0]
  np.testing.assert_allclose(result.values, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("framework", [LINEN, NNX])
@pytest.mark.parametrize("positions", [None, range(4)], ids=["whole", "positions"])
def test_shared_prefix_sweep_equals_the_loop_of_single_patches_bit_for_bit(
  framework, corpora, positions
):
  # Each patched forward runs alone, at the single patch's shapes, with the values before
  # its site taken from the unpatched corrupted run: the same program as the single
  # patch's, cut at the site. Against native patches compiled by hand (another program,
  # whose patch XLA fuses otherwise), it agrees to a float32 ulp.
  clean, corrupted, sites, metric = _setting(framework, corpora)
  tree = framework.convert(clean)
  result = fl.sweep(
    tree, clean.args, corrupted.args, sites, metric, positions=positions, share_prefix=True
  )
  _, cache = fl.capture(tree, clean.args, at=sites)
  where = [None] if positions is None else [jnp.s_[:, p] for p in positions]
  single = np.asarray(
    [
      [
        metric(fl.run(tree, corrupted.args, interventions=[fl.patch(s, cache[s], where=w)]))
        for w in where
      ]
      for s in sites
    ]
  )
  cleans = {s: _native_clean(framework, clean, s) for s in sites}
  native = np.asarray(
    [
      [metric(_native_patched(framework, corrupted, s, cleans[s], p)) for p in positions or [None]]
      for s in sites
    ]
  )
  if positions is None:
    single, native = single[:, 0], native[:, 0]
  assert not np.allclose(native, np.broadcast_to(result.corrupted, native.shape))
  np.testing.assert_array_equal(result.values, single)
  np.testing.assert_allclose(result.values, native, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(
    result.corrupted, metric(framework.native(corrupted, jit=True)[0]), rtol=1e-6, atol=1e-6
  )


_RUNS: dict[str, int] = {}  # per block name, how many times it ran (not was traced)


class _Counted(nn.Module):
  """A residual Dense block that counts its runs in `_RUNS` as it runs."""

  @nn.compact
  def __call__(self, x):
    jax.debug.callback(lambda _, name=self.name: _RUNS.update({name: _RUNS[name] + 1}), x)
    return x + nn.Dense(x.shape[-1])(x)


def test_shared_prefix_sweep_runs_a_block_only_for_forwards_patched_before_it():
  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(4):
        x = _Counted(name=f"block_{i}")(x)
      return x

  model, x = Stack(), jnp.arange(12.0).reshape(1, 3, 4) / 10
  sites = [f"block_{i}" for i in range(4)]
  _RUNS.update(dict.fromkeys(sites, 0))
  tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  jax.effects_barrier()
  _RUNS.update(dict.fromkeys(sites, 0))
  result = fl.sweep(tree, x, -x, sites, lambda out: out[0, 0, 0], positions=range(3))
  jax.block_until_ready(result.values)
  jax.effects_barrier()
  # Block i runs in the clean run, in the corrupted base run, and in the patched forwards
  # of the i earlier sites (3 positions each); the others take its output from the base.
  assert _RUNS == {f"block_{i}": 2 + 3 * i for i in range(4)}
  unshared = fl.sweep(
    tree, x, -x, sites, lambda out: out[0, 0, 0], positions=range(3), share_prefix=False
  )
  np.testing.assert_allclose(result.values, unshared.values, rtol=1e-6, atol=1e-6)


class _Branches(nn.Module):
  """Two parallel branches (sites side by side) and a site nested in another."""

  @nn.compact
  def __call__(self, x):
    left = nn.Dense(4, name="left")(x)
    right = _TwoDense(name="right")(x)
    return nn.Dense(3, name="head")(nn.relu(left) * right + x)


class _TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="outer")(nn.relu(nn.Dense(4, name="inner")(x)))


@pytest.mark.parametrize("positions", [None, range(2)], ids=["whole", "positions"])
def test_shared_prefix_sweep_of_parallel_and_nested_sites_equals_the_single_patches(positions):
  model, x = _Branches(), jax.random.normal(jax.random.key(1), (2, 2, 4))
  variables = model.init(jax.random.key(0), x)
  tree = fl.unflaxify(model, variables, x)
  sites = ["right/inner", "left", "right", "head"]

  def metric(out):
    return out[:, 1, 0].sum()

  result = fl.sweep(tree, x, -x, sites, metric, positions=positions, share_prefix=True)
  assert result.sites == ("left", "right", "right/inner", "head")  # a call before its calls
  sites = result.sites
  _, cache = fl.capture(tree, x, at=sites)
  where = [None] if positions is None else [jnp.s_[:, p] for p in positions]
  single = np.asarray(
    [
      [metric(fl.run(tree, -x, interventions=[fl.patch(s, cache[s], where=w)])) for w in where]
      for s in sites
    ]
  )
  single = single if positions else single[:, 0]
  np.testing.assert_array_equal(result.values, single)
  native = [
    metric(model.apply(variables, -x, method=lambda m, y, s=s: _patched_apply(m, y, s, cache)))
    for s in sites
  ]
  if positions is None:
    np.testing.assert_allclose(result.values, np.asarray(native), rtol=1e-6, atol=1e-6)


def _patched_apply(module, x, site, cache):
  """`_Branches` called natively with `site`'s output replaced by its clean value."""

  def interceptor(next_fun, args, kwargs, context):
    path = "/".join(context.module.path)
    out = next_fun(*args, **kwargs)
    return cache[site] if path == site and context.method_name == "__call__" else out

  with nn.intercept_methods(interceptor):
    return module(x)


def test_shared_prefix_refuses_chunk_size_heads_and_other_values(corpora):
  tree, sites, clean, _ = _exact_stack(LINEN)
  metric = lambda out: out.sum()  # noqa: E731
  with pytest.raises(fl.ArgumentError, match=r"runs the patched forwards one at a time"):
    fl.sweep(tree, clean, -clean, sites, metric, chunk_size=2, share_prefix=True)
  with pytest.raises(fl.ArgumentError, match=r"share_prefix= is True, False or None"):
    fl.sweep(tree, clean, -clean, sites, metric, share_prefix=2)
  with pytest.raises(fl.BudgetError, match=r"about two forwards at once"):
    budget = _one_forward_bytes(tree, clean, metric) + 1
    fl.sweep(tree, clean, -clean, sites, metric, budget=budget, share_prefix=True)
  case = corpora[LINEN]["transformer"]
  tree = LINEN.convert(case)
  heads = fl.heads("TransformerBlock_0/MultiHeadDotProductAttention_0")
  with pytest.raises(fl.ArgumentError, match=r"fl.heads units are parts of one call"):
    fl.sweep(tree, case.args, case.args, heads, lambda o: o.sum(), share_prefix=True)


def _quarters(x):
  """`x` rounded to a multiple of 1/4 in [-2, 2]: few mantissa bits, so that every product
  and sum of a three-layer stack of such values is exact in float32 (no rounding at all)."""
  return jnp.clip(jnp.round(x * 4) / 4, -2.0, 2.0)


def _exact_stack(framework):
  """A Dense/relu stack with quarter-valued weights, its tree, and a native patched forward.

  With every float32 operation exact, any two correct computations of a patched forward
  agree bit for bit, however XLA fuses or batches them; a sweep that routes one value
  wrongly cannot hide in rounding.
  """
  x = _quarters(jax.random.normal(jax.random.key(5), (2, 4, 4)) * 2)
  if framework is LINEN:
    model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(4), nn.relu, nn.Dense(4)])
    variables = jax.tree_util.tree_map(_quarters, model.init(jax.random.key(0), x))
    tree = fl.unflaxify(model, variables, x)
    layers = [
      lambda h, i=i: nn.Dense(4).apply({"params": variables["params"][f"layers_{i}"]}, h)
      for i in (0, 2, 4)
    ]
    sites = ["layers_0", "layers_2", "layers_4"]
  else:
    linears = [nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)]
    for number, layer in enumerate(linears):
      layer.kernel.value = _quarters(layer.kernel.value)
      layer.bias.value = _quarters(jax.random.normal(jax.random.key(7 + number), (4,)))
    model = nnx.Sequential(linears[0], nnx.relu, linears[1], nnx.relu, linears[2])
    tree = fl.unflaxify(model, x)
    layers = linears
    sites = ["layers/0", "layers/2", "layers/4"]

  def native(inputs, patch_at=None, value=None, position=None):
    """The stack run natively, layer by layer; `patch_at`'s output patched at `position`."""
    h, outputs = inputs, []
    for number, layer in enumerate(layers):
      h = layer(h)
      if number == patch_at:
        h = h.at[:, position].set(value[:, position])
      outputs.append(h)
      h = nn.relu(h) if number < len(layers) - 1 else h
    return h, outputs

  return tree, sites, x, native


@pytest.mark.parametrize("framework", [LINEN, NNX])
@pytest.mark.parametrize(
  ("chunk_size", "share_prefix"),
  [(None, False), (1, False), (5, False), (None, True)],
  ids=["vmap", "chunks_of_1", "chunks_of_5", "shared_prefix"],
)
def test_sweep_equals_native_single_patches_bit_for_bit_where_arithmetic_is_exact(
  framework, chunk_size, share_prefix
):
  tree, sites, clean, native = _exact_stack(framework)
  corrupted = clean[::-1]

  def metric(out):
    return out[:, 0, 1]

  result = fl.sweep(
    tree,
    clean,
    corrupted,
    sites,
    metric,
    positions=range(4),
    chunk_size=chunk_size,
    share_prefix=share_prefix,
  )
  _, clean_values = native(clean)
  expected = [
    [metric(native(corrupted, k, clean_values[k], p)[0]) for p in range(4)]
    for k in range(len(sites))
  ]
  assert not np.array_equal(expected[0][0], metric(native(corrupted)[0]))  # patches matter
  np.testing.assert_array_equal(result.values, np.asarray(expected))


def _one_forward_bytes(tree, x, metric):
  """What `budget=` counts per patched forward: every call's output and the metric."""
  out, cache = fl.capture(tree, x)
  return sum(v.nbytes for v in jax.tree_util.tree_leaves(cache)) + metric(out).nbytes


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_sweep_with_budget_equals_the_sweep_without(framework):
  tree, sites, clean, _ = _exact_stack(framework)
  corrupted = clean[::-1]

  def metric(out):
    return out[:, 0, 1]

  expected = fl.sweep(tree, clean, corrupted, sites, metric, positions=range(4))
  budget = 5 * _one_forward_bytes(tree, corrupted, metric)  # 5 of the 12 forwards at once
  result = fl.sweep(tree, clean, corrupted, sites, metric, positions=range(4), budget=budget)
  assert result.sites == expected.sites
  np.testing.assert_array_equal(result.values, expected.values)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_sweep_refuses_a_budget_below_one_forward(framework):
  tree, sites, clean, _ = _exact_stack(framework)
  with pytest.raises(fl.BudgetError, match=r"does not hold one patched forward, estimated at"):
    fl.sweep(tree, clean, clean[::-1], sites, lambda out: out.sum(), budget=64)


def test_sweep_refuses_chunk_size_with_budget():
  tree, sites, clean, _ = _exact_stack(LINEN)
  with pytest.raises(fl.ArgumentError, match=r"chunk_size=2 and budget=4096 both set"):
    fl.sweep(tree, clean, -clean, sites, lambda out: out.sum(), chunk_size=2, budget=4096)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_sweep_in_chunks_of_one_agrees_with_single_patches_to_float32_rounding(framework, corpora):
  # Not bit for bit: the sweep is one program (the clean forward, then the patched ones
  # in a loop body) and each single patch its own, and XLA does not promise two programs
  # the same rounding; it varies with the CPU's vector width. Exact arithmetic above
  # shows the values routed are the same; here, real weights agree to a few ulp.
  clean, corrupted, sites, metric = _setting(framework, corpora)
  tree = framework.convert(clean)
  result = fl.sweep(
    tree, clean.args, corrupted.args, sites, metric, positions=range(4), chunk_size=1
  )
  _, cache = fl.capture(tree, clean.args, at=sites)
  single = [
    [
      metric(
        fl.run(tree, corrupted.args, interventions=[fl.patch(s, cache[s], where=jnp.s_[:, p])])
      )
      for p in range(4)
    ]
    for s in sites
  ]
  np.testing.assert_allclose(result.values, np.asarray(single), rtol=4e-7, atol=4e-7)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_sweep_leaves_the_tree_and_its_state_unchanged(framework, corpora):
  clean, corrupted, sites, metric = _setting(framework, corpora)
  tree = framework.convert(clean)
  before = framework.tree_state(tree)
  fl.sweep(tree, clean.args, corrupted.args, sites, metric)
  after = framework.tree_state(tree)
  assert before.keys() == after.keys()
  assert all(before[k] is after[k] for k in before)


def test_sweep_compiles_once_for_new_inputs(corpora):
  clean, corrupted, sites, metric = _setting(LINEN, corpora)
  tree = LINEN.convert(clean)
  traces = []

  def counted(output):
    traces.append(1)
    return metric(output)

  for shift in range(3):
    fl.sweep(tree, clean.args, (corrupted.args[0] + shift) % 10, sites, counted)
  # One trace of the patched forward (vmap traces it once) per compilation.
  assert len(traces) == 1


# --- nn.scan / nnx.scan: one site per iteration -------------------------------------------


def _linen_scan_layer(case, layer, x, patch):
  """The Linen scan case unrolled by hand: layer `layer`'s Dense output edited by `patch`."""
  params = case.variables["params"]["layers"]
  block = linen_corpus.ScanBlock()

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return patch(out) if isinstance(context.module, nn.Dense) else out

  for i in range(3):
    layer_params = jax.tree_util.tree_map(lambda a, i=i: a[i], params)
    if i == layer:
      with nn.intercept_methods(interceptor):
        x, _ = block.apply({"params": layer_params}, x, None)
    else:
      x, _ = block.apply({"params": layer_params}, x, None)
  return x


def _nnx_scan_layer(case, layer, x, patch):
  """The NNX scan case unrolled by hand: layer `layer`'s Linear output edited by `patch`."""
  graphdef, state = nnx.split(nnx.view(case.model, deterministic=True).blocks)
  for i in range(4):
    block = nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, i=i: a[i], state))
    h = block.linear(x)
    if i == layer:
      h = patch(h)
    x = x + block.drop(nnx.relu(h))
  return x


SCANS = {
  "linen": (LINEN, "scan", "layers/Dense_0", 3, _linen_scan_layer),
  "nnx": (NNX, "scan", "blocks/linear", 4, _nnx_scan_layer),
}


def _scan_setting(name, corpora):
  framework, case_name, site, layers, unrolled = SCANS[name]
  case = corpora[framework][case_name]
  if framework is NNX:
    case = dataclasses.replace(case, model=nnx.view(case.model, deterministic=True))
  return framework, case, site, layers, unrolled


@pytest.mark.parametrize("name", ["linen", "nnx"])
def test_sweep_patches_each_iteration_of_a_scanned_call_alone(name, corpora):
  framework, case, site, layers, unrolled = _scan_setting(name, corpora)
  tree = framework.convert(case)
  x = case.args[0]
  corrupted = -0.5 * x
  metric = lambda out: out[:, 0]
  result = fl.sweep(tree, x, corrupted, site, metric, positions=range(2), axis=0, chunk_size=1)
  expected = []
  for layer in range(layers):
    seen = []
    unrolled(case, layer, x, lambda h, seen=seen: seen.append(h) or h)
    clean = seen[0]
    row = []
    for p in range(2):
      patched = jax.jit(
        lambda c, p=p, layer=layer, clean=clean: unrolled(
          case, layer, c, lambda h: h.at[p].set(clean[p])
        )
      )(corrupted)
      row.append(metric(patched))
    expected.append(row)
  assert result.sites == tuple(f"{site}[{i}]" for i in range(layers))
  np.testing.assert_allclose(result.values, np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_sweep_refuses_calls_inside_a_vmap_body(corpora):
  case = corpora[LINEN]["vmap"]
  tree = LINEN.convert(case)
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match="ensemble.*vmap"):
    fl.sweep(tree, case.args, case.args, "ensemble", lambda out: out.sum())


def test_sweep_refuses_positions_outside_the_value(corpora):
  clean, corrupted, sites, metric = _setting(LINEN, corpora)
  tree = LINEN.convert(clean)
  with pytest.raises(fl.ArgumentError, match=r"TransformerBlock_0: positions \[4\]"):
    fl.sweep(tree, clean.args, corrupted.args, sites, metric, positions=[0, 4])


@pytest.mark.parametrize("tool", [fl.sweep, fl.attribute], ids=["sweep", "attribute"])
@pytest.mark.parametrize(
  "positions, axis, said",
  [
    ([0, 99], 1, r"^{site}: positions \[99\] are outside axis 1 .* Give positions from 0"),
    ([-1], 1, r"^{site}: positions \[-1\] are outside axis 1 .* Give positions from 0"),
    ([10**30], 1, r"^positions= holds \[10+\], which no axis has.* Give positions from 0"),
    ([0], 7, r"^{site}: axis=7 is not an axis of the value.* Pass the axis"),
    ([0], "1", r"^{site}: axis='1' is not an axis of the value.* Pass the axis"),
    ([True, False], 1, r"^positions= takes integers .*not bools, floats"),
    ([0, True], 1, r"^positions= takes integers .*not bools, floats"),
    ([1.7], 1, r"^positions= takes integers .*not bools, floats"),
    (np.array([3.0], np.float32), 1, r"^positions= takes integers .*not bools, floats"),
  ],
  ids=[
    "past_the_end",
    "negative",
    "huge",
    "axis_7",
    "axis_text",
    "bools",
    "a_bool",
    "float",
    "float_array",
  ],
)
@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_positions_or_an_axis_the_values_lack_are_refused(
  framework, corpora, tool, positions, axis, said
):
  clean, corrupted, sites, metric = _setting(framework, corpora)
  tree = framework.convert(clean)
  with pytest.raises(fl.ArgumentError, match=said.format(site=re.escape(sites[0]))):
    tool(
      tree,
      clean.args,
      corrupted.args,
      sites,
      lambda o: metric(o).sum(),
      positions=positions,
      axis=axis,
    )


def test_sweep_refuses_a_structured_output_without_part(corpora):
  case = corpora[LINEN]["scan"]
  tree = LINEN.convert(case)
  with pytest.raises(fl.ArgumentError, match="layers: the output is a tuple.*part="):
    fl.sweep(tree, case.args, case.args, "layers", lambda out: out.sum())


def test_sweep_result_plots_a_heatmap(corpora, tmp_path):
  clean, corrupted, sites, metric = _setting(LINEN, corpora)
  tree = LINEN.convert(clean)
  result = fl.sweep(
    tree, clean.args, corrupted.args, sites, lambda o: metric(o).mean(), positions=range(4)
  )
  path = tmp_path / "sweep.png"
  result.plot(path, title="logit")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- attribution patching -------------------------------------------------------------------


def _native_attribution(framework, clean, corrupted, site, metric):
  """(clean - corrupted) * d metric / d value at the site, summed over all but axis 1."""
  clean_value = _native_clean(framework, clean, site)

  def loss(delta):
    seen = []

    def add(out, *args):
      seen.append(out + delta)
      return seen[-1]

    output, _ = framework.native(corrupted, wrap=Wrap(site, add))
    return metric(output).mean(), seen[-1]

  grad, corrupted_value = jax.grad(loss, has_aux=True)(jnp.zeros_like(clean_value))
  return ((clean_value - corrupted_value) * grad).sum(axis=0)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_attribution_equals_its_definition_by_hand(framework, corpora):
  clean, corrupted, sites, metric = _setting(framework, corpora)
  tree = framework.convert(clean)
  scalar = lambda out: metric(out).mean()
  result = fl.attribute(tree, clean.args, corrupted.args, sites, scalar, positions=range(4))
  expected = [_native_attribution(framework, clean, corrupted, s, metric) for s in sites]
  expected = np.stack([e if e.ndim == 1 else e.sum(axis=-1) for e in expected])
  np.testing.assert_allclose(result.values, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["linen", "nnx"])
def test_attribution_of_a_scanned_call_has_one_row_per_iteration(name, corpora):
  framework, case, site, layers, unrolled = _scan_setting(name, corpora)
  tree = framework.convert(case)
  x = case.args[0]
  corrupted = -0.5 * x
  result = fl.attribute(tree, x, corrupted, site, lambda out: out.sum())
  expected = []
  for layer in range(layers):
    seen = []
    unrolled(case, layer, x, lambda h, seen=seen: seen.append(h) or h)
    clean = seen[0]

    def loss(delta, layer=layer):
      values = []

      def add(h):
        values.append(h + delta)
        return values[-1]

      return unrolled(case, layer, corrupted, add).sum(), values[-1]

    grad, value = jax.grad(loss, has_aux=True)(jnp.zeros_like(clean))
    expected.append(((clean - value) * grad).sum())
  assert result.sites == tuple(f"{site}[{i}]" for i in range(layers))
  np.testing.assert_allclose(result.values, np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_attribution_refuses_a_metric_that_is_not_a_scalar(corpora):
  clean, corrupted, sites, metric = _setting(LINEN, corpora)
  tree = LINEN.convert(clean)
  with pytest.raises(fl.ArgumentError, match="scalar metric"):
    fl.attribute(tree, clean.args, corrupted.args, sites, metric)


class _TokenIds(nn.Module):
  """A call with an integer output: no gradient reaches it."""

  @nn.compact
  def __call__(self, ids):
    return ids * 2


class _Embedder(nn.Module):
  @nn.compact
  def __call__(self, ids):
    return nn.Dense(4, name="head")(nn.Embed(20, 8, name="embed")(_TokenIds(name="ids")(ids)))


def _embedder():
  ids = jnp.array([[1, 2, 3]])
  model = _Embedder()
  return fl.unflaxify(model, model.init(jax.random.key(0), ids), ids), ids


GRADIENT_TOOLS = {
  "grad_at": lambda tree, ids, at, metric: fl.grad_at(tree, ids, at, metric),
  "attribute": lambda tree, ids, at, metric: fl.attribute(tree, ids, (ids + 1) % 9, at, metric),
}


@pytest.mark.parametrize("tool", sorted(GRADIENT_TOOLS))
def test_gradients_at_a_call_with_an_integer_output_are_refused_naming_it(tool):
  tree, ids = _embedder()
  with pytest.raises(fl.ArgumentError) as raised:
    GRADIENT_TOOLS[tool](tree, ids, "ids", lambda out: out.sum())
  message = str(raised.value)
  assert message.startswith(f"ids: fl.{tool} takes gradients at the site's output, which is")
  assert "int32[1, 3]: an integer or boolean value has no gradient. Choose sites" in message


@pytest.mark.parametrize("tool", sorted(GRADIENT_TOOLS))
@pytest.mark.parametrize(
  "metric, dtype",
  [
    (lambda out: jnp.argmax(out.sum(-1).ravel()), "int32"),
    (lambda out: out.sum().astype(jnp.complex64), "complex64"),
  ],
  ids=["argmax", "complex"],
)
def test_gradients_of_a_metric_that_is_not_a_real_float_are_refused(tool, metric, dtype):
  tree, ids = _embedder()
  refused = rf"^Gradients need a real floating-point metric; this one returned {dtype}\. Return "
  with pytest.raises(fl.ArgumentError, match=refused):
    GRADIENT_TOOLS[tool](tree, ids, "embed", metric)


# --- gradients at calls ------------------------------------------------------------------------


def test_grad_at_equals_linen_perturb(corpora):
  case = corpora[LINEN]["perturb"]
  tree = LINEN.convert(case)
  loss = lambda out: (out**2).sum()
  value, grads = fl.grad_at(tree, case.args, "Dense_0", loss)

  def native(perturbations, x):
    variables = {**case.variables, "perturbations": perturbations}
    output, _ = case.module.apply(variables, x, mutable=["perturbations"])
    return loss(output)

  native_value, native_grads = jax.jit(jax.value_and_grad(native))(
    case.variables["perturbations"], *case.args
  )
  np.testing.assert_array_equal(value, native_value)
  np.testing.assert_array_equal(grads["Dense_0"], native_grads["hidden"])


def test_grad_at_equals_nnx_perturb_under_nnx_capture(corpora):
  model = corpora[NNX]["capture_sow_perturb"].model
  x = corpora[NNX]["capture_sow_perturb"].args[0]
  tree = fl.unflaxify(model, x)
  loss = lambda out: (out**2).sum()
  value, grads = fl.grad_at(tree, x, "first", loss)

  _, perturbations = nnx.capture(model, nnx.Perturbation)(x)

  def native(model, perturbations, x):
    output, _ = nnx.capture(model, nnx.Intermediate, init=perturbations)(x)
    return loss(output)

  native = nnx.jit(nnx.value_and_grad(native, argnums=1))
  native_value, native_grads = native(model, perturbations, x)
  np.testing.assert_array_equal(value, native_value)
  np.testing.assert_array_equal(grads["first"], native_grads["delta"][...])


@pytest.mark.parametrize("name", ["linen", "nnx"])
def test_grad_at_stacks_the_gradients_of_a_scanned_call(name, corpora):
  framework, case, site, layers, unrolled = _scan_setting(name, corpora)
  tree = framework.convert(case)
  x = case.args[0]
  _, grads = fl.grad_at(tree, x, site, lambda out: (out**2).sum())
  expected = []
  for layer in range(layers):
    shape = []
    unrolled(case, layer, x, lambda h, shape=shape: shape.append(h) or h)

    def loss(delta, layer=layer):
      return (unrolled(case, layer, x, lambda h: h + delta) ** 2).sum()

    expected.append(jax.grad(loss)(jnp.zeros_like(shape[0])))
  np.testing.assert_allclose(grads[site], np.stack(expected), rtol=1e-6, atol=1e-6)


DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "sweeps.md"


def test_the_sweeps_page_examples_run_in_order(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
  namespace: dict = {}
  for index, block in enumerate(blocks):
    exec(compile(block, f"docs/sweeps.md[python block {index}]", "exec"), namespace)
