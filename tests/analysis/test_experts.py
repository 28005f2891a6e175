"""Experts and routers of mixture-of-experts layers as sites (`fl.experts`, `fl.routing`).

Each MoE layer is written the ways JAX libraries write them: one module per expert;
stacked expert weights with dense `einsum` dispatch; `jax.lax.ragged_dot` over tokens
sorted by expert; top-1 routing with a capacity (tokens over it dropped). Each takes a
`hook`, a function applied natively to the experts' values before they are combined
(and `router_hook` to the router's logits): the same edit written by hand in the
model. Weights and inputs are multiples of 1/4, so the experts' arithmetic is exact,
and flaxlens's edit is compared with the native one bit for bit, both compiled.
"""

from __future__ import annotations

import tempfile
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl
from flaxlens.errors import FlaxlensError, SelectionError

E, D, H, K = 4, 8, 8, 2  # experts, features, hidden, experts per token
X = jnp.round(jax.random.normal(jax.random.key(1), (2, 3, D)) * 4) / 4


def _quarters(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda w: jnp.clip(jnp.round(w * 4) / 4, -1.0, 1.0), tree)


def _top_k_gates(logits: Any) -> tuple[Any, Any]:
  """Mixtral-style routing: the top K logits, softmaxed; `(gates, chosen)`."""
  top, chosen = jax.lax.top_k(logits, K)
  return jax.nn.softmax(top, axis=-1), chosen


def _dense_gates(logits: Any) -> Any:
  """The gate of every expert, zero for those not chosen: `[..., E]`."""
  gates, chosen = _top_k_gates(logits)
  return jnp.sum(jax.nn.one_hot(chosen, E) * gates[..., None], axis=-2)


def _same(a: Any, b: Any) -> None:
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- the models, Linen --------------------------------------------------------------------


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(D, name="wo")(nn.relu(nn.Dense(H, name="wi")(x)))


class PerModule(nn.Module):
  """One module per expert; every expert computed on every token, combined by gates."""

  hook: Any = None
  router_hook: Any = None

  @nn.compact
  def __call__(self, x):
    logits = nn.Dense(E, name="router")(x)
    logits = logits if self.router_hook is None else self.router_hook(logits)
    outs = jnp.stack([Mlp(name=f"experts_{e}")(x) for e in range(E)], axis=-2)
    outs = outs if self.hook is None else self.hook(outs)
    return jnp.einsum("bse,bsed->bsd", _dense_gates(logits), outs)


class StackedExperts(nn.Module):
  """Stacked weights `[E, ...]`, every expert on every token: `[..., E, D]`."""

  @nn.compact
  def __call__(self, x):
    wi = self.param("wi", nn.initializers.normal(1.0), (E, D, H))
    wo = self.param("wo", nn.initializers.normal(1.0), (E, H, D))
    return jnp.einsum("bseh,ehd->bsed", nn.relu(jnp.einsum("bsd,edh->bseh", x, wi)), wo)


class Stacked(nn.Module):
  """Stacked expert weights, dense einsum dispatch (MaxText's and Tunix's dense path)."""

  hook: Any = None
  router_hook: Any = None

  @nn.compact
  def __call__(self, x):
    logits = nn.Dense(E, name="gate")(x)
    logits = logits if self.router_hook is None else self.router_hook(logits)
    outs = StackedExperts(name="experts")(x)
    outs = outs if self.hook is None else self.hook(outs)
    return jnp.einsum("bse,bsed->bsd", _dense_gates(logits), outs)


class GroupedExperts(nn.Module):
  """Stacked weights applied with `jax.lax.ragged_dot` to rows sorted by expert."""

  @nn.compact
  def __call__(self, rows, group_sizes):
    wi = self.param("wi", nn.initializers.normal(1.0), (E, D, H))
    wo = self.param("wo", nn.initializers.normal(1.0), (E, H, D))
    hidden = nn.relu(jax.lax.ragged_dot(rows, wi, group_sizes))
    return jax.lax.ragged_dot(hidden, wo, group_sizes)


class Ragged(nn.Module):
  """Grouped dispatch: each (token, choice) sorted by expert, `ragged_dot`, unsorted."""

  hook: Any = None
  router_hook: Any = None

  @nn.compact
  def __call__(self, x):
    logits = nn.Dense(E, name="router")(x)
    logits = logits if self.router_hook is None else self.router_hook(logits)
    gates, chosen = _top_k_gates(logits)
    tokens = x.reshape(-1, D)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    rows = GroupedExperts(name="experts")(tokens[order // K], sizes)
    rows = rows if self.hook is None else self.hook(rows, sizes)
    unsorted = jnp.zeros_like(rows).at[order].set(rows).reshape(*chosen.shape, D)
    return jnp.einsum("bsk,bskd->bsd", gates, unsorted)


class CapacityExperts(nn.Module):
  """Stacked weights on a capacity buffer `[E, C, D]`."""

  @nn.compact
  def __call__(self, buffer):
    wi = self.param("wi", nn.initializers.normal(1.0), (E, D, H))
    wo = self.param("wo", nn.initializers.normal(1.0), (E, H, D))
    return jnp.einsum("ech,ehd->ecd", nn.relu(jnp.einsum("ecd,edh->ech", buffer, wi)), wo)


CAPACITY = 2


class Capacity(nn.Module):
  """Top-1 routing with a capacity of CAPACITY tokens per expert (Switch style): the
  tokens over it are dropped (the layer returns zero for them)."""

  hook: Any = None
  router_hook: Any = None
  num_experts_per_tok: int = 1

  @nn.compact
  def __call__(self, x):
    tokens = x.reshape(-1, D)
    logits = nn.Dense(E, name="router")(tokens)
    logits = logits if self.router_hook is None else self.router_hook(logits)
    chosen = jnp.argmax(logits, axis=-1)
    gate = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    onehot = jax.nn.one_hot(chosen, E)
    slot = (jnp.cumsum(onehot, axis=0) - 1) * onehot  # each token's place in its expert
    dispatch = onehot[..., None] * jax.nn.one_hot(slot, CAPACITY) * (slot < CAPACITY)[..., None]
    buffer = jnp.einsum("tec,td->ecd", dispatch, tokens)
    outs = CapacityExperts(name="experts")(buffer)
    outs = outs if self.hook is None else self.hook(outs)
    return jnp.einsum("tec,ecd->td", dispatch * gate[:, None, None], outs).reshape(x.shape)


class Inline(nn.Module):
  """MaxText's style with the experts in the layer's own code: no call holds them."""

  @nn.compact
  def __call__(self, x):
    gates = _dense_gates(nn.Dense(E, name="router")(x))
    wi = self.param("wi", nn.initializers.normal(1.0), (E, D, D))
    return jnp.einsum("bse,bsd,edh->bsh", gates, x, wi)


class NoRouter(nn.Module):
  """Stacked experts combined by a fixed mean: no call computes routing logits."""

  @nn.compact
  def __call__(self, x):
    return StackedExperts(name="experts")(x).mean(axis=-2)


class AutoNamed(nn.Module):
  """Modules named by Linen (`Dense_0` router, `Dense_1` shared expert), stacked experts."""

  hook: Any = None

  @nn.compact
  def __call__(self, x):
    gates = _dense_gates(nn.Dense(E)(x))
    shared = nn.Dense(D)(x)
    outs = StackedExperts()(x)
    outs = outs if self.hook is None else self.hook(outs)
    return shared + jnp.einsum("bse,bsed->bsd", gates, outs)


class Blocks(nn.Module):
  """Residual MoE blocks (Stacked layers), for sweeps; `hooks[i]` edits block i natively."""

  layers: int = 2
  hooks: tuple = ()

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      hook = self.hooks[i] if i < len(self.hooks) else None
      x = x + Stacked(hook=hook, name=f"moe_{i}")(x)
    return x


class ScanBody(nn.Module):
  hook: Any = None

  @nn.compact
  def __call__(self, x, _):
    return x + Stacked(hook=self.hook, name="moe")(x), None


class Scanned(nn.Module):
  """Three Stacked blocks under `nn.scan`: parameters `[layers, experts, ...]`."""

  hook: Any = None

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(ScanBody, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
    return scan(hook=self.hook, name="layers")(x, None)[0]


def _linen(model: nn.Module, x: Any = X) -> tuple[Any, Any]:
  """`(tree, native)`: the converted model and `native(**fields)`, the same model with
  those fields (hooks) applied natively, compiled."""
  variables = _quarters(model.init(jax.random.key(0), x))
  tree = fl.unflaxify(model, variables, x)

  def native(**fields: Any) -> Any:
    return jax.jit(lambda v, x: model.clone(**fields).apply(v, x))(variables, x)

  return tree, native


# --- the models, NNX ----------------------------------------------------------------------


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.wi, self.wo = nnx.Linear(D, H, rngs=rngs), nnx.Linear(H, D, rngs=rngs)

  def __call__(self, x):
    return self.wo(nnx.relu(self.wi(x)))


class NnxPerModule(nnx.Module):
  def __init__(self, rngs):
    self.router = nnx.Linear(D, E, rngs=rngs)
    self.experts = nnx.List([NnxMlp(rngs) for _ in range(E)])
    self.hook = None

  def __call__(self, x):
    outs = jnp.stack([expert(x) for expert in self.experts], axis=-2)
    outs = outs if self.hook is None else self.hook(outs)
    return jnp.einsum("bse,bsed->bsd", _dense_gates(self.router(x)), outs)


class NnxStackedExperts(nnx.Module):
  def __init__(self, rngs):
    self.wi = nnx.Param(jax.random.normal(rngs.params(), (E, D, H)))
    self.wo = nnx.Param(jax.random.normal(rngs.params(), (E, H, D)))

  def __call__(self, x):
    return jnp.einsum("bseh,ehd->bsed", nnx.relu(jnp.einsum("bsd,edh->bseh", x, self.wi)), self.wo)


class NnxStacked(nnx.Module):
  def __init__(self, rngs):
    self.gate = nnx.Linear(D, E, rngs=rngs)
    self.experts = NnxStackedExperts(rngs)
    self.hook = self.router_hook = None

  def __call__(self, x):
    logits = self.gate(x)
    logits = logits if self.router_hook is None else self.router_hook(logits)
    outs = self.experts(x)
    outs = outs if self.hook is None else self.hook(outs)
    return jnp.einsum("bse,bsed->bsd", _dense_gates(logits), outs)


def _nnx(cls: type) -> tuple[Any, Any]:
  model = cls(nnx.Rngs(0))
  graph, state = nnx.split(model)
  model = nnx.merge(graph, _quarters(state))
  tree = fl.unflaxify(model, X)

  def native(**hooks: Any) -> Any:
    def run(state, x):
      copy = nnx.merge(graph, state)
      for name, hook in hooks.items():
        setattr(copy, name, hook)
      return copy(x)

    return jax.jit(run)(_quarters(state), X)

  return tree, native


# --- expert sites on every layout equal the native edit -----------------------------------

LAYOUTS = {
  "linen one module per expert": lambda: (*_linen(PerModule()), "PerModule.__call__"),
  "linen stacked einsum": lambda: (*_linen(Stacked()), "Stacked.__call__"),
  "linen ragged_dot": lambda: (*_linen(Ragged()), "Ragged.__call__"),
  "linen capacity": lambda: (*_linen(Capacity()), "Capacity.__call__"),
  "nnx one module per expert": lambda: (*_nnx(NnxPerModule), "NnxPerModule.__call__"),
  "nnx stacked einsum": lambda: (*_nnx(NnxStacked), "NnxStacked.__call__"),
}


def _zero_expert(expert: int, grouped: bool) -> Any:
  """The native ablation of one expert: its slice of the expert axis (`[..., e, :]`, or
  `[e]` of a capacity buffer), or its rows of a grouped output."""
  if grouped:

    def zero_rows(rows, sizes):
      ends = jnp.cumsum(sizes)
      index = jnp.arange(rows.shape[0])
      return jnp.where(
        ((index >= ends[expert] - sizes[expert]) & (index < ends[expert]))[:, None], 0, rows
      )

    return zero_rows
  return lambda outs: outs.at[..., expert, :].set(0) if outs.ndim == 4 else outs.at[expert].set(0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_ablated_expert_equals_the_native_ablation(layout):
  tree, native, layer = LAYOUTS[layout]()
  ablated = fl.run(tree, X, interventions=[fl.ablate(fl.experts(layer, 1))])
  _same(ablated, native(hook=_zero_expert(1, "ragged" in layout)))
  assert not np.array_equal(ablated, native())


def test_numbered_calls_of_different_structure_are_not_experts():
  """`Dense_0` (the router, 4 logits) and `Dense_1` (a shared expert) share a module type
  and numbering, not a structure: the experts are the stacked call."""
  tree, native = _linen(AutoNamed())
  ablated = fl.run(tree, X, interventions=[fl.ablate(fl.experts("AutoNamed.__call__", 2))])
  _same(ablated, native(hook=_zero_expert(2, False)))
  _, cache = fl.capture(tree, X, at=[fl.routing("AutoNamed.__call__", k=K), "Dense_0"])
  _same(cache["AutoNamed.__call__:router_logits"], cache["Dense_0"])


def test_experts_under_a_scan_over_layers_follow_the_scans_parameter_axis():
  """Under `nn.scan` the stacked weights are `[layers, experts, ...]`: the experts are
  the second axis, and a sweep has a row per (iteration, expert)."""
  tree, native = _linen(Scanned())
  ablated = fl.run(tree, X, interventions=[fl.ablate(fl.experts("layers/moe", 1))])
  _same(ablated, native(hook=_zero_expert(1, False)))
  result = fl.sweep(tree, X, X[:, ::-1], fl.experts("layers/moe", [0, 3]), lambda o: o.sum())
  assert result.sites[:3] == (
    "layers/moe[0] expert 0",
    "layers/moe[0] expert 3",
    "layers/moe[1] expert 0",
  )
  assert len(result.sites) == 6


@pytest.mark.parametrize("layout", ["linen stacked einsum", "linen one module per expert"])
def test_a_steered_expert_equals_the_native_steering(layout):
  tree, native, layer = LAYOUTS[layout]()
  vector = jnp.arange(D, dtype=jnp.float32) / 4
  steered = fl.run(tree, X, interventions=[fl.steer(fl.experts(layer, [0, 2]), vector)])
  _same(steered, native(hook=lambda outs: outs.at[..., jnp.array([0, 2]), :].add(vector)))


def test_captured_experts_are_the_native_values_and_patch_back():
  tree, _, layer = LAYOUTS["linen stacked einsum"]()
  _, cache = fl.capture(tree, X, at=fl.experts(layer, [3, 1]))
  assert sorted(cache) == [f"{layer}:expert 1", f"{layer}:expert 3"]
  variables = {"params": tree.select().at_path("experts").get().export()["params"]}
  outs = StackedExperts().apply(variables, X)
  _same(cache[f"{layer}:expert 3"], outs[..., 3, :])
  other = X[::-1]
  patched = fl.run(
    tree, other, interventions=[fl.patch(fl.experts(layer, 3), cache[f"{layer}:expert 3"])]
  )
  moved = fl.run(
    tree,
    other,
    interventions=[fl.modify("experts", lambda a, y: y.at[..., 3, :].set(outs[..., 3, :]))],
  )
  _same(patched, moved)


def test_a_grouped_capture_holds_its_expert_rows_only():
  tree, _, layer = LAYOUTS["linen ragged_dot"]()
  _, cache = fl.capture(tree, X, at=[fl.experts(layer, 2), fl.routing(layer, k=K)])
  chosen = np.asarray(cache[f"{layer}:chosen"]).reshape(-1)
  rows = np.asarray(cache[f"{layer}:expert 2"])
  start = int((chosen < 2).sum())
  held = np.abs(rows).sum(axis=-1) > 0
  assert not held[:start].any() and not held[start + int((chosen == 2).sum()) :].any()


# --- sweeps -------------------------------------------------------------------------------


def test_an_experts_sweep_equals_each_native_patch():
  """Every (layer, expert) row is the corrupted run with that expert's clean output put
  back natively; to a float32 rounding, as the sweep's forwards run batched (vmap)."""
  model = Blocks()
  tree, native = _linen(model)
  clean, corrupted = X, X[:, ::-1] * 0.5
  _, cache = fl.capture(tree, clean, at=["moe_0/experts", "moe_1/experts"])

  def metric(output):
    return output[:, -1, :].sum()

  result = fl.sweep(tree, clean, corrupted, fl.experts("moe_*"), metric)
  assert result.sites == tuple(f"moe_{i} expert {e}" for i in range(2) for e in range(E))
  variables = _quarters(model.init(jax.random.key(0), X))
  for layer, expert in ((0, 0), (0, 3), (1, 2)):  # a native compile each: three rows
    row = layer * E + expert
    clean_outs = cache[f"moe_{layer}/experts"][..., expert, :]
    hooks = [None, None]
    hooks[layer] = lambda outs, c=clean_outs, e=expert: outs.at[..., e, :].set(c)
    expected = metric(
      jax.jit(lambda v, x, h=tuple(hooks): Blocks(hooks=h).apply(v, x))(variables, corrupted)
    )
    np.testing.assert_allclose(result.values[row], expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(result.clean, metric(native()), rtol=1e-6)


def test_a_grouped_sweep_is_refused_naming_the_layer():
  tree, _, layer = LAYOUTS["linen ragged_dot"]()
  with pytest.raises(SelectionError, match=f"{layer}.*Sweep by ablation"):
    fl.sweep(tree, X, X[::-1], fl.experts(layer), lambda out: out.sum())


# --- routing ------------------------------------------------------------------------------


def test_router_logits_and_chosen_experts_are_the_routers():
  tree, _, layer = LAYOUTS["linen stacked einsum"]()
  _, cache = fl.capture(tree, X, at=[fl.routing(layer, k=K), "gate"])
  _same(cache[f"{layer}:router_logits"], cache["gate"])
  _same(cache[f"{layer}:chosen"], jax.lax.top_k(cache["gate"], K)[1])


@pytest.mark.parametrize(
  "layout", ["linen stacked einsum", "linen ragged_dot", "linen capacity", "nnx stacked einsum"]
)
def test_forbidding_an_expert_equals_the_native_edit_of_the_logits(layout):
  tree, native, layer = LAYOUTS[layout]()
  site = fl.routing(layer, k=K)
  forbidden = fl.run(tree, X, interventions=[site.forbid(0)])
  _same(forbidden, native(router_hook=lambda logits: logits.at[..., 0].set(-jnp.inf)))
  _, cache = fl.capture(tree, X, at=site, interventions=[site.forbid([0, 1])])
  assert not np.isin(np.asarray(cache[f"{layer}:chosen"]), [0, 1]).any()


def test_forcing_an_expert_routes_every_token_to_it_first():
  tree, native, layer = LAYOUTS["linen capacity"]()
  site = fl.routing(layer)  # k from the layer's num_experts_per_tok setting
  forced = fl.run(tree, X, interventions=[site.force(3)])

  def force(logits):
    return logits.at[..., 3].set(jnp.nextafter(logits.max(axis=-1), jnp.inf))

  _same(forced, native(router_hook=force))
  _, cache = fl.capture(tree, X, at=site, interventions=[site.force(3)])
  assert (np.asarray(cache[f"{layer}:chosen"]) == 3).all()


def test_load_counts_the_chosen_experts_over_a_capture_and_a_harvest():
  tree, _, layer = LAYOUTS["linen stacked einsum"]()
  site = fl.routing(layer, k=K)
  batches = [X, X[::-1] * 0.5]
  chosen = [fl.capture(tree, x, at=site)[1][f"{layer}:chosen"] for x in batches]
  expected = np.bincount(np.concatenate([np.asarray(c).reshape(-1) for c in chosen]), minlength=E)
  assert site.load(tree, chosen[0]).sum() == X.shape[0] * X.shape[1] * K
  path = tempfile.mkdtemp() + "/store"
  fl.harvest(tree, batches, "gate", path)
  _same(site.load(tree, fl.open_harvest(path)["gate"]), expected)
  _same(site.load(tree, chosen[0]) + site.load(tree, chosen[1]), expected)


# --- refusals -----------------------------------------------------------------------------


def test_an_expert_out_of_range_is_refused_naming_the_layer():
  tree, _, layer = LAYOUTS["linen stacked einsum"]()
  with pytest.raises(SelectionError, match=f"{layer}: experts \\[{E}\\] are out of range"):
    fl.run(tree, X, interventions=[fl.ablate(fl.experts(layer, E))])
  with pytest.raises(SelectionError, match="out of range"):
    fl.run(tree, X, interventions=[fl.routing(layer, k=K).force(E + 2)])


def test_experts_computed_in_the_layers_own_code_are_refused_with_the_fix():
  tree, _ = _linen(Inline())
  with pytest.raises(
    SelectionError, match="Inline.__call__: flaxlens cannot see into .*'wi'.*submodule"
  ):
    fl.capture(tree, X, at=fl.experts("Inline.__call__"))


def test_a_layer_without_a_router_is_refused_for_routing_only():
  tree, _ = _linen(NoRouter())
  _, cache = fl.capture(tree, X, at=fl.experts("NoRouter.__call__", 0))
  assert cache["NoRouter.__call__:expert 0"].shape == X.shape
  with pytest.raises(SelectionError, match="NoRouter.__call__: no router found.*router='name'"):
    fl.capture(tree, X, at=fl.routing("NoRouter.__call__", k=1))


def test_an_unknown_top_k_is_refused_asking_for_k():
  tree, _, layer = LAYOUTS["linen stacked einsum"]()
  with pytest.raises(FlaxlensError, match="k=n"):
    fl.capture(tree, X, at=fl.routing(layer))
