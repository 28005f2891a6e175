"""Converting an NNX module into a tree of `InterceptedNNXModuleMethod` nodes.

Conversion rebuilds a private, instrumented copy of the model and calls the method once
abstractly (`core._convert.record_calls`) while the `NNXInterceptor` records every
reported call, so it
costs no FLOPs, copies no buffers and does not grow with batch size. Every recorded call
becomes a node; every NNX variable becomes a `Parameter` (`nnx.Param`) or a
`StateVariable` (any other type, grouped by its collection: see
`InterceptedFlaxScopeData`) holding the user's own array, owned by the calls of its
module, and variables the call creates start as `Uninitialized`. Flax internals
used: through `flaxlens._compat` (`nnx_graph`, `nnx_variables`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from flax import nnx

from flaxlens._compat import nnx_graph, nnx_variables
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._call_record import CallRecord
from flaxlens.core._call_variables import ScopeBuilder
from flaxlens.core._convert import build_nodes, record_calls
from flaxlens.core._names import Path, join_name
from flaxlens.core._variables import Parameter, StateVariable, Uninitialized
from flaxlens.errors import ArgumentError, FlaxlensError, UnsupportedFlaxFeatureError
from flaxlens.nnx._definition import (
  NNXModuleDef,
  abstract,
  equal,
  metadata_changed,
  own_containers,
  private_container,
)
from flaxlens.nnx._interceptor import NNXInterceptor, call_method
from flaxlens.nnx._node import InterceptedNNXModuleMethod, NNXVariableSpec


def label_of(path: Path, variable: Any) -> str:
  """The label of the NNX variable at `path`: `"BatchStat:bn/mean"`."""
  return f"{type(variable).__name__}:{join_name(path)}"


def unflaxify_nnx(
  model: nnx.Module,
  *example_args: Any,
  method: str | Callable[..., Any] = "__call__",
  **example_kwargs: Any,
) -> InterceptedNNXModuleMethod:
  """Converts an NNX module into a tree of its calls; see `flaxlens.unflaxify`."""
  where = type(model).__name__
  if inspect.ismethod(method) and method.__self__ is model:
    method = method.__name__
  if isinstance(method, str):
    if not callable(getattr(model, method, None)):
      raise FlaxlensError(f"{where}: the module has no method {method!r}.")
  elif not callable(method):
    raise ArgumentError(
      f"{where}: method must be a method name or a function taking the module first,"
      f" got {type(method).__name__}."
    )

  graphdef, variables = nnx_graph.flatten(model)
  # The definition gets its own copies of static lists, dicts and sets, so that no run
  # of the tree (nor the conversion's) changes the user's in place.
  statics = nnx_graph.static_values(graphdef)
  containers_held = statics is None or any(private_container(v) is not v for v in statics)
  if containers_held:
    template = nnx.merge(graphdef, [None] * len(variables))
    if own_containers(template):
      graphdef = nnx_graph.flatten(template)[0]
  given = dict(variables)
  for path, variable in given.items():
    if not isinstance(variable, nnx.Variable):
      raise UnsupportedFlaxFeatureError(
        f"{where}: the attribute {join_name(path)!r} holds a plain"
        f" {type(variable).__name__} as data, not an nnx.Variable; flaxlens holds a"
        " model's arrays only in variables. Wrap it in one (nnx.Param for a weight,"
        " nnx.Variable or nnx.BatchStat for other state) before converting."
      )
    mode = nnx_variables.variable_mode(variable)
    if mode is not None:
      raise UnsupportedFlaxFeatureError(
        f"{where}: the variable {join_name(path)!r} is in {mode} mode, which flaxlens"
        " does not support yet. Create the model with plain variables (the default)."
      )
  paths = tuple(given)
  leaves = [nnx_variables.raw_value(v) for v in given.values()]
  definition = NNXModuleDef(graphdef, tuple(abstract(x) for x in leaves), paths)

  root = CallRecord(type(model), (), method)
  created: dict[Path, Any] = {}

  def run(interceptor: NNXInterceptor, inputs: Any) -> None:
    leaves, args, kwargs = inputs
    copy, made = nnx_graph.merge_indexed(graphdef, list(leaves))
    private = definition.private_copy(copy, made)
    interceptor.instrument(private.modules, ())
    attributes = {p: dict(vars(m)) for p, m in private.modules}
    containers = [  # copies of the static containers, to find changes made in place
      (p, m, name, private_container(value))
      for p, m in (private.modules if containers_held else ())
      for name, value in nnx_graph.static_attributes(m).items()
      if private_container(value) is not value
    ]
    metadata = [
      (v, dict(nnx_variables.metadata(v))) for v in made.values() if isinstance(v, nnx.Variable)
    ]
    graph = nnx_graph.references(copy)
    private.seal()  # After the sites are set: a call that adds attributes is walked.
    with interceptor.active():
      call_method(copy, method, args, kwargs)
    _check_graph(where, graph, nnx_graph.references(copy))
    _check_statics(where, interceptor.by_path, attributes)
    _check_containers(where, containers)
    _check_metadata(where, copy, metadata)
    created.clear()
    for path, variable in private.current_variables():
      if path not in given:
        _check_created(where, path, variable, interceptor.by_path)
        created[path] = variable

  record_calls(
    root,
    lambda: NNXInterceptor(side_inputs={}, building=True),
    run,
    (leaves, example_args, example_kwargs),
    ArgsAndKwargs(args=tuple(example_args), kwargs=dict(example_kwargs)),
  )
  return _build_tree(definition, root, given, created)


def _check_graph(where: str, before: tuple[dict, dict], after: tuple[dict, dict]) -> None:
  """Refuses calls that change the module's graph (`nnx_graph.references` before, after).

  The tree rebuilds every call from the graph seen at conversion, so an attribute that
  held a variable or a submodule must hold the very same object after the call: one
  deleted, re-pointed (`self.cur = self.b`), aliased (`self.b = self.a`) or replaced by
  a variable of another type would be undone at the next call. What a call may do:
  replace a variable by a new one of the same type and metadata (its value is read
  back by path), and add new variables to existing modules (checked by
  `_check_created`).
  """
  (old, owners), (new, _) = before, after
  known = {id(obj) for obj in old.values()}
  counts: dict[int, int] = {}
  for obj in new.values():
    counts[id(obj)] = counts.get(id(obj), 0) + 1

  def name(key: tuple[int, Path]) -> str:
    return join_name((*owners.get(key[0], ("<new>",)), *key[1]))

  def refuse(key: tuple[int, Path], what: str) -> UnsupportedFlaxFeatureError:
    return UnsupportedFlaxFeatureError(
      f"{where}: the call changes the model's graph at {name(key)!r}: it {what}. flaxlens"
      " replays every call"
      " from the graph of variables and submodules seen at conversion, so later calls"
      " would differ from the model's; keep the graph fixed while running (update a"
      " variable's value in place: `v[...] = new`), or make the change before converting."
    )

  partner: dict[int, tuple[int, Path]] = {}
  for key, obj in old.items():
    now = new.get(key, _MISSING)
    if now is _MISSING:
      raise refuse(key, f"deletes the {type(obj).__name__} held there")
    if now is not obj:
      kind = type(obj).__name__
      if id(now) in known:
        raise refuse(key, f"re-points the attribute from a {kind} to another object of the model")
      if not isinstance(obj, nnx.Variable) or not isinstance(now, nnx.Variable):
        raise refuse(key, f"replaces the {kind} held there by a new {type(now).__name__}")
      if type(now) is not type(obj):
        raise refuse(key, f"changes the type of the variable from {kind} to {type(now).__name__}")
      if counts[id(now)] > 1 or metadata_changed(nnx_variables.metadata(obj), now):
        raise refuse(key, f"replaces the {kind} held there by one of other metadata or sharing")
    # Objects shared before must be shared after, and only by the same references.
    first = partner.setdefault(id(obj), key)
    if new[first] is not now:
      raise refuse(key, f"no longer shares the {type(obj).__name__} held at {name(first)!r}")
  for key, obj in new.items():
    if key in old:
      continue
    if id(obj) in known or counts[id(obj)] > 1:
      raise refuse(key, f"adds another reference to a {type(obj).__name__} of the model (an alias)")
    if key[0] not in owners or not isinstance(obj, nnx.Variable):
      raise refuse(key, f"adds a new {type(obj).__name__}")


def _check_statics(where: str, modules: dict[Path, Any], before: dict[Path, dict]) -> None:
  """Refuses calls that change a module's static (non-variable) attributes.

  The tree starts every call from the static attributes seen at conversion; a model
  that changed them while running would behave differently on its next call. A static
  placeholder the call replaces with a variable (`cache_index = None` until
  `init_cache`) is a created variable, not a change. `before`: a copy of each module's
  attributes (`vars`) taken before the call; a module holding the very same attributes
  now kept its static ones.
  """
  for path, module in modules.items():
    attributes, now = before[path], vars(module)
    if len(attributes) == len(now) and all(
      now.get(name, _MISSING) is value for name, value in attributes.items()
    ):
      continue
    old = nnx_graph.static_attributes(module, attributes)
    new = nnx_graph.static_attributes(module)
    for name in sorted(set(old) | set(new)):
      if name in old and name not in new and name in vars(module):
        continue
      if name not in old or name not in new or not equal(old[name], new[name]):
        raise UnsupportedFlaxFeatureError(
          f"{where}: the call changes the static attribute {name!r} of the module at"
          f" {join_name(path) or '<root>'!r}. flaxlens replays every call from the"
          " static attributes seen at conversion; keep values that change while"
          " running in an nnx.Variable, or set them before converting."
        )


_MISSING = object()


def _check_containers(where: str, containers: list[tuple[Path, Any, str, Any]]) -> None:
  """Refuses calls that change a static list, dict or set in place (`self.log.append`).

  `containers`: `(path, module, name, copy)` of every static attribute holding plain
  containers, copied before the call; an attribute the call set anew is left to
  `_check_statics`.
  """
  for path, module, name, before in containers:
    now = vars(module).get(name, _MISSING)
    if now is not _MISSING and not equal(before, now):
      raise UnsupportedFlaxFeatureError(
        f"{where}: the call changes the static attribute {name!r} of the module at"
        f" {join_name(path) or '<root>'!r} in place. flaxlens replays every call from"
        " the static attributes seen at conversion; keep values that change while"
        " running in an nnx.Variable, or set them before converting."
      )


def _check_metadata(where: str, copy: Any, before: list[tuple[Any, dict]]) -> None:
  """Refuses calls that change a variable's metadata (`set_metadata` while running).

  Like static attributes, metadata is part of the `GraphDef` every call of the tree
  starts from, so a change made by one call would be lost at the next.
  """
  changed = {id(v) for v, items in before if metadata_changed(items, v)}
  if not changed:
    return
  paths = [join_name(tuple(p)) for p, v in nnx.to_flat_state(nnx.state(copy)) if id(v) in changed]
  raise UnsupportedFlaxFeatureError(
    f"{where}: the call changes the metadata of the variable"
    f" {paths[0] if paths else '<unknown>'!r}. flaxlens replays every call from the"
    " metadata seen at conversion; keep values that change while running in the"
    " variable's value, or set the metadata before converting."
  )


def _check_created(where: str, path: Path, variable: Any, modules: dict[Path, Any]) -> None:
  name = f"{type(variable).__name__} {join_name(path)!r}"
  if isinstance(variable, nnx.Param):
    raise UnsupportedFlaxFeatureError(
      f"{where}: the call creates the parameter {name} (lazy initialization)."
      " Initialize the model first (for nnx.bridge modules: nnx.bridge.lazy_init)."
    )
  if path[:-1] not in modules or not isinstance(path[-1], str):
    raise UnsupportedFlaxFeatureError(
      f"{where}: the call creates the variable {name} inside a new container; flaxlens"
      " holds variables a call creates only as attributes of existing modules."
    )


def _build_tree(
  definition: NNXModuleDef,
  root: CallRecord,
  given: dict[Path, Any],
  created: dict[Path, Any],
) -> InterceptedNNXModuleMethod:
  called = {r.path for r in root.walk()}
  definitions = {p: definition if p == () else NNXModuleDef.derived(definition, p) for p in called}
  scopes = ScopeBuilder(called)
  specs: dict[Path, list[NNXVariableSpec]] = {p: [] for p in called}
  variables = [(p, v, False) for p, v in given.items()]
  variables += [(p, v, True) for p, v in created.items()]
  for path, variable, is_new in variables:
    label = label_of(path, variable)
    if isinstance(variable, nnx.Param):
      collection = None
      entry = Parameter(nnx_variables.raw_value(variable), label=label)
    else:
      collection = nnx_variables.collection_name(type(variable))
      value = Uninitialized() if is_new else nnx_variables.raw_value(variable)
      entry = StateVariable(value, label=label)
    name = scopes.add(path, collection, entry)
    owner = scopes.owner(path)
    metadata = tuple(variable.get_metadata().items())
    spec = NNXVariableSpec(name, collection, path[len(owner) :], type(variable), metadata, is_new)
    specs[owner].append(spec)

  def make(record: CallRecord, children: dict, origin: int) -> InterceptedNNXModuleMethod:
    return InterceptedNNXModuleMethod(
      module_type=record.module,
      method_name=record.method_name,
      path=record.path,
      scope_data=scopes.scope_data(record.path),
      submodule_calls=children,
      definition=definitions[record.path],
      specs=tuple(specs[record.path]),
      sliced=record.extra.get("sliced", False),
      call_specs=record.call_specs(),
      own_spec=record.spec,
      origin=origin,
    )

  return build_nodes(root, make)
