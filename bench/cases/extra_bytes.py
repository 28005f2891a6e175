"""Case 7: parameter bytes of a converted tree not shared with the user's arrays, and
device bytes that a fresh conversion leaves alive.

Buffers are told apart by their device pointers: a tree parameter whose buffer is one of
the model's arrays costs nothing.
"""

from __future__ import annotations

import gc
from typing import Any

import jax

import flaxlens as fl
from bench.harness import Progress, nbytes
from bench.models import Sizes
from bench.report import Row
from bench.subjects import Subject

NAME = "7. extra bytes"


def _buffer(x: Any) -> int | None:
  try:
    return x.unsafe_buffer_pointer()
  except (AttributeError, RuntimeError):
    return None


def measure(subjects: list[Subject], sizes: Sizes, progress: Progress) -> list[Row]:
  progress(NAME)
  return [_measure(subject) for subject in subjects]


def _measure(subject: Subject) -> Row:
  user = {_buffer(a) for a in subject.user_arrays} - {None}
  values = [v.value for v in fl.variables_in(subject.tree) if isinstance(v, fl.Parameter)]
  held = {_buffer(v): v.nbytes for v in jax.tree_util.tree_leaves(values) if _buffer(v)}
  unshared = sum(n for pointer, n in held.items() if pointer not in user)
  gc.collect()
  before = {_buffer(a) for a in jax.live_arrays()}
  tree = subject.convert()
  gc.collect()
  created = sum(a.nbytes for a in jax.live_arrays() if _buffer(a) not in before)
  del tree
  return Row(
    NAME,
    f"{subject.framework}: tree parameter bytes not shared with the model's arrays",
    "extra_bytes",
    measured=f"**{nbytes(unshared)}** of {nbytes(sum(held.values()))}",
    status="PASS" if unshared == 0 and created == 0 else "MISS",
    note=f"device bytes left alive by a fresh conversion: {nbytes(created)}",
  )
