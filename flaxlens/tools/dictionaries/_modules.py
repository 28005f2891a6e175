"""Dictionary modules: sparse autoencoders, transcoders and cross-layer transcoders.

A dictionary is a plain NNX module, so it splices into a tree (`fl.splice`), shards,
saves and differentiates like any model. `encode` maps what it reads to features,
`decode` maps features to what it writes, and its call is `decode(encode(x))` (plus a
linear skip where it has one): the reconstruction, which `fl.splice` takes as is. The
activation is a submodule (`_activations.py`), so once spliced the features are the
output of the `activation` call (and of `encode`), sites like any other.

- `SAE` reads one site and reconstructs it (`d_out == d_in`; by default the decoder bias
  is subtracted from the input first).
- `Transcoder` reads a call's input and predicts its output (it stands in for an MLP);
  optionally with a linear skip `x @ W_skip`.
- `CrossLayerTranscoder` reads the residual stream at each of `layers` layers and writes
  into the MLP outputs of that layer and every later one: features of layer `l` decode to
  layers `l..layers-1` (`W_dec[l]` has shape `[width, layers - l, d_out]`).

Weights follow one convention: `x @ W_enc + b_enc`, `features @ W_dec + b_dec`, `x @
W_skip` (so `W_enc` is `[d_in, width]`, `W_dec` is `[width, d_out]`; loaders of other
libraries' files transpose where theirs differ). A dictionary's `config`
(`DictionaryConfig`) says everything needed to build it again (files, `make_dictionary`).
No Flax internals here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxlens.errors import ArgumentError
from flaxlens.tools.dictionaries._activations import ACTIVATIONS, make_activation

KINDS = ("sae", "transcoder", "clt")


@dataclasses.dataclass(frozen=True)
class DictionaryConfig:
  """What a dictionary is: enough to build it again (its weights aside).

  Attributes:
    kind: "sae", "transcoder" or "clt" (cross-layer transcoder).
    d_in: the width of what it reads.
    d_out: the width of what it writes (`d_in` for an SAE).
    width: the number of features (per layer, for a CLT).
    activation: "relu", "jumprelu", "topk" or "batchtopk".
    k: features kept per row (topk, batchtopk), else None.
    layers: the layers a CLT spans (1 otherwise).
    skip: whether it has a linear skip `x @ W_skip` (transcoders and CLTs).
    center_input: whether the decoder bias is subtracted from the input before encoding
      (SAEs only).
    dtype: the parameters' dtype, by name ("float32").
    threshold: JumpReLU's initial threshold.
    bandwidth: JumpReLU's straight-through kernel width.
    momentum: BatchTopK's running-threshold momentum.
  """

  kind: str
  d_in: int
  d_out: int
  width: int
  activation: str = "relu"
  k: int | None = None
  layers: int = 1
  skip: bool = False
  center_input: bool = False
  dtype: str = "float32"
  threshold: float = 0.001
  bandwidth: float = 0.001
  momentum: float = 0.99

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ArgumentError(f"DictionaryConfig: kind={self.kind!r}; give one of {list(KINDS)}.")
    for name in ("d_in", "d_out", "width", "layers"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(
          f"DictionaryConfig: {name}={value!r} is not a positive int. Give the size."
        )
    if self.activation not in ACTIVATIONS:
      raise ArgumentError(
        f"DictionaryConfig: activation={self.activation!r}; give one of {list(ACTIVATIONS)}."
      )
    if self.kind == "sae" and (self.d_out != self.d_in or self.skip):
      raise ArgumentError(
        f"DictionaryConfig: an SAE reconstructs what it reads, so d_out ({self.d_out}) must"
        f" equal d_in ({self.d_in}) and it has no skip. Use kind='transcoder' to map one"
        " site to another."
      )
    if self.kind != "sae" and self.center_input:
      raise ArgumentError(
        "DictionaryConfig: center_input subtracts the decoder bias from the input, which"
        " only an SAE (reading what it writes) can do. Drop center_input=True."
      )
    if self.kind != "clt" and self.layers != 1:
      raise ArgumentError(
        f"DictionaryConfig: layers={self.layers} is for kind='clt'. Drop layers=, or give"
        " kind='clt'."
      )
    try:
      jnp.dtype(self.dtype)
    except TypeError as error:
      raise ArgumentError(
        f"DictionaryConfig: dtype={self.dtype!r} is no dtype. Give one such as 'float32'."
      ) from error

  def to_dict(self) -> dict[str, Any]:
    """The config as plain JSON-ready values."""
    return dataclasses.asdict(self)


def _unit_rows(key: jax.Array, shape: tuple[int, ...]) -> Any:
  """Random float32 directions of unit norm along the last axis. Drawn on the host from a
  NumPy generator seeded by `key`, so that building a dictionary compiles nothing; drawn
  with JAX where the key is traced (a dictionary built abstractly, by `nnx.eval_shape`)."""
  if isinstance(key, jax.core.Tracer):
    rows = jax.random.normal(key, shape, jnp.float32)
    return rows / jnp.linalg.norm(rows, axis=-1, keepdims=True)
  generator = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
  rows = generator.standard_normal(shape, np.float32)
  return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def _zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
  return jnp.asarray(np.zeros(shape), dtype)


class Dictionary(nnx.Module):
  """The open base class of dictionaries: `encode`, `decode`, and a call returning the
  reconstruction. Subclasses set the parameters in `__init__` and may override
  `pre_activation` and `decode`; training, evaluation, files and feature views read a
  dictionary only through these methods, its `config` and its parameters (`W_enc`,
  `b_enc`, `W_dec`, `b_dec`, `W_skip` where `config.skip`, `activation`).

  Attributes:
    config: the `DictionaryConfig` it was built from.
  """

  config: DictionaryConfig

  def pre_activation(self, x: jax.Array) -> jax.Array:
    """The pre-activations (before the activation) for input `x`."""
    if self.config.center_input:
      x = x - self.b_dec[...]
    return x @ self.W_enc[...] + self.b_enc[...]

  def encode(self, x: jax.Array) -> jax.Array:
    """The features for input `x`: `activation(pre_activation(x))`, `[..., width]`."""
    return self.activation(self.pre_activation(x))

  def decode(self, features: jax.Array) -> jax.Array:
    """What the features write, `features @ W_dec + b_dec` (the skip aside)."""
    return features @ self.W_dec[...] + self.b_dec[...]

  def skip_of(self, x: jax.Array) -> jax.Array | None:
    """The linear skip's output `x @ W_skip`, or None without one."""
    return x @ self.W_skip[...] if self.config.skip else None

  def __call__(self, x: jax.Array) -> jax.Array:
    """The reconstruction: `decode(encode(x))`, plus the skip where there is one."""
    out = self.decode(self.encode(x))
    skipped = self.skip_of(x)
    return out if skipped is None else out + skipped


class SAE(Dictionary):
  """A sparse autoencoder: reads one site, `[..., d_in]`, and reconstructs it.

  Args:
    d_in: the width of the site.
    width: the number of features.
    activation: "relu" (default), "jumprelu", "topk" or "batchtopk".
    k: features kept per row, for "topk" and "batchtopk".
    center_input: subtract the decoder bias from the input before encoding (default).
    dtype: the parameters' dtype.
    threshold: JumpReLU's initial threshold.
    bandwidth: JumpReLU's straight-through kernel width.
    momentum: BatchTopK's running-threshold momentum.
    rngs: `nnx.Rngs` for the initial weights (unit-norm decoder rows, the encoder their
      transpose, zero biases).

  Example:
    >>> import flaxlens.dictionaries as fld, jax.numpy as jnp
    >>> from flax import nnx
    >>> sae = fld.SAE(8, 32, activation="topk", k=4, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 5, 8))
    >>> sae.encode(x).shape, int((sae.encode(x) != 0).sum(-1).max()), sae(x).shape
    ((2, 5, 32), 4, (2, 5, 8))
  """

  def __init__(
    self,
    d_in: int,
    width: int,
    *,
    activation: str = "relu",
    k: int | None = None,
    center_input: bool = True,
    dtype: Any = "float32",
    threshold: float = 0.001,
    bandwidth: float = 0.001,
    momentum: float = 0.99,
    rngs: nnx.Rngs,
  ):
    config = DictionaryConfig(
      "sae", d_in, d_in, width, activation, k, center_input=center_input,
      dtype=jnp.dtype(dtype).name, threshold=threshold, bandwidth=bandwidth, momentum=momentum,
    )  # fmt: skip
    _build(self, config, rngs)


class Transcoder(Dictionary):
  """A transcoder: reads a call's input (`[..., d_in]`) and predicts its output
  (`[..., d_out]`), standing in for an MLP; optionally with a linear skip.

  Args:
    d_in: the width of the call's input.
    d_out: the width of its output.
    width: the number of features.
    activation: "relu" (default), "jumprelu", "topk" or "batchtopk".
    k: features kept per row, for "topk" and "batchtopk".
    skip: add a linear skip `x @ W_skip` (zero-initialised).
    dtype: the parameters' dtype.
    threshold: JumpReLU's initial threshold.
    bandwidth: JumpReLU's straight-through kernel width.
    momentum: BatchTopK's running-threshold momentum.
    rngs: `nnx.Rngs` for the initial weights.

  Example:
    >>> import flaxlens.dictionaries as fld, jax.numpy as jnp
    >>> from flax import nnx
    >>> transcoder = fld.Transcoder(8, 6, 32, skip=True, rngs=nnx.Rngs(0))
    >>> transcoder(jnp.ones((3, 8))).shape, transcoder.W_skip.shape
    ((3, 6), (8, 6))
  """

  def __init__(
    self,
    d_in: int,
    d_out: int,
    width: int,
    *,
    activation: str = "relu",
    k: int | None = None,
    skip: bool = False,
    dtype: Any = "float32",
    threshold: float = 0.001,
    bandwidth: float = 0.001,
    momentum: float = 0.99,
    rngs: nnx.Rngs,
  ):
    config = DictionaryConfig(
      "transcoder", d_in, d_out, width, activation, k, skip=skip, dtype=jnp.dtype(dtype).name,
      threshold=threshold, bandwidth=bandwidth, momentum=momentum,
    )  # fmt: skip
    _build(self, config, rngs)


class CrossLayerTranscoder(Dictionary):
  """A cross-layer transcoder (CLT): features of layer `l` read that layer's residual
  stream (its MLP's input) and write into the MLP outputs of layers `l..layers-1`.

  It reads and writes all layers at once: `encode(xs)` takes the inputs stacked,
  `[layers, ..., d_in]`, and gives features `[layers, ..., width]`; `decode(features)`
  gives the outputs `[layers, ..., d_out]`, output `j` summing the decodes of every layer
  `l <= j` (`features[l] @ W_dec[l][:, j - l]`) plus `b_dec[j]`.

  Attributes:
    W_enc: `[layers, d_in, width]`; b_enc: `[layers, width]`.
    W_dec: a list of `layers` parameters, `W_dec[l]` of shape `[width, layers - l, d_out]`.
    b_dec: `[layers, d_out]`; W_skip (with `skip=True`): `[layers, d_in, d_out]`.

  Args:
    layers: the layers it spans.
    d_in: the width of each layer's input (the residual stream).
    d_out: the width of each layer's output (the MLP's).
    width: the number of features per layer.
    activation: "relu" (default), "jumprelu", "topk" or "batchtopk".
    k: features kept per row, for "topk" and "batchtopk".
    skip: add a linear skip per layer, `xs[l] @ W_skip[l]` (zero-initialised).
    dtype: the parameters' dtype.
    threshold: JumpReLU's initial threshold.
    bandwidth: JumpReLU's straight-through kernel width.
    momentum: BatchTopK's running-threshold momentum.
    rngs: `nnx.Rngs` for the initial weights.

  Example:
    >>> import flaxlens.dictionaries as fld, jax.numpy as jnp
    >>> from flax import nnx
    >>> clt = fld.CrossLayerTranscoder(3, 8, 8, 16, rngs=nnx.Rngs(0))
    >>> clt.encode(jnp.ones((3, 5, 8))).shape, clt.W_dec[1].shape, clt(jnp.ones((3, 5, 8))).shape
    ((3, 5, 16), (16, 2, 8), (3, 5, 8))
  """

  def __init__(
    self,
    layers: int,
    d_in: int,
    d_out: int,
    width: int,
    *,
    activation: str = "relu",
    k: int | None = None,
    skip: bool = False,
    dtype: Any = "float32",
    threshold: float = 0.001,
    bandwidth: float = 0.001,
    momentum: float = 0.99,
    rngs: nnx.Rngs,
  ):
    config = DictionaryConfig(
      "clt", d_in, d_out, width, activation, k, layers=layers, skip=skip,
      dtype=jnp.dtype(dtype).name, threshold=threshold, bandwidth=bandwidth, momentum=momentum,
    )  # fmt: skip
    _build(self, config, rngs)

  def pre_activation(self, xs: jax.Array) -> jax.Array:
    """The pre-activations `[layers, ..., width]` for stacked inputs `[layers, ..., d_in]`."""
    lead = xs.ndim - 2
    bias = self.b_enc[...].reshape((self.config.layers,) + (1,) * lead + (self.config.width,))
    return jnp.einsum("l...i,lif->l...f", xs, self.W_enc[...]) + bias

  def decode(self, features: jax.Array) -> jax.Array:
    """The outputs `[layers, ..., d_out]`: output `j` sums `features[l] @ W_dec[l][:, j-l]`
    over `l <= j`, plus `b_dec[j]` (the skip aside)."""
    layers = self.config.layers
    outputs = []
    for target in range(layers):
      out = self.b_dec[target]
      for source in range(target + 1):
        out = out + features[source] @ self.W_dec[source][:, target - source]
      outputs.append(out)
    return jnp.stack(outputs)

  def decode_layer(self, features: jax.Array, source: int) -> jax.Array:
    """What features of layer `source` (`[..., width]`) write into every layer they
    reach: `[layers - source, ..., d_out]` (no bias)."""
    return jnp.einsum("...f,ftd->t...d", features, self.W_dec[source][...])

  def skip_of(self, xs: jax.Array) -> jax.Array | None:
    """The skip's outputs `[layers, ..., d_out]` (`xs[l] @ W_skip[l]`), or None."""
    if not self.config.skip:
      return None
    return jnp.einsum("l...i,lio->l...o", xs, self.W_skip[...])


def _build(dictionary: Dictionary, config: DictionaryConfig, rngs: nnx.Rngs) -> None:
  """Set `dictionary`'s config, parameters and activation for `config`."""
  dtype = jnp.dtype(config.dtype)
  dictionary.config = config
  layers = (config.layers,) if config.kind == "clt" else ()
  shape = layers + (config.width,)
  if config.kind == "clt":
    # One draw for every layer's decoders, split by target count: `W_dec[l]` holds the
    # rows of layers l..L-1, each layer's scaled by 1/sqrt(L - l).
    counts = [config.layers - layer for layer in range(config.layers)]
    rows = _unit_rows(rngs.params(), (config.width, sum(counts), config.d_out))
    starts = np.cumsum([0, *counts])
    dictionary.W_dec = nnx.List(
      [
        nnx.Param(jnp.asarray(rows[:, start : start + count] / np.sqrt(count), dtype))
        for start, count in zip(starts, counts, strict=False)
      ]
    )
  else:
    dictionary.W_dec = nnx.Param(
      jnp.asarray(_unit_rows(rngs.params(), (config.width, config.d_out)), dtype)
    )
  if config.kind == "sae":
    encoder = jnp.swapaxes(dictionary.W_dec[...], -1, -2)
  else:
    rows = _unit_rows(rngs.params(), layers + (config.width, config.d_in))
    encoder = jnp.asarray(rows.swapaxes(-1, -2), dtype)
  dictionary.W_enc = nnx.Param(encoder)
  dictionary.b_enc = nnx.Param(_zeros(shape, dtype))
  dictionary.b_dec = nnx.Param(_zeros(layers + (config.d_out,), dtype))
  if config.skip:
    dictionary.W_skip = nnx.Param(_zeros(layers + (config.d_in, config.d_out), dtype))
  dictionary.activation = make_activation(
    config.activation,
    shape,
    k=config.k,
    threshold=config.threshold,
    bandwidth=config.bandwidth,
    momentum=config.momentum,
    dtype=dtype,
  )


def make_dictionary(config: DictionaryConfig, *, rngs: nnx.Rngs | None = None) -> Dictionary:
  """A dictionary built from `config` (random weights from `rngs`, default `nnx.Rngs(0)`).

  Example:
    >>> import flaxlens.dictionaries as fld
    >>> config = fld.DictionaryConfig("transcoder", 8, 6, 32, "jumprelu", skip=True)
    >>> fld.make_dictionary(config).config == config
    True
  """
  if not isinstance(config, DictionaryConfig):
    raise ArgumentError(
      f"make_dictionary: config is a {type(config).__name__}, not a DictionaryConfig."
      " Give fld.DictionaryConfig(kind, d_in, d_out, width, ...)."
    )
  rngs = rngs if rngs is not None else nnx.Rngs(0)
  shared = dict(
    activation=config.activation, k=config.k, dtype=config.dtype, threshold=config.threshold,
    bandwidth=config.bandwidth, momentum=config.momentum, rngs=rngs,
  )  # fmt: skip
  if config.kind == "sae":
    return SAE(config.d_in, config.width, center_input=config.center_input, **shared)
  if config.kind == "transcoder":
    return Transcoder(config.d_in, config.d_out, config.width, skip=config.skip, **shared)
  return CrossLayerTranscoder(
    config.layers, config.d_in, config.d_out, config.width, skip=config.skip, **shared
  )
