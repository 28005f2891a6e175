"""Converting a Linen module into a tree of `InterceptedFlaxModuleMethod` nodes.

Conversion runs the root `module.apply` once abstractly (`core._convert.record_calls`)
with a building `LinenInterceptor`, so it costs no FLOPs, copies no buffers and does not
grow with batch size. Every intercepted call becomes a node; every variable becomes a
`Parameter` (`params`), a `StateVariable` (mutable collections) or a plain value (other
collections) holding the caller's own buffer, owned by the calls of its module. Flax
re-checks every parameter's shape against its initializer at every apply; while
converting, each distinct initializer (same function object, equal arguments) is
evaluated once and its shapes compared for every parameter, raising Flax's own
`ScopeParamShapeError` (`_compat.linen_apply.param_checks_once`). Flax internals used: through
`flaxlens._compat` (`linen_apply`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import errors as flax_errors

from flaxlens._compat import linen_apply
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._call_record import CallRecord
from flaxlens.core._call_variables import ScopeBuilder
from flaxlens.core._convert import build_nodes, record_calls
from flaxlens.core._names import join_name
from flaxlens.core._variables import Parameter, StateVariable, Uninitialized
from flaxlens.errors import (
  ArgumentError,
  FlaxlensError,
  ModelCallError,
  UnsupportedFlaxFeatureError,
)
from flaxlens.linen._collections import flatten_collections, frozen_levels
from flaxlens.linen._interceptor import LinenInterceptor
from flaxlens.linen._node import InterceptedFlaxModuleMethod, RngSnapshot


def unflaxify_linen(
  module: nn.Module,
  variables: Mapping[str, Any],
  *example_args: Any,
  method: str | Callable[..., Any] | None = None,
  rngs: Any = None,
  mutable: Any = False,
  capture_intermediates: bool | Callable[..., bool] = False,
  **example_kwargs: Any,
) -> InterceptedFlaxModuleMethod:
  """Converts a Linen module into a tree of its calls; see `flaxlens.unflaxify`."""
  where = f"{type(module).__name__}"
  if module.scope is not None:
    raise FlaxlensError(
      f"{where}: unflaxify needs an unbound module (as passed to module.apply); this"
      " one is bound. Use module.unbind() to get the module and its variables."
    )
  if not isinstance(variables, Mapping):
    raise ArgumentError(
      f"{where}: variables must be a dict of collections (as returned by"
      f" module.init), got {type(variables).__name__}."
    )
  method_name = "__call__" if method is None else method
  if isinstance(method_name, str) and not callable(getattr(module, method_name, None)):
    raise FlaxlensError(f"{where}: the module has no method {method_name!r}.")

  def run(interceptor: LinenInterceptor, inputs: Any) -> Any:
    vs, args, kwargs, keys = inputs
    snapshot = keys.as_flax() if isinstance(keys, RngSnapshot) else None
    adopted = keys.adopted_as_flax() if isinstance(keys, RngSnapshot) else ()
    cursor = keys.compact_cursor if isinstance(keys, RngSnapshot) else None
    keys = None if snapshot is not None else keys
    with interceptor.active(), linen_apply.param_checks_once():
      result = linen_apply.apply_fresh(
        module,
        vs,
        *args,
        method=method,
        rngs=keys,
        rng_snapshot=snapshot,
        adopted=adopted,
        compact_cursor=cursor,
        mutable=mutable,
        capture_intermediates=capture_intermediates,
        **kwargs,
      )
    mutated = result[1] if _any_mutable(mutable, capture_intermediates) else {}
    updated_params[:] = _updated_params(vs, mutated)
    return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x,
      mutated,
    )

  root = CallRecord(module, (), method_name)
  updated_params: list[str] = []
  try:
    mutated = record_calls(
      root,
      lambda: LinenInterceptor(side_inputs={}, building=True),
      run,
      (variables, example_args, example_kwargs, rngs),
      ArgsAndKwargs(args=tuple(example_args), kwargs=dict(example_kwargs)),
    )
  except _MISSING_VARIABLES as e:
    said = e.__cause__ if isinstance(e, ModelCallError) else e  # Flax's own words.
    raise ArgumentError(
      f"unflaxify({where}): variables lacks what the model reads"
      f" ({' '.join(str(said).split()).split(' (https://')[0].rstrip('.')}). Pass the variables"
      " module.init returns for this module: fl.unflaxify(module,"
      " module.init(key, *example_args), *example_args)."
    ) from said
  if updated_params:
    raise UnsupportedFlaxFeatureError(
      f"{where}: the call updates the parameter {updated_params[0]!r} (the 'params'"
      " collection is mutable and the call puts a new value into it). flaxlens holds"
      " parameters fixed while a tree runs; keep values a call updates in another"
      " collection (self.variable('state', ...)) and make it mutable instead."
    )
  named = [mutable] if isinstance(mutable, str) else mutable
  named = list(named) if isinstance(named, list | tuple) else []
  tree = _build_tree(root, variables, mutated, capture_intermediates, named)
  if isinstance(rngs, RngSnapshot):
    data = tree.scope_data
    tree = (
      tree.select()
      .at(lambda t: t.scope_data)
      .set(type(data).from_attributes(**{**data.attributes_dict(), "rngs": rngs}))
    )
  return tree


# Flax's errors for variables that lack a collection or a variable the call reads.
_MISSING_VARIABLES = (
  flax_errors.ScopeCollectionNotFound,
  flax_errors.ScopeParamNotFoundError,
  flax_errors.ScopeVariableNotFoundError,
)


def _updated_params(given: Mapping[str, Any], mutated: Mapping[str, Any]) -> list[str]:
  """The paths of the parameters a call put new values into (`put_variable`).

  A parameter the call only read is returned as the very object it was given (conversion
  traces the call, so every given value is a distinct tracer); any other leaf is new.
  Created parameters are refused elsewhere (`_build_tree`).
  """
  if "params" not in mutated:
    return []
  before = flatten_collections({"params": given.get("params", {})})
  after = flatten_collections({"params": mutated["params"]})
  return [join_name(k[1]) for k, v in after.items() if k in before and v is not before[k]]


def _any_mutable(mutable: Any, capture_intermediates: Any) -> bool:
  return bool(capture_intermediates) or not (mutable is False or mutable is None)


def _build_tree(
  root: CallRecord,
  variables: Mapping[str, Any],
  mutated: Mapping[str, Any],
  capture_intermediates: Any,
  named_mutable: list[str],
) -> InterceptedFlaxModuleMethod:
  given = flatten_collections(variables)
  created = flatten_collections(mutated)
  mutable_collections = set(mutated)
  if any(c == "params" for c, _ in created if (c, _) not in given):
    raise UnsupportedFlaxFeatureError(
      f"{type(root.module).__name__}: this call creates parameters (an `init` run"
      " through apply). Run module.init first and convert with its variables."
    )
  mutable_collections.update(named_mutable)
  mutable_collections.discard("params")

  frozen = frozen_levels(variables)
  scopes = ScopeBuilder({r.path for r in root.walk()})
  for (collection, vpath), value in {**{k: None for k in created}, **given}.items():
    label = f"{collection}:{join_name(vpath)}"
    if collection == "params":
      scopes.add(vpath, None, Parameter(value, label=label))
    elif collection in mutable_collections:
      initial = Uninitialized() if (collection, vpath) not in given else value
      scopes.add(vpath, collection, StateVariable(initial, label=label))
    else:
      scopes.add(vpath, collection, value, mutable=False)

  def make(record: CallRecord, children: dict, origin: int) -> InterceptedFlaxModuleMethod:
    return InterceptedFlaxModuleMethod(
      module=record.module,
      method_name=record.method_name,
      path=record.path,
      scope_data=scopes.scope_data(record.path),
      submodule_calls=children,
      capture_intermediates=capture_intermediates,
      mutable=tuple(sorted(mutable_collections)),
      lifted_by=record.extra.get("lifted_by", ()),
      sliced=record.extra.get("sliced", False),
      converted_module=record.module,
      call_specs=record.call_specs(),
      own_spec=record.spec,
      origin=origin,
      frozen_levels=frozen,
    )

  return build_nodes(root, make)
