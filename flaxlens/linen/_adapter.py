"""`LinenAdapter`: how the runtime converts, runs and isolates Linen calls.

A Linen variable's key is `(collection, path)`. A run applies the root's module once
with `module.apply` on the gathered variables (mutable: the collections holding state
variables and those named at conversion) and returns the updated collections. An
isolated execution is rebuilt from the module's variables, its scope's rng state (keys,
lazy suffixes and counters) and its arguments. Flax internals used: through
`flaxlens._compat` (`linen_apply`, `linen_modules`, `linen_rngs`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.errors
import flax.linen as nn

from flaxlens._compat import linen_apply, linen_modules, linen_rngs
from flaxlens.core._adapter import FrameworkAdapter, register_adapter
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._export import check_exportable
from flaxlens.core._names import join_name, split_name
from flaxlens.core._recorder import Execution, standalone
from flaxlens.core._runtime import Gathered, private_value, resolve_random_streams
from flaxlens.core._variables import StateVariable, Uninitialized
from flaxlens.core._walk import own_call_nodes
from flaxlens.errors import ArgumentError, ExportError, UnsupportedFlaxFeatureError
from flaxlens.linen._collections import flatten_collections, nest_collections, refreeze
from flaxlens.linen._convert import unflaxify_linen
from flaxlens.linen._interceptor import LinenInterceptor, changed_fields
from flaxlens.linen._node import AdoptedModule, InterceptedFlaxModuleMethod, RngSnapshot


class LinenAdapter(FrameworkAdapter):
  """Flax Linen (`flax.linen.Module`) behind the runtime's `FrameworkAdapter` interface."""

  name = "linen"
  node_type = InterceptedFlaxModuleMethod

  def attention_class(self, module_type: type) -> type | None:
    attention = nn.MultiHeadDotProductAttention
    return attention if issubclass(module_type, attention) else None

  def declares_trailing_features(self, module_type: type) -> bool:
    return issubclass(module_type, nn.DenseGeneral)

  def is_own_attention_function(self, fn: Any) -> bool:
    return fn is nn.dot_product_attention

  def attention_weights(
    self, settings: dict[str, Any], query: Any, key: Any, given: dict[str, Any]
  ) -> Any:
    return nn.dot_product_attention_weights(
      query,
      key,
      mask=given.get("mask"),
      dtype=settings.get("dtype"),
      precision=settings.get("precision"),
      force_fp32_for_softmax=settings.get("force_fp32_for_softmax"),
    )

  def accepts(self, model: Any) -> bool:
    return isinstance(model, nn.Module)

  def convert(self, model: Any, *args: Any, **kwargs: Any) -> InterceptedFlaxModuleMethod:
    if not args:
      raise ArgumentError(
        f"unflaxify({type(model).__name__}): a Linen module needs its variables as the"
        " second argument: fl.unflaxify(module, variables, *example_args)."
      )
    return unflaxify_linen(model, *args, **kwargs)

  def entries(self, node: Any, base: tuple[Any, ...]) -> Iterator[tuple[Any, Any, Any]]:
    data = node.scope_data
    for name, entry in data.parameters.items():
      yield ("params", base + split_name(name)), entry, None
    for group in (data.variables, data.immutable_variables):
      for collection, entries in group.items():
        for name, entry in entries.items():
          yield (collection, base + split_name(name)), entry, None

  def key_name(self, key: Any) -> str:
    collection, path = key
    return f"{collection}:{join_name(path)}"

  def new_interceptor(self, root: Any, side_inputs: dict[str, Any]) -> LinenInterceptor:
    return LinenInterceptor(side_inputs, building=False, prefix=root.path)

  def native_run(
    self, root: Any, gathered: Gathered, random_streams: Any, interceptor: Any
  ) -> Callable[[ArgsAndKwargs], tuple[Any, dict[Any, Any]]]:
    variables = _variables(gathered)
    held = {c for (c, _), e in gathered.entries.items() if isinstance(e, StateVariable)}
    mutable = tuple(sorted(held.union(root.mutable)))
    interceptor.mutable = mutable
    rngs = resolve_random_streams(random_streams, root.where())
    start = root.scope_data.rngs  # An isolated call's start: rng state, adopted modules.
    snapshot = start if random_streams is None else None
    adopted = start.adopted_as_flax(rngs=snapshot is not None) if start is not None else ()
    capture = interceptor.capture_only_native(
      linen_modules.capture_filter(root.capture_intermediates)
    )

    def run(argument: ArgsAndKwargs) -> tuple[Any, dict[Any, Any]]:
      result = linen_apply.apply_fresh(
        root.module,
        variables,
        *argument.args,
        method=root.method_name,
        rngs=rngs,
        mutable=list(mutable) if mutable else False,
        capture_intermediates=capture,
        rng_snapshot=snapshot.as_flax() if snapshot is not None else None,
        adopted=adopted,
        compact_cursor=start.compact_cursor if start is not None else None,
        **argument.kwargs,
      )
      if not mutable:
        return result, {}
      output, updates = result
      return output, flatten_collections(updates)

    return run

  def record_before(
    self, interceptor: Any, node: Any, module: Any, args: Any, kwargs: Any
  ) -> tuple[Any, Any]:
    keys, suffixes, counters = linen_rngs.rng_snapshot(module)
    held = linen_modules.held_elsewhere(module)
    adopted_static, adopted_keys = [], []
    for where, other in held:  # They draw from their own scopes: keep those states too.
      other_keys, other_suffixes, other_counters = linen_rngs.rng_snapshot(other)
      other_suffixes = tuple(sorted(other_suffixes.items()))
      adopted_static.append((where, other.name, other_suffixes, other_counters))
      adopted_keys.append(other_keys)
    static = (
      linen_modules.unbound_clone(module),  # With any settings edited in the node applied.
      node.method_name,
      tuple(sorted(suffixes.items())),
      counters,
      interceptor.mutable,
      node.capture_intermediates,
      tuple(adopted_static),
      linen_modules.compact_state(module, node.method_name),
    )
    return static, (linen_modules.call_variables(module, held), keys, tuple(adopted_keys))

  def record_after(self, node: Any, module: Any, output: Any) -> tuple[Any, Any]:
    after = linen_modules.call_variables(module)
    capture = linen_modules.capture_filter(node.capture_intermediates)
    if capture is not None and capture(module, node.method_name):
      # Flax sows a captured output after the interceptor returns; add it as Flax will.
      sown = after.setdefault("intermediates", {})
      sown[node.method_name] = tuple(sown.get(node.method_name, ())) + (output,)
    return None, after

  def check_isolatable(self, node: Any) -> None:
    if linen_modules.lifted_function_body(node.module, node.method_name):
      name = type(node.module).__name__
      inside = ", ".join(c.where() for c in node.submodule_calls.values() if hasattr(c, "where"))
      raise UnsupportedFlaxFeatureError(
        f"{node.where()}: {name}.{node.method_name} is not a method of {name} but the"
        " body of a Flax lifted transform applied to a plain function"
        " (nn.map_variables(fn, ...)(module), as nn.WeightNorm and nn.SpectralNorm call"
        " their layer; nn.vmap(fn), nn.cond, ...). The function is not part of the"
        " module (it may take its inputs from a closure), so it cannot run on its own."
        f" Isolate a call inside it ({inside or 'none was made'}) or the call that"
        " applies the transform."
      )

  def isolated_call(self, execution: Execution) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    module, method, suffixes, counters, mutable, capture, adopted, compact = execution.static_before
    variables, keys, adopted_keys = execution.before
    after = execution.after
    snapshot = RngSnapshot(
      keys=keys,
      suffixes=suffixes,
      counters=counters,
      adopted=tuple(
        AdoptedModule(path=where, name=name, rngs=RngSnapshot(keys=k, suffixes=s, counters=c))
        for (where, name, s, c), k in zip(adopted, adopted_keys, strict=True)
      ),
      compact_cursor=compact,
    )
    argument = execution.argument
    tree = unflaxify_linen(
      module,
      variables,
      *argument.args,
      method=method,
      rngs=snapshot,
      mutable=[c for c in mutable if c in after or c in variables],
      capture_intermediates=capture,
      **argument.kwargs,
    )
    submodel, state = standalone(tree)
    final = {self.key_name(k): v for k, v in flatten_collections(after).items()}
    return submodel, state, final

  def describe(self, submodel: Any, encode: Callable[[Any, str], Any]) -> dict[str, Any]:
    snapshot = submodel.scope_data.rngs
    return {
      "module": encode(submodel.module, "module"),
      "method": encode(submodel.method_name, "method"),
      "variables": encode(_variables(Gathered(submodel)), "variables"),
      "rngs": None if snapshot is None else _describe_rngs(snapshot, encode),
      "mutable": list(submodel.mutable),
      "capture_intermediates": encode(submodel.capture_intermediates, "capture"),
    }

  def rebuild(
    self,
    recipe: dict[str, Any],
    decode: Callable[[Any, str], Any],
    argument: ArgsAndKwargs,
    side_inputs: dict[str, Any],
  ) -> tuple[Any, tuple[Any, ...]]:
    module = decode(recipe["module"], "recipe.module")
    if not isinstance(module, nn.Module):
      raise TypeError("the recipe's module is not a flax.linen.Module")
    rngs = recipe["rngs"]
    if rngs is None:
      rngs = side_inputs.get("random_streams")
    else:
      rngs = _rebuild_rngs(rngs, decode, "recipe.rngs")
    tree = unflaxify_linen(
      module,
      decode(recipe["variables"], "recipe.variables"),
      *argument.args,
      method=decode(recipe["method"], "recipe.method"),
      rngs=rngs,
      mutable=recipe["mutable"],
      capture_intermediates=decode(recipe["capture_intermediates"], "recipe.capture"),
      **argument.kwargs,
    )
    return standalone(tree)

  def accepts_native(self, model: Any) -> bool:
    if isinstance(model, tuple) and model:
      model = model[0]
    return isinstance(model, nn.Module)

  def run_native(
    self, model: Any, argument: ArgsAndKwargs, method: Any, rngs: Any, mutable: Any
  ) -> tuple[Any, dict[str, Any]]:
    if not (isinstance(model, tuple) and len(model) == 2 and isinstance(model[1], Mapping)):
      module = model[0] if isinstance(model, tuple) else model
      raise ArgumentError(
        f"{type(module).__name__}: a Linen module runs with its variables; pass the pair"
        " (module, variables), as module.apply takes them."
      )
    module, variables = model
    result = module.apply(
      variables,
      *argument.args,
      method=method,
      rngs=rngs,
      mutable=mutable,
      **argument.kwargs,
    )
    output, updates = result if mutable not in (False, None) else (result, {})
    held = flatten_collections({"params": variables.get("params", {}), **updates})
    return output, {self.key_name(k): v for k, v in held.items()}

  def native_call_fix(self, error: Exception) -> str:
    if isinstance(error, flax.errors.ModifyScopeVariableError):
      # Flax names the collection only in its message: 'collection "batch_stats" is ...'.
      found = re.search(r'collection "([^"]+)"', str(error))
      names = repr([found.group(1)]) if found else "[...]"
      return (
        f"The model updates a collection that module.apply was not allowed to: pass"
        f" mutable={names} (the collections it updates, as module.apply takes them)."
      )
    return (
      "Check that module.apply(variables, *args, method=..., rngs=..., mutable=...) runs"
      " on these arguments, with variables made for them (module.init)."
    )

  def export(self, node: Any) -> dict[str, Any]:
    check_exportable(node)
    edited = [
      n.where()
      for n in own_call_nodes(node)
      if n is not node
      and n.converted_module is not None
      and n.module is not n.converted_module
      and changed_fields(n.module, n.converted_module)
    ]
    if edited:
      raise ExportError(
        f"{node.where()}: the settings of the modules of {edited} were edited"
        " (module.clone(...)); a variables dict cannot carry settings, so module.apply"
        " would run without the edit. Build the model with the new settings and convert"
        " it, or export before editing."
      )
    inside = len(node.path)
    levels = tuple(
      level[:1] + level[1 + inside :]
      for level in node.frozen_levels
      if len(level) <= 1 or tuple(level[1 : 1 + inside]) == tuple(node.path)
    )
    return refreeze(_variables(Gathered(node)), levels)

  def exported_variables(self, exported: Any) -> Any:
    return exported if isinstance(exported, Mapping) else None

  def with_exported_variables(self, like: Any, variables: Any) -> Any:
    return variables


def _describe_rngs(snapshot: RngSnapshot, encode: Callable[[Any, str], Any]) -> dict[str, Any]:
  """An `RngSnapshot` as recipe data; `adopted` and `compact` only where the call has them."""
  data = {
    "keys": encode(dict(snapshot.keys), "rng keys"),
    "suffixes": encode(dict(snapshot.suffixes), "rng suffixes"),
    "counters": linen_rngs.counters_to_data(snapshot.counters),
  }
  if snapshot.adopted:
    data["adopted"] = [
      {"path": list(a.path), "name": a.name, **_describe_rngs(a.rngs, encode)}
      for a in snapshot.adopted
    ]
  if snapshot.compact_cursor is not None:
    data["compact"] = [[prefix, count] for prefix, count in snapshot.compact_cursor]
  return data


def _rebuild_rngs(
  data: dict[str, Any], decode: Callable[[Any, str], Any], where: str
) -> RngSnapshot:
  """Inverse of `_describe_rngs`."""
  compact = data.get("compact")
  return RngSnapshot(
    keys=decode(data["keys"], f"{where}.keys"),
    suffixes=tuple(sorted(decode(data["suffixes"], f"{where}.suffixes").items())),
    counters=linen_rngs.counters_from_data(data["counters"]),
    adopted=tuple(
      AdoptedModule(
        path=tuple(a["path"]),
        name=a["name"],
        rngs=_rebuild_rngs(a, decode, f"{where}.adopted[{i}]"),
      )
      for i, a in enumerate(data.get("adopted", ()))
    ),
    compact_cursor=None if compact is None else tuple((p, c) for p, c in compact),
  )


def _variables(gathered: Gathered) -> dict[str, dict[str, Any]]:
  """The gathered values as a Flax variables dict (variables not created yet left out)."""
  return nest_collections(
    {k: private_value(v) for k, v in gathered.values.items() if not isinstance(v, Uninitialized)}
  )


LINEN = register_adapter(LinenAdapter())
