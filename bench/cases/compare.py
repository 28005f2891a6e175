"""Case 14: flaxlens next to the PyTorch tools a user would otherwise pick, on one GPT-2.

One GPT-2 (Hugging Face's `FlaxGPT2LMHeadModel`, random weights, sizes below) is copied
into PyTorch (`GPT2LMHeadModel`, the same weights), TransformerLens (`HookedTransformer`
from a config, the same weights loaded unprocessed) and nnsight (`NNsight` wrapping the
PyTorch model); before anything is timed, every library's result of every task is
checked against flaxlens's (allclose). Tasks, each written the way its library does it:

- forward: the logits (flaxlens `fl.run`; TransformerLens `model(tokens)`; nnsight a
  trace saving the output; PyTorch the model call);
- capture: every block's output (`fl.capture`; `run_with_cache` of every
  `hook_resid_post`; a trace saving every block's output; forward hooks);
- steer: add `alpha * v` to the middle block's output for 20 strengths, last-position
  logits of each (flaxlens: one `fl.variable_jit` program `jax.vmap`-ed over the
  strengths; TransformerLens and nnsight: one forward over the batch repeated for every
  strength, each copy steered by its own strength, with a hook or an in-place edit);
- sweep: activation patching of every block's output at every position, one clean and
  one corrupted prompt, the metric one logit at the last position (`fl.sweep`;
  TransformerLens's own `patching.generic_activation_patch`, its loop of
  `run_with_hooks`; nnsight one trace over the corrupted prompt repeated blocks x
  positions times, each copy patched at its own block and position);
- attribute: attribution patching over the same grid (`fl.attribute`; the
  TransformerLens and nnsight recipes: clean activations, then the corrupted run's
  activations and gradients from one backward pass).

Steady state: the contenders run interleaved in this process, after a warm-up, under
`torch.no_grad` except for attribution. First call: for every repetition, library and
task, a fresh Python process builds the model untimed and times the task's first call
(compilation included for flaxlens; with a persistent compilation cache, warmed by an
untimed process first, where `fl.enable_compilation_cache` exists). The ratio is
flaxlens over the faster of TransformerLens and nnsight, per repetition. Without
PyTorch, TransformerLens, nnsight, or a Flax-capable transformers (< 5), the rows say
"not installed" (`pip install -e ".[bench,models]"`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import Progress, Sample, interleaved, median, seconds
from bench.models import QUICK, Sizes
from bench.report import REPO, Row

NAME = "14. vs PyTorch tools"
USES_SUBJECTS = False  # it builds its own GPT-2
TASKS = ("forward", "capture", "steer", "sweep", "attribute")
PEERS = ("transformer_lens", "nnsight")
LIBRARIES = ("flaxlens", *PEERS, "pytorch")
PYTORCH_TASKS = ("forward", "capture")  # plain PyTorch, for context: no tool around it
# PyTorch's intra-op threads. On the shared 2-core machine (load about 7), 2 OpenMP
# threads made a forward 4-6x slower than 1 thread (the threads wait on each other at
# every operation), and 30x slower next to JAX's thread pool in one process; 1 thread is
# PyTorch's best setting here. JAX keeps its defaults.
TORCH_THREADS = 1
ANSWER = 7  # the token whose last-position logit is the patching metric
LABELS = {
  "forward": "forward (logits)",
  "capture": "capture every block's output",
  "steer": "steer with 20 strengths",
  "sweep": "blocks x positions patching sweep",
  "attribute": "attribution patching, blocks x positions",
}
SHORT = {"flaxlens": "fl", "transformer_lens": "TL", "nnsight": "nnsight", "pytorch": "PyTorch"}


@dataclasses.dataclass(frozen=True)
class CompareSizes:
  """The GPT-2 of this case and its repetitions."""

  layers: int
  width: int
  heads: int
  vocab: int
  seq: int
  batch: int  # of forward, capture and steer; the sweeps take one prompt pair
  strengths: int
  steady_reps: int
  first_reps: int


FULL = CompareSizes(6, 256, 4, 2048, 64, 4, 20, 5, 2)
SMALL = CompareSizes(2, 32, 2, 64, 8, 2, 20, 2, 1)


def missing() -> list[str]:
  """The packages this case needs that are not installed (or too new to have Flax)."""
  gone = [p for p in ("torch", *PEERS, "transformers") if importlib.util.find_spec(p) is None]
  if "transformers" not in gone:
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
      gone.append(f"transformers < 5 (has {transformers.__version__}, without Flax models)")
  return gone


# --- the model and its weights ------------------------------------------------------------


def _config(s: CompareSizes) -> Any:
  import transformers

  return transformers.GPT2Config(
    vocab_size=s.vocab, n_positions=s.seq, n_embd=s.width, n_layer=s.layers, n_head=s.heads
  )


def make_weights(s: CompareSizes) -> dict[str, np.ndarray]:
  """Random GPT-2 weights (Hugging Face's own Flax initialiser), flat `a/b/c` keys."""
  import jax
  import jax.numpy as jnp
  import transformers
  from flax import traverse_util

  module = transformers.FlaxGPT2LMHeadModel(_config(s), _do_init=False).module
  ids = jnp.zeros((1, s.seq), jnp.int32)
  params = jax.jit(module.init)(jax.random.key(0), ids, jnp.ones_like(ids), jnp.arange(s.seq)[None])
  flat = traverse_util.flatten_dict(params["params"], sep="/")
  return {key: np.asarray(value) for key, value in flat.items()}


def inputs(s: CompareSizes) -> dict[str, np.ndarray]:
  """Token ids: a batch for forward, capture and steer; a clean and corrupted prompt pair."""
  rng = np.random.default_rng(1)
  batch = rng.integers(0, s.vocab, (s.batch, s.seq)).astype(np.int32)
  clean = rng.integers(0, s.vocab, (1, s.seq)).astype(np.int32)
  return {"batch": batch, "clean": clean, "corrupted": clean[:, ::-1].copy()}


def steering(s: CompareSizes) -> tuple[np.ndarray, np.ndarray]:
  """The steering vector and the strengths."""
  v = np.random.default_rng(2).standard_normal(s.width).astype(np.float32)
  return v / np.linalg.norm(v), np.linspace(0.0, 8.0, s.strengths, dtype=np.float32)


def torch_state(weights: dict[str, np.ndarray]) -> dict[str, Any]:
  """Flax GPT-2 weights as `GPT2LMHeadModel`'s state dict (Conv1D kernels transposed)."""
  import torch

  names = {"scale": "weight", "embedding": "weight", "bias": "bias", "kernel": "weight"}
  state = {}
  for key, value in weights.items():
    *path, leaf = key.split("/")
    state[".".join([*path, names[leaf]])] = torch.from_numpy(
      value.T.copy() if leaf == "kernel" else value.copy()
    )
  state["lm_head.weight"] = state["transformer.wte.weight"]
  return state


# --- the libraries: each builds its model and answers the five tasks ---------------------


class Flaxlens:
  """flaxlens on the Hugging Face Flax GPT-2 (Linen), converted once."""

  def __init__(self, s: CompareSizes, weights: dict[str, np.ndarray]):
    import jax
    import jax.numpy as jnp
    import transformers
    from flax import traverse_util

    import flaxlens as fl

    self.s, self.fl, self.jax, self.jnp = s, fl, jax, jnp
    module = transformers.FlaxGPT2LMHeadModel(_config(s), _do_init=False).module
    params = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in weights.items()})
    data = inputs(s)
    self.args = {name: self._args(ids) for name, ids in data.items()}
    self.tree = fl.unflaxify(module, {"params": jax.device_put(params)}, *self.args["batch"])
    v, alphas = steering(s)
    self.v, self.alphas = jnp.asarray(v), jnp.asarray(alphas)
    middle = f"transformer/h/{s.layers // 2}"
    batch = self.args["batch"]

    def steer(tree: Any, v: Any, alphas: Any) -> Any:
      def one(alpha: Any) -> Any:
        edit = fl.steer(middle, v, alpha=alpha, part=0)
        return fl.run(tree, batch, interventions=[edit], jit=False).logits[:, -1]

      return jax.vmap(one)(alphas)

    self.steer_program = fl.variable_jit(steer)

  def _args(self, ids: np.ndarray) -> tuple[Any, ...]:
    jnp = self.jnp
    ids = jnp.asarray(ids)
    return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)

  @staticmethod
  def metric(output: Any) -> Any:
    return output.logits[0, -1, ANSWER]

  def forward(self) -> Any:
    return self.fl.run(self.tree, self.args["batch"]).logits

  def capture(self) -> Any:
    _, cache = self.fl.capture(self.tree, self.args["batch"], "transformer/h/*")
    return [cache[f"transformer/h/{i}"][0] for i in range(self.s.layers)]

  def steer(self) -> Any:
    return self.steer_program(self.tree, self.v, self.alphas)

  def _grid(self, tool: Callable[..., Any]) -> Any:
    args = self.args
    positions = range(self.s.seq)
    sites = "transformer/h/*"
    return tool(
      self.tree, args["clean"], args["corrupted"], sites, self.metric, positions=positions, part=0
    ).values

  def sweep(self) -> Any:
    return self._grid(self.fl.sweep)

  def attribute(self) -> Any:
    return self._grid(self.fl.attribute)

  def result(self, value: Any) -> Any:
    return self.jax.block_until_ready(value)


class _Torch:
  """What the PyTorch libraries share: the Hugging Face PyTorch GPT-2 and the inputs."""

  def __init__(self, s: CompareSizes, weights: dict[str, np.ndarray]):
    import torch
    import transformers

    self.s, self.torch = s, torch
    torch.set_num_threads(TORCH_THREADS)
    self.hf = transformers.GPT2LMHeadModel(_config(s)).eval()
    self.hf.load_state_dict(torch_state(weights))
    data = inputs(s)
    self.ids = {name: torch.from_numpy(ids.astype(np.int64)) for name, ids in data.items()}
    v, alphas = steering(s)
    self.v = torch.from_numpy(v)
    # One row per (strength, example): the batch repeated once per strength.
    self.steer_ids = self.ids["batch"].repeat(s.strengths, 1)
    self.row_alphas = torch.from_numpy(alphas).repeat_interleave(s.batch)[:, None, None]

  def result(self, value: Any) -> Any:
    return value

  def no_grad(self) -> Any:
    return self.torch.no_grad()


class PyTorch(_Torch):
  """Plain PyTorch: the Hugging Face model call and forward hooks, no tool around them."""

  def forward(self) -> Any:
    with self.no_grad():
      return self.hf(self.ids["batch"]).logits

  def capture(self) -> Any:
    outputs = []
    hooks = [
      block.register_forward_hook(lambda m, i, o: outputs.append(o[0]))
      for block in self.hf.transformer.h
    ]
    try:
      with self.no_grad():
        self.hf(self.ids["batch"])
    finally:
      for hook in hooks:
        hook.remove()
    return outputs


class TransformerLens(_Torch):
  """TransformerLens: a `HookedTransformer` from a config, holding the same weights."""

  def __init__(self, s: CompareSizes, weights: dict[str, np.ndarray]):
    super().__init__(s, weights)
    from transformer_lens import HookedTransformer, HookedTransformerConfig, patching
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    config = HookedTransformerConfig(
      n_layers=s.layers,
      d_model=s.width,
      n_ctx=s.seq,
      d_head=s.width // s.heads,
      n_heads=s.heads,
      d_mlp=4 * s.width,
      d_vocab=s.vocab,
      act_fn="gelu_new",
      normalization_type="LN",
      eps=1e-5,
      device="cpu",
      default_prepend_bos=False,
    )
    self.model = HookedTransformer(config).eval()
    self.model.load_and_process_state_dict(
      convert_gpt2_weights(self.hf, config),
      fold_ln=False,
      center_writing_weights=False,
      center_unembed=False,
      fold_value_biases=False,
      refactor_factored_attn_matrices=False,
    )
    self.patching = patching
    self.names = [f"blocks.{i}.hook_resid_post" for i in range(s.layers)]
    del self.hf

  def forward(self) -> Any:
    with self.no_grad():
      return self.model(self.ids["batch"])

  def capture(self) -> Any:
    names = set(self.names)
    with self.no_grad():
      _, cache = self.model.run_with_cache(self.ids["batch"], names_filter=names.__contains__)
    return [cache[name] for name in self.names]

  def steer(self) -> Any:
    def hook(value: Any, hook: Any) -> Any:
      return value + self.row_alphas * self.v

    middle = self.names[self.s.layers // 2]
    with self.no_grad():
      logits = self.model.run_with_hooks(self.steer_ids, fwd_hooks=[(middle, hook)])
    return logits[:, -1].reshape(self.s.strengths, self.s.batch, -1)

  @staticmethod
  def metric(logits: Any) -> Any:
    return logits[0, -1, ANSWER]

  def sweep(self) -> Any:
    names = set(self.names)
    with self.no_grad():
      _, clean = self.model.run_with_cache(self.ids["clean"], names_filter=names.__contains__)
      return self.patching.generic_activation_patch(
        self.model,
        self.ids["corrupted"],
        clean,
        self.metric,
        self.patching.layer_pos_patch_setter,
        "resid_post",
        index_axis_names=("layer", "pos"),
      )

  def attribute(self) -> Any:
    names = set(self.names)
    with self.no_grad():
      _, clean = self.model.run_with_cache(self.ids["clean"], names_filter=names.__contains__)
    values, grads = {}, {}

    def keep(value: Any, hook: Any) -> None:
      values[hook.name] = value.detach()

    def keep_grad(grad: Any, hook: Any) -> None:
      grads[hook.name] = grad.detach()

    is_site = names.__contains__
    with self.model.hooks(fwd_hooks=[(is_site, keep)], bwd_hooks=[(is_site, keep_grad)]):
      self.metric(self.model(self.ids["corrupted"])).backward()
    self.model.zero_grad(set_to_none=True)
    return self.torch.stack([((clean[n] - values[n]) * grads[n]).sum(-1)[0] for n in self.names])


class NNsight(_Torch):
  """nnsight wrapping the Hugging Face PyTorch GPT-2."""

  def __init__(self, s: CompareSizes, weights: dict[str, np.ndarray]):
    super().__init__(s, weights)
    from nnsight import NNsight as Wrapper

    self.model = Wrapper(self.hf)
    self.blocks = self.model.transformer.h
    rows = self.torch.arange(s.layers * s.seq)
    # The sweep's batch: the corrupted prompt once per (block, position); row r patches
    # block r // seq at position r % seq.
    self.sweep_ids = self.ids["corrupted"].repeat(s.layers * s.seq, 1)
    self.sweep_rows = [rows[i * s.seq : (i + 1) * s.seq] for i in range(s.layers)]
    self.positions = self.torch.arange(s.seq)

  def forward(self) -> Any:
    with self.no_grad(), self.model.trace(self.ids["batch"]):
      logits = self.model.output.logits.save()
    return logits

  def capture(self) -> Any:
    outputs = []  # nnsight runs the with block's own code: a loop, not a comprehension
    with self.no_grad(), self.model.trace(self.ids["batch"]):
      for block in self.blocks:
        outputs.append(block.output[0].save())
    return outputs

  def steer(self) -> Any:
    middle = self.blocks[self.s.layers // 2]
    with self.no_grad(), self.model.trace(self.steer_ids):
      middle.output[0][:] += self.row_alphas * self.v
      logits = self.model.output.logits[:, -1].save()
    return logits.reshape(self.s.strengths, self.s.batch, -1)

  def _clean(self) -> list[Any]:
    clean = []
    with self.no_grad(), self.model.trace(self.ids["clean"]):
      for block in self.blocks:
        clean.append(block.output[0].save())
    return clean

  def sweep(self) -> Any:
    clean = self._clean()
    with self.no_grad(), self.model.trace(self.sweep_ids):
      for block, rows, value in zip(self.blocks, self.sweep_rows, clean, strict=True):
        block.output[0][rows, self.positions] = value[0]
      metric = self.model.output.logits[:, -1, ANSWER].save()
    return metric.reshape(self.s.layers, self.s.seq)

  def attribute(self) -> Any:
    clean = self._clean()
    values, grads = [], []
    with self.model.trace(self.ids["corrupted"]):
      for block in self.blocks:
        values.append(block.output[0].save())
      metric = self.model.output.logits[0, -1, ANSWER]
      with metric.backward():  # gradients come in reverse order of the forward
        for value in reversed(values):
          grads.insert(0, value.grad.save())
    self.hf.zero_grad(set_to_none=True)
    return self.torch.stack(
      [((c - v) * g).sum(-1)[0] for c, v, g in zip(clean, values, grads, strict=True)]
    ).detach()


CLASSES = {
  "flaxlens": Flaxlens,
  "transformer_lens": TransformerLens,
  "nnsight": NNsight,
  "pytorch": PyTorch,
}


def tasks_of(library: str) -> tuple[str, ...]:
  return PYTORCH_TASKS if library == "pytorch" else TASKS


def as_numpy(value: Any) -> Any:
  if isinstance(value, list | tuple):
    return np.stack([as_numpy(v) for v in value])
  if hasattr(value, "detach"):
    return value.detach().numpy()
  return np.asarray(value)


# --- first calls: one fresh process per (library, task) ----------------------------------


def worker(library: str, task: str, folder: str, cache: str) -> None:
  """In a fresh process: build `library`'s model untimed, print its first `task` time."""
  if cache:
    import flaxlens as fl

    fl.enable_compilation_cache(cache)
  s = CompareSizes(**json.loads((Path(folder) / "sizes.json").read_text()))
  with np.load(Path(folder) / "weights.npz") as stored:
    weights = dict(stored)
  built = CLASSES[library](s, weights)
  start = time.perf_counter()
  built.result(getattr(built, task)())
  print(json.dumps({"first": time.perf_counter() - start}))


def first_call(library: str, task: str, folder: str, cache: str) -> float:
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
  }
  done = subprocess.run(
    [sys.executable, "-m", "bench.cases.compare", library, task, folder, cache],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  if done.returncode != 0:
    raise RuntimeError(f"first call of {library} {task} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])["first"]


# --- the case -------------------------------------------------------------------------------


def _rows(kind: str, samples: dict[str, dict[str, list[Sample]]], target: str) -> list[Row]:
  rows = []
  for task in TASKS:
    got = samples[task]
    best = np.minimum(*(np.array([x["total"] for x in got[p]]) for p in PEERS))
    ours = np.array([x["total"] for x in got["flaxlens"]])
    measured = ", ".join(f"{SHORT[lib]} {seconds(median(got[lib]))}" for lib in got)
    rows.append(
      Row(
        NAME,
        f"{kind}, {LABELS[task]}: flaxlens / best of TransformerLens, nnsight",
        target,
        ours / best,
        measured,
      )
    )
  return rows


def measure(subjects: Any, sizes: Sizes, progress: Progress) -> list[Row]:
  del subjects  # this case builds its own GPT-2
  s = SMALL if sizes == QUICK else FULL
  gone = missing()
  if gone:
    return [
      Row(
        NAME,
        f"{kind}, {LABELS[task]}",
        target,
        status="not installed",
        note=f"needs {', '.join(gone)}",
      )
      for kind, target in (("steady state", "compare_steady"), ("first call", "compare_first_call"))
      for task in TASKS
    ]
  import torch

  # TransformerLens's patching loop draws a progress bar; without it, it runs a bit faster.
  os.environ.setdefault("TQDM_DISABLE", "1")
  progress(f"{NAME}: building the GPT-2 in every library")
  weights = make_weights(s)
  built = {library: CLASSES[library](s, weights) for library in LIBRARIES}
  for task in TASKS:
    expected = as_numpy(built["flaxlens"].result(getattr(built["flaxlens"], task)()))
    for library in LIBRARIES[1:]:
      if task in tasks_of(library):
        got = as_numpy(getattr(built[library], task)())
        np.testing.assert_allclose(
          got, expected, rtol=2e-4, atol=2e-4, err_msg=f"{library} disagrees on {task}"
        )
  steady = {}
  for task in TASKS:
    progress(f"{NAME}: steady state, {task}")
    contenders = {
      library: (lambda b=built[library], task=task: _timed(b, task))
      for library in LIBRARIES
      if task in tasks_of(library)
    }
    steady[task] = interleaved(contenders, s.steady_reps)
  del built

  first: dict[str, dict[str, list[Sample]]] = {
    task: {lib: [] for lib in LIBRARIES if task in tasks_of(lib)} for task in TASKS
  }
  with tempfile.TemporaryDirectory() as folder:
    np.savez(Path(folder) / "weights.npz", **weights)
    (Path(folder) / "sizes.json").write_text(json.dumps(dataclasses.asdict(s)))
    cache = ""
    import flaxlens as fl

    if hasattr(fl, "enable_compilation_cache"):
      cache = str(Path(folder) / "jax-cache")
      for task in TASKS:
        progress(f"{NAME}: warming the compilation cache, {task}")
        first_call("flaxlens", task, folder, cache)
    for rep in range(s.first_reps):
      for task in TASKS:
        libraries = list(first[task])
        progress(f"{NAME}: first calls, {task}, repetition {rep + 1}/{s.first_reps}")
        for library in libraries if rep % 2 == 0 else reversed(libraries):
          first[task][library].append({"total": first_call(library, task, folder, cache)})
  notes = (
    f"Hugging Face GPT-2, {s.layers} layers, width {s.width}, {s.heads} heads, vocabulary"
    f" {s.vocab}, {s.seq} tokens, batch {s.batch} (the sweeps: one prompt pair, so"
    f" {s.layers * s.seq} patched forwards), float32; torch {torch.__version__},"
    f" {torch.get_num_threads()} threads"
  )
  rows = _rows("steady state", steady, "compare_steady") + _rows(
    "first call", first, "compare_first_call"
  )
  rows[0].note = notes
  rows[len(TASKS)].note = (
    "a fresh process per library, task and repetition; the model is built untimed, then its"
    " first call of the task is timed (JAX: tracing and compilation included"
    + ("; persistent compilation cache, warmed)" if cache else "; no persistent cache)")
  )
  return rows


def _timed(built: Any, task: str) -> Sample:
  start = time.perf_counter()
  built.result(getattr(built, task)())
  return {"total": time.perf_counter() - start}


if __name__ == "__main__":
  worker(*sys.argv[1:5])
