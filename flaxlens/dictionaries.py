"""flaxlens.dictionaries: sparse autoencoders (SAEs), transcoders and cross-layer
transcoders (CLTs): build, train, evaluate, save and load them, and look at their features.

A dictionary is a plain NNX module (`SAE`, `Transcoder`, `CrossLayerTranscoder`, all
`Dictionary`s): `encode` gives features, `decode` what they write, its call the
reconstruction, so `fl.splice` puts it into a tree and its features are sites there.
docs/dictionaries.md works through training, evaluation, files and feature views.

Example:
  >>> import flaxlens.dictionaries as fld, jax.numpy as jnp
  >>> from flax import nnx
  >>> sae = fld.SAE(4, 16, activation="jumprelu", rngs=nnx.Rngs(0))
  >>> sae(jnp.ones((2, 4))).shape
  (2, 4)
"""

from flaxlens.tools.dictionaries._activations import (
  Activation,
  BatchTopK,
  JumpReLU,
  ReLU,
  TopK,
)
from flaxlens.tools.dictionaries._evaluate import Evaluation, evaluate
from flaxlens.tools.dictionaries._modules import (
  SAE,
  CrossLayerTranscoder,
  Dictionary,
  DictionaryConfig,
  Transcoder,
  make_dictionary,
)
from flaxlens.tools.dictionaries._stream import Rows, Stream, stream

__all__ = [
  "SAE",
  "Activation",
  "BatchTopK",
  "CrossLayerTranscoder",
  "Dictionary",
  "DictionaryConfig",
  "Evaluation",
  "JumpReLU",
  "ReLU",
  "Rows",
  "Stream",
  "TopK",
  "Transcoder",
  "evaluate",
  "make_dictionary",
  "stream",
]
