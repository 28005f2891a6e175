"""The activation functions of a dictionary: ReLU, JumpReLU, TopK and BatchTopK.

An activation maps a dictionary's pre-activations (`[..., width]`, or `[layers, ...,
width]` for a cross-layer transcoder) to its features. Each is a small NNX module, so its
call is a site of a spliced dictionary (capture, ablate or steer the features there) and
its learned state (JumpReLU's threshold, BatchTopK's running threshold) is a variable like
any other. JumpReLU trains its threshold through a straight-through estimator
(`jump_relu`, `heaviside`: a rectangle kernel of width `bandwidth` around the threshold),
as in the JumpReLU SAE paper. An activation of one's own implements `Activation`. No Flax
internals here.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxlens.errors import ArgumentError

ACTIVATIONS = ("relu", "jumprelu", "topk", "batchtopk")


@runtime_checkable
class Activation(Protocol):
  """What a dictionary's activation is: a callable from pre-activations to features.

  Attributes:
    name: the activation's name in a dictionary's config ("relu", ...).
  """

  name: str

  def __call__(self, pre: jax.Array) -> jax.Array:
    """The features for pre-activations `pre` (same shape)."""
    ...


def _broadcast(threshold: jax.Array, pre: jax.Array) -> jax.Array:
  """`threshold` (`[width]`, or `[layers, width]`) shaped to broadcast against `pre`
  (`[..., width]`, or `[layers, ..., width]`)."""
  middle = (1,) * (pre.ndim - threshold.ndim)
  return threshold.reshape(threshold.shape[:-1] + middle + threshold.shape[-1:])


def _reduced(gradient: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """`gradient` (shaped as the pre-activations) summed back to a threshold's `shape`."""
  lead = len(shape) - 1
  axes = tuple(range(lead, gradient.ndim - 1))
  return jnp.sum(gradient, axis=axes).reshape(shape)


def _kernel(pre: jax.Array, threshold: jax.Array, bandwidth: float) -> jax.Array:
  """The rectangle kernel of the straight-through estimator, `K((pre - t) / bandwidth)`."""
  return (jnp.abs((pre - threshold) / bandwidth) < 0.5).astype(pre.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def jump_relu(pre: jax.Array, threshold: jax.Array, bandwidth: float) -> jax.Array:
  """`pre` where it exceeds `threshold` (and is positive), else 0.

  The gradient with respect to `pre` is the mask; with respect to the threshold it is the
  straight-through estimate `-(threshold / bandwidth) K((pre - threshold) / bandwidth)`.
  """
  return jnp.where(pre > _broadcast(threshold, pre), jax.nn.relu(pre), 0)


def _jump_relu_forward(pre, threshold, bandwidth):
  return jump_relu(pre, threshold, bandwidth), (pre, threshold)


def _jump_relu_backward(bandwidth, saved, cotangent):
  pre, threshold = saved
  wide = _broadcast(threshold, pre)
  d_pre = jnp.where(pre > wide, cotangent, 0) * (pre > 0)
  d_threshold = -(wide / bandwidth) * _kernel(pre, wide, bandwidth) * cotangent
  return d_pre, _reduced(d_threshold, threshold.shape)


jump_relu.defvjp(_jump_relu_forward, _jump_relu_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def heaviside(pre: jax.Array, threshold: jax.Array, bandwidth: float) -> jax.Array:
  """1 where `pre` exceeds `threshold`, else 0: JumpReLU's L0, with a straight-through
  gradient `-(1 / bandwidth) K(...)` for the threshold and none for `pre`."""
  return (pre > _broadcast(threshold, pre)).astype(pre.dtype)


def _heaviside_forward(pre, threshold, bandwidth):
  return heaviside(pre, threshold, bandwidth), (pre, threshold)


def _heaviside_backward(bandwidth, saved, cotangent):
  pre, threshold = saved
  wide = _broadcast(threshold, pre)
  d_threshold = -(1.0 / bandwidth) * _kernel(pre, wide, bandwidth) * cotangent
  return jnp.zeros_like(pre), _reduced(d_threshold, threshold.shape)


heaviside.defvjp(_heaviside_forward, _heaviside_backward)


def _scatter_rows(pre: jax.Array, k: int) -> jax.Array:
  """Per row (last axis): the `k` largest pre-activations, ReLU'd, the rest 0."""
  values, indices = jax.lax.top_k(pre, k)
  rows = pre.reshape(-1, pre.shape[-1])
  placed = jax.vmap(lambda row, i, v: jnp.zeros_like(row).at[i].set(v))(
    rows, indices.reshape(-1, k), jax.nn.relu(values).reshape(-1, k)
  )
  return placed.reshape(pre.shape)


class ReLU(nnx.Module):
  """Features `relu(pre)`: the standard SAE's activation (sparsity from an L1 penalty)."""

  name = "relu"

  def __call__(self, pre: jax.Array) -> jax.Array:
    return jax.nn.relu(pre)


class JumpReLU(nnx.Module):
  """Features `pre` where `pre > threshold` (one learned threshold per feature), else 0.

  Attributes:
    threshold: `nnx.Param` of shape `[width]` (`[layers, width]` in a cross-layer
      transcoder), trained through the straight-through estimator.
    bandwidth: the estimator's kernel width (static).
  """

  name = "jumprelu"

  def __init__(self, shape: tuple[int, ...], *, threshold: float, bandwidth: float, dtype: Any):
    self.threshold = nnx.Param(jnp.asarray(np.full(shape, threshold), dtype))
    self.bandwidth = float(bandwidth)

  def __call__(self, pre: jax.Array) -> jax.Array:
    return jump_relu(pre, self.threshold[...], self.bandwidth)


class TopK(nnx.Module):
  """Features: the `k` largest pre-activations of each row (token), ReLU'd; the rest 0."""

  name = "topk"

  def __init__(self, k: int):
    self.k = int(k)

  def __call__(self, pre: jax.Array) -> jax.Array:
    return _scatter_rows(pre, self.k)


class BatchTopK(nnx.Module):
  """Features: the `k × rows` largest pre-activations of the whole batch while training
  (`use_running_average=False`, as `model.train()` sets), so rows share a budget of `k`
  on average; at inference (`model.eval()`, the default) a fixed threshold: features
  above it, the rest 0.

  The threshold is a running average (`nnx.BatchStat`) of the smallest feature each
  training batch keeps, updated by training calls.

  Attributes:
    k: the average number of features per row.
    threshold: `nnx.BatchStat` of shape `[]`: the inference threshold.
    momentum: the running average's momentum.
    use_running_average: True at inference (threshold), False while training.
  """

  name = "batchtopk"

  def __init__(self, k: int, *, momentum: float, dtype: Any):
    self.k = int(k)
    self.threshold = nnx.BatchStat(jnp.asarray(np.zeros(()), dtype))
    self.momentum = float(momentum)
    self.use_running_average = True

  def __call__(self, pre: jax.Array) -> jax.Array:
    relu = jax.nn.relu(pre)
    if self.use_running_average:
      threshold = self.threshold[...]
      return jnp.where(relu > _broadcast(threshold, relu), relu, 0)
    keep = self.k * (pre.size // pre.shape[-1])
    flat = relu.reshape(-1)
    values, indices = jax.lax.top_k(flat, keep)
    features = jnp.zeros_like(flat).at[indices].set(values).reshape(pre.shape)
    kept = jnp.where(values > 0, values, jnp.inf)
    smallest = jnp.min(kept)
    smallest = jnp.where(jnp.isfinite(smallest), smallest, self.threshold[...].mean())
    smallest = jax.lax.stop_gradient(smallest)
    self.threshold[...] = self.momentum * self.threshold[...] + (1 - self.momentum) * smallest
    return features


def make_activation(
  name: str,
  shape: tuple[int, ...],
  *,
  k: int | None,
  threshold: float,
  bandwidth: float,
  momentum: float,
  dtype: Any,
) -> nnx.Module:
  """The activation `name` for features of `shape` (`[width]` or `[layers, width]`)."""
  if name not in ACTIVATIONS:
    raise ArgumentError(
      f"activation={name!r} is no dictionary activation. Give one of {list(ACTIVATIONS)}."
    )
  needs_k = name in ("topk", "batchtopk")
  if needs_k and (isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= shape[-1]):
    raise ArgumentError(
      f"activation={name!r} keeps k features per row; k={k!r} is not an int in"
      f" 1..{shape[-1]} (the width). Give k=."
    )
  if not needs_k and k is not None:
    raise ArgumentError(
      f"k={k!r} is given but activation={name!r} does not keep a fixed number of features."
      " Drop k=, or give activation='topk' or 'batchtopk'."
    )
  if name == "relu":
    return ReLU()
  if name == "jumprelu":
    return JumpReLU(shape, threshold=threshold, bandwidth=bandwidth, dtype=dtype)
  if name == "topk":
    return TopK(k)
  return BatchTopK(k, momentum=momentum, dtype=dtype)
