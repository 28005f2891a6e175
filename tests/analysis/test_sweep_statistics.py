"""How sure a sweep is: its clean and corrupted metrics, per-example values, the normalised
effect, bootstrap intervals, permutation p-values and the heatmap, against native Flax.

The model is a Dense/relu stack whose weights and inputs are multiples of 1/4, so every
float32 operation in it is exact and a sweep's values equal the model run natively, one
example at a time with a hand-written patch, bit for bit. The statistics are checked
against NumPy (and SciPy) computations written out here over those same values.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from frameworks import LINEN, NNX

import flaxlens as fl

BATCH = 6


def _quarters(x):
  """`x` rounded to a multiple of 1/4 in [-2, 2]: every sum and product below is exact."""
  return jnp.clip(jnp.round(x * 4) / 4, -2.0, 2.0)


class Stack(nn.Module):
  """Three Dense layers; the last reads the first's output too, so every layer matters."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    g = nn.Dense(4)(nn.relu(h))
    return nn.Dense(4)(nn.relu(g) + h)


class NNXStack(nnx.Module):
  def __init__(self):
    self.layers = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)])

  def __call__(self, x):
    h = self.layers[0](x)
    g = self.layers[1](nnx.relu(h))
    return self.layers[2](nnx.relu(g) + h)


def _stack(framework):
  """The three-layer stack, its tree, its sites and its native run.

  `native(x, patch_at, value, position)` runs the stack natively, layer by layer (Linen:
  `nn.Dense(4).apply` of each layer's parameters; NNX: the model's own `nnx.Linear`s),
  with layer `patch_at`'s output set to `value` at `position` (None: everywhere); it
  returns the output and each layer's output.
  """
  x = _quarters(jax.random.normal(jax.random.key(5), (BATCH, 4, 4)) * 2)
  if framework is LINEN:
    model = Stack()
    variables = jax.tree_util.tree_map(_quarters, model.init(jax.random.key(0), x))
    tree = fl.unflaxify(model, variables, x)
    layers = [
      lambda h, i=i: nn.Dense(4).apply({"params": variables["params"][f"Dense_{i}"]}, h)
      for i in range(3)
    ]
    sites = ["Dense_0", "Dense_1", "Dense_2"]
  else:
    model = NNXStack()
    for number, layer in enumerate(model.layers):
      layer.kernel.value = _quarters(layer.kernel.value)
      layer.bias.value = _quarters(jax.random.normal(jax.random.key(7 + number), (4,)))
    tree = fl.unflaxify(model, x)
    layers = list(model.layers)
    sites = ["layers/0", "layers/1", "layers/2"]

  def native(inputs, patch_at=None, value=None, position=None):
    outputs = []

    def call(number, h):
      h = layers[number](h)
      if number == patch_at:
        where = jnp.s_[:] if position is None else jnp.s_[:, position]
        h = h.at[where].set(value[where])
      outputs.append(h)
      return h

    h = call(0, inputs)
    g = call(1, nn.relu(h))
    return call(2, nn.relu(g) + h), outputs

  return tree, sites, x, native


def _corrupted(clean, key=9):
  return _quarters(jax.random.normal(jax.random.key(key), clean.shape) * 2)


# A corruption lowering the metric of every example (by 1.2 to 19.6), so that clean -
# corrupted keeps its sign in every resample and the normalised effect has an interval;
# key 9's changes the sign from example to example.
ONE_SIGNED = 12


def per_example_metric(out):
  """One number per example, moved by a patch at any position: a logit difference summed."""
  return (out[..., 1] - out[..., 0]).sum(axis=-1)


def total_metric(out):
  return per_example_metric(out).sum()


def _per_example_sweep(framework, positions=range(4), key=9):
  tree, sites, clean, native = _stack(framework)
  corrupted = _corrupted(clean, key)
  result = fl.sweep(
    tree, clean, corrupted, sites, per_example_metric, positions=positions, per_example=True
  )
  return result, sites, clean, corrupted, native


# --- what a sweep keeps ---------------------------------------------------------------------


@pytest.mark.parametrize("framework", [LINEN, NNX])
@pytest.mark.parametrize("tool", [fl.sweep, fl.attribute], ids=["sweep", "attribute"])
def test_a_sweep_keeps_the_metrics_of_the_native_clean_and_corrupted_runs(framework, tool):
  tree, sites, clean, native = _stack(framework)
  corrupted = _corrupted(clean)
  result = tool(tree, clean, corrupted, sites, total_metric)
  np.testing.assert_array_equal(result.clean, total_metric(native(clean)[0]))
  np.testing.assert_array_equal(result.corrupted, total_metric(native(corrupted)[0]))
  assert result.measure == ("patched" if tool is fl.sweep else "change")


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_per_example_values_equal_native_patched_runs_of_each_example(framework):
  result, sites, clean, corrupted, native = _per_example_sweep(framework)
  expected = np.zeros((len(sites), 4, BATCH), np.float32)
  for i in range(BATCH):
    _, clean_values = native(clean[i : i + 1])
    for k in range(len(sites)):
      for p in range(4):
        output, _ = native(corrupted[i : i + 1], k, clean_values[k], p)
        expected[k, p, i] = per_example_metric(output)[0]
  assert result.per_example.shape == (len(sites), 4, BATCH)
  np.testing.assert_array_equal(result.per_example, expected)
  assert len(np.unique(expected)) > 10  # the patches and examples differ


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_per_example_clean_and_corrupted_metrics_equal_native_runs_of_each_example(framework):
  result, _, clean, corrupted, native = _per_example_sweep(framework)
  for run, held in [(clean, result.clean_per_example), (corrupted, result.corrupted_per_example)]:
    expected = [per_example_metric(native(run[i : i + 1])[0])[0] for i in range(BATCH)]
    np.testing.assert_array_equal(held, np.asarray(expected))


def test_per_example_values_average_to_the_values():
  result, *_ = _per_example_sweep(LINEN)
  np.testing.assert_allclose(result.values, np.mean(result.per_example, axis=-1), rtol=1e-6)
  np.testing.assert_allclose(result.clean, np.mean(result.clean_per_example), rtol=1e-6)
  np.testing.assert_allclose(result.corrupted, np.mean(result.corrupted_per_example), rtol=1e-6)


def test_per_example_values_of_a_vector_metric_put_the_examples_last():
  tree, sites, clean, _ = _stack(LINEN)
  result = fl.sweep(
    tree, clean, _corrupted(clean), sites, lambda out: out[:, 0, :3], per_example=True
  )
  assert result.per_example.shape == (3, 3, BATCH)
  assert result.values.shape == (3, 3)
  assert result.clean_per_example.shape == (3, BATCH)


def test_per_example_refuses_a_metric_returning_a_scalar():
  tree, sites, clean, _ = _stack(LINEN)
  with pytest.raises(fl.ArgumentError, match=r"^fl.sweep: per_example=True .* Return one value"):
    fl.sweep(tree, clean, _corrupted(clean), sites, total_metric, per_example=True)


@pytest.mark.parametrize("share_prefix", [False, True], ids=["batched", "shared_prefix"])
def test_per_example_refuses_a_metric_whose_leading_axis_is_not_the_batch(share_prefix):
  """One value per position of example 0 (shape (4,), batch 6) is not one per example."""
  tree, sites, clean, _ = _stack(LINEN)
  said = r"^fl.sweep: per_example=True .* shape \(4,\), .*\(args\[0\]: \(6, 4, 4\)\)"
  with pytest.raises(fl.ArgumentError, match=said):
    fl.sweep(
      tree,
      clean,
      _corrupted(clean),
      sites,
      lambda out: out[0, :, 1] - out[0, :, 0],
      per_example=True,
      share_prefix=share_prefix,
    )


# --- the normalised effect ------------------------------------------------------------------


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_normalised_effect_is_patched_minus_corrupted_over_clean_minus_corrupted(framework):
  tree, sites, clean, native = _stack(framework)
  corrupted = _corrupted(clean)
  result = fl.sweep(tree, clean, corrupted, sites, total_metric)
  _, clean_values = native(clean)
  clean_metric = np.float64(total_metric(native(clean)[0]))
  corrupted_metric = np.float64(total_metric(native(corrupted)[0]))
  patched = [np.float64(total_metric(native(corrupted, k, clean_values[k])[0])) for k in range(3)]
  expected = (np.asarray(patched) - corrupted_metric) / (clean_metric - corrupted_metric)
  np.testing.assert_array_equal(result.normalised(), expected)
  assert result.normalised()[-1] == 1.0  # the last layer's clean output is the clean output


def test_normalised_effect_of_an_attribution_divides_the_change_by_clean_minus_corrupted():
  tree, sites, clean, _ = _stack(LINEN)
  result = fl.attribute(tree, clean, _corrupted(clean), sites, total_metric)
  span = np.float64(result.clean) - np.float64(result.corrupted)
  np.testing.assert_array_equal(result.normalised(), np.asarray(result.values, np.float64) / span)
  assert result.normalised()[-1] == pytest.approx(1.0)  # the last layer is linear


def test_normalised_effect_refuses_clean_equal_to_corrupted():
  tree, sites, clean, _ = _stack(LINEN)
  result = fl.sweep(tree, clean, clean, sites, total_metric)
  with pytest.raises(fl.StatisticsError, match=r"equal within rounding .* Choose a corrupted"):
    result.normalised()


def test_normalised_effect_refuses_a_result_without_the_runs_metrics():
  with pytest.raises(fl.StatisticsError, match=r"needs the clean and corrupted .* build it"):
    fl.SweepResult(np.ones(2), ("a", "b")).normalised()


# --- bootstrap intervals --------------------------------------------------------------------


def _resampled(per_example, n, seed):
  """Each resample's mean, by hand: the documented draws, examples picked by indexing."""
  draws = np.random.default_rng(seed).integers(0, per_example.shape[-1], size=(n, BATCH))
  return np.stack([per_example[..., d].mean(axis=-1) for d in draws], axis=-1)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_bootstrap_equals_numpy_percentiles_of_resampled_example_means(framework):
  result, *_ = _per_example_sweep(framework)
  lower, upper = result.bootstrap(n=500, confidence=0.9, seed=3)
  means = _resampled(np.asarray(result.per_example, np.float64), 500, 3)
  np.testing.assert_allclose(lower, np.quantile(means, 0.05, axis=-1), rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(upper, np.quantile(means, 0.95, axis=-1), rtol=1e-12, atol=1e-12)
  assert np.all(lower < upper)


def test_bootstrap_of_the_normalised_effect_resamples_the_three_runs_together():
  result, *_ = _per_example_sweep(LINEN, key=ONE_SIGNED)
  lower, upper = result.bootstrap(n=400, seed=1, normalised=True)
  patched, clean, corrupted = (
    _resampled(np.asarray(v, np.float64), 400, 1)
    for v in (result.per_example, result.clean_per_example, result.corrupted_per_example)
  )
  ratio = (patched - corrupted) / (clean - corrupted)
  np.testing.assert_allclose(lower, np.quantile(ratio, 0.025, axis=-1), rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(upper, np.quantile(ratio, 0.975, axis=-1), rtol=1e-12, atol=1e-12)


def test_bootstrap_refuses_a_confidence_outside_zero_and_one():
  result, *_ = _per_example_sweep(LINEN)
  with pytest.raises(
    fl.StatisticsError,
    match=r"^SweepResult.bootstrap\(\): confidence=95 is outside \(0, 1\).*=0.95",
  ):
    result.bootstrap(confidence=95)


def _one_differing_sweep(batch=32, differing=7):
  """A sweep of `batch` examples whose corrupted input equals the clean one but on one."""
  tree, sites, _, _ = _stack(LINEN)
  clean = _quarters(jax.random.normal(jax.random.key(5), (batch, 4, 4)) * 2)
  corrupted = clean.at[differing].set(_corrupted(clean)[differing])
  return fl.sweep(tree, clean, corrupted, sites, per_example_metric, per_example=True)


def test_bootstrap_of_the_normalised_effect_refuses_resamples_with_nothing_to_normalise_by():
  """Clean and corrupted differ on 1 of 32 examples: the point estimate exists, but about
  a third of the resamples miss that example and would divide 0 by 0."""
  result = _one_differing_sweep()
  assert np.isfinite(result.normalised()).all()
  said = r"equal within rounding.*they differ on 1 of 32 examples \(\[7\]\).*normalised=False"
  with pytest.raises(fl.StatisticsError, match=said):
    result.bootstrap(normalised=True)


def test_bootstrap_of_the_normalised_effect_refuses_a_denominator_of_unsettled_sign():
  """Key 9's corruption raises the metric of some examples and lowers it on others."""
  result, *_ = _per_example_sweep(LINEN)
  clean = np.asarray(result.clean_per_example, np.float64)
  corrupted = np.asarray(result.corrupted_per_example, np.float64)
  spans = _resampled(clean, 10_000, 0) - _resampled(corrupted, 10_000, 0)
  assert np.mean(np.sign(spans) != np.sign(clean.mean() - corrupted.mean())) > 0.025
  with pytest.raises(
    fl.StatisticsError,
    match=r"changes sign in .* positive on examples \[0, 2\] and negative on \[1, 3, 4, 5\]",
  ):
    result.bootstrap(normalised=True)


def test_bootstrap_refuses_a_confidence_its_examples_cannot_support():
  """5 examples: the exact sign-flip test cannot go below 2 / 2**5, so at most 0.9375."""
  result = fl.SweepResult(
    np.ones(1),
    ("a",),
    per_example=np.arange(5.0)[None],
    clean_per_example=np.ones(5),
    corrupted_per_example=np.zeros(5),
  )
  with pytest.raises(fl.StatisticsError, match=r"5 examples cannot support a 0.99 .* at least 8"):
    result.bootstrap(confidence=0.99)
  lower, upper = result.bootstrap(confidence=0.9375)
  assert np.isfinite([lower, upper]).all()


@pytest.mark.parametrize("statistic", ["normalised", "bootstrap", "p_values"])
def test_statistics_refuse_values_that_are_not_finite_naming_rows_and_examples(statistic):
  per_example = np.ones((2, 6))
  per_example[1, 2] = np.nan
  result = fl.SweepResult(
    per_example.mean(-1),
    ("a", "b"),
    clean=1.0,
    corrupted=0.0,
    per_example=per_example,
    clean_per_example=np.ones(6),
    corrupted_per_example=np.zeros(6),
  )
  at = r"in rows \['b'\]" + (r" at examples \[2\]" if statistic != "normalised" else "")
  with pytest.raises(fl.StatisticsError, match=r"not finite \(inf or NaN\) " + at):
    getattr(result, statistic)()


# --- permutation p-values -------------------------------------------------------------------


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_p_values_equal_scipys_exact_paired_permutation_test(framework):
  stats = pytest.importorskip("scipy.stats")
  result, *_ = _per_example_sweep(framework)  # 6 examples: all 64 sign vectors
  patched = np.asarray(result.per_example, np.float64).reshape(-1, BATCH)
  corrupted = np.asarray(result.corrupted_per_example, np.float64)
  expected = [
    stats.permutation_test(
      (cell, corrupted),
      lambda x, y, axis: np.mean(x - y, axis=axis),
      permutation_type="samples",
      vectorized=True,
      n_resamples=np.inf,
    ).pvalue
    for cell in patched
  ]
  p = result.p_values()
  assert p.shape == result.values.shape
  np.testing.assert_allclose(p.reshape(-1), expected, rtol=1e-12)
  assert len(np.unique(p)) > 3  # the cells differ


def test_p_values_from_random_sign_flips_equal_numpy_by_hand():
  result, *_ = _per_example_sweep(LINEN)
  differences = np.asarray(result.per_example, np.float64) - np.asarray(
    result.corrupted_per_example, np.float64
  )
  signs = 1 - 2 * np.random.default_rng(4).integers(0, 2, size=(50, BATCH))  # 50 < 2**6
  observed = np.abs(differences.sum(axis=-1))
  flipped = np.abs(np.einsum("rb,...b->...r", signs, differences))
  count = (flipped >= observed[..., None] * (1 - 1e-13)).sum(axis=-1)
  np.testing.assert_array_equal(result.p_values(permutations=50, seed=4), (count + 1) / 51)


@pytest.mark.parametrize("statistic", ["bootstrap", "p_values"])
def test_statistics_without_per_example_values_say_how_to_get_them(statistic):
  tree, sites, clean, _ = _stack(LINEN)
  result = fl.sweep(tree, clean, _corrupted(clean), sites, total_metric)
  with pytest.raises(fl.StatisticsError, match=r"no per-example values\. Sweep with per_exam"):
    getattr(result, statistic)()


@pytest.mark.parametrize("statistic", ["bootstrap", "p_values"])
def test_statistics_refuse_a_sweep_of_one_example(statistic):
  tree, sites, clean, _ = _stack(LINEN)
  one = clean[:1]
  result = fl.sweep(tree, one, _corrupted(clean)[:1], sites, per_example_metric, per_example=True)
  with pytest.raises(fl.StatisticsError, match=r"saw 1 example; resampling needs at least 2"):
    getattr(result, statistic)()


# --- the heatmap ----------------------------------------------------------------------------


def _image(figure):
  (image,) = figure.axes[0].images
  return image


def _far_from_zero_sweep():
  """A sweep whose metric sits far from 0 (as a logit does): plotted around 0, one colour."""
  tree, sites, clean, _ = _stack(LINEN)
  return fl.sweep(
    tree, clean, _corrupted(clean), sites, lambda o: total_metric(o) + 1000, positions=range(4)
  )


def test_plot_shows_the_normalised_effect_centred_on_zero_when_the_runs_are_known():
  pytest.importorskip("matplotlib")
  result = _far_from_zero_sweep()
  image = _image(result.plot())
  assert image.norm.vcenter == 0
  np.testing.assert_array_equal(image.get_array(), result.normalised())
  colours = image.norm(image.get_array())
  assert colours.max() - colours.min() > 0.4  # not one flat colour


def test_plot_of_raw_values_centres_on_the_corrupted_metric():
  pytest.importorskip("matplotlib")
  result = _far_from_zero_sweep()
  image = _image(result.plot(normalised=False))
  assert image.norm.vcenter == pytest.approx(float(result.corrupted))
  assert "corrupted" in result.plot(normalised=False).axes[1].get_ylabel()


def test_plot_of_an_attribution_centres_its_estimated_changes_on_zero():
  pytest.importorskip("matplotlib")
  tree, sites, clean, _ = _stack(LINEN)
  result = fl.attribute(tree, clean, _corrupted(clean), sites, total_metric, positions=range(4))
  image = _image(result.plot(normalised=False))
  assert image.norm.vcenter == 0
  np.testing.assert_array_equal(image.get_array(), np.asarray(result.values, np.float64))


def test_plot_limits_leave_out_an_outlier():
  pytest.importorskip("matplotlib")
  values = np.linspace(0, 1, 200).reshape(20, 10)
  values[3, 4] = 1000.0
  names = tuple(f"s{i}" for i in range(20))
  result = fl.SweepResult(values, names, tuple(range(10)), corrupted=0.0)
  image = _image(result.plot(normalised=False))
  assert image.norm.vcenter == 0 and image.norm.vmax < 2  # the other 199 cells set the scale
  assert image.colorbar.extend == "max"  # the colorbar shows that cells lie beyond


def test_plot_without_a_baseline_spans_the_values_with_a_sequential_map():
  pytest.importorskip("matplotlib")
  values = np.linspace(1000, 1001, 12).reshape(3, 4)
  image = _image(fl.SweepResult(values, ("a", "b", "c"), tuple(range(4))).plot())
  assert (image.norm.vmin, image.norm.vmax) == (1000, 1001)
  assert image.get_cmap().name.startswith("viridis")


def test_plot_moves_shared_site_path_parts_to_the_axis_and_thins_tick_labels():
  pytest.importorskip("matplotlib")
  names = tuple(f"model/encoder/layers_{i}/self_attention/out" for i in range(100))
  result = fl.SweepResult(np.zeros((100, 64)), names, tuple(range(64)), clean=1.0, corrupted=0.0)
  axes = result.plot().axes[0]
  rows = [t.get_text() for t in axes.get_yticklabels()]
  assert rows[:2] == ["layers_0", "layers_3"] and len(rows) <= 40
  assert axes.get_ylabel().replace("\n", "") == "model/encoder/…/self_attention/out"
  assert len(axes.get_xticklabels()) <= 32


def test_plot_saves_the_image_to_a_path(tmp_path):
  pytest.importorskip("matplotlib")
  path = tmp_path / "sweep.svg"
  _far_from_zero_sweep().plot(path, title="logit difference")
  assert b"<svg" in path.read_bytes()[:400]


def _tested(signs):
  """A result of one cell per row of `signs` (examples' differences from the corrupted
  run: +1 or -1), clean 1 and corrupted 0 on every example."""
  per_example = np.asarray(signs, np.float64) * 0.5
  batch = per_example.shape[-1]
  return fl.SweepResult(
    per_example.mean(-1),
    tuple(f"s{i}" for i in range(len(signs))),
    clean=1.0,
    corrupted=0.0,
    per_example=per_example,
    clean_per_example=np.ones(batch),
    corrupted_per_example=np.zeros(batch),
  )


def _hatched_rows(figure):
  found = [c for c in figure.axes[0].collections if c.get_gid() == "not significant"]
  if not found:
    return []
  return sorted(int(round(path.vertices[:, 1].min() + 0.5)) for path in found[0].get_paths())


def test_plot_hatches_the_cells_not_significant_after_holms_adjustment():
  """8 examples: a cell whose examples all agree has the exact p-value 2 / 2**8; Holm over
  3 cells takes it to 3 * 2 / 2**8 = 0.023 < 0.05. A cell of mixed signs stays above."""
  pytest.importorskip("matplotlib")
  agree, mixed = [1] * 8, [1, -1] * 4
  figure = _tested([agree, mixed, agree]).plot()
  assert _hatched_rows(figure) == [1]
  (note,) = figure.legends
  assert "not significant at 0.05" in note.get_texts()[0].get_text()
  assert "Holm" in note.get_texts()[0].get_text()
  assert _hatched_rows(_tested([agree, mixed, agree]).plot(significance=None)) == []


def test_plot_of_few_examples_hatches_every_cell():
  """6 examples cannot reach 0.05 after Holm over 3 cells (3 * 2 / 2**6 = 0.094)."""
  pytest.importorskip("matplotlib")
  agree = [1] * 6
  assert _hatched_rows(_tested([agree, agree, agree]).plot()) == [0, 1, 2]


@pytest.mark.parametrize("shape", [(1, 1), (3, 4), (100, 64)], ids=["1x1", "3x4", "100x64"])
def test_plot_keeps_its_labels_inside_the_figure(shape):
  pytest.importorskip("matplotlib")
  from matplotlib.backends.backend_agg import FigureCanvasAgg

  rows, columns = shape
  names = tuple(f"model/encoder/layers_{i}/self_attention/out" for i in range(rows))
  per_example = np.linspace(-1, 1, rows * columns * 8).reshape(rows, columns, 8)
  result = fl.SweepResult(
    per_example.mean(-1),
    names,
    tuple(range(columns)),
    clean=1.0,
    corrupted=0.0,
    per_example=per_example,
    clean_per_example=np.ones(8),
    corrupted_per_example=np.zeros(8),
  )
  figure = result.plot(title="a title")
  canvas = FigureCanvasAgg(figure)
  canvas.draw()
  renderer = canvas.get_renderer()
  inside = figure.bbox
  texts = [figure.axes[1].yaxis.label, figure.axes[0].yaxis.label, figure.axes[0].title]
  texts += [text for legend in figure.legends for text in legend.get_texts()]
  for text in texts:
    box = text.get_window_extent(renderer)
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1, text.get_text()
    assert inside.y0 <= box.y0 and box.y1 <= inside.y1, text.get_text()


def test_plot_draws_enough_sign_flips_that_their_floor_hatches_no_clear_effect():
  """1000 cells whose 20 examples all agree: the exact p-value 2 / 2**20 survives Holm, but
  10,000 random sign flips cannot go below 1 / 10,001, and 1000 times that is 0.1."""
  pytest.importorskip("matplotlib")
  assert _hatched_rows(_tested([[1] * 20] * 1000).plot()) == []
