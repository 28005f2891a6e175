"""Trained interventions: `fl.train_interventions` is native Flax + optax, the model frozen.

Every training run here is checked against a training loop written by hand: the
model's own call (`module.apply`, the NNX model's call) with the edit written natively
around the site's output (`Wrap`), `jax.value_and_grad` over the edit's arrays only, and
the same optax update, jitted. The two loops are different programs (the flaxlens step
holds the run's own casts, checks and bookkeeping), which XLA fuses differently: after
four Adam steps the arrays are 1 ulp apart in places (measured: 3e-8 for a steering
vector, 1.2e-7 for a low-rank edit, in float32), Adam's division by the root of its
second moment carrying each rounding difference on; so they are compared to rounding
(rtol 1e-5, atol 1e-6). The interchange is trained with SGD: only the rotation's rows
that the swapped coordinates read get a gradient, the others get rounding noise, which
Adam would turn into steps of its learning rate.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX, Wrap

import flaxlens as fl

BOTH = [LINEN, NNX]
SITES = {LINEN: ("Dense_0", 16), NNX: ("hidden", 8)}  # the "mlp" case's first layer
STEPS = 4


def _loss(output, target):
  return jnp.mean((output - target) ** 2)


def _targets(fw, case, steps=STEPS):
  shape = fw.native(case)[0].shape
  return [jax.random.normal(jax.random.key(100 + n), shape) for n in range(steps)]


def _orthonormal_rows(matrix):
  """Written independently of flaxlens: QR of the transpose, R's diagonal made positive."""
  q, r = jnp.linalg.qr(matrix.T)
  return (q * jnp.where(jnp.diag(r) < 0, -1.0, 1.0)).T


def _steer(features):
  vector = jax.random.normal(jax.random.key(1), (features,))
  alpha = jnp.float32(0.5)
  made = lambda path: fl.steer(path, vector, alpha=alpha)  # noqa: E731
  native = lambda y, v: y + alpha * v  # noqa: E731
  return made, native, (vector,)


def _low_rank(features):
  projection = jax.random.normal(jax.random.key(1), (3, features))
  weight = jax.random.normal(jax.random.key(2), (3, features))
  bias = jax.random.normal(jax.random.key(3), (3,))

  def native(y, p, w, b):
    rows = _orthonormal_rows(p)
    return y + (y @ w.T + b - y @ rows.T) @ rows

  made = lambda path: fl.low_rank_edit(path, projection, weight, bias)  # noqa: E731
  return made, native, (projection, weight, bias)


EDITS = {"steer": _steer, "low_rank": _low_rank}


def _assert_trained(actual, expected):
  """Equal to rounding (module docstring), leaf by leaf."""
  jax.tree_util.tree_map(
    lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6), actual, expected
  )


def _native_training(fw, case, path, native_edit, start, batches, optimizer):
  """The hand-written loop: the native model with the edit wrapped around `path`."""

  @jax.jit
  def step(learned, state, target):
    def objective(learned):
      output, _ = fw.native(case, wrap=Wrap(path, lambda y, *_: native_edit(y, *learned)))
      return _loss(output, target)

    value, grads = jax.value_and_grad(objective)(learned)
    updates, state = optimizer.update(grads, state, learned)
    return optax.apply_updates(learned, updates), state, value

  learned, state, losses = start, optimizer.init(start), []
  for target in batches:
    learned, state, value = step(learned, state, target)
    losses.append(value)
  return learned, np.asarray(losses)


@pytest.mark.parametrize("kind", sorted(EDITS))
@pytest.mark.parametrize("fw", BOTH)
def test_training_equals_a_native_flax_and_optax_loop(corpora, fw, kind):
  case = corpora[fw]["mlp"]
  path, features = SITES[fw]
  made, native_edit, start = EDITS[kind](features)
  targets = _targets(fw, case)
  optimizer = optax.adam(0.05)
  batches = [(fw.argument(case), target) for target in targets]

  (trained,), losses = fl.train_interventions(
    fw.convert(case), [made(path)], batches, _loss, optimizer
  )

  expected, expected_losses = _native_training(
    fw, case, path, native_edit, start, targets, optimizer
  )
  learned = tuple(trained.operands[i] for i in range(len(expected)))
  _assert_trained((learned, losses), (expected, expected_losses))


@pytest.mark.parametrize("fw", BOTH)
def test_interchange_training_equals_a_native_two_run_loop(corpora, fw):
  """DAS: the source run's value at the site (Flax's own capture), rotated, its first
  coordinates swapped into the rotated base value, rotated back; the rotation trained."""
  case = corpora[fw]["mlp"]
  path, features = SITES[fw]
  source_case = dataclasses.replace(case, args=(2.0 * case.args[0],))
  rotation = jax.random.normal(jax.random.key(4), (features, features))
  mask = jnp.arange(features) < 3
  targets = _targets(fw, case)
  optimizer = optax.sgd(0.5)
  batches = [(fw.argument(case), t, fw.argument(source_case)) for t in targets]
  edit = fl.interchange(path, rotation, jnp.zeros(features), 3)

  (trained,), losses = fl.train_interventions(fw.convert(case), [edit], batches, _loss, optimizer)

  _, captured = fw.native_captures(source_case)
  (source,) = captured[(path, "__call__")]

  def native_edit(y, r):
    q = _orthonormal_rows(r)
    return jnp.where(mask, source @ q.T, y @ q.T) @ q

  (expected,), expected_losses = _native_training(
    fw, case, path, native_edit, (rotation,), targets, optimizer
  )
  _assert_trained((trained.operands[0], losses), (expected, expected_losses))


@pytest.mark.parametrize("fw", BOTH)
def test_training_leaves_the_model_variables_untouched(corpora, fw):
  case = corpora[fw]["mlp"]
  path, features = SITES[fw]
  tree = fw.convert(case)
  before = [(v.label, v.value) for v in fl.variables_in(tree)]
  batches = [(fw.argument(case), t) for t in _targets(fw, case)]
  made, _, _ = _low_rank(features)

  fl.train_interventions(tree, [made(path)], batches, _loss, optax.sgd(1.0))

  after = [(v.label, v.value) for v in fl.variables_in(tree)]
  assert [label for label, _ in after] == [label for label, _ in before]
  assert all(a is b for (_, a), (_, b) in zip(after, before, strict=True))  # the same arrays
  assert_trees_equal(fw.export(tree), fw.unedited_export(case))


@pytest.mark.parametrize("fw", BOTH)
def test_every_batch_reuses_one_compiled_step(corpora, fw):
  case = corpora[fw]["mlp"]
  path, features = SITES[fw]
  traces = []

  def loss(output, target):
    traces.append(None)  # runs only while JAX traces
    return _loss(output, target)

  batches = [(fw.argument(case), t) for t in _targets(fw, case, steps=10)]
  fl.train_interventions(
    fw.convert(case), [_steer(features)[0](path)], batches, loss, optax.adam(0.1)
  )

  assert len(traces) == 1


@pytest.mark.parametrize("fw", BOTH)
def test_trained_interventions_save_and_load_bit_for_bit(corpora, fw, tmp_path):
  case = corpora[fw]["mlp"]
  path, features = SITES[fw]
  tree = fw.convert(case)
  argument = fw.argument(case)
  _, source = fl.capture(tree, dataclasses.replace(argument, args=(3.0 * case.args[0],)), path)
  edits = [
    _steer(features)[0](path),
    _low_rank(features)[0](path),
    fl.interchange(path, jnp.eye(features) + 0.1, source[path], 2),
  ]
  batches = [(argument, t) for t in _targets(fw, case)]
  trained, _ = fl.train_interventions(tree, edits, batches, _loss, optax.adam(0.1))

  fl.save_interventions(trained, tmp_path / "set")
  loaded = fl.load_interventions(tmp_path / "set")

  assert_trees_equal(loaded, trained)
  assert_trees_equal(
    fl.run(tree, argument, interventions=loaded), fl.run(tree, argument, interventions=trained)
  )


@pytest.mark.parametrize("fw", BOTH)
def test_a_trained_steering_vector_and_low_rank_edit_fold_into_the_exported_model(corpora, fw):
  case = corpora[fw]["mlp"]
  path, features = SITES[fw]
  tree = fw.convert(case)
  argument = fw.argument(case)
  edits = [_steer(features)[0](path), _low_rank(features)[0](path)]
  batches = [(argument, t) for t in _targets(fw, case)]
  trained, _ = fl.train_interventions(tree, edits, batches, _loss, optax.adam(0.1))

  folded = fl.fold(tree, argument, trained)

  native, _ = fw.native(fw.with_exported(case, fw.export(folded)))
  np.testing.assert_allclose(
    native, fl.run(tree, argument, interventions=trained), atol=1e-5, rtol=1e-5
  )


@pytest.mark.parametrize("fw", BOTH)
def test_a_trained_interchange_rotation_stays_orthogonal(corpora, fw):
  """With every coordinate swapped, `Qᵀ Q s` is the source value exactly when Q is
  orthogonal: the run must give the source run's output after large updates."""
  case = corpora[fw]["mlp"]
  path, features = SITES[fw]
  tree = fw.convert(case)
  argument = fw.argument(case)
  source_argument = dataclasses.replace(argument, args=(2.0 * case.args[0],))
  rotation = jax.random.normal(jax.random.key(4), (features, features))
  batches = [(argument, t, source_argument) for t in _targets(fw, case)]
  edit = fl.interchange(path, rotation, jnp.zeros(features), 3)
  (trained,), _ = fl.train_interventions(tree, [edit], batches, _loss, optax.sgd(10.0))
  assert float(jnp.abs(trained.operands[0] - rotation).max()) > 0.1  # it moved far

  _, source = fl.capture(tree, source_argument, path)
  swap_all = fl.interchange(path, trained.operands[0], source[path], features)

  np.testing.assert_allclose(
    fl.run(tree, argument, interventions=[swap_all]),
    fw.native(dataclasses.replace(case, args=source_argument.args))[0],
    atol=1e-5,
  )


def test_training_reduces_the_loss_of_a_convex_problem_to_its_minimum():
  """Steering the output of a linear model under a mean squared loss is a convex quadratic
  in the vector with curvature 2/3 (3 outputs), so gradient descent with step 0.5
  shrinks the distance to the minimum by 2/3 at every step: the loss never rises and
  reaches the minimum, at the mean residual (NumPy, float64)."""
  import flax.linen as nn

  model, x = nn.Dense(3), jax.random.normal(jax.random.key(0), (16, 5))
  variables = model.init(jax.random.key(1), x)
  tree = fl.unflaxify(model, variables, x)
  target = jax.random.normal(jax.random.key(2), (16, 3))
  batches = [(x, target)] * 40

  (trained,), losses = fl.train_interventions(
    tree, [fl.steer("Dense.__call__", jnp.zeros(3))], batches, _loss, optax.sgd(0.5)
  )

  plain = np.asarray(model.apply(variables, x), np.float64)
  residual = np.asarray(target, np.float64) - plain
  best = residual.mean(axis=0)
  minimum = np.mean((residual - best) ** 2)
  assert np.all(np.diff(losses) <= 1e-6 * losses[0])  # never rises, beyond float32 rounding
  assert losses[-1] < losses[0] - 0.05
  np.testing.assert_allclose(trained.operands[0], best, atol=1e-5)
  np.testing.assert_allclose(losses[-1], minimum, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_low_rank_edits_and_interchanges_equal_the_edit_written_by_hand(dtype):
  """QR takes no bfloat16 or float16: the matrix is made orthonormal in float32 and cast
  back, and the edit then runs in its own dtype, as written here around the native call."""
  model = nn.Sequential([nn.Dense(8, dtype=dtype, param_dtype=dtype), nn.relu, nn.Dense(4)])
  x = jax.random.normal(jax.random.key(0), (2, 8)).astype(dtype)
  variables = model.init(jax.random.key(1), x)
  tree = fl.unflaxify(model, variables, x)
  matrix = lambda n, shape: jax.random.normal(jax.random.key(n), shape).astype(dtype)  # noqa: E731
  projection, weight, bias = matrix(2, (3, 8)), matrix(3, (3, 8)), matrix(4, (3,))
  rotation, source = matrix(5, (8, 8)), matrix(6, (2, 8))

  def low_rank(y):
    rows = _orthonormal_rows(projection.astype(jnp.float32)).astype(dtype)
    return y + (y @ weight.T + bias - y @ rows.T) @ rows

  def swap(y):
    q = _orthonormal_rows(rotation.astype(jnp.float32)).astype(dtype)
    return jnp.where(jnp.arange(8) < 3, source @ q.T, y @ q.T) @ q

  for edit, native in [
    (fl.low_rank_edit("layers_0", projection, weight, bias), low_rank),
    (fl.interchange("layers_0", rotation, source, 3), swap),
  ]:
    assert edit.operands[0].dtype == dtype

    def intercept(next_fun, args, kwargs, context, native=native):
      out = next_fun(*args, **kwargs)
      return native(out) if context.module.name == "layers_0" else out

    with nn.intercept_methods(intercept):
      expected = model.apply(variables, x)
    assert_trees_equal(fl.run(tree, x, interventions=[edit], jit=False), expected)


# --- refusals -----------------------------------------------------------------------------

STATEFUL = [(LINEN, "batchnorm_train"), (NNX, "convnet_train")]


@pytest.mark.parametrize("fw, name", STATEFUL)
def test_a_model_whose_run_updates_state_is_refused(corpora, fw, name):
  case = corpora[fw][name]
  tree = fw.convert(case)
  before = fw.tree_state(tree)
  output = fw.native(case)[0]
  edit = fl.steer(fw.module_class(tree), jnp.zeros(output.shape[-1]))
  with pytest.raises(fl.ArgumentError, match=r"updates the state variables .*model\.eval\(\)"):
    fl.train_interventions(
      tree, [edit], [(fw.argument(case), output)], _loss, optax.sgd(0.1), **fw.side_inputs(case)
    )
  assert_trees_equal(fw.tree_state(tree), before)


@pytest.mark.parametrize(
  "batch, edits, loss, message",
  [
    ("x", "steer", _loss, r"batch 0 is of type ArrayImpl; each batch is a tuple \(args, data\)"),
    ("pair", "steer", lambda o, t: (o - t) ** 2, r"scalar loss; this one returned shape \(2, 4\)"),
    ("pair", "steer", lambda o, t: jnp.argmax(o), "floating-point loss; this one returned int32"),
    ("pair", "steer", lambda o, t: _loss(o, t) > 0, "floating-point loss; this one returned bool"),
    ("pair", "steer", lambda o, t: (_loss(o, t), o), "loss must return an array .*got tuple"),
    ("pair", "steer", lambda o, t: None, "loss must return an array .*got NoneType"),
    ("pair", "ablate", _loss, "none of the interventions learns anything"),
    ("none", "steer", _loss, r"batches gave no batch .*at least one \(args, data\) tuple"),
    ("triple", "steer", _loss, "no intervention is an fl.interchange"),
  ],
  ids=[
    "not_a_tuple",
    "loss_not_scalar",
    "loss_int",
    "loss_bool",
    "loss_with_aux",
    "loss_none",
    "nothing_learned",
    "no_batches",
    "source_without_interchange",
  ],
)
def test_bad_training_input_is_refused(corpora, batch, edits, loss, message):
  case = corpora[LINEN]["mlp"]
  tree = LINEN.convert(case)
  x, target = case.args[0], jnp.zeros((2, 4))
  batches = {"x": [x], "pair": [(x, target)], "triple": [(x, target, x)], "none": []}[batch]
  edit = {"steer": fl.steer("Dense_1", jnp.zeros(4)), "ablate": fl.ablate("Dense_1")}[edits]
  with pytest.raises(fl.ArgumentError, match=message):
    fl.train_interventions(tree, [edit], batches, loss, optax.sgd(0.1))


def test_a_loss_failing_on_its_data_blames_the_loss_and_keeps_its_class(corpora):
  case = corpora[LINEN]["mlp"]
  tree = LINEN.convert(case)
  x = case.args[0]
  mismatched = jnp.zeros((x.shape[0] + 3, 4))  # labels of another batch size

  def loss(output, target):
    return ((output - target) ** 2).mean()

  with pytest.raises(Exception) as native:  # the loss fails on these natively, traced
    jax.grad(lambda out: loss(out, mismatched))(jnp.zeros((x.shape[0], 4)))
  with pytest.raises(native.type) as raised:  # ours keeps that class
    fl.train_interventions(
      tree, [fl.steer("Dense_1", jnp.zeros(4))], [(x, mismatched)], loss, optax.sgd(0.1)
    )
  assert isinstance(raised.value, fl.ModelCallError)
  assert "fl.train_interventions: the loss raised" in str(raised.value)


@pytest.mark.parametrize(
  "make, message",
  [
    (
      lambda: fl.interchange("layers_0", jnp.eye(4), jnp.ones(4), 2),
      "it sets coordinates of the value to another run's activations",
    ),
    (
      lambda: fl.low_rank_edit("layers_1", jnp.eye(4)[:2], jnp.ones((2, 4)), jnp.ones(2)),
      r"with its parameters mapped by the edit misses the edited output .*not affine",
    ),
  ],
  ids=["interchange", "low_rank_of_a_layer_norm"],
)
def test_fold_refuses_what_weights_cannot_express(make, message):
  import flax.linen as nn

  model, x = nn.Sequential([nn.Dense(4), nn.LayerNorm()]), jnp.arange(6.0).reshape(2, 3)
  tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  with pytest.raises(fl.ExportError, match=message):
    fl.fold(tree, x, [make()])


def test_an_interchange_on_a_head_site_trains_and_runs_as_it_reported():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(x)
      return nn.Dense(3, name="head")(x.mean(1))

  model = Model()
  base = jax.random.normal(jax.random.key(0), (16, 5, 8))
  source = jax.random.normal(jax.random.key(5), (16, 5, 8))
  variables = model.init(jax.random.key(1), base)
  tree = fl.unflaxify(model, variables, base)
  head = fl.heads("attn", 1)
  _, seen = fl.capture(tree, source, at=head)  # (16, 5, 1, 2): head 1 of the source run

  def swap_first_dim(next_fun, args, kwargs, context):  # the target: native interchange
    if context.module.name == "out":
      args = (args[0].at[..., 1, 0].set(seen["attn:heads"][..., 0, 0]), *args[1:])
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(swap_first_dim):
    target = model.apply(variables, base)
  loss = lambda out, target: jnp.mean((out - target) ** 2)  # noqa: E731
  start = fl.interchange(head, jax.random.normal(jax.random.key(3), (2, 2)), jnp.zeros(2), 1)
  (trained,), losses = fl.train_interventions(
    tree, [start], [(base, target, source)] * 30, loss, optax.sgd(0.5)
  )
  assert losses[-1] < losses[0]
  _, reported = fl.train_interventions(
    tree, [trained], [(base, target, source)], loss, optax.sgd(0.0)
  )
  filled = dataclasses.replace(
    trained, operands=(trained.operands[0], seen["attn:heads"], *trained.operands[2:])
  )
  out = fl.run(tree, base, interventions=[filled])
  np.testing.assert_allclose(loss(out, target), reported[0], rtol=1e-5)


@pytest.mark.parametrize("bad", [0, 1, 3, STEPS + 1], ids=lambda k: f"step_{k}")
@pytest.mark.parametrize("fw", BOTH)
def test_a_loss_that_becomes_nan_stops_at_its_step_keeping_the_last_good_parameters(
  corpora, fw, bad
):
  # Step `bad`'s target holds a nan, so its loss (and only its) is nan. The error names
  # the step and holds what the native loop has after the steps before the last finite
  # loss: the parameters that loss was computed with.
  steps = STEPS + 2
  case = corpora[fw]["mlp"]
  path, features = SITES[fw]
  made, native_edit, start = _steer(features)
  targets = _targets(fw, case, steps)
  targets[bad] = targets[bad].at[0, 0].set(jnp.nan)
  optimizer = optax.adam(0.05)
  batches = [(fw.argument(case), target) for target in targets]

  with pytest.raises(fl.TrainingError, match=rf"the loss of step {bad} is nan") as raised:
    fl.train_interventions(fw.convert(case), [made(path)], batches, _loss, optimizer)

  good = max(bad - 1, 0)
  expected, expected_losses = _native_training(
    fw, case, path, native_edit, start, targets[:good], optimizer
  )
  _, all_losses = _native_training(fw, case, path, native_edit, start, targets[:bad], optimizer)
  assert raised.value.step == bad
  (trained,) = raised.value.trained
  _assert_trained((trained.operands[0], raised.value.losses), (expected[0], all_losses[:bad]))
  assert trained.kind == "steer" and np.all(np.isfinite(raised.value.losses))


def test_a_loss_that_overflows_stops_before_the_parameters_do():
  # Plain SGD with a learning rate far too large: the steering vector grows each step
  # until the squared error overflows float32 to inf.
  model, x = nn.Dense(2), jnp.ones((4, 3))
  variables = model.init(jax.random.key(0), x)
  target = jnp.zeros((4, 2))
  optimizer = optax.sgd(1e3)
  edit = fl.steer("Dense.__call__", jnp.ones(2))
  batches = [(x, target)] * 40

  with pytest.raises(fl.TrainingError, match="is inf") as raised:
    fl.train_interventions(fl.unflaxify(model, variables, x), [edit], batches, _loss, optimizer)

  vector, state = jnp.ones(2), optimizer.init(jnp.ones(2))
  objective = jax.value_and_grad(lambda v: _loss(model.apply(variables, x) + v, target))
  history = []
  for _ in range(40):
    loss, grads = objective(vector)
    if not np.isfinite(loss):
      break
    history.append(vector)
    updates, state = optimizer.update(grads, state, vector)
    vector = optax.apply_updates(vector, updates)
  assert raised.value.step == len(history)
  np.testing.assert_allclose(raised.value.trained[0].operands[0], history[-1], rtol=1e-5)


def test_a_last_update_that_makes_the_parameters_nan_stops_after_the_last_step():
  # The last batch's loss adds sqrt(|y - y|), 0 with a nan gradient: every loss is finite,
  # and the last update makes the vector nan. The error keeps what the native loop has
  # before that update.
  model, x = nn.Dense(2), jnp.ones((4, 3))
  variables = model.init(jax.random.key(0), x)
  optimizer = optax.sgd(0.1)
  batches = [(x, (jnp.zeros((4, 2)), jnp.float32(flag))) for flag in (0, 0, 1)]

  def loss(output, data):
    target, flag = data
    nan_gradient = lambda y: jnp.sqrt(jnp.abs(y[0, 0] - y[0, 0]))  # noqa: E731
    return _loss(output, target) + jax.lax.cond(flag > 0, nan_gradient, lambda y: 0.0, output)

  edit = fl.steer("Dense.__call__", jnp.ones(2))
  with pytest.raises(fl.TrainingError, match="update of step 2 made the learned arrays nan") as e:
    fl.train_interventions(fl.unflaxify(model, variables, x), [edit], batches, loss, optimizer)

  vector, state, losses = jnp.ones(2), optimizer.init(jnp.ones(2)), []
  for _, data in batches[:2]:
    value, grads = jax.value_and_grad(lambda v, d=data: loss(model.apply(variables, x) + v, d))(
      vector
    )
    updates, state = optimizer.update(grads, state, vector)
    vector = optax.apply_updates(vector, updates)
    losses.append(value)
  assert e.value.step == 3
  np.testing.assert_allclose(e.value.trained[0].operands[0], vector, rtol=1e-5)
  assert len(e.value.losses) == 3 and np.all(np.isfinite(e.value.losses))
  np.testing.assert_allclose(e.value.losses[:2], losses, rtol=1e-5)
