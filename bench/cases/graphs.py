"""Case 16: attribution graphs (`flg.attribute`, `flaxlens.graphs`) against circuit-tracer's
`attribute`, on the same weights and prompts: time per graph, the compilations a second
prompt of the same length costs, peak memory at 512 tokens, and a 2048-token graph under
a memory budget.

The weights are made here, in NumPy (so the case runs without PyTorch): a GPT-2 style
model (LayerNorm, gelu_new, learned positions) written in TransformerLens's parameter
names and per-layer ReLU transcoders in circuit-tracer's file layout (`layer_{i}
.safetensors`, `W_enc` `[width, d_model]`). Each transcoder's encoder bias is set so its
layer fires about `l0` features per token on the prompts (the quantile of its
pre-activations there). The flaxlens worker (this module, `python -m bench.cases.graphs
worker SPEC`) runs a Linen port of the model (`LinenGraphModel`: `nn.Embed`, a learned
position table, blocks of `nn.LayerNorm`, an attention whose pattern is `jax.nn.softmax`
of the causal scores scaled by `1/sqrt(d_head)`, an `mlp` call, then the final norm and
the unembedding) with the transcoders loaded by `fld.load_circuit_tracer`. The
circuit-tracer worker (`bench/circuit_tracer_graph.py`, run with the interpreter named by
`FLAXLENS_BENCH_CIRCUIT_TRACER_PYTHON`; without it its rows say "not installed") loads the
same files into a `HookedTransformer` and circuit-tracer's replacement model, its
transcoders reading `mlp.hook_in` and writing `mlp.hook_out` (the MLP call's input and
output, as flaxlens's `at=` names). Before timing, the port's logits must equal
TransformerLens's within 1e-4 (the case fails otherwise), and at the tiny size the two
graphs' adjacencies are compared (in the notes).

Both workers are pinned to the same one CPU with one compute thread (as case 15), take
turns (interleaved repetitions), compute the full graph (no feature cap) with the same
batch size, and time one `attribute` call on the second prompt. The flaxlens worker
computes the first prompt's graph (compiling) before it says it is ready (the compilation
is in the notes) and counts XLA compilations (`jax.monitoring`'s backend-compile events)
in every graph after it, all of a second prompt of the same length: that count is a row
(target 0).
Memory rows run each side once in a fresh subprocess and report the peak resident set
during the call (VmHWM, reset as the call starts); the 2048-token row runs both under one
address-space limit (`RLIMIT_AS`), flaxlens with a `budget=`, circuit-tracer with
`batch_size=1`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bench.cases.dictionaries import ONE_THREAD, REPO, _Worker
from bench.cases.harvest import _reset_peak, _status
from bench.harness import Progress, interleaved, median, nbytes, ratios, seconds
from bench.models import FULL, QUICK, Sizes
from bench.report import Row

NAME = "16. graphs"
USES_SUBJECTS = False  # it builds its own models
CIRCUIT_TRACER_PYTHON = "FLAXLENS_BENCH_CIRCUIT_TRACER_PYTHON"
CORE = 0  # the CPU every timed worker is pinned to (they take turns)
LN_EPSILON = 1e-5  # TransformerLens's default
LOGITS_TOLERANCE = 1e-4
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class Shape:
  """One model, its transcoders and its prompts."""

  layers: int
  d_model: int
  heads: int
  d_mlp: int
  vocab: int
  width: int  # transcoder features per layer
  positions: int  # prompt length
  l0: float  # features active per token per layer, aimed at

  @property
  def label(self) -> str:
    return (
      f"{self.layers} layers, d_model {self.d_model}, {self.width}-feature transcoders,"
      f" {self.positions} tokens"
    )


@dataclasses.dataclass(frozen=True)
class Timed:
  """A time row: its shape and repetitions (fewer where one graph takes minutes)."""

  shape: Shape
  reps: int
  warm_up: bool  # an untimed graph on each side first (flaxlens has compiled already)


@dataclasses.dataclass(frozen=True)
class GraphSizes:
  """The sizes of one run of the case."""

  timed: tuple[Timed, ...]
  batch_size: int
  memory: Shape | None  # peak memory, each side in a fresh process
  memory_batch_size: int
  memory_features: int  # max_feature_nodes of the memory rows (the same on both sides)
  long: Shape | None  # the graph under a budget
  long_budget: int  # flaxlens's budget= (bytes)
  long_limit: int  # both sides' address-space limit (bytes)
  long_features: int


TINY = Shape(2, 64, 4, 256, 512, 512, 16, 10.0)
TWELVE = Shape(12, 256, 4, 1024, 512, 2048, 64, 10.0)
SIZES = {
  FULL: GraphSizes(
    timed=(Timed(TINY, 3, True), Timed(TWELVE, 1, False)), batch_size=32,
    memory=dataclasses.replace(TWELVE, positions=512, l0=1.0), memory_batch_size=16,
    memory_features=512,
    long=dataclasses.replace(TWELVE, positions=2048, l0=1.0), long_budget=2**30,
    long_limit=4 * 2**30, long_features=64,
  ),
  QUICK: GraphSizes(
    timed=(Timed(TINY, 1, False),), batch_size=32, memory=None, memory_batch_size=16,
    memory_features=64, long=None, long_budget=0, long_limit=0, long_features=0,
  ),
}  # fmt: skip


# --- the Linen port ---------------------------------------------------------------------------


class MLP(nn.Module):
  """TransformerLens's MLP: `gelu_new(x @ W_in + b_in) @ W_out + b_out`."""

  d_model: int
  d_mlp: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    zeros = nn.initializers.zeros
    hidden = x @ self.param("W_in", zeros, (self.d_model, self.d_mlp)) + self.param(
      "b_in", zeros, (self.d_mlp,)
    )
    hidden = jax.nn.gelu(hidden, approximate=True)
    return hidden @ self.param("W_out", zeros, (self.d_mlp, self.d_model)) + self.param(
      "b_out", zeros, (self.d_model,)
    )


class SelfAttention(nn.Module):
  """TransformerLens's attention: per-head projections, causal scores scaled by
  `1/sqrt(d_head)`, the pattern `jax.nn.softmax` of them."""

  d_model: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d_head = self.d_model // self.heads
    zeros = nn.initializers.zeros

    def project(name: str) -> jax.Array:
      weight = self.param(f"W_{name}", zeros, (self.heads, self.d_model, d_head))
      return jnp.einsum("bpd,hde->bphe", x, weight) + self.param(
        f"b_{name}", zeros, (self.heads, d_head)
      )

    q, k, v = project("Q"), project("K"), project("V")
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(d_head).astype(np.float32)
    positions = x.shape[1]
    causal = jnp.tril(jnp.ones((positions, positions), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    pattern = jax.nn.softmax(scores, axis=-1)
    mixed = jnp.einsum("bhqk,bkhe->bqhe", pattern, v)
    W_O = self.param("W_O", zeros, (self.heads, d_head, self.d_model))
    return jnp.einsum("bqhe,hed->bqd", mixed, W_O) + self.param("b_O", zeros, (self.d_model,))


class Block(nn.Module):
  """A pre-norm block: attention, then the MLP, each added to the residual stream."""

  shape: Shape

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    s = self.shape
    norm = {"epsilon": LN_EPSILON, "use_fast_variance": False}
    x = x + SelfAttention(s.d_model, s.heads, name="attn")(nn.LayerNorm(**norm, name="ln1")(x))
    return x + MLP(s.d_model, s.d_mlp, name="mlp")(nn.LayerNorm(**norm, name="ln2")(x))


class LinenGraphModel(nn.Module):
  """The port of the TransformerLens model: token ids `[1, positions]` to logits."""

  shape: Shape

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    s = self.shape
    x = nn.Embed(s.vocab, s.d_model, name="embed")(tokens)
    x = x + self.param("W_pos", nn.initializers.zeros, (s.positions, s.d_model))[: tokens.shape[1]]
    for layer in range(s.layers):
      x = Block(s, name=f"block_{layer}")(x)
    x = nn.LayerNorm(epsilon=LN_EPSILON, use_fast_variance=False, name="ln_final")(x)
    W_U = self.param("W_U", nn.initializers.zeros, (s.d_model, s.vocab))
    return x @ W_U + self.param("b_U", nn.initializers.zeros, (s.vocab,))


def mlp_sites(shape: Shape) -> list[str]:
  """The MLP calls of `LinenGraphModel`, in layer order (flaxlens's `at=`)."""
  return [f"block_{layer}/mlp" for layer in range(shape.layers)]


def linen_variables(weights: dict[str, np.ndarray], shape: Shape) -> dict[str, Any]:
  """The port's variables from the weights in TransformerLens's names."""

  def norm(prefix: str) -> dict[str, np.ndarray]:
    return {"scale": weights[f"{prefix}.w"], "bias": weights[f"{prefix}.b"]}

  params: dict[str, Any] = {
    "embed": {"embedding": weights["embed.W_E"]},
    "W_pos": weights["pos_embed.W_pos"],
    "ln_final": norm("ln_final"),
    "W_U": weights["unembed.W_U"],
    "b_U": weights["unembed.b_U"],
  }
  for layer in range(shape.layers):
    p = f"blocks.{layer}"
    attention = {f"{k}_{n}": weights[f"{p}.attn.{k}_{n}"] for k in "Wb" for n in "QKVO"}
    mlp = {n: weights[f"{p}.mlp.{n}"] for n in ("W_in", "b_in", "W_out", "b_out")}
    params[f"block_{layer}"] = {
      "ln1": norm(f"{p}.ln1"), "ln2": norm(f"{p}.ln2"), "attn": attention, "mlp": mlp,
    }  # fmt: skip
  return {"params": jax.tree.map(jnp.asarray, params)}


# --- the weights and prompts ---------------------------------------------------------------------


def _model_weights(shape: Shape, rng: np.random.Generator) -> dict[str, np.ndarray]:
  s, d_head = shape, shape.d_model // shape.heads

  def normal(scale: float, *dims: int) -> np.ndarray:
    return (scale * rng.standard_normal(dims)).astype(np.float32)

  weights = {
    "embed.W_E": normal(1.0, s.vocab, s.d_model),
    "pos_embed.W_pos": normal(0.5, s.positions, s.d_model),
    "ln_final.w": 1 + normal(0.1, s.d_model),
    "ln_final.b": normal(0.1, s.d_model),
    "unembed.W_U": normal(s.d_model**-0.5, s.d_model, s.vocab),
    "unembed.b_U": normal(0.1, s.vocab),
  }
  for layer in range(s.layers):
    p = f"blocks.{layer}"
    for norm in ("ln1", "ln2"):
      weights |= {
        f"{p}.{norm}.w": 1 + normal(0.1, s.d_model),
        f"{p}.{norm}.b": normal(0.1, s.d_model),
      }
    for n in "QKV":
      weights[f"{p}.attn.W_{n}"] = normal(s.d_model**-0.5, s.heads, s.d_model, d_head)
      weights[f"{p}.attn.b_{n}"] = normal(0.1, s.heads, d_head)
    weights[f"{p}.attn.W_O"] = normal(s.d_model**-0.5, s.heads, d_head, s.d_model)
    weights[f"{p}.attn.b_O"] = normal(0.1, s.d_model)
    weights[f"{p}.mlp.W_in"] = normal(s.d_model**-0.5, s.d_model, s.d_mlp)
    weights[f"{p}.mlp.b_in"] = normal(0.1, s.d_mlp)
    weights[f"{p}.mlp.W_out"] = normal(s.d_mlp**-0.5, s.d_mlp, s.d_model)
    weights[f"{p}.mlp.b_out"] = normal(0.1, s.d_model)
  return weights


def _mlp_inputs(weights: dict[str, np.ndarray], shape: Shape, prompts: np.ndarray) -> np.ndarray:
  """Each layer's MLP input on `prompts` past position 0, `[layers, tokens, d_model]`."""

  def is_ln2(module: nn.Module, method: str) -> bool:
    return module.name == "ln2" and method == "__call__"

  model, variables = LinenGraphModel(shape), linen_variables(weights, shape)
  run = jax.jit(
    lambda v, t: model.apply(v, t, capture_intermediates=is_ln2, mutable=["intermediates"])
  )
  found = []
  for tokens in prompts:
    _, state = run(variables, tokens[None])
    found.append(
      [
        state["intermediates"][f"block_{layer}"]["ln2"]["__call__"][0][0, 1:]
        for layer in range(shape.layers)
      ]
    )
  return np.concatenate([np.stack(f) for f in found], axis=1)


def write_weights(shape: Shape, folder: Path, prompts: int, seed: int = 0) -> None:
  """Writes `model.safetensors`, `transcoders/layer_{i}.safetensors` and `prompts.npy`
  (`prompts` random prompts, each starting with token 0) under `folder`."""
  from safetensors.numpy import save_file

  rng = np.random.default_rng(seed)
  weights = _model_weights(shape, rng)
  tokens = rng.integers(1, shape.vocab, (prompts, shape.positions)).astype(np.int32)
  tokens[:, 0] = 0
  np.save(folder / "prompts.npy", tokens)
  save_file(weights, str(folder / "model.safetensors"))
  inputs = _mlp_inputs(weights, shape, tokens)
  (folder / "transcoders").mkdir()
  for layer in range(shape.layers):
    W_enc = (shape.d_model**-0.5 * rng.standard_normal((shape.width, shape.d_model))).astype(
      np.float32
    )
    pre = inputs[layer] @ W_enc.T
    threshold = np.quantile(pre, 1 - shape.l0 / shape.width)
    transcoder = {
      "W_enc": W_enc,
      "b_enc": np.full(shape.width, -threshold, np.float32),
      "W_dec": (shape.d_model**-0.5 * rng.standard_normal((shape.width, shape.d_model))).astype(
        np.float32
      ),
      "b_dec": (0.1 * rng.standard_normal(shape.d_model)).astype(np.float32),
    }
    save_file(transcoder, str(folder / "transcoders" / f"layer_{layer}.safetensors"))


# --- the workers, from this process ---------------------------------------------------------------


def _env() -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), ONE_THREAD]))
  return {**env, "JAX_PLATFORMS": "cpu"}


def _spec(
  shape: Shape, folder: Path, batch_size: int, max_feature_nodes: int | None
) -> dict[str, Any]:
  return {
    "folder": str(folder), "shape": dataclasses.asdict(shape),
    "prompts": str(folder / "prompts.npy"), "batch_size": batch_size,
    "max_feature_nodes": max_feature_nodes, "core": CORE,
  }  # fmt: skip


def _workers(spec: dict[str, Any]) -> tuple[_Worker, _Worker | None]:
  ours = _Worker([sys.executable, "-m", "bench.cases.graphs", "worker", json.dumps(spec)], _env())
  python = os.environ.get(CIRCUIT_TRACER_PYTHON)
  if not python:
    return ours, None
  script = str(REPO / "bench" / "circuit_tracer_graph.py")
  return ours, _Worker([python, script, "worker", json.dumps(spec)], _env())


def _agreement(
  folder: Path, ours: _Worker, theirs: _Worker, shape: Shape, check_graph: bool
) -> str:
  """Fails unless the port's logits equal TransformerLens's within `LOGITS_TOLERANCE`;
  with `check_graph`, compares the two adjacencies of the second prompt."""
  port, lens = np.load(folder / "fl_logits.npy"), np.load(folder / "tl_logits.npy")
  gap = float(np.max(np.abs(port - lens)))
  if gap > LOGITS_TOLERANCE:
    raise RuntimeError(
      f"{NAME}: the Linen port's logits differ from TransformerLens's by {gap:.2e} (more than"
      f" {LOGITS_TOLERANCE}) at {shape.label}; the two sides would not compute the same graph."
    )
  said = f"port logits within {gap:.1e} of TransformerLens's"
  if not check_graph:
    return said
  mine, reference = ours.ask("save 1"), theirs.ask("save 1")
  a, b = np.load(folder / "fl_adjacency.npy"), np.load(folder / "ct_adjacency.npy")
  if a.shape != b.shape:
    return (
      f"{said}; the graphs differ in size: {mine['features']} features and"
      f" {mine['logits']} logits vs {reference['features']} and {reference['logits']}"
    )
  return (
    f"{said}; graphs of {mine['features']} features, {mine['logits']} logits, adjacencies"
    f" within {np.max(np.abs(a - b)):.1e} (largest entry {np.max(np.abs(b)):.2f})"
  )


def _time_rows(chosen: GraphSizes, timed: Timed, folder: Path, progress: Progress) -> list[Row]:
  """Time per graph against circuit-tracer, and the compilations of a second prompt."""
  shape = timed.shape
  progress(f"{NAME}: weights and prompts ({shape.label})")
  write_weights(shape, folder, prompts=2)
  ours, theirs = _workers(_spec(shape, folder, chosen.batch_size, None))
  try:
    agreement = "" if theirs is None else _agreement(folder, ours, theirs, shape, shape == TINY)
    contenders = {"flaxlens": lambda: ours.ask("run 1")}
    if theirs is not None:
      contenders["circuit-tracer"] = lambda: theirs.ask("run 1")
    progress(f"{NAME}: time per graph ({', '.join(contenders)}; {shape.label})")
    samples = interleaved(contenders, timed.reps, warm_up=timed.warm_up and theirs is not None)
  finally:
    for worker in (ours, theirs):
      if worker is not None:
        worker.close()
  ready, fld = ours.ready, samples["flaxlens"]
  what = (
    f"time per graph, flaxlens / circuit-tracer ({shape.label}, full graph,"
    f" batch {chosen.batch_size})"
  )
  compiled = (
    f"first call (compiling) {seconds(ready['first'])}, {ready['first_compiles']} compilations"
    f" taking {seconds(ready['first_compile_seconds'])}"
  )
  last = max(fld, key=lambda sample: sample["calls"])
  rows = [
    Row(
      NAME,
      f"XLA compilations of flaxlens's graphs of a second prompt of the same length, after"
      f" the first prompt's ({shape.label})",
      "graph_second_prompt_compiles",
      measured=f"**{last['since_ready']}**",
      status="PASS" if last["since_ready"] == 0 else "MISS",
      note=f"{compiled}; {last['calls']} graph(s) of the second prompt since",
    )
  ]
  if theirs is None:
    reason = f"not installed ({CIRCUIT_TRACER_PYTHON} unset)"
    rows.append(
      Row(NAME, what, "graph_time_vs_circuit_tracer", measured=seconds(median(fld)), status=reason)
    )
    return rows
  ct = samples["circuit-tracer"]
  rows.append(
    Row(
      NAME,
      what,
      "graph_time_vs_circuit_tracer",
      ratios(fld, ct),
      f"{seconds(median(fld))} vs {seconds(median(ct))}",
      note=(
        f"{fld[0]['features']} features, {fld[0]['logits']} logits ({ct[0]['features']} and"
        f" {ct[0]['logits']} for circuit-tracer); {timed.reps} repetition(s); {agreement};"
        f" circuit-tracer on torch"
        f" {theirs.ready['ready']}, both pinned to one core, one thread; flaxlens's {compiled}"
      ),
      analysis=(
        f"per row (features + logits): flaxlens"
        f" {seconds(median(fld) / (fld[0]['features'] + fld[0]['logits']))}, circuit-tracer"
        f" {seconds(median(ct) / (ct[0]['features'] + ct[0]['logits']))}; flaxlens compiled"
        f" {max(s['compiles'] for s in fld)} programs during timed calls"
      ),
    )
  )
  return rows


def _fresh(shape: Shape, folder: Path, spec: dict[str, Any], side: str) -> dict[str, Any]:
  """One graph in a fresh process of `side` ("flaxlens" or "circuit-tracer"): its peak
  memory or the error that stopped it."""
  if side == "flaxlens":
    command = [sys.executable, "-m", "bench.cases.graphs", "memory", json.dumps(spec)]
  else:
    script = str(REPO / "bench" / "circuit_tracer_graph.py")
    command = [os.environ[CIRCUIT_TRACER_PYTHON], script, "memory", json.dumps(spec)]
  done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True)
  if done.returncode != 0 or not done.stdout.strip():
    return {"failed": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:200]}"}
  return json.loads(done.stdout.strip().splitlines()[-1])


def _peak_text(found: dict[str, Any]) -> str:
  if "failed" in found:
    return f"failed ({found['failed']})"
  return (
    f"{nbytes(found['peak'])} (virtual {nbytes(found['virtual'])}, {seconds(found['seconds'])})"
  )


def _memory_row(chosen: GraphSizes, folder: Path, progress: Progress) -> Row:
  shape = chosen.memory
  progress(f"{NAME}: peak memory ({shape.label}), each side in a fresh process")
  write_weights(shape, folder, prompts=2)
  spec = _spec(shape, folder, chosen.memory_batch_size, chosen.memory_features)
  spec |= {"prompt": 1, "budget": None, "limit_bytes": None}
  ours = _fresh(shape, folder, spec, "flaxlens")
  what = (
    f"peak RSS of a graph, flaxlens / circuit-tracer ({shape.label}, L0 about {shape.l0:g},"
    f" {chosen.memory_features} feature nodes, batch {chosen.memory_batch_size})"
  )
  if "failed" in ours:
    raise RuntimeError(f"{NAME}: the flaxlens memory run failed: {ours['failed']}")
  if not os.environ.get(CIRCUIT_TRACER_PYTHON):
    reason = f"not installed ({CIRCUIT_TRACER_PYTHON} unset)"
    return Row(
      NAME, what, "graph_memory_vs_circuit_tracer", measured=_peak_text(ours), status=reason
    )
  theirs = _fresh(shape, folder, spec, "circuit-tracer")
  note = (
    f"VmHWM reset as the call starts (the first call: flaxlens's compilation included);"
    f" resident when it started {nbytes(ours['before'])} vs"
    f" {nbytes(theirs.get('before', 0))}; {ours['features']} of {ours['active']} active features"
  )
  if "failed" in theirs:
    return Row(
      NAME,
      what,
      "graph_memory_vs_circuit_tracer",
      measured=_peak_text(theirs),
      status="circuit-tracer failed",
      note=note,
    )
  return Row(
    NAME,
    what,
    "graph_memory_vs_circuit_tracer",
    np.array([ours["peak"] / theirs["peak"]]),
    f"{_peak_text(ours)} vs {_peak_text(theirs)}",
    note=note,
    analysis=(
      f"above the resident set at the call's start: flaxlens"
      f" {nbytes(ours['peak'] - ours['before'])}, circuit-tracer"
      f" {nbytes(theirs['peak'] - theirs['before'])}"
    ),
  )


def _long_row(chosen: GraphSizes, folder: Path, progress: Progress) -> Row:
  shape = chosen.long
  progress(f"{NAME}: a long graph under a budget ({shape.label}; slow)")
  write_weights(shape, folder, prompts=2)
  spec = _spec(shape, folder, chosen.memory_batch_size, chosen.long_features)
  spec |= {"prompt": 1, "budget": chosen.long_budget, "limit_bytes": chosen.long_limit}
  ours = _fresh(shape, folder, spec, "flaxlens")
  what = (
    f"a graph of {shape.positions} tokens ({shape.label}, {chosen.long_features} feature nodes)"
    f" in one address-space limit (RLIMIT_AS {nbytes(chosen.long_limit)}): flaxlens with"
    f" budget={nbytes(chosen.long_budget)}, circuit-tracer with batch_size=1"
  )
  if "failed" in ours:
    return Row(NAME, what, "graph_long_under_budget", measured=_peak_text(ours), status="MISS")
  if not os.environ.get(CIRCUIT_TRACER_PYTHON):
    reason = f"not installed ({CIRCUIT_TRACER_PYTHON} unset)"
    return Row(NAME, what, "graph_long_under_budget", measured=_peak_text(ours), status=reason)
  progress(f"{NAME}: circuit-tracer at {shape.positions} tokens under RLIMIT_AS")
  spec["batch_size"] = 1  # circuit-tracer's most frugal setting
  theirs = _fresh(shape, folder, spec, "circuit-tracer")
  return Row(
    NAME,
    what,
    "graph_long_under_budget",
    measured=f"flaxlens {_peak_text(ours)}; circuit-tracer {_peak_text(theirs)}",
    status="PASS" if "failed" in theirs else "MISS",
    note=(
      "each side in a fresh process under the same RLIMIT_AS (virtual memory: the limit"
      " Linux can enforce); circuit-tracer's batch_size=1 is the least memory it can use;"
      f" {ours['features']} of {ours['active']} active features; peaks are VmHWM reset as"
      " the call starts (flaxlens's first call: compilation included)"
    ),
  )


def measure(subjects: Any, sizes: Sizes, progress: Progress) -> list[Row]:
  chosen = SIZES.get(sizes, SIZES[FULL])
  rows = []
  with tempfile.TemporaryDirectory(prefix="flaxlens-bench-graphs-") as directory:
    for number, timed in enumerate(chosen.timed):
      folder = Path(directory) / f"timed_{number}"
      folder.mkdir()
      rows += _time_rows(chosen, timed, folder, progress)
    if chosen.memory is not None:
      (Path(directory) / "memory").mkdir()
      rows.append(_memory_row(chosen, Path(directory) / "memory", progress))
    if chosen.long is not None:
      (Path(directory) / "long").mkdir()
      rows.append(_long_row(chosen, Path(directory) / "long", progress))
  return rows


# --- in the worker processes ------------------------------------------------------------------


class _Compilations:
  """Counts XLA compilations (and their seconds) from `jax.monitoring`'s events."""

  def __init__(self):
    self.count, self.seconds = 0, 0.0
    jax.monitoring.register_event_duration_secs_listener(self._heard)

  def _heard(self, event: str, duration: float, **kwargs: Any) -> None:
    del kwargs
    if event == COMPILE_EVENT:
      self.count += 1
      self.seconds += duration


def _graphs(spec: dict[str, Any]) -> tuple[Any, np.ndarray, Any]:
  """The port, the prompts, and a function computing the graph of prompt `i`."""
  from safetensors.numpy import load_file

  import flaxlens as fl
  import flaxlens.dictionaries as fld
  import flaxlens.graphs as flg

  shape, folder = Shape(**spec["shape"]), Path(spec["folder"])
  model = LinenGraphModel(shape)
  variables = linen_variables(load_file(str(folder / "model.safetensors")), shape)
  prompts = np.load(folder / "prompts.npy", allow_pickle=False)
  tree = fl.unflaxify(model, variables, prompts[:1])
  transcoders = fld.load_circuit_tracer(folder / "transcoders")

  def graph(index: int, budget: int | None = None) -> Any:
    return flg.attribute(
      tree, prompts[index : index + 1], transcoders, mlp_sites(shape),
      batch_size=spec["batch_size"], max_feature_nodes=spec["max_feature_nodes"], budget=budget,
    )  # fmt: skip

  return (model, variables), prompts, graph


def _timed(graph: Any, index: int, compilations: _Compilations) -> tuple[Any, dict[str, Any]]:
  count, spent = compilations.count, compilations.seconds
  start = time.perf_counter()
  found = graph(index)
  took = time.perf_counter() - start
  return found, {
    "total": took,
    "compiles": compilations.count - count,
    "compile_seconds": compilations.seconds - spent,
    "features": int(found.n_features),
    "logits": len(found.targets.ids),
  }


def _worker(spec: dict[str, Any]) -> None:
  """The flaxlens worker: compiles on prompt 0, then answers "run I" and "save I" as the
  circuit-tracer worker does, with the compilations since prompt 0's graph."""
  os.sched_setaffinity(0, {spec["core"]})
  compilations = _Compilations()
  (model, variables), prompts, graph = _graphs(spec)
  folder = Path(spec["folder"])
  np.save(folder / "fl_logits.npy", np.asarray(model.apply(variables, prompts[:1]))[0])
  _, first = _timed(graph, 0, compilations)
  ready = {
    "first": first["total"], "first_compiles": first["compiles"],
    "first_compile_seconds": first["compile_seconds"],
  }  # fmt: skip
  print(json.dumps(ready), flush=True)
  count, calls = compilations.count, 0
  for line in sys.stdin:
    command, index = line.split()
    found, answer = _timed(graph, int(index), compilations)
    calls += 1
    if command == "save":
      np.save(folder / "fl_adjacency.npy", found.adjacency)
    answer |= {"since_ready": compilations.count - count, "calls": calls}
    print(json.dumps(answer), flush=True)


def _memory(spec: dict[str, Any]) -> None:
  """In a fresh process (under `limit_bytes` of address space, where given): one graph,
  and the peak resident set during the call."""
  os.sched_setaffinity(0, {spec["core"]})
  if spec["limit_bytes"]:
    resource.setrlimit(resource.RLIMIT_AS, (spec["limit_bytes"], spec["limit_bytes"]))
  _, _, graph = _graphs(spec)
  reset = _reset_peak()
  before = _status("VmRSS")
  start = time.perf_counter()
  found = graph(spec["prompt"], spec["budget"])
  took = time.perf_counter() - start
  process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  peak = _status("VmHWM") if reset else process_peak
  print(
    json.dumps(
      {
        "peak": peak,
        "before": before,
        "reset": reset,
        "process_peak": process_peak,
        "virtual": _status("VmPeak"),
        "seconds": took,
        "features": int(found.n_features),
        "active": len(found.active_features),
        "logits": len(found.targets.ids),
      }
    )  # fmt: skip
  )


if __name__ == "__main__":
  if sys.argv[1] == "worker":
    _worker(json.loads(sys.argv[2]))
  else:
    _memory(json.loads(sys.argv[2]))
