"""The logit targets of an attribution graph (`Targets`): by default the most likely next
tokens, the shortest prefix of the top `max_n_logits` whose probability reaches
`desired_logit_prob`; or given token ids; or given directions over the logits. A target
reads the demeaned logit (`logit[t] - mean(logits)`) at the last position, weighted by
its probability in pruning. No Flax internals here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from flaxlens.errors import ArgumentError


class Target(NamedTuple):
  """A custom target: a direction over the last position's logits and its weight.

  Attributes:
    direction: `[vocabulary]` (a logit difference: `+1` at one token, `-1` at another).
    weight: its weight in pruning (a probability for a token).
    label: how files and pages name it.

  Example:
    >>> import flaxlens.graphs as flg, numpy as np
    >>> target = flg.Target(np.eye(8)[3] - np.eye(8)[5], 1.0, "3 over 5")
    >>> target.label
    '3 over 5'
  """

  direction: Any
  weight: float
  label: str


class Targets(NamedTuple):
  """A graph's logit targets.

  Attributes:
    ids: token ids, `[n]` (-1 for a custom `Target`).
    probabilities: their probabilities (a custom target's weight), `[n]`.
    directions: what each reads on the logits, `[n, vocabulary]`.
    labels: how each is named (the token id as text, or the custom label).
  """

  ids: np.ndarray
  probabilities: np.ndarray
  directions: np.ndarray
  labels: tuple[str, ...]


def _softmax(logits: np.ndarray) -> np.ndarray:
  shifted = np.exp(logits - logits.max())
  return (shifted / shifted.sum()).astype(np.float32)


def _demeaned(ids: np.ndarray, vocabulary: int) -> np.ndarray:
  directions = np.full((len(ids), vocabulary), -1.0 / vocabulary, np.float32)
  directions[np.arange(len(ids)), ids] += 1.0
  return directions


def chosen_targets(
  logits: Any, targets: Any, max_n_logits: int, desired_logit_prob: float, where: str
) -> Targets:
  """The `Targets` for the last position's `logits` (`[vocabulary]`): `targets=None`
  (the most likely), token ids, or a sequence of `Target`."""
  logits = np.asarray(logits, np.float32)
  vocabulary = logits.shape[-1]
  probabilities = _softmax(logits)
  if targets is None:
    if not isinstance(max_n_logits, int) or max_n_logits < 1 or not 0 < desired_logit_prob <= 1:
      raise ArgumentError(
        f"{where}: max_n_logits={max_n_logits!r} must be a positive int and"
        f" desired_logit_prob={desired_logit_prob!r} in (0, 1]."
      )
    top = np.argsort(-probabilities, kind="stable")[: min(max_n_logits, vocabulary)]
    cutoff = int(np.searchsorted(np.cumsum(probabilities[top]), desired_logit_prob)) + 1
    ids = top[:cutoff]
    return Targets(ids, probabilities[ids], _demeaned(ids, vocabulary), tuple(str(i) for i in ids))
  if isinstance(targets, Sequence) and targets and all(isinstance(t, Target) for t in targets):
    directions = np.stack([np.asarray(t.direction, np.float32) for t in targets])
    if directions.shape != (len(targets), vocabulary):
      raise ArgumentError(
        f"{where}: each Target's direction is [vocabulary={vocabulary}], got"
        f" {[np.shape(t.direction) for t in targets]}. Give directions over the logits."
      )
    weights = np.asarray([t.weight for t in targets], np.float32)
    return Targets(np.full(len(targets), -1), weights, directions, tuple(t.label for t in targets))
  ids = np.asarray(targets)
  if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
    raise ArgumentError(
      f"{where}: targets= is None (the likeliest tokens), a list of token ids, or a list of"
      f" flg.Target; got {targets!r}."
    )
  outside = [int(i) for i in ids if not 0 <= i < vocabulary]
  if outside:
    raise ArgumentError(
      f"{where}: target token ids {outside} are outside the vocabulary (0..{vocabulary - 1})."
      " Give ids the model's logits have."
    )
  return Targets(ids, probabilities[ids], _demeaned(ids, vocabulary), tuple(str(i) for i in ids))
