"""Case 15: training dictionaries (`fld.train`): throughput against SAELens and against a
bare optax step, streaming from the model against training from a store, and peak host
memory as the tokens grow.

Every timed contender runs in a worker process of its own, pinned to the same one CPU
(`os.sched_setaffinity`) with one compute thread (JAX: `XLA_FLAGS`
`--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`; PyTorch:
`torch.set_num_threads(1)`): the ratios then compare the work each side does per token,
not how each spreads over a shared machine's few busy cores. This process sends each
worker one command per repetition, interleaved as the harness does, and reads back its
times. The flaxlens worker is this module (`python -m bench.cases.dictionaries worker
SPEC`), the SAELens worker `bench/saelens_step.py`, run with the interpreter named by
`FLAXLENS_BENCH_SAELENS_PYTHON` (SAELens's pins clash with ours, so it lives in an
environment of its own; without it its rows say "not installed").

- Throughput: the same activations (synthetic rows: sparse combinations of unit
  directions plus noise, saved to a .npy both sides read), the same width, kind
  (standard ReLU + L1 and TopK), batch size, steps and learning rate (adam, constant).
  `fld.train` reads them through `fld.from_arrays` (a shuffled pass, rows copied to the
  device each step); SAELens runs `SAETrainer.step` on batches of a shuffled order (its
  training forward, loss, backward, gradient clipping, adam). A training call's time
  counts from the moment it asks for its second batch to its end (so `fld.train`'s
  compilation of its step, and SAELens's first-step warm-up, are left out; a whole
  call's time is in the notes). The bare step is a hand-written jitted `optax.adam`
  step of the same ReLU loss (squared error + L1 weighted by decoder norms) on one
  batch already on the device, run as many steps: what is left is the data path and
  the trainer's own per-step work (dead-feature counters, the non-finite guard).
- Streaming: an SAE on the last block's output of a 2-layer bench model, trained by
  `fld.train` on `fld.stream(tree, inputs, site)` (the model runs as rows are needed)
  against `fld.train` on a harvest store of the same rows (`fld.from_harvest`), plus
  the native forward that computes the site (`jax.jit` of `module.apply` with
  `capture_intermediates`, returning the block's output only, so XLA drops the rest of
  the model, as it does in the stream's program) over as many tokens as the streamed
  steps consumed: the bound is on stream / (store + forward).
- Memory: `fld.train` of a d=16, width-64 ReLU SAE over 10 M and 100 M tokens, each
  run in a fresh subprocess on rows generated batch by batch (never held), reporting
  the peak resident set during the call (VmHWM, reset as the call starts, as case 11
  does; the process's `ru_maxrss` where it cannot be reset).
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.cases.harvest import _reset_peak, _status
from bench.harness import Progress, Sample, interleaved, median, nbytes, ratios, seconds
from bench.models import FULL, QUICK, Sizes
from bench.report import Row

NAME = "15. dictionaries"
REPO = Path(__file__).resolve().parents[2]
USES_SUBJECTS = False  # it builds its own model, in its worker
SAELENS_PYTHON = "FLAXLENS_BENCH_SAELENS_PYTHON"
CORE = 0  # the CPU every timed worker is pinned to (they take turns, never run together)
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
STREAM_SITE = "LinenBlock_1"  # the last block's output of the 2-layer model


@dataclasses.dataclass(frozen=True)
class DictionarySizes:
  """The sizes of one run of the case."""

  d_in: int  # throughput rows: width of the activations
  width: int  # and of the dictionary
  k: int  # TopK's k
  batch_size: int
  steps: int  # per timed training call
  rows: int  # in the .npy both sides read
  reps: int
  warm_up: bool  # an untimed call of each contender first (fld.train compiles in each call)
  kinds: tuple[str, ...]  # "relu" (SAELens "standard"), "topk"
  stream_width: int
  stream_batch_size: int
  stream_steps: int
  stream_buffer: int
  memory_d: int
  memory_width: int
  memory_batch_size: int
  memory_tokens: tuple[int, int]


SIZES = {
  FULL: DictionarySizes(
    d_in=128, width=1024, k=32, batch_size=1024, steps=12, rows=32768, reps=5, warm_up=True,
    kinds=("relu", "topk"), stream_width=1024, stream_batch_size=512, stream_steps=12,
    stream_buffer=4096, memory_d=16, memory_width=64, memory_batch_size=16384,
    memory_tokens=(10_000_000, 100_000_000),
  ),
  QUICK: DictionarySizes(
    d_in=8, width=32, k=4, batch_size=64, steps=4, rows=1024, reps=1, warm_up=False,
    kinds=("relu",), stream_width=64, stream_batch_size=32, stream_steps=4, stream_buffer=64,
    memory_d=8, memory_width=16, memory_batch_size=1024, memory_tokens=(20_000, 200_000),
  ),
}  # fmt: skip
LEARNING_RATE = 3e-4
L1_COEFFICIENT = 1.0


def _planted_rows(count: int, d: int, seed: int = 0) -> np.ndarray:
  """Activations with structure: each row a sparse combination (about 4 of 4 d unit
  directions, positive weights) plus a little noise, float32."""
  rng = np.random.default_rng(seed)
  directions = rng.normal(size=(4 * d, d))
  directions /= np.linalg.norm(directions, axis=1, keepdims=True)
  weights = rng.exponential(size=(count, 4 * d)) * (rng.random((count, 4 * d)) < 1 / d)
  return (weights @ directions + 0.01 * rng.normal(size=(count, d))).astype(np.float32)


# --- the workers --------------------------------------------------------------------------------


class _Worker:
  """A worker process: one JSON spec on its command line, then one command per line on
  stdin, each answered by one JSON line on stdout."""

  def __init__(self, command: list[str], env: dict[str, str]):
    self._process = subprocess.Popen(
      command,
      cwd=REPO,
      env=env,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    self.ready = self._answer()

  def _answer(self) -> dict[str, Any]:
    line = self._process.stdout.readline()
    if not line:
      self._process.wait()
      raise RuntimeError(f"{self._process.args[:3]} failed:\n{self._process.stderr.read()[-3000:]}")
    return json.loads(line)

  def ask(self, command: str) -> dict[str, Any]:
    self._process.stdin.write(command + "\n")
    self._process.stdin.flush()
    return self._answer()

  def close(self) -> None:
    self._process.stdin.close()
    self._process.wait(timeout=60)


def _env(**extra: str) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), ONE_THREAD]))
  return {**env, **extra}


def _jax_worker(spec: dict[str, Any]) -> _Worker:
  command = [sys.executable, "-m", "bench.cases.dictionaries", "worker", json.dumps(spec)]
  return _Worker(command, _env(JAX_PLATFORMS="cpu"))


def _saelens_worker(python: str, spec: dict[str, Any]) -> _Worker:
  return _Worker([python, str(REPO / "bench" / "saelens_step.py"), json.dumps(spec)], _env())


def _steady(answer: dict[str, Any]) -> Sample:
  """A worker's answer as a Sample whose "total" is the steady time."""
  return {"total": answer["steady"], "whole": answer["total"]}


# --- throughput ---------------------------------------------------------------------------------


def _throughput_rows(chosen: DictionarySizes, directory: str, progress: Progress) -> list[Row]:
  rows_path = os.path.join(directory, "rows.npy")
  np.save(rows_path, _planted_rows(chosen.rows, chosen.d_in))
  spec = {**dataclasses.asdict(chosen), "rows_path": rows_path, "core": CORE}
  ours = _jax_worker(spec)
  python = os.environ.get(SAELENS_PYTHON)
  theirs: dict[str, _Worker] = {}
  if python:
    for kind in chosen.kinds:
      theirs[kind] = _saelens_worker(python, {
        "rows": rows_path, "kind": "standard" if kind == "relu" else "topk",
        "width": chosen.width, "k": chosen.k, "batch_size": chosen.batch_size,
        "steps": chosen.steps, "learning_rate": LEARNING_RATE,
        "l1_coefficient": L1_COEFFICIENT, "core": CORE,
      })  # fmt: skip
  contenders: dict[str, Callable[[], Sample]] = {"bare": lambda: _steady(ours.ask("bare"))}
  for kind in chosen.kinds:
    contenders[f"fld {kind}"] = lambda kind=kind: _steady(ours.ask(f"train {kind}"))
    if kind in theirs:
      contenders[f"saelens {kind}"] = lambda kind=kind: _steady(theirs[kind].ask("run"))
  progress(f"{NAME}: throughput ({', '.join(contenders)})")
  try:
    samples = interleaved(contenders, chosen.reps, chosen.warm_up)
  finally:
    for worker in (ours, *theirs.values()):
      worker.close()
  tokens = (chosen.steps - 1) * chosen.batch_size
  shape = (
    f"d_in {chosen.d_in}, width {chosen.width}, batch {chosen.batch_size},"
    f" {chosen.steps - 1} steps timed"
  )
  rows = []
  for kind in chosen.kinds:
    fld = samples[f"fld {kind}"]
    what = f"fld.train {kind} SAE tokens/s / SAELens's ({shape})"
    if kind not in theirs:
      reason = f"not installed ({SAELENS_PYTHON} unset)"
      rows.append(Row(NAME, what, "dictionary_vs_saelens", status=reason))
      continue
    saelens = samples[f"saelens {kind}"]
    rows.append(
      Row(
        NAME,
        what,
        "dictionary_vs_saelens",
        ratios(saelens, fld),  # a throughput ratio: their time over ours
        f"{tokens / median(fld):,.0f} vs {tokens / median(saelens):,.0f} tokens/s",
        note=(
          f"SAELens {theirs[kind].ready['ready']} in its own environment; both pinned to one"
          f" core, one thread; whole calls (fld.train's compilation, SAELens's first step"
          f" included) {seconds(median(fld, 'whole'))} vs {seconds(median(saelens, 'whole'))}"
        ),
        analysis=(
          f"per step fld.train {seconds(median(fld) / (chosen.steps - 1))}, SAELens"
          f" {seconds(median(saelens) / (chosen.steps - 1))}, the bare optax step (ReLU)"
          f" {seconds(median(samples['bare']) / (chosen.steps - 1))}"
        ),
      )
    )
  fld, bare = samples["fld relu"], samples["bare"]
  rows.append(
    Row(
      NAME,
      f"fld.train relu SAE tokens/s / a bare jitted optax step on a batch on the device ({shape})",
      "dictionary_vs_bare_step",
      ratios(bare, fld),
      f"{tokens / median(fld):,.0f} vs {tokens / median(bare):,.0f} tokens/s",
      note=(
        "the bare step: the same loss and adam, hand-written over a dict of arrays, jitted"
        " with the state donated, one batch placed on the device once"
      ),
      analysis=(
        f"per step fld.train {seconds(median(fld) / (chosen.steps - 1))} (a fresh batch"
        f" drawn and copied to the device, dead-feature counters, non-finite guard), the bare"
        f" step {seconds(median(bare) / (chosen.steps - 1))}"
      ),
    )
  )
  return rows


# --- streaming ----------------------------------------------------------------------------------


def _stream_row(chosen: DictionarySizes, sizes: Sizes, directory: str, progress: Progress) -> Row:
  spec = {**dataclasses.asdict(chosen), "quick": sizes == QUICK, "core": CORE}
  spec["store"] = os.path.join(directory, "store")
  progress(f"{NAME}: streaming (harvesting the store first)")
  worker = _jax_worker(spec)
  try:
    samples = interleaved(
      {
        "stream": lambda: _steady(worker.ask("stream")),
        "store": lambda: _steady(worker.ask("store")),
        "forward": lambda: _steady(worker.ask("forward")),
      },
      chosen.reps,
      chosen.warm_up,
    )
  finally:
    worker.close()
  stream, store, forward = samples["stream"], samples["store"], samples["forward"]
  both = [{"total": s["total"] + f["total"]} for s, f in zip(store, forward, strict=True)]
  tokens = (chosen.stream_steps - 1) * chosen.stream_batch_size
  return Row(
    NAME,
    f"fld.train on fld.stream of a 2-layer model / on a harvest store + the forward"
    f" (width {sizes.width} -> {chosen.stream_width}, batch {chosen.stream_batch_size})",
    "dictionary_stream",
    ratios(stream, both),
    f"{seconds(median(stream))} vs {seconds(median(store))} + {seconds(median(forward))}",
    note=(
      f"{chosen.stream_steps - 1} steps timed ({tokens} tokens); stream buffer"
      f" {chosen.stream_buffer} rows; the forward is the native jitted forward up to"
      f" the site ({STREAM_SITE}, capture_intermediates) over as many tokens; stream /"
      f" store alone {np.median(ratios(stream, store)):.3f}; whole"
      f" calls {seconds(median(stream, 'whole'))} vs {seconds(median(store, 'whole'))}"
    ),
    analysis=(
      f"the streamed call takes {seconds(median(stream))}; training from the store"
      f" {seconds(median(store))} and the forward over the same tokens"
      f" {seconds(median(forward))}; the rest, {seconds(median(stream) - median(both))},"
      " is capturing the site, the copy to the host buffer and the shuffle"
    ),
  )


# --- memory ----------------------------------------------------------------------------------


def _memory_row(chosen: DictionarySizes) -> Row:
  found = []
  for tokens in chosen.memory_tokens:
    spec = json.dumps({**dataclasses.asdict(chosen), "tokens": tokens})
    command = [sys.executable, "-m", "bench.cases.dictionaries", "memory", spec]
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"the memory subprocess failed:\n{done.stderr[-3000:]}")
    found.append(json.loads(done.stdout.strip().splitlines()[-1]))
  small, large = found
  how = (
    "VmHWM, reset when the call starts"
    if small["reset"] and large["reset"]
    else "ru_maxrss: the whole process's peak, as /proc/self/clear_refs could not reset it"
  )
  return Row(
    NAME,
    f"peak host RSS of fld.train over {chosen.memory_tokens[1]:,} tokens / over"
    f" {chosen.memory_tokens[0]:,} (d {chosen.memory_d}, width {chosen.memory_width})",
    "dictionary_rss_flat",
    np.array([large["peak"] / small["peak"]]),
    f"{nbytes(large['peak'])} vs {nbytes(small['peak'])}",
    note=(
      f"each run in a fresh subprocess, batches of {chosen.memory_batch_size} rows"
      f" generated as asked for; the peak during the fld.train call ({how}); resident when"
      f" it started {nbytes(small['before'])} and {nbytes(large['before'])}; the processes'"
      f" own peaks (ru_maxrss) {nbytes(small['process_peak'])} and"
      f" {nbytes(large['process_peak'])}; training took {seconds(small['seconds'])} and"
      f" {seconds(large['seconds'])}"
    ),
    analysis=(
      f"the larger run peaked {(large['peak'] - small['peak']) / 2**20:+.1f} MiB from the"
      " smaller's;"
      f" its steps' history is {nbytes(6 * 4 * large['steps'])}"
    ),
  )


def measure(subjects: Any, sizes: Sizes, progress: Progress) -> list[Row]:
  chosen = SIZES.get(sizes, SIZES[FULL])
  with tempfile.TemporaryDirectory(prefix="flaxlens-bench-") as directory:
    rows = _throughput_rows(chosen, directory, progress)
    rows.append(_stream_row(chosen, sizes, directory, progress))
  progress(f"{NAME}: peak memory over {chosen.memory_tokens} tokens")
  rows.append(_memory_row(chosen))
  return rows


# --- in the worker processes ----------------------------------------------------------------------


class _Timed:
  """`data` (a `fld.DictionaryData`) that notes when its second batch is asked for."""

  def __init__(self, data: Any):
    self.data = data
    self.d_in, self.d_out, self.layers = data.d_in, data.d_out, data.layers
    self.reads, self.writes = data.reads, data.writes
    self.second = 0.0

  def batches(self, batch_size: int, *, seed: int) -> Iterator[Any]:
    for number, rows in enumerate(self.data.batches(batch_size, seed=seed)):
      if number == 1:
        self.second = time.perf_counter()
      yield rows


def _train(sae: Any, data: Any, steps: int, batch_size: int, seed: int) -> dict[str, float]:
  import flaxlens.dictionaries as fld

  timed = _Timed(data)
  recipe = fld.Recipe(learning_rate=LEARNING_RATE, l1_coefficient=L1_COEFFICIENT)
  start = time.perf_counter()
  fld.train(
    sae, timed, steps=steps, batch_size=batch_size, recipe=recipe, seed=seed, progress=False
  )
  end = time.perf_counter()
  return {"steady": end - timed.second, "total": end - start}


def _bare_step(chosen: DictionarySizes, rows: np.ndarray) -> Callable[[], dict[str, float]]:
  """A hand-written adam step of the ReLU SAE loss (as fld's recipe: squared error summed
  over the output, L1 weighted by decoder norms, averaged over rows) on one batch."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import flaxlens.dictionaries as fld

  sae = fld.SAE(chosen.d_in, chosen.width, rngs=nnx.Rngs(0))
  params = {"W_enc": sae.W_enc[...], "b_enc": sae.b_enc[...]}
  params |= {"W_dec": sae.W_dec[...], "b_dec": sae.b_dec[...]}
  optimizer = optax.adam(LEARNING_RATE)
  batch = jnp.asarray(rows[: chosen.batch_size])

  def loss_of(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    features = jax.nn.relu((x - p["b_dec"]) @ p["W_enc"] + p["b_enc"])
    error = x - (features @ p["W_dec"] + p["b_dec"])
    norms = jnp.linalg.norm(p["W_dec"], axis=-1)
    return (jnp.sum(error**2) + L1_COEFFICIENT * jnp.sum(features * norms)) / x.shape[0]

  def step(state: Any, x: jax.Array) -> tuple[Any, jax.Array]:
    p, opt = state
    loss, grads = jax.value_and_grad(loss_of)(p, x)
    updates, opt = optimizer.update(grads, opt, p)
    return (optax.apply_updates(p, updates), opt), loss

  jitted = jax.jit(step, donate_argnums=0)

  def run() -> dict[str, float]:
    state = jax.tree.map(jnp.copy, (params, optimizer.init(params)))
    start = second = time.perf_counter()
    for number in range(chosen.steps):
      if number == 1:
        second = time.perf_counter()  # as fld.train asks for its second batch
      state, loss = jitted(state, batch)
    jax.block_until_ready(loss)
    end = time.perf_counter()
    return {"steady": end - second, "total": end - start}

  return run


def _is_block(module: Any, method: str) -> bool:
  from bench.models import LinenBlock

  return isinstance(module, LinenBlock) and method == "__call__"


class _StreamCommands:
  """The streaming row's three contenders, on the bench model at 2 layers: built once (the
  model, its tree, the stream, the harvest store) and run on each command."""

  def __init__(self, chosen: DictionarySizes, sizes: Sizes, store: str):
    import jax

    import flaxlens as fl
    import flaxlens.dictionaries as fld
    from bench.models import linen_model

    model, variables = linen_model(sizes, 2)
    rng = np.random.default_rng(2)
    per_input = sizes.batch * sizes.seq
    count = -(-(chosen.stream_steps * chosen.stream_batch_size + chosen.stream_buffer) // per_input)
    shape = (sizes.batch, sizes.seq)
    self.inputs = [rng.integers(0, sizes.vocab, shape, dtype=np.int32) for _ in range(count + 1)]
    self.tree = fl.unflaxify(model, variables, self.inputs[0])
    self.stream = fld.stream(self.tree, self.inputs, STREAM_SITE, buffer=chosen.stream_buffer)
    fl.harvest(self.tree, self.inputs, STREAM_SITE, store, progress=False)
    self.store = fld.from_harvest(fl.open_harvest(store), STREAM_SITE)

    def to_site(variables: Any, tokens: Any) -> Any:  # natively: the forward up to the site
      _, state = model.apply(
        variables, tokens, capture_intermediates=_is_block, mutable=["intermediates"]
      )
      return state["intermediates"][STREAM_SITE]["__call__"][0]

    forward = jax.jit(to_site)
    forwards = -(-((chosen.stream_steps - 1) * chosen.stream_batch_size) // per_input)
    self.chosen, self.sizes, self.seed = chosen, sizes, 0

    def run_forward() -> dict[str, float]:
      start = time.perf_counter()
      for tokens in self.inputs[:forwards]:
        out = forward(variables, tokens)
      jax.block_until_ready(out)
      took = time.perf_counter() - start
      return {"steady": took, "total": took}

    self.forward = run_forward

  def train(self, data: Any) -> dict[str, float]:
    from flax import nnx

    import flaxlens.dictionaries as fld

    chosen = self.chosen
    self.seed += 1
    sae = fld.SAE(self.sizes.width, chosen.stream_width, rngs=nnx.Rngs(0))
    return _train(sae, data, chosen.stream_steps, chosen.stream_batch_size, self.seed)


def _worker(spec: dict[str, Any]) -> None:
  """The flaxlens worker: answers "train KIND", "bare", "stream", "store", "forward"."""
  os.sched_setaffinity(0, {spec.pop("core")})
  from flax import nnx

  import flaxlens.dictionaries as fld

  store, quick = spec.pop("store", None), spec.pop("quick", False)
  rows_path = spec.pop("rows_path", None)
  chosen = DictionarySizes(
    **{**spec, "kinds": tuple(spec["kinds"]), "memory_tokens": tuple(spec["memory_tokens"])}
  )
  commands: dict[str, Callable[[], dict[str, float]]] = {}
  if rows_path:
    rows = np.load(rows_path, allow_pickle=False)
    data = fld.from_arrays(rows)
    commands["bare"] = _bare_step(chosen, rows)
    for kind in chosen.kinds:
      k = chosen.k if kind == "topk" else None

      def train(kind: str = kind, k: int | None = k) -> dict[str, float]:
        sae = fld.SAE(chosen.d_in, chosen.width, activation=kind, k=k, rngs=nnx.Rngs(0))
        return _train(sae, data, chosen.steps, chosen.batch_size, seed=0)

      commands[f"train {kind}"] = train
  if store:
    streamed = _StreamCommands(chosen, QUICK if quick else FULL, store)
    commands["stream"] = lambda: streamed.train(streamed.stream)
    commands["store"] = lambda: streamed.train(streamed.store)
    commands["forward"] = streamed.forward
  for name in ("bare", "forward"):  # compiled here: their timings start at their second step
    if name in commands:
      commands[name]()
  print(json.dumps({"ready": sorted(commands)}), flush=True)
  for line in sys.stdin:
    print(json.dumps(commands[line.strip()]()), flush=True)


class _Generated:
  """`tokens` rows of width `d`, generated batch by batch (never held): a
  `fld.DictionaryData` whose memory does not grow with its length."""

  def __init__(self, d: int, tokens: int):
    self.d_in = self.d_out = d
    self.layers = 1
    self.reads = self.writes = ("generated",)
    self.tokens = tokens

  def batches(self, batch_size: int, *, seed: int) -> Iterator[Any]:
    import flaxlens.dictionaries as fld

    rng = np.random.default_rng(seed)
    for _ in range(self.tokens // batch_size):
      rows = rng.standard_normal((batch_size, self.d_in), dtype=np.float32)
      yield fld.Rows(rows, rows)


def _memory(spec: dict[str, Any]) -> None:
  """In a fresh process: trains over `tokens` generated rows and prints the peak RSS."""
  from flax import nnx

  import flaxlens.dictionaries as fld

  steps = spec["tokens"] // spec["memory_batch_size"]
  sae = fld.SAE(spec["memory_d"], spec["memory_width"], rngs=nnx.Rngs(0))
  data = _Generated(spec["memory_d"], spec["tokens"])
  reset = _reset_peak()
  before = _status("VmRSS")
  start = time.perf_counter()
  fld.train(sae, data, steps=steps, batch_size=spec["memory_batch_size"], progress=False)
  took = time.perf_counter() - start
  process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
  peak = _status("VmHWM") if reset else process_peak
  found = {"peak": peak, "before": before, "reset": reset, "process_peak": process_peak}
  print(json.dumps({**found, "seconds": took, "steps": steps}))


if __name__ == "__main__":
  if sys.argv[1] == "worker":
    _worker(json.loads(sys.argv[2]))
  else:
    _memory(json.loads(sys.argv[2]))
