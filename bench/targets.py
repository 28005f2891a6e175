"""The one table of targets: what each measures, its bound, and the reason for that bound.

A result row names the target it checks by key (`Row(..., target="compile_time")`); the
report's target column and the row's verdict come from here, so a bound changes in one
place. Targets that no case measures yet are listed too, with `case=None` (not yet
measured): a case added later names its key and needs nothing else. Values are written
as the design brief or the issue that set them writes them ("1.10", not 1.1).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Target:
  """One target.

  `comparison` says how `value` bounds the measurement:
  - "≤": the median of the per-repetition ratios must not exceed `value`;
  - "≥": the median of the per-repetition ratios must reach `value` (a throughput ratio);
  - "flat": the same, for one quantity at two sizes, a ratio that should stay at 1;
  - "=": the measured amount must equal `value` (the case gives the verdict);
  - "context": no verdict; Penzai's ratio, next to the figure the design brief quoted
    for it (`value`, empty when it quoted none);
  - "none": reported, with no target.
  `case` is the module of `bench/cases` that measures it, None when none does yet.
  """

  what: str
  comparison: str
  value: str
  reason: str
  case: str | None

  @property
  def limit(self) -> float | None:
    """The bound on the median ratio, for the comparisons that have one."""
    return float(self.value) if self.comparison in ("≤", "≥", "flat") else None

  @property
  def shown(self) -> str:
    """The target as the report's table shows it."""
    if self.comparison in ("≤", "≥"):
      return f"{self.comparison} {self.value}"
    if self.comparison == "flat":
      return f"flat (≤ {self.value})"
    if self.comparison == "context":
      return f"context (brief: about {self.value})" if self.value else "context"
    if self.comparison == "none":
      return "(no target)"
    return self.value


_PENZAI_CONTEXT = (
  "No target: Penzai, the reference system flaxlens replaces, on the same model, so that"
  " flaxlens's ratio can be read next to a peer's."
)

TARGETS: dict[str, Target] = {
  "jitted_forward": Target(
    "jitted forward of a converted tree / native Flax",
    "≤",
    "1.02",
    "Once compiled, a converted tree runs the native model's program (case 1 checks that"
    " the lowered StableHLO has the same operations), so a call should cost what the native"
    " call costs; 2% leaves room for per-call host work and a shared machine's noise.",
    "jitted_forward",
  ),
  "jitted_forward_penzai": Target(
    "Penzai's jitted forward / native Flax", "context", "", _PENZAI_CONTEXT, "jitted_forward"
  ),
  "compile_time": Target(
    "compile time of a converted tree / native Flax",
    "≤",
    "1.10",
    "Tracing a converted tree runs flaxlens's call dispatch in Python on top of Flax's own"
    " tracing, and XLA then compiles the same program; 10% bounds that dispatch and stays"
    " under Penzai's cost.",
    "compile_time",
  ),
  "compile_time_penzai": Target(
    "Penzai's compile time / native Flax",
    "context",
    "1.16",
    f"{_PENZAI_CONTEXT} 1.16 is the figure the design brief quoted when case 2 was written;"
    " it now quotes about 1.13.",
    "compile_time",
  ),
  "conversion_flat_in_batch": Target(
    "conversion time at a large batch / at a small batch",
    "flat",
    "1.10",
    "Conversion traces abstractly (jax.eval_shape), so no step of it may grow with the"
    " batch size or the sequence length; 10% is room for noise, which the floor's own ratio"
    " at the same two batch sizes, in the row's notes, measures.",
    "conversion",
  ),
  "eager_penzai": Target(
    "Penzai's eager call / native Flax",
    "context",
    "1.9",
    f"{_PENZAI_CONTEXT} 1.9 is the figure the design brief quoted when case 4 was written;"
    " it now quotes about 1.18.",
    "eager_call",
  ),
  "extra_bytes": Target(
    "parameter bytes of a converted tree not shared with the model's arrays",
    "=",
    "0 B",
    "A converted tree holds the user's parameter arrays rather than copies (conversion must"
    " not copy parameter buffers), so a model that fits in memory once still fits; any byte"
    " more is a copy.",
    "extra_bytes",
  ),
  "isolate_replay": Target(
    "isolating one call and replaying it / one module.apply",
    "none",
    "",
    "No target: isolating a call runs the whole tree once eagerly while observing the call,"
    " then the call is replayed alone; reported so that this cost is known.",
    "isolate_replay",
  ),
  # Issue 12 (interventions); case 5 and 6 measure the first two.
  "capture_everything": Target(
    "capturing every intermediate under jit / plain jitted forward",
    "≤",
    "1.05",
    "Captured values leave a jitted function as extra outputs of the same program, so"
    " capturing everything costs writing those outputs and nothing else; 5% bounds that.",
    "interventions",
  ),
  "recompiles": Target(
    "traces after the first for 100 different intervention values",
    "=",
    "0",
    "Intervention values must be arguments of the compiled program, not constants traced"
    " into it, or every new value would recompile the model.",
    "interventions",
  ),
  "patching_sweep_vs_loop": Target(
    "blocks × positions patching sweep in one call / Python loop of N jitted single patches",
    "≤",
    "0.6",
    "A sweep should be one compiled program over all N cells, not N dispatches, and its"
    " patched forwards start from one corrupted base run at the patched block (issue 23).",
    "sweeps",
  ),
  "patching_sweep_vs_batched": Target(
    "blocks × positions patching sweep in one call / N plain forwards batched",
    "≤",
    "0.6",
    "Sharing each patched forward's prefix with one base run leaves about (L+1)/2 of L"
    " blocks' work per forward (issue 23), plus the clean and corrupted runs.",
    "sweeps",
  ),
  "patching_sweep_unshared_vs_batched": Target(
    "batched patching sweep (share_prefix=False) / N plain forwards batched",
    "≤",
    "1.10",
    "Batched, a sweep does the work of N forwards; 10% bounds the cost of the patches themselves.",
    "sweeps",
  ),
  "attribution_patching": Target(
    "attribution patching / one forward and backward",
    "≤",
    "1.2",
    "Attribution patching estimates every site's effect from one forward and one backward"
    " pass, so it should cost about that pass; 20% bounds reading activations and"
    " gradients at every site.",
    "sweeps",
  ),
  # Issue 24 (circuits).
  "path_patching_compiles": Target(
    "compilations of path patching over all senders of one receiver",
    "=",
    "1",
    "Path patching runs two forwards per sender (record the receivers, then patch them);"
    " batched as one program, a sweep over every head of a 12-layer model costs one"
    " compilation, where a loop of single path patches would trace a program per sender.",
    "paths",
  ),
  "heads_sweep_vs_batched": Target(
    "heads × positions patching sweep of the 12-layer model in one call / as many plain"
    " forwards batched",
    "≤",
    "1.10",
    "Batched, a heads sweep does the work of layers × heads × positions forwards; 10% bounds"
    " the cost of viewing each attention output projection's input as heads and patching one.",
    "heads",
  ),
  "heads_sweep_compiles": Target(
    "compiled programs for heads sweeps on new inputs of the same shapes",
    "=",
    "1",
    "A heads sweep is one program over every (layer, head, position): new clean or"
    " corrupted inputs must reuse it, never compile again.",
    "heads",
  ),
  # Issue 39 (mixture of experts).
  "experts_sweep_vs_batched": Target(
    "experts sweep (every layer × expert) of an 8-layer, 8-expert MoE in one call / as many"
    " plain forwards batched",
    "≤",
    "1.10",
    "Batched, an experts sweep does the work of layers × experts forwards; 10% bounds the"
    " cost of patching one expert's slice of the stacked experts' output in each.",
    "experts",
  ),
  "experts_sweep_compiles": Target(
    "compiled programs for experts sweeps on new inputs of the same shapes",
    "=",
    "1",
    "An experts sweep is one program over every (layer, expert): new clean or corrupted"
    " inputs must reuse it, never compile again.",
    "experts",
  ),
  # Issue 23 (compiling once).
  "second_process_first_call": Target(
    "first call of a question in a second process (persistent cache) / a steady call",
    "≤",
    "1.5",
    "With fl.enable_compilation_cache, a process asking a question an earlier process asked"
    " reads the compiled program from disk instead of compiling it, so its first answer"
    " should cost little more than a warm call; 1.5 leaves half a call for the cache read"
    " and what tracing remains.",
    "compilation_cache",
  ),
  "second_process_first_call_reference": Target(
    "the same for a forward: fl.run, and native jax.jit(module.apply) (reference)",
    "none",
    "",
    "What JAX's persistent cache leaves a second process to pay for a forward, with and"
    " without flaxlens: tracing and lowering run again in every process, for native Flax"
    " too, so this bounds what any flaxlens question can reach.",
    "compilation_cache",
  ),
  # Issue 15 (speed).
  "jitted_host_time": Target(
    "host time until a jitted tree call returns / native jax.jit",
    "≤",
    "1.2",
    "The time before a jitted call returns to Python is what a loop of small calls pays for"
    " every call; 20% over native jax.jit keeps flaxlens's per-call work (splitting the"
    " arguments, reading the variables) from showing there.",
    "jitted_forward",
  ),
  "jitted_small_model": Target(
    "jitted end-to-end call of a 2-layer model / native",
    "≤",
    "1.05",
    "On a small model the host work of a call is a large part of it, which a 12-layer model"
    " hides; 5% bounds what a user of a small model sees end to end.",
    "jitted_forward",
  ),
  "conversion_vs_penzai_revised": Target(
    "conversion time / Penzai's unflaxify_apply, 12- and 48-layer Linen models",
    "≤",
    "0.9",
    "Converting is what a user waits for whenever a model is opened, and Penzai's converter"
    " is the one flaxlens replaces. (The first bound, 0.5, was out of reach: both"
    " converters trace the model's Python once under jax.eval_shape, and that floor alone"
    " measured about 0.9 of Penzai's time.) At or under the floor, 0.9 follows.",
    "conversion",
  ),
  "conversion_floor": Target(
    "conversion time / jax.eval_shape of module.apply alone (the floor)",
    "≤",
    "1.0",
    "Both converters must trace the model's Python once abstractly; at or under that floor,"
    " flaxlens's own work fits in what it saves of Flax's (about half the floor is Flax's"
    " per-apply shape check of every parameter, case 3's analysis). For NNX the floor is"
    " jax.eval_shape of the merged model's call.",
    "conversion",
  ),
  "conversion_nnx_eval_shape": Target(
    "NNX conversion time / nnx.eval_shape of the model's call",
    "none",
    "",
    "No target: context for the NNX floor, whose model is split before its timing starts."
    " nnx.eval_shape splits the user's model, merges it and traces the call abstractly,"
    " which is what NNX itself runs to trace a model it is given, as conversion is.",
    "conversion",
  ),
  "linen_eager": Target(
    "Linen eager call of a converted tree / module.apply",
    "≤",
    "1.03",
    "An un-jitted call is what a user debugging a layer runs; it runs the model natively"
    " under flaxlens's interception, and interception that costs little per call keeps it"
    " within 3% of native (the first bound was 1.25).",
    "eager_call",
  ),
  "nnx_eager": Target(
    "NNX eager call of a converted tree / the model's own call",
    "≤",
    "1.03",
    "As linen_eager: the NNX call runs the model's own modules under interception.",
    "eager_call",
  ),
  # The harvest issue; case 11 measures its four targets.
  "harvest_throughput": Target(
    "fl.harvest throughput (tokens/s, store on local disk) / the plain jitted forward's",
    "≥",
    "0.9",
    "A harvest runs the forward the user would run anyway; the rows' copy to the host and"
    " their writes overlap the next batch's forward, so harvesting a dataset should cost about"
    " one pass of inference over it; 10% bounds the copies, the writes and the commits.",
    "harvest",
  ),
  "harvest_rss_flat": Target(
    "peak host RSS of a harvest over 10x the batches / over 1x",
    "flat",
    "1.10",
    "At most two batches' rows are held on the host while their writes complete, so the"
    " memory of a harvest must not grow with the dataset; 10% is room for the allocator's"
    " and the runtime's noise.",
    "harvest",
  ),
  "capture_budget": Target(
    "peak bytes of live device arrays during a budgeted capture-everything / the budget",
    "≤",
    "1.0",
    "A budget is a bound, not an estimate: a capture of every call of a 12-layer model at a"
    " batch whose captures are three times the budget must complete without holding more"
    " than the budget, and give the unbudgeted capture's values.",
    "harvest",
  ),
  "harvest_resume": Target(
    "harvest resumed after a kill at 50% / a full harvest",
    "≤",
    "0.55",
    "A resumed run skips the committed batches (read and dropped, not run), so it does half"
    " the work of a full run; 5% bounds checking the store again and the batches whose"
    " writes the kill cut short.",
    "harvest",
  ),
  # Issue 23, item 6 (case 14): the PyTorch tools a user would otherwise pick.
  "compare_steady": Target(
    "steady state of a task / the faster of TransformerLens and nnsight (CPU)",
    "≤",
    "0.8",
    "Once compiled, flaxlens runs each task as one XLA program where the PyTorch tools run"
    " eager operations and Python hooks per call, so on the same model and CPU it should be"
    " clearly faster than the better of the two; 0.8 is the issue's bound.",
    "compare",
  ),
  "compare_first_call": Target(
    "first call of a task in a fresh process / the faster of TransformerLens and nnsight",
    "≤",
    "1.0",
    "The first answer to a new question is what a user waits for; flaxlens pays tracing and"
    " compilation there (less with a warm persistent compilation cache), the PyTorch tools"
    " none, and it should still answer no later than they do.",
    "compare",
  ),
  # Issue 37 (dictionaries); case 15.
  "dictionary_vs_saelens": Target(
    "fld.train tokens/s / SAELens's, same activations, width, kind and CPU (one thread each)",
    "≥",
    "1.5",
    "A training step is one compiled XLA program (forward, loss, backward, adam fused) where"
    " SAELens runs PyTorch's eager operations and its trainer's Python per step; on the same"
    " CPU that should be clearly faster, and 1.5 is the issue's bound.",
    "dictionaries",
  ),
  "dictionary_vs_bare_step": Target(
    "fld.train tokens/s / a bare jitted optax step on a batch already on the device",
    "≥",
    "0.8",
    "What fld.train adds to the step a user would write by hand (drawing each batch and"
    " copying it to the device, dead-feature counters, the non-finite guard, the metrics)"
    " must cost at most a fifth of the throughput.",
    "dictionaries",
  ),
  "dictionary_stream": Target(
    "fld.train streaming from the model / from a harvest store plus the model's forward",
    "≤",
    "1.3",
    "Streaming must run the forward that a store ran once already; beyond that, capturing"
    " the site, the host buffer and its shuffle may cost at most 30% of forward and step.",
    "dictionaries",
  ),
  "dictionary_rss_flat": Target(
    "peak host RSS of fld.train over 100 M tokens / over 10 M",
    "flat",
    "1.10",
    "Training holds a batch or two and the dictionary's state, never the data, so its memory"
    " must not grow with the tokens; 10% is room for the allocator's and the runtime's noise"
    " (and the per-step history, 24 bytes a step).",
    "dictionaries",
  ),
  # Attribution graphs; case 16.
  "graph_time_vs_circuit_tracer": Target(
    "time per attribution graph, flaxlens / circuit-tracer, same weights, prompt and CPU",
    "≤",
    "0.5",
    "Once compiled, flaxlens computes a batch of graph rows as one XLA program (the frozen"
    " forward's vector-Jacobian products, vmapped) where circuit-tracer runs PyTorch's eager"
    " backward over a batch-sized copy of the forward with Python hooks; on the same CPU it"
    " should take at most half the time.",
    "graphs",
  ),
  "graph_second_prompt_compiles": Target(
    "XLA compilations of a graph of a second prompt of the same length",
    "=",
    "0",
    "Programs are keyed on the prompt's shape, the batch and the column chunk, never on the"
    " prompt's values or its number of active features, so a new prompt of a length seen"
    " before must reuse them.",
    "graphs",
  ),
  "graph_memory_vs_circuit_tracer": Target(
    "peak RSS of a 512-token graph, flaxlens / circuit-tracer, each in a fresh process",
    "≤",
    "0.5",
    "circuit-tracer keeps the autograd graph of a forward over `batch_size` copies of the"
    " prompt; flaxlens linearises one forward and vmaps its transpose over the rows, so it"
    " should need at most half the memory.",
    "graphs",
  ),
  "graph_long_under_budget": Target(
    "a 2048-token graph in one address-space limit: flaxlens (budget=) runs, circuit-tracer not",
    "=",
    "flaxlens runs, circuit-tracer does not",
    "A budget bounds what one compiled batch holds (rows and column chunks shrink to fit), so"
    " flaxlens reaches prompt lengths where circuit-tracer's forward, kept for its backward"
    " passes even at batch_size=1, runs out of memory (its issues 92, 39, 40).",
    "graphs",
  ),
}
