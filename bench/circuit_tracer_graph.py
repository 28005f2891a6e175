"""The circuit-tracer side of case 16 (graphs): attribution graphs by circuit-tracer's own
`attribute` on a TransformerLens model, run with the interpreter of an environment where
`circuit-tracer` is installed (`FLAXLENS_BENCH_CIRCUIT_TRACER_PYTHON`; its pins clash with
ours, so it is not imported here).

Started as `python bench/circuit_tracer_graph.py MODE SPEC`, SPEC a JSON object:
`folder` (the weights case 16 wrote: `model.safetensors` in TransformerLens's parameter
names, `transcoders/layer_{i}.safetensors` as circuit-tracer's `TranscoderSet` writes
them), `shape` (layers, d_model, heads, d_mlp, vocab, width, positions), `prompts` (a .npy
of int32 token ids `[prompts, positions]`, each starting with token 0, the model's special
token), `batch_size`, `max_feature_nodes` (null: every active feature), `core` (the CPU
this process is pinned to), and in "memory" mode `prompt` and `limit_bytes` (null: no
limit on the address space).

It builds a `HookedTransformer` (GPT-2 style: LayerNorm, gelu_new, learned positions; no
weight processing) from those weights and circuit-tracer's replacement model on its
ReLU transcoders (reading `mlp.hook_in`, writing `mlp.hook_out`: the MLP's own input and
output). Mode "worker" prints `{"ready": ...}` (after writing the model's logits on the
first prompt to `folder/tl_logits.npy`), then answers each stdin line "run I" (a graph of
prompt I, timed) or "save I" (a graph of prompt I, its adjacency written to
`folder/ct_adjacency.npy`) with one JSON line. Mode "memory" computes one graph in this
fresh process under the address-space limit and prints its peak resident set during the
call (VmHWM, reset as it starts) or the error that stopped it. It reads no file but
these (no pickle).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np


def _status(field: str) -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(f"{field}:"):
      return int(line.split()[1]) * 1024
  return -1


def _reset_peak() -> bool:
  try:
    Path("/proc/self/clear_refs").write_text("5")
  except OSError:
    return False
  return True


class _Tokens:
  """What circuit-tracer asks of a tokenizer, for a model built from a config (none):
  token 0 is the special first token it looks for (every prompt starts with it), and a
  token's text is its id."""

  all_special_ids = (0,)
  padding_side = "right"

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def decode(self, ids) -> str:
    return str(ids)


def _model(spec: dict):
  """The replacement model: the TransformerLens model with the folder's weights and
  circuit-tracer's transcoders."""
  import torch
  from circuit_tracer import ReplacementModel
  from circuit_tracer.transcoder.single_layer_transcoder import TranscoderSet, load_relu_transcoder
  from safetensors.torch import load_file
  from transformer_lens import HookedTransformerConfig

  shape, folder = spec["shape"], Path(spec["folder"])
  config = HookedTransformerConfig(
    n_layers=shape["layers"],
    d_model=shape["d_model"],
    n_heads=shape["heads"],
    d_head=shape["d_model"] // shape["heads"],
    d_mlp=shape["d_mlp"],
    d_vocab=shape["vocab"],
    n_ctx=shape["positions"],
    act_fn="gelu_new",
    normalization_type="LN",
    positional_embedding_type="standard",
    default_prepend_bos=False,
    device="cpu",
    dtype=torch.float32,
  )
  layers = {
    layer: load_relu_transcoder(
      str(folder / "transcoders" / f"layer_{layer}.safetensors"),
      layer,
      device=torch.device("cpu"),
      dtype=torch.float32,
      lazy_encoder=False,
      lazy_decoder=False,
    )
    for layer in range(shape["layers"])
  }
  transcoders = TranscoderSet(layers, "mlp.hook_in", "mlp.hook_out")
  model = ReplacementModel.from_config(config, transcoders)
  weights = load_file(str(folder / "model.safetensors"))
  parameters = dict(model.named_parameters())
  own = {
    name.replace(".old_mlp", "").replace(".old_unembed", ""): name
    for name in parameters
    if "transcoders" not in name
  }
  if set(own) != set(weights):
    raise SystemExit(f"weights {sorted(set(weights) ^ set(own))} differ from the model's")
  with torch.no_grad():
    for name, value in weights.items():
      parameters[own[name]].copy_(value)
  model.tokenizer = _Tokens(shape["vocab"])
  return model


def _graph(model, tokens: np.ndarray, spec: dict):
  import torch
  from circuit_tracer import attribute

  return attribute(
    torch.from_numpy(tokens.astype(np.int64)),
    model,
    batch_size=spec["batch_size"],
    max_feature_nodes=spec["max_feature_nodes"],
    verbose=False,
  )


def _counts(graph) -> dict:
  return {
    "features": int(len(graph.selected_features)),
    "active": int(len(graph.active_features)),
    "logits": int(len(graph.logit_targets)),
  }


def worker(spec: dict) -> None:
  import torch

  model = _model(spec)
  prompts = np.load(spec["prompts"], allow_pickle=False)
  with torch.no_grad():
    logits = model(torch.from_numpy(prompts[:1].astype(np.int64)))
  np.save(Path(spec["folder"]) / "tl_logits.npy", logits[0].numpy())
  ready = {"ready": torch.__version__, "threads": torch.get_num_threads()}
  print(json.dumps(ready), flush=True)
  for line in sys.stdin:
    command, index = line.split()
    start = time.perf_counter()
    graph = _graph(model, prompts[int(index)], spec)
    took = time.perf_counter() - start
    if command == "save":
      np.save(Path(spec["folder"]) / "ct_adjacency.npy", graph.adjacency_matrix.numpy())
    print(json.dumps({"total": took, **_counts(graph)}), flush=True)


def memory(spec: dict) -> None:
  if spec["limit_bytes"]:
    resource.setrlimit(resource.RLIMIT_AS, (spec["limit_bytes"], spec["limit_bytes"]))
  model = _model(spec)
  tokens = np.load(spec["prompts"], allow_pickle=False)[spec["prompt"]]
  reset = _reset_peak()
  before = _status("VmRSS")
  start = time.perf_counter()
  try:
    graph = _graph(model, tokens, spec)
  except (MemoryError, RuntimeError) as error:  # torch's allocator raises RuntimeError
    message = str(error).splitlines()[0][:200]
    print(json.dumps({"failed": f"{type(error).__name__}: {message}", "before": before}))
    return
  took = time.perf_counter() - start
  process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  peak = _status("VmHWM") if reset else process_peak
  found = {"peak": peak, "before": before, "reset": reset, "process_peak": process_peak}
  found["virtual"] = _status("VmPeak")
  print(json.dumps({**found, "seconds": took, **_counts(graph)}))


def main() -> None:
  mode, spec = sys.argv[1], json.loads(sys.argv[2])
  os.sched_setaffinity(0, {spec["core"]})
  import torch

  torch.set_num_threads(1)
  {"worker": worker, "memory": memory}[mode](spec)


if __name__ == "__main__":
  main()
