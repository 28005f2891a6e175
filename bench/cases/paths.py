"""Case 12: path patching over every sender of one receiver, in one compilation.

On each subject, the senders are the attention heads of every block but the last (each
head's slice of its attention's out projection input), and the receiver is the last
block's attention query projection (all heads). `fl.path_patch` runs the clean and
corrupted forwards, then for each sender a forward recording the receiver and a forward
patching it, all in one compiled program. The row counts the traces of the metric (one per
compilation) over two calls with new corrupted inputs, and reports the first call's time
(tracing and compiling included) and the second's (the compiled program alone), next to
one plain jitted forward.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

import flaxlens as fl
from bench.harness import seconds
from bench.models import Sizes, tokens
from bench.report import Row
from bench.subjects import Subject, per_subject

NAME = "12. path patching"


def _sites(subject: Subject, sizes: Sizes) -> tuple[fl.Sites, fl.Sites]:
  last = subject.layers - 1
  if subject.framework == "Linen":
    attention = [f"LinenBlock_{i}/MultiHeadDotProductAttention_0" for i in range(subject.layers)]
  else:
    attention = [f"blocks/{i}/attention" for i in range(subject.layers)]
  heads = [jnp.s_[..., h, :] for h in range(sizes.heads)]
  senders = fl.Sites([f"{a}/out" for a in attention[:last]], on="input", where=heads)
  return senders, fl.Sites(f"{attention[last]}/query")


def _measure(subject: Subject, sizes: Sizes) -> list[Row]:
  if subject.layers < 2:
    return [
      Row(
        NAME,
        f"{subject.framework}: compilations of fl.path_patch over all senders of one receiver",
        "path_patching_compiles",
        status="not measured: needs 2 layers or more",
      )
    ]
  tree = subject.tree
  clean = tokens(sizes)
  senders, receiver = _sites(subject, sizes)
  traces = []

  def metric(output: Any) -> Any:
    traces.append(None)
    return output[:, -1, 0].mean()

  times = []
  for shift in (0, 1):
    corrupted = (clean[:, ::-1] + shift) % sizes.vocab
    start = time.perf_counter()
    result = fl.path_patch(tree, clean, corrupted, senders, receiver, metric)
    jax.block_until_ready(result.values)
    times.append(time.perf_counter() - start)
  native, args = subject.jitted["variable_jit"]()
  jax.block_until_ready(native(*args))
  start = time.perf_counter()
  jax.block_until_ready(native(*args))
  forward = time.perf_counter() - start
  n = len(result.sites)
  return [
    Row(
      NAME,
      f"{subject.framework}: compilations of fl.path_patch over all {n} heads before the"
      " last block into its query projection, two calls with new inputs",
      "path_patching_compiles",
      measured=f"**{len(traces)}**",
      status="PASS" if len(traces) == 1 else "MISS",
      note=(
        f"first call {seconds(times[0])} (compiling), second {seconds(times[1])}:"
        f" {2 * n + 2} forwards; one jitted forward {seconds(forward)}"
      ),
    )
  ]


measure = per_subject(NAME, _measure)
