"""Fingerprints of what a harvest store was made from, the same in every process and on every
platform: arrays by a checksum of their names, shapes, dtypes and bits (summed with NumPy
where they are in host memory, else by one jitted program on their devices, giving the
same numbers), and functions by `core`'s `StableText`, their arrays by that checksum.
Not cryptographic: they tell this call's store from another's. No Flax internals here.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._functions import StableText
from flaxlens.tools.harvest._processes import fetch_whole


@jax.jit
def _checksums(leaves: list[Any]) -> Any:
  """Two 32-bit sums per array of its bits (plain and position-weighted), on device."""
  sums = []
  for leaf in leaves:
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):  # real and imaginary parts in turn
      leaf = jnp.stack([leaf.real, leaf.imag], axis=-1)
    if leaf.dtype == jnp.bool_ or leaf.dtype.itemsize == 1:
      bits = leaf.astype(jnp.uint32)
    else:
      unsigned = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
      bits = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)
    bits = bits.reshape(-1)
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) % 65521) + 1
    sums.append(jnp.stack([bits.sum(dtype=jnp.uint32), (bits * weights).sum(dtype=jnp.uint32)]))
  return jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)


# The position weights' period, and the elements summed at a time on the host: a whole
# number of periods, so every slice starts at weight 1 and one table of weights serves all.
_PERIOD = 65521
_SPAN = 16 * _PERIOD
_host_weights = functools.cache(
  lambda: (np.arange(_SPAN, dtype=np.uint32) % _PERIOD + 1).astype(np.uint32)
)


def _on_host(value: Any) -> np.ndarray | None:
  """`value` as a NumPy array without a transfer where it already is one in host memory (a
  NumPy array, at the dtype `jnp.asarray` would give it, or a JAX array on one CPU device);
  None for anything else (arrays on accelerators or over several devices)."""
  if isinstance(value, np.ndarray | np.generic):
    if value.dtype.kind not in "biufc" and value.dtype.name != "bfloat16":
      return None  # other dtypes: jnp.asarray says what it makes of them
    return np.asarray(value).astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)
  if (
    isinstance(value, jax.Array)
    and not jnp.issubdtype(value.dtype, jax.dtypes.prng_key)
    and value.is_fully_addressable
    and len(value.sharding.device_set) == 1
    and next(iter(value.sharding.device_set)).platform == "cpu"
  ):
    return np.asarray(value)
  return None


def _host_checksum(array: np.ndarray) -> tuple[int, int]:
  """`_checksums`' pair for one host array, computed with NumPy a slice at a time (the same
  unsigned 32-bit arithmetic, so the same numbers, in memory bounded by `_SPAN`)."""
  if array.dtype.kind == "c":  # real and imaginary parts in turn, as `_checksums` sums them
    array = np.stack([array.real, array.imag], axis=-1)
  flat = array.reshape(-1)
  if array.dtype.itemsize in (2, 4, 8) and array.dtype != np.bool_:
    flat = flat.view({2: np.uint16, 4: np.uint32, 8: np.uint32}[array.dtype.itemsize])
  weights, plain, weighted = _host_weights(), 0, 0
  for start in range(0, flat.size, _SPAN):
    bits = flat[start : start + _SPAN].astype(np.uint32)
    plain += int(bits.sum(dtype=np.uint32))
    weighted += int((bits * weights[: bits.size]).sum(dtype=np.uint32))
  return plain % 2**32, weighted % 2**32


def fingerprint(named: list[tuple[str, Any]]) -> str:
  """A checksum of named arrays: their names, shapes, dtypes and bits (not cryptographic).

  Arrays already in host memory are summed there with NumPy (on CPU, the model's variables:
  no program to trace and compile in each new process); the others in one jitted program
  on their devices. Both give the same numbers, so a store fingerprinted on one resumes
  on the other."""
  arrays = []  # each value as a host array where it is in host memory, else on device
  for _, value in named:
    host = _on_host(value)
    if host is None:  # not an array yet (a Python number), or on an accelerator
      value = jnp.asarray(value)
      host = _on_host(value)
    arrays.append(value if host is None else host)
  on_device = [a for a in arrays if isinstance(a, jax.Array)]
  device_sums = iter(fetch_whole(_checksums(on_device)) if on_device else ())
  digest = hashlib.sha256()
  for (name, _), array in zip(named, arrays, strict=True):
    on_host = isinstance(array, np.ndarray)
    pair = list(_host_checksum(array)) if on_host else next(device_sums).tolist()
    digest.update(f"{name}|{array.dtype}|{tuple(array.shape)}|{pair};".encode())
  return digest.hexdigest()[:32]


# Functions and values given to `fl.harvest` (`ids=`, a mask, a batch's Python values) as
# text the same in every process, arrays by their `fingerprint`.
STABLE_TEXT = StableText(lambda array: fingerprint([("", array)]))
