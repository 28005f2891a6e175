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
  heaviside,
  jump_relu,
)
from flaxlens.tools.dictionaries._checkpoints import Checkpoints
from flaxlens.tools.dictionaries._data import DictionaryData, Rows, from_arrays, from_harvest
from flaxlens.tools.dictionaries._evaluate import Evaluation, evaluate
from flaxlens.tools.dictionaries._modules import (
  SAE,
  CrossLayerTranscoder,
  Dictionary,
  DictionaryConfig,
  Transcoder,
  make_dictionary,
)
from flaxlens.tools.dictionaries._recipes import Recipe
from flaxlens.tools.dictionaries._stream import Stream, stream
from flaxlens.tools.dictionaries._training import TrainResult, train

__all__ = [
  "SAE",
  "Activation",
  "BatchTopK",
  "Checkpoints",
  "CrossLayerTranscoder",
  "Dictionary",
  "DictionaryConfig",
  "DictionaryData",
  "Evaluation",
  "JumpReLU",
  "Recipe",
  "ReLU",
  "Rows",
  "Stream",
  "TopK",
  "TrainResult",
  "Transcoder",
  "evaluate",
  "from_arrays",
  "from_harvest",
  "heaviside",
  "jump_relu",
  "make_dictionary",
  "stream",
  "train",
]
