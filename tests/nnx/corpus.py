"""The NNX fidelity corpus: small models that exercise one NNX feature each.

Each `Case` carries a model and the arguments of one call; tests compare the converted
tree against calling (a copy of) the model natively. Built lazily (`build()`), so
importing costs nothing. Cases never mutate their model: native calls run on
`nnx.clone`s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

X = jax.random.normal(jax.random.key(3), (2, 4))
IMG = jax.random.normal(jax.random.key(4), (2, 6, 6, 3))
TOKENS = jnp.array([[1, 5, 2, 7], [3, 3, 0, 1]])


@dataclasses.dataclass
class Case:
  name: str
  model: nnx.Module
  args: tuple[Any, ...]
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  method: Any = "__call__"

  def fresh_arguments(self, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments, with NNX objects in them (an `nnx.Rngs`) copied."""
    return jax.tree_util.tree_map(lambda x: x, (self.args, {**self.kwargs, **kwargs}))

  def native(self, model: nnx.Module, **kwargs: Any) -> Any:
    """Calls `model` (a copy of `self.model`) as the tree is called."""
    args, kwargs = self.fresh_arguments(**kwargs)
    if isinstance(self.method, str):
      return getattr(model, self.method)(*args, **kwargs)
    return self.method(model, *args, **kwargs)


RNGS = functools.partial(nnx.Rngs, 0, dropout=1)


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


class ConvNet(nnx.Module):
  """Conv + BatchNorm + Dropout; train/eval mode lives in the modules' attributes."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    x = self.drop(nnx.relu(self.norm(self.conv(x))))
    return self.head(x.mean(axis=(1, 2)))


class FlagNet(nnx.Module):
  """BatchNorm and Dropout switched by a call-time flag."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)

  def __call__(self, x, train: bool = True):
    x = self.norm(self.linear(x), use_running_average=not train)
    return self.drop(x, deterministic=not train)


class Holder(nnx.Module):
  def __init__(self, inner: nnx.Module, scale: float):
    self.inner = inner
    self.scale = scale

  def __call__(self, x):
    return self.inner(x) * self.scale


class SharedChild(nnx.Module):
  """One Linear held by two parents."""

  def __init__(self, rngs: nnx.Rngs):
    shared = nnx.Linear(4, 4, rngs=rngs)
    self.first = Holder(shared, 2.0)
    self.second = Holder(shared, 3.0)

  def __call__(self, x):
    return self.second(nnx.relu(self.first(x)))


class DropNormHolder(nnx.Module):
  def __init__(self, drop: nnx.Module, norm: nnx.Module, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.drop = drop
    self.norm = norm

  def __call__(self, x):
    return self.drop(self.norm(self.linear(x)))


class HandedModules(nnx.Module):
  """A Dropout with its own `nnx.Rngs` and a BatchNorm, held by two parents."""

  def __init__(self, rngs: nnx.Rngs):
    drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=11))
    norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
    self.first = DropNormHolder(drop, norm, rngs)
    self.second = DropNormHolder(drop, norm, rngs)

  def __call__(self, x):
    return self.second(self.first(x))


class CalledTwice(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return self.linear(nnx.tanh(self.linear(x)))


class Stack(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])

  def __call__(self, x):
    for layer in self.layers:
      x = nnx.relu(layer(x))
    return x


class EncoderDecoder(nnx.Module):
  """Methods that call other methods of the same module."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(10, 8, rngs=rngs)
    self.proj = nnx.Linear(8, 8, rngs=rngs)

  def encode(self, tokens):
    return self.proj(self.embed(tokens))

  def decode(self, h):
    return self.embed.attend(h)

  def __call__(self, tokens):
    return self.decode(self.encode(tokens))


class MyLinear(nnx.Linear):
  """Inherits `__call__` only: `nnx.capture(method_outputs=...)` does not see it."""


class InheritedOnly(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.first = MyLinear(4, 8, rngs=rngs)
    self.second = MyLinear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.second(nnx.gelu(self.first(x)))


class Probed(nnx.Module):
  """`sow` and `perturb`, meant to run inside `nnx.capture`."""

  def __init__(self, rngs: nnx.Rngs):
    self.first = nnx.Linear(4, 8, rngs=rngs)
    self.second = nnx.Linear(8, 2, rngs=rngs)

  def features(self, x):
    h = self.first(x)
    self.sow(nnx.Intermediate, "hidden", h)
    return self.perturb("delta", h)

  def __call__(self, x):
    return self.second(nnx.relu(self.features(x)))


def captured(model, x):
  """`nnx.capture` with sown values, perturbations and every method's output."""
  return nnx.capture(model, nnx.Intermediate, nnx.Perturbation, method_outputs=nnx.Intermediate)(x)


class Sower(nnx.Module):
  """`sow` outside `nnx.capture`: the first call creates the variable, later ones grow it."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    h = self.linear(x)
    self.sow(nnx.Intermediate, "hidden", h)
    return h * 2.0


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(nnx.relu(self.linear(x)))


class Scanned(nnx.Module):
  """`nnx.scan` over 4 stacked blocks (their variables have a leading axis of 4)."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Block(rngs)

    self.blocks = create(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return forward(x, self.blocks)


class Ensemble(nnx.Module):
  """`nnx.vmap` over 3 members, each a Linear."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return nnx.Linear(4, 2, rngs=rngs)

    self.members = create(rngs)

  def __call__(self, x):
    return nnx.vmap(lambda member, x: member(x), in_axes=(0, None))(self.members, x)


class Rematted(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.block = Block(rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    x = nnx.remat(lambda block, x: block(x))(self.block, x)
    return self.out(x)


@nnx.jit
def _jitted_block(block, x):
  return block(x)


class Jitted(nnx.Module):
  """A module-level `nnx.jit` function inside the call (its trace cache persists)."""

  def __init__(self, rngs: nnx.Rngs):
    self.block = Block(rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(_jitted_block(self.block, x))


class JitMethod(nnx.Module):
  """`__call__` decorated with `nnx.jit`: the whole call is one jitted trace."""

  def __init__(self, rngs: nnx.Rngs):
    self.block = Block(rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  @nnx.jit
  def __call__(self, x):
    return self.out(self.block(x))


class Bridged(nnx.Module):
  """Linen modules inside an NNX model through `nnx.bridge.ToNNX`."""

  def __init__(self, rngs: nnx.Rngs):
    self.dense = nnx.bridge.lazy_init(nnx.bridge.ToNNX(nn.Dense(8), rngs=rngs), X)
    self.linear = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.linear(nnx.relu(self.dense(x)))


class LinenNormed(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.BatchNorm(use_running_average=False, momentum=0.8, name="bn")(nn.Dense(8)(x))


class BridgedBatchStats(nnx.Module):
  """Linen BatchNorm in training mode through `nnx.bridge.ToNNX`, `mutable=["batch_stats"]`.

  The bridge stores a nested Linen collection as a dict of NNX variables marked as data.
  """

  def __init__(self, rngs: nnx.Rngs):
    self.bn = nnx.bridge.ToNNX(nn.BatchNorm(use_running_average=False), rngs=rngs)
    nnx.bridge.lazy_init(self.bn, X)
    self.net = nnx.bridge.lazy_init(nnx.bridge.ToNNX(LinenNormed(), rngs=rngs), X)

  def __call__(self, x):
    return self.net(self.bn(x, mutable=["batch_stats"]), mutable=["batch_stats"])


class LinenWeightNormed(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.WeightNorm(nn.Dense(4))(x)


class BridgedWeightNorm(nnx.Module):
  """`nn.WeightNorm` through the bridge: an NNX path key "Dense_0/kernel/scale"."""

  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.bridge.lazy_init(nnx.bridge.ToNNX(LinenWeightNormed(), rngs=rngs), X)

  def __call__(self, x):
    return self.norm(x)


class Configured(nnx.Module):
  """Static attributes NNX cannot hash: a dict of settings and a list."""

  def __init__(self, rngs: nnx.Rngs):
    self.config = {"scale": 0.5, "activation": "gelu"}
    self.widths = [4, 4]
    self.linear = nnx.Linear(4, self.widths[-1], rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    activation = getattr(nnx, self.config["activation"])
    return self.drop(activation(self.linear(x))) * self.config["scale"]


class ByModules(nnx.Module):
  """Finds the layers to call with `nnx.iter_modules`."""

  def __init__(self, rngs: nnx.Rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    for _, module in nnx.iter_modules(self):
      if isinstance(module, nnx.Linear):
        x = module(x)
    return x


class Branchy(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x, mode: str = "a"):
    return self.a(x) if mode == "a" else self.b(x)


class RngsArgument(nnx.Module):
  """Dropout whose keys come from an `nnx.Rngs` passed to the call."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs: nnx.Rngs):
    return self.drop(self.linear(x), rngs=rngs)


class Annotated(nnx.Module):
  """Variables carrying metadata of their own (NNX keeps it on the `Variable`)."""

  def __init__(self, rngs: nnx.Rngs):
    projection = nnx.with_metadata(nnx.initializers.lecun_normal(), role="projection")
    self.linear = nnx.Linear(4, 2, kernel_init=projection, rngs=rngs)
    self.scale = nnx.Param(jnp.full((2,), 1.5), role="scale", axes=("features",))

  def __call__(self, x):
    return self.linear(x) * self.scale[...]


class Recounted(nnx.Module):
  """Replaces its `calls` variable with a new object at every call, and counts in it."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 2, rngs=rngs)
    self.calls = nnx.BatchStat(jnp.zeros(()))

  def __call__(self, x):
    self.calls = nnx.BatchStat(self.calls[...] + 1.0)
    return self.linear(x) * self.calls[...]


class TransformerBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(8, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
    )
    self.mlp_norm = nnx.LayerNorm(8, rngs=rngs)
    self.up = nnx.Linear(8, 16, rngs=rngs)
    self.down = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    h = self.attention_norm(x)
    x = x + self.attention(h)
    return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class Transformer(nnx.Module):
  """The NNX counterpart of the Linen corpus's `Transformer` (attention with its `out`
  projection taking `(..., heads, head_dim)`)."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(10, 8, rngs=rngs)
    self.blocks = nnx.List([TransformerBlock(rngs) for _ in range(2)])
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


class PositionTable(nnx.Module):
  """Learned position embeddings: a table of `length` rows, added to the first `n`."""

  def __init__(self, length: int, features: int, rngs: nnx.Rngs):
    self.table = nnx.Param(0.02 * jax.random.normal(rngs.params(), (length, features)))

  def __call__(self, x, n):
    return x + self.table[...][:n]


class Positional(nnx.Module):
  """The NNX counterpart of the Linen corpus's `Positional` (a table of 8 positions)."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(10, 8, rngs=rngs)
    self.positions = PositionTable(8, 8, rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, tokens):
    return self.head(self.positions(self.embed(tokens), tokens.shape[1]))


def _mha(decode: bool) -> nnx.MultiHeadAttention:
  mha = nnx.MultiHeadAttention(
    num_heads=2, in_features=8, qkv_features=8, decode=decode, rngs=RNGS()
  )
  if decode:
    mha.init_cache((2, 3, 8))
  return mha


def _eval(model: nnx.Module) -> nnx.Module:
  model.eval()
  return model


FLAX_RELEASE = tuple(int(part) for part in flax.__version__.split(".")[:3])
# Cases whose model or call uses an NNX API that older Flax releases lack (the
# `nnx.iter_modules` function: 0.12.1, `nnx.view`: 0.12.4, `nnx.with_attributes` and
# `nnx.capture`: 0.12.6), with that release: on older Flax they are left out of
# `build()`, and a test asking for one is skipped, saying why.
NEEDS_RELEASE = {
  "iter_modules": (0, 12, 1),
  "view": (0, 12, 4),
  "with_attributes": (0, 12, 6),
  "capture_sow_perturb": (0, 12, 6),
}


class Cases(dict):
  """The built cases by name; asking for one the installed Flax cannot build skips the test."""

  def __missing__(self, name: str) -> Case:
    if name in NEEDS_RELEASE:
      release = ".".join(map(str, NEEDS_RELEASE[name]))
      pytest.skip(f"the NNX corpus case {name!r} needs flax {release} or newer")
    raise KeyError(name)


def build() -> dict[str, Case]:
  """All corpus cases, keyed by name (those the installed Flax can build: `NEEDS_RELEASE`)."""
  step = jax.random.normal(jax.random.key(5), (2, 1, 8))
  builders: list[Callable[[], Case]] = [
    lambda: Case("mlp", MLP(RNGS()), (X,)),
    lambda: Case("convnet_train", ConvNet(RNGS()), (IMG,)),
    lambda: Case("convnet_eval", _eval(ConvNet(RNGS())), (IMG,)),
    lambda: Case("call_time_flags", FlagNet(RNGS()), (X,), {"train": True}),
    lambda: Case("shared_submodule", SharedChild(RNGS()), (X,)),
    lambda: Case("handed_modules", HandedModules(RNGS()), (X,)),
    lambda: Case("called_twice", CalledTwice(RNGS()), (X,)),
    lambda: Case("list", Stack(RNGS()), (X,)),
    lambda: Case(
      "sequential",
      nnx.Sequential(nnx.Linear(4, 8, rngs=RNGS()), nnx.relu, nnx.Linear(8, 2, rngs=RNGS())),
      (X,),
    ),
    lambda: Case("self_method_calls", EncoderDecoder(RNGS()), (TOKENS,)),
    lambda: Case("method_encode", EncoderDecoder(RNGS()), (TOKENS,), method="encode"),
    lambda: Case("inherited_call", InheritedOnly(RNGS()), (X,)),
    lambda: Case("capture_sow_perturb", Probed(RNGS()), (X,), method=captured),
    lambda: Case("sow_outside_capture", Sower(RNGS()), (X,)),
    lambda: Case("attention_decode", _mha(decode=True), (step,)),
    lambda: Case("attention_init_cache", _mha(decode=False), ((2, 3, 8),), method="init_cache"),
    lambda: Case("scan", Scanned(RNGS()), (X,)),
    lambda: Case("vmap_ensemble", Ensemble(RNGS()), (X,)),
    lambda: Case("remat", Rematted(RNGS()), (X,)),
    lambda: Case("nnx_jit_inside", Jitted(RNGS()), (X,)),
    lambda: Case("jit_method", JitMethod(RNGS()), (X,)),
    lambda: Case("linen_bridge", Bridged(RNGS()), (X,)),
    lambda: Case("linen_bridge_batch_stats", BridgedBatchStats(RNGS()), (X,)),
    lambda: Case("linen_bridge_weight_norm", BridgedWeightNorm(RNGS()), (X,)),
    lambda: Case("unhashable_static_attributes", Configured(RNGS()), (X,)),
    lambda: Case("iter_modules", ByModules(RNGS()), (X,)),
    lambda: Case("view", nnx.view(ConvNet(RNGS()), deterministic=True), (IMG,)),
    lambda: Case(
      "with_attributes",
      nnx.with_attributes(ConvNet(RNGS()), use_running_average=True),
      (IMG,),
    ),
    lambda: Case("branch", Branchy(RNGS()), (X,), {"mode": "a"}),
    lambda: Case("rngs_argument", RngsArgument(RNGS()), (X,), {"rngs": nnx.Rngs(dropout=9)}),
    lambda: Case("variable_metadata", Annotated(RNGS()), (X,)),
    lambda: Case("variable_replaced_by_the_call", Recounted(RNGS()), (X,)),
    # Not in NAMES: for the tests of calls that fail inside the model (test_call_failures).
    lambda: Case("positional", Positional(RNGS()), (TOKENS,)),
    # Not in NAMES: the counterpart of Linen's "transformer", for lenses (test_lens).
    lambda: Case("transformer", Transformer(RNGS()), (TOKENS,)),
  ]
  cases = Cases()
  for name, build_case in zip([*NAMES, "positional", "transformer"], builders, strict=True):
    if FLAX_RELEASE >= NEEDS_RELEASE.get(name, FLAX_RELEASE):
      cases[name] = build_case()
      assert cases[name].name == name, "the builders are in the order of NAMES"
  return cases


NAMES = [
  "mlp",
  "convnet_train",
  "convnet_eval",
  "call_time_flags",
  "shared_submodule",
  "handed_modules",
  "called_twice",
  "list",
  "sequential",
  "self_method_calls",
  "method_encode",
  "inherited_call",
  "capture_sow_perturb",
  "sow_outside_capture",
  "attention_decode",
  "attention_init_cache",
  "scan",
  "vmap_ensemble",
  "remat",
  "nnx_jit_inside",
  "jit_method",
  "linen_bridge",
  "linen_bridge_batch_stats",
  "linen_bridge_weight_norm",
  "unhashable_static_attributes",
  "iter_modules",
  "view",
  "with_attributes",
  "branch",
  "rngs_argument",
  "variable_metadata",
  "variable_replaced_by_the_call",
]
# Keyword arguments of other calls (another flag value, say), compared as well.
CALL_KWARGS: dict[str, Sequence[dict[str, Any]]] = {
  "call_time_flags": ({"train": False},),
  "branch": ({"mode": "b"},),
}
