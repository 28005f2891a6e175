"""The Linen fidelity corpus: small models that exercise one Flax feature each.

Each `Case` carries everything `module.apply` needs; tests compare the converted tree
against that native call. Built lazily (`build()`), so importing costs nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

KEY = jax.random.key(0)


@dataclasses.dataclass
class Case:
  name: str
  module: nn.Module
  variables: dict[str, Any]
  args: tuple[Any, ...]
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  method: Any = None
  rngs: Any = None
  mutable: Any = False
  capture_intermediates: Any = False

  def apply(self, variables=None, rngs=None, **kwargs):
    return self.module.apply(
      self.variables if variables is None else variables,
      *self.args,
      method=self.method,
      rngs=self.rngs if rngs is None else rngs,
      mutable=self.mutable,
      capture_intermediates=self.capture_intermediates,
      **{**self.kwargs, **kwargs},
    )


def _init(module, *args, method=None, **kwargs):
  return module.init(
    {"params": jax.random.key(1), "dropout": jax.random.key(2)}, *args, method=method, **kwargs
  )


X = jax.random.normal(jax.random.key(3), (2, 8))
IMG = jax.random.normal(jax.random.key(4), (2, 8, 8, 3))
TOKENS = jnp.array([[1, 5, 2, 7], [3, 3, 0, 1]])


class MLP(nn.Module):
  features: Sequence[int] = (16, 4)

  @nn.compact
  def __call__(self, x):
    for f in self.features[:-1]:
      x = nn.relu(nn.Dense(f)(x))
    return nn.Dense(self.features[-1])(x)


class SetupMLP(nn.Module):
  def setup(self):
    self.hidden = nn.Dense(16)
    self.out = nn.Dense(4)

  def __call__(self, x):
    return self.out(nn.gelu(self.hidden(x)))


class SharedParent(nn.Module):
  """One Dense, created in setup, used by two child calls."""

  def setup(self):
    self.shared = nn.Dense(8)

  def __call__(self, x):
    return self.shared(nn.relu(self.shared(x)))


class Holder(nn.Module):
  inner: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.inner(x) * 2.0


class PassedAttribute(nn.Module):
  """A module passed as an attribute to two children (shared weights)."""

  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(8, name="shared")
    return Holder(shared)(x) + Holder(shared)(x)


class DropNormHolder(nn.Module):
  """Calls a Dropout and a BatchNorm it is handed, after a Dense of its own."""

  drop: nn.Module
  norm: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.drop(self.norm(nn.Dense(8)(x), use_running_average=False), deterministic=False)


class HandedModules(nn.Module):
  """A Dropout and a BatchNorm made in setup, handed to two children: they stay bound here."""

  def setup(self):
    self.drop = nn.Dropout(0.5)
    self.norm = nn.BatchNorm(momentum=0.9)
    self.first = DropNormHolder(self.drop, self.norm)
    self.second = DropNormHolder(self.drop, self.norm)

  def __call__(self, x):
    return self.second(self.first(x))


class Counter(nn.Module):
  @nn.compact
  def __call__(self, x):
    count = self.variable("counter", "count", lambda: jnp.zeros((), jnp.int32))
    consts = self.variable("constants", "scale", lambda: jnp.full((), 3.0))
    count.value += 1
    return x * consts.value + count.value


class BatchNormNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(4, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.relu(x).mean(axis=(1, 2))


class DropoutNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16)(x)
    x = nn.Dropout(0.5, deterministic=not train)(x)
    x = nn.Dense(16)(x)
    x = nn.Dropout(0.3)(x, deterministic=not train)
    return x


class EncoderDecoder(nn.Module):
  def setup(self):
    self.embed = nn.Embed(10, 8)
    self.proj = nn.Dense(8)

  def encode(self, tokens):
    return self.proj(self.embed(tokens))

  def decode(self, h):
    return self.embed.attend(h)

  def __call__(self, tokens):
    return self.decode(self.encode(tokens))


class Scale(nn.Module):
  factor: float

  def __call__(self, x):
    return x * self.factor


class Branchy(nn.Module):
  """Takes one of two branches by a Python argument; init creates both."""

  @nn.compact
  def __call__(self, x, mode: str = "a"):
    a, b = nn.Dense(8, name="a"), nn.Dense(8, name="b")
    if self.is_initializing():
      b(x)
    x = a(x) if mode == "a" else b(x)
    return Scale(2.0 if mode == "a" else 3.0)(x)


class Sower(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8)(x)
    self.sow("intermediates", "hidden", h)
    return nn.Dense(2)(h)


class Cached(nn.Module):
  """Creates its cache on the first apply (as decoders do), then updates it."""

  @nn.compact
  def __call__(self, x):
    is_new = not self.has_variable("cache", "total")
    total = self.variable("cache", "total", lambda: jnp.zeros(x.shape[-1]))
    if not is_new:
      total.value = total.value + x.sum(axis=0)
    return nn.Dense(4)(x) + total.value.sum()


class Perturbed(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8)(x)
    h = self.perturb("hidden", h)
    return nn.Dense(2)(h)


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, carry, _):
    return nn.relu(nn.Dense(8)(carry)) + carry, None


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    layers = nn.scan(
      ScanBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=3,
    )(name="layers")
    x, _ = layers(x, None)
    return x


class Vmapped(nn.Module):
  @nn.compact
  def __call__(self, x):
    ensemble = nn.vmap(
      nn.Dense,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=None,
      axis_size=3,
    )(4, name="ensemble")
    return ensemble(x)


class Remat(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat(MLP)(name="mlp")(x)


class Jitted(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.jit(MLP)(name="mlp")(x)


class RNNModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.RNN(nn.LSTMCell(6), name="rnn")(x)


class Partitioned(nn.Module):
  @nn.compact
  def __call__(self, x):
    kernel = self.param(
      "kernel",
      nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")),
      (x.shape[-1], 4),
    )
    return x @ kernel


class LogicalBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    bias = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp",))
    return nn.Dense(x.shape[-1], kernel_init=init, bias_init=bias)(x), None


class LogicallyPartitionedScan(nn.Module):
  """Boxed parameters (`nn.LogicallyPartitioned`) stacked by `nn.scan` (a "layers" axis)."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(
      LogicalBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=2,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return stack(name="stack")(x, None)[0]


class TransformerBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h, h)
    h = nn.LayerNorm()(x)
    return x + nn.Dense(8)(nn.gelu(nn.Dense(16)(h)))


class Transformer(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(10, 8)(tokens)
    for _ in range(2):
      x = TransformerBlock()(x)
    return nn.Dense(10)(nn.LayerNorm()(x))


class WeightNormed(nn.Module):
  """`nn.WeightNorm` names its parameter "Dense_0/kernel/scale": one key holding "/"."""

  @nn.compact
  def __call__(self, x):
    return nn.WeightNorm(nn.Dense(8))(nn.relu(nn.WeightNorm(nn.Dense(8))(x)))


class SpectralNormed(nn.Module):
  """`nn.SpectralNorm` keeps "Dense_0/kernel/u" and ".../sigma" in `batch_stats`."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.SpectralNorm(nn.Dense(8))(x, update_stats=train)
    return nn.SpectralNorm(nn.Dense(4), n_steps=2)(nn.relu(x), update_stats=train)


class PositionTable(nn.Module):
  """Learned position embeddings: a table of `length` rows, added to the first `n`."""

  length: int
  features: int

  @nn.compact
  def __call__(self, x, n):
    table = self.param("table", nn.initializers.normal(0.02), (self.length, self.features))
    return x + table[:n]


class Positional(nn.Module):
  """Token ids `(batch, length)` with positions from a table of 8, as GPT-2 embeds them:
  1-D ids, or more than 8 positions, fail inside the model."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(10, 8)(tokens)
    return nn.Dense(10)(PositionTable(8, 8)(x, tokens.shape[1]))


def _case(name, module, *args, init_kwargs=None, **fields) -> Case:
  init_kwargs = init_kwargs if init_kwargs is not None else fields.get("kwargs", {})
  variables = _init(module, *args, method=fields.get("method"), **init_kwargs)
  return Case(name, module, dict(variables), args, **fields)


def _sow_existing() -> Case:
  case = _case("sow_existing_collection", Sower(), X, mutable=["intermediates"])
  _, sown = case.apply()
  case.variables = {**case.variables, **sown}
  return case


def _created_during_apply() -> Case:
  case = _case("created_during_apply", Cached(), X, mutable=["cache"])
  case.variables = {"params": case.variables["params"]}
  return case


# Keyword arguments of further calls, other than at conversion, compared as well.
CALL_KWARGS: dict[str, Sequence[dict[str, Any]]] = {
  "batchnorm_train": ({"train": False},),
  "batchnorm_eval": ({"train": True},),
  "dropout": ({"train": False},),
  "branch": ({"mode": "b"},),
  "spectral_norm_train": ({"train": False},),
}


def build() -> dict[str, Case]:
  """All corpus cases, keyed by name."""
  builders: list[Callable[[], Case]] = [
    lambda: _case("mlp", MLP(), X),
    lambda: _case("setup_mlp", SetupMLP(), X),
    lambda: _case("shared_child_called_twice", SharedParent(), X),
    lambda: _case("passed_attribute", PassedAttribute(), X),
    lambda: _case(
      "handed_modules",
      HandedModules(),
      X,
      rngs={"dropout": jax.random.key(7)},
      mutable=["batch_stats"],
    ),
    lambda: _case("collections", Counter(), X, mutable=["counter"]),
    lambda: _case(
      "batchnorm_train",
      BatchNormNet(),
      IMG,
      kwargs={"train": True},
      mutable=["batch_stats"],
      init_kwargs={"train": False},
    ),
    lambda: _case(
      "batchnorm_eval",
      BatchNormNet(),
      IMG,
      kwargs={"train": False},
      init_kwargs={"train": False},
      mutable=["batch_stats"],
    ),
    lambda: _case(
      "dropout",
      DropoutNet(),
      X,
      rngs={"dropout": jax.random.key(7)},
    ),
    lambda: _case("single_key_rngs", DropoutNet(), X, rngs=jax.random.key(7)),
    lambda: _case("method_encode", EncoderDecoder(), TOKENS, method="encode"),
    lambda: _case("self_method_calls", EncoderDecoder(), TOKENS),
    lambda: _case(
      "method_function",
      EncoderDecoder(),
      TOKENS,
      method=lambda m, t: m.decode(m.encode(t) * 2.0),
      init_kwargs={},
    ),
    lambda: _case("sequential", nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)]), X),
    lambda: _case("branch", Branchy(), X, kwargs={"mode": "a"}),
    lambda: _case("sow_new_collection", Sower(), X, mutable=["intermediates"]),
    _sow_existing,
    _created_during_apply,
    lambda: _case("perturb", Perturbed(), X, mutable=["perturbations"]),
    lambda: _case("capture_intermediates", MLP(), X, capture_intermediates=True),
    lambda: _case("scan", Scanned(), X),
    lambda: _case("vmap", Vmapped(), X),
    lambda: _case("remat", Remat(), X),
    lambda: _case("jit", Jitted(), X),
    lambda: _case("rnn_lstm", RNNModel(), jnp.ones((2, 5, 3))),
    lambda: _case("partitioned", Partitioned(), X),
    lambda: _case("logically_partitioned_scan", LogicallyPartitionedScan(), X),
    lambda: _case("transformer", Transformer(), TOKENS),
    lambda: _case("weight_norm", WeightNormed(), X),
    lambda: _case(
      "spectral_norm_train",
      SpectralNormed(),
      X,
      kwargs={"train": True},
      mutable=["batch_stats"],
    ),
    # Not in NAMES: for the tests of calls that fail inside the model (test_call_failures).
    lambda: _case("positional", Positional(), TOKENS),
  ]
  cases = [b() for b in builders]
  return {c.name: c for c in cases}


NAMES = [
  "mlp",
  "setup_mlp",
  "shared_child_called_twice",
  "passed_attribute",
  "handed_modules",
  "collections",
  "batchnorm_train",
  "batchnorm_eval",
  "dropout",
  "single_key_rngs",
  "method_encode",
  "self_method_calls",
  "method_function",
  "sequential",
  "branch",
  "sow_new_collection",
  "sow_existing_collection",
  "created_during_apply",
  "perturb",
  "capture_intermediates",
  "scan",
  "vmap",
  "remat",
  "jit",
  "rnn_lstm",
  "partitioned",
  "logically_partitioned_scan",
  "transformer",
  "weight_norm",
  "spectral_norm_train",
]
