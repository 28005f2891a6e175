"""Native NNX stand-ins for patched calls: subclasses swapped into a copy of the model.

`swap(module, cls)` turns one module of an `nnx.clone` into an instance of a subclass of
its class whose method is replaced or wrapped, which is how an NNX user would patch a
call by hand. The class survives `nnx.split`/`nnx.merge`, so it applies inside
`nnx.scan` and `nnx.vmap` bodies too.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def swap(module: nnx.Module, cls: type) -> None:
  object.__setattr__(module, "__class__", cls)


class ZeroLinear(nnx.Linear):
  def __call__(self, x):
    return jnp.zeros(x.shape[:-1] + (self.out_features,), x.dtype)


class PlusOneLinear(nnx.Linear):
  def __call__(self, x):
    return super().__call__(x) + 1.0


class PlusOneDropout(nnx.Dropout):
  def __call__(self, x, **kwargs):
    return super().__call__(x, **kwargs) + 1.0
