"""`unflaxify`: the one entry point that converts a Linen or an NNX model into a tree."""

from __future__ import annotations

from typing import Any

from flaxlens.errors import ArgumentError
from flaxlens.linen._adapter import LINEN
from flaxlens.nnx._adapter import NNX

ADAPTERS = (LINEN, NNX)  # The Flax APIs `unflaxify` converts, each registered on import.


def unflaxify(model: Any, *args: Any, **kwargs: Any) -> Any:
  """Converts a Flax model into an explicit tree of its calls.

  Linen: `unflaxify(module, variables, *example_args, method=None, rngs=None,
  mutable=False, capture_intermediates=False, **example_kwargs)` returns an
  `InterceptedFlaxModuleMethod` whose call reproduces `module.apply` bit for bit.

  NNX: `unflaxify(module, *example_args, method="__call__", **example_kwargs)` returns
  an `InterceptedNNXModuleMethod` whose call reproduces `getattr(module, method)(...)`
  bit for bit, state updates included, on a private copy: the module is never
  modified. `method` may also be a function taking the module first.

  Args:
    model: an unbound `flax.linen.Module`, or a `flax.nnx.Module`.
    *args: for Linen, the variables then the example positional arguments; for NNX,
      the example positional arguments.
    **kwargs: conversion options and example keyword arguments.

  Returns:
    The root node of the converted tree.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Dense(3)
    >>> x = jnp.ones((2, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> tree = fl.unflaxify(model, variables, x)
    >>> bool((tree(fl.ArgsAndKwargs.capture(x)) == model.apply(variables, x)).all())
    True

    An NNX model converts from itself and its example arguments:

    >>> from flax import nnx
    >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> tree = fl.unflaxify(model, x)
    >>> bool((tree(fl.ArgsAndKwargs.capture(x)) == model(x)).all())
    True
  """
  adapter = next((a for a in ADAPTERS if a.accepts(model)), None)
  if adapter is None:
    raise ArgumentError(
      f"unflaxify expects a flax.linen.Module (with its variables) or a flax.nnx.Module,"
      f" got {type(model).__name__}."
    )
  return adapter.convert(model, *args, **kwargs)
