"""The subjects: each benchmark model in native and converted form, and the calls timed on it.

A `Subject` holds, for one framework, the eager calls and the jitted-function factories
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
  same_program: dict[str, str] = dataclasses.field(default_factory=dict)


def _call_tree(tree: Any, x: jax.Array) -> Any:
  return tree(fl.ArgsAndKwargs.capture(x))


def _stateless_jit(tree: Any, x: jax.Array) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  slots, values = fl.unbind_variables(tree, freeze=True)
  fn = jax.jit(lambda vs, x: slots.stateless_call(vs, fl.ArgsAndKwargs.capture(x))[0])
  return fn, (values, x)


def linen_subject(sizes: Sizes) -> Subject:
  model, variables = linen_model(sizes, sizes.layers)
  x = tokens(sizes)
  tree = fl.unflaxify(model, variables, x)
  eager = {"native": lambda: model.apply(variables, x), "flaxlens": lambda: _call_tree(tree, x)}
  eager_comparisons = [Comparison("tree call / module.apply", "flaxlens", "native")]
  jitted = {
    "native": lambda: (jax.jit(model.apply), (variables, x)),
    "variable_jit": lambda: (fl.variable_jit(_call_tree), (tree, x)),
    "stateless_call": lambda: _stateless_jit(tree, x),
  }
  jit_comparisons = [
    Comparison("fl.variable_jit(tree call) / jax.jit(module.apply)", "variable_jit", "native"),
    Comparison("jax.jit(tree.stateless_call) / jax.jit(module.apply)", "stateless_call", "native"),
  ]
  if pz is not None:
    pz_tree = pz_unflaxify.unflaxify_apply(model, variables, x)
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
  )


def nnx_subject(sizes: Sizes) -> Subject:
  model = nnx_model(sizes)
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
    },
    [
      Comparison("fl.variable_jit(tree call) / nnx.jit(model call)", "variable_jit", "nnx.jit"),
      Comparison(
        "jax.jit(tree.stateless_call) / jax.jit(merge + call)", "stateless_call", "jax.jit+merge"
      ),
    ],
    tree,
    lambda: fl.unflaxify(model, x),
    jax.tree_util.tree_leaves(state),
  )


def per_subject(name: str, measure_one: Callable[[Subject, Sizes], list[Any]]) -> Any:
  """A case's `measure`: `measure_one(subject, sizes)` for each subject, in order."""

  def measure(subjects: list[Subject], sizes: Sizes, progress: Callable[[str], None]) -> list:
    rows = []
    for subject in subjects:
      progress(f"{name}, {subject.framework}")
      rows += measure_one(subject, sizes)
    return rows

  return measure
