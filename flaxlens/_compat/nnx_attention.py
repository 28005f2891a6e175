"""NNX's attention-weights function, which `flax.nnx` does not re-export.

Checked with flax 0.12.8. `flax.nnx.nn.attention.dot_product_attention_weights` is the
function `nnx.MultiHeadAttention` (through `nnx.dot_product_attention`) computes its
softmax weights with; `flax.nnx` exports `dot_product_attention` but not the weights
function, so it is reached by its module path, which is not public API.
"""

from __future__ import annotations

from typing import Any

from flaxlens._compat import Internal

DOT_PRODUCT_ATTENTION_WEIGHTS = Internal("flax.nnx.nn.attention", "dot_product_attention_weights")


def dot_product_attention_weights(query: Any, key: Any, **options: Any) -> Any:
  """The softmax weights NNX's attention computes for `query` and `key` (NNX's options)."""
  return DOT_PRODUCT_ATTENTION_WEIGHTS()(query, key, **options)
