"""The subjects: each benchmark model in native and converted form, and the calls timed on it.

A `Subject` holds, for one framework and depth, the eager calls and the jitted-function factories
the cases compare, and which ratios they report (`Comparison`). Penzai, the optional
peer, joins the Linen subject when it is installed (`pip install -e ".[bench]"`);
without it `pz` and `pz_unflaxify` are None and its rows say "not installed".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

import flaxlens as fl
from bench.models import Sizes, linen_model, nnx_model, tokens

try:
  from penzai import pz
  from penzai.toolshed import unflaxify as pz_unflaxify
except ImportError:
  pz = pz_unflaxify = None

_JAX_JIT = type(jax.jit(lambda: None))


def is_plain_jit(fn: Callable[..., Any]) -> bool:
  """Whether `fn` is a plain `jax.jit` function, with AOT stages (`lower`, `compile`)."""
  return isinstance(fn, _JAX_JIT)


@dataclasses.dataclass
class Comparison:
  """A ratio to report: contender `top` over contender `bottom`."""

  label: str
  top: str
  bottom: str
  peer: bool = False  # Penzai's ratio, shown for context (no flaxlens target)


@dataclasses.dataclass
class Subject:
  """One model, native and converted, and the calls the cases time on it.

  `jitted` maps a contender name to a factory returning a fresh jitted function and its
  arguments: fresh, so that each compile-time sample really compiles.
  """

  framework: str
  eager: dict[str, Callable[[], Any]]
  eager_comparisons: list[Comparison]
  jitted: dict[str, Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]]
  jit_comparisons: list[Comparison]
  tree: Any
  convert: Callable[[], Any]
  user_arrays: list[Any]
  layers: int
  floor: Callable[[], Any]  # an abstract trace of the native call alone (jax.eval_shape)
  penzai_convert: Callable[[], Any] | None = None
  # NNX: `nnx.eval_shape` of the model's call, which splits the model within its timing
  model_floor: Callable[[], Any] | None = None
  same_program: dict[str, str] = dataclasses.field(default_factory=dict)

  @property
  def name(self) -> str:
    """How rows name the subject: its framework and depth."""
    return f"{self.framework}, {self.layers} layers"


class Subjects(list):
  """The subjects at the main depth (`sizes.layers`), and in `scaled` those at every
  depth of `sizes.scales` (the main ones among them)."""

  def __init__(self, main: list[Subject], scaled: list[Subject]):
    super().__init__(main)
    self.scaled = scaled


def make_subjects(sizes: Sizes, progress: Callable[[str], None]) -> Subjects:
  """Linen and NNX subjects at `sizes.layers` and at each depth of `sizes.scales`."""
  by_depth = {}
  for layers in sorted({sizes.layers, *sizes.scales}):
    progress(f"models and trees, {layers} layers")
    by_depth[layers] = [linen_subject(sizes, layers), nnx_subject(sizes, layers)]
  scaled = [s for layers in sorted(sizes.scales) for s in by_depth[layers]]
  return Subjects(by_depth[sizes.layers], scaled)


def _call_tree(tree: Any, x: jax.Array) -> Any:
  return tree(fl.ArgsAndKwargs.capture(x))


def _stateless_jit(tree: Any, x: jax.Array) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  slots, values = fl.unbind_variables(tree, freeze=True)
  fn = jax.jit(lambda vs, x: slots.stateless_call(vs, fl.ArgsAndKwargs.capture(x))[0])
  return fn, (values, x)


def linen_subject(sizes: Sizes, layers: int | None = None) -> Subject:
  layers = sizes.layers if layers is None else layers
  model, variables = linen_model(sizes, layers)
  x = tokens(sizes)
  tree = fl.unflaxify(model, variables, x)
  eager = {"native": lambda: model.apply(variables, x), "flaxlens": lambda: _call_tree(tree, x)}
  eager_comparisons = [Comparison("tree call / module.apply", "flaxlens", "native")]
  jitted = {
    "native": lambda: (jax.jit(model.apply), (variables, x)),
    "variable_jit": lambda: (fl.variable_jit(_call_tree), (tree, x)),
    "stateless_call": lambda: _stateless_jit(tree, x),
    "frozen_tree": lambda: (jax.jit(_call_tree), (fl.freeze_variables(tree), x)),
  }
  jit_comparisons = [
    Comparison("fl.variable_jit(tree call) / jax.jit(module.apply)", "variable_jit", "native"),
    Comparison("jax.jit(tree.stateless_call) / jax.jit(module.apply)", "stateless_call", "native"),
    Comparison("jax.jit(f)(frozen tree, x) / jax.jit(module.apply)", "frozen_tree", "native"),
  ]
  penzai_convert = None
  if pz is not None:
    pz_tree = pz_unflaxify.unflaxify_apply(model, variables, x)
    penzai_convert = lambda: pz_unflaxify.unflaxify_apply(model, variables, x)  # noqa: E731
    capture = pz_unflaxify.ArgsAndKwargs.capture
    eager["penzai"] = lambda: pz_tree(capture(x))
    eager_comparisons.append(
      Comparison("Penzai tree call / module.apply", "penzai", "native", peer=True)
    )

    def penzai() -> tuple[Callable[..., Any], tuple[Any, ...]]:
      slots, values = pz.unbind_variables(pz_tree, freeze=True)
      return jax.jit(lambda vs, x: slots.stateless_call(vs, capture(x))[0]), (values, x)

    jitted["penzai"] = penzai
    jit_comparisons.append(
      Comparison(
        "Penzai jax.jit(stateless_call) / jax.jit(module.apply)", "penzai", "native", peer=True
      )
    )
  return Subject(
    "Linen",
    eager,
    eager_comparisons,
    jitted,
    jit_comparisons,
    tree,
    lambda: fl.unflaxify(model, variables, x),
    jax.tree_util.tree_leaves(variables),
    layers,
    lambda: jax.eval_shape(lambda v, x: model.apply(v, x), variables, x),
    penzai_convert=penzai_convert,
  )


def nnx_subject(sizes: Sizes, layers: int | None = None) -> Subject:
  layers = sizes.layers if layers is None else layers
  model = nnx_model(sizes, layers)
  x = tokens(sizes)
  tree = fl.unflaxify(model, x)
  graphdef, state = nnx.split(model)
  return Subject(
    "NNX",
    {"native": lambda: model(x), "flaxlens": lambda: _call_tree(tree, x)},
    [Comparison("tree call / model call", "flaxlens", "native")],
    {
      "nnx.jit": lambda: (nnx.jit(lambda m, x: m(x)), (model, x)),
      "variable_jit": lambda: (fl.variable_jit(_call_tree), (tree, x)),
      "jax.jit+merge": lambda: (jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)), (state, x)),
      "stateless_call": lambda: _stateless_jit(tree, x),
      "frozen_tree": lambda: (jax.jit(_call_tree), (fl.freeze_variables(tree), x)),
    },
    [
      Comparison("fl.variable_jit(tree call) / nnx.jit(model call)", "variable_jit", "nnx.jit"),
      Comparison(
        "jax.jit(tree.stateless_call) / jax.jit(merge + call)", "stateless_call", "jax.jit+merge"
      ),
      Comparison(
        "jax.jit(f)(frozen tree, x) / jax.jit(merge + call)", "frozen_tree", "jax.jit+merge"
      ),
    ],
    tree,
    lambda: fl.unflaxify(model, x),
    jax.tree_util.tree_leaves(state),
    layers,
    lambda: jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, x),
    model_floor=lambda: nnx.eval_shape(lambda m, x: m(x), model, x),
  )


def per_subject(
  name: str, measure_one: Callable[[Subject, Sizes], list[Any]], scaled: bool = False
) -> Any:
  """A case's `measure`: `measure_one(subject, sizes)` for each subject, in order (with
  `scaled`, for the subjects at every depth of `sizes.scales`)."""

  def measure(subjects: Subjects, sizes: Sizes, progress: Callable[[str], None]) -> list:
    rows = []
    for subject in subjects.scaled if scaled else subjects:
      progress(f"{name}, {subject.name}")
      rows += measure_one(subject, sizes)
    return rows

  return measure
