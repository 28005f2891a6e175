"""The NNX call tree: one `InterceptedNNXModuleMethod` node per intercepted method call.

Calling a node rebuilds a private copy of its module with `nnx.merge` (its `GraphDef`
plus the tree's current variable values), marks each of the copy's modules with a site
attribute and, while the method runs, wraps the methods of their classes in place so
that calls of marked modules report to an `NNXInterceptor` (see its docstring for why
in place rather than per-instance subclasses). The method then runs natively: an
unmodified child node lets its call continue (so rng streams, batch statistics, caches
and NNX transforms are NNX's own, bit for bit) and any other layer replaces the call.
The copy's updated state is written back into the tree's `StateVariable`s and the copy
is dropped. The user's model is never touched, the classes are restored exactly even
when a call raises, inherited methods are seen, and sites survive `nnx.split`/
`nnx.merge` inside transforms. Flax internals used: see `flaxlens._flax_internals`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
from flax import nnx

from flaxlens import _flax_internals as fi
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._calls import (
  CallInterceptor,
  CallNode,
  CallRecord,
  CallSpec,
  Frame,
  Path,
  is_active,
  is_call_node,
  own_call_nodes,
)
from flaxlens.core._inner_jit import RunToken
from flaxlens.core._struct import static_field
from flaxlens.core._variables import (
  AbstractVariable,
  Uninitialized,
  check_storable,
  private_value,
  same_entry,
  value_of,
)
from flaxlens.errors import CallStructureError, FlaxlensError, UnsupportedFlaxFeatureError


class NNXVariableSpec(NamedTuple):
  """What a node knows about one of its NNX variables, to rebuild it exactly.

  Attributes:
    name: its key in the node's `parameters` or `variables` (`"rngs/count"`).
    path: its path from the node's module, as NNX spells it (`("rngs", "count")`).
    type: the `nnx.Variable` subclass (`nnx.Param`, `nnx.BatchStat`, ...).
    metadata: the variable's metadata, as `(name, value)` pairs.
    created: whether the converted call itself created it (a `sow` outside
      `nnx.capture`, a cache made by `init_cache`); such variables are not part of the
      node's `GraphDef` and are added to the private copy once they hold a value.
  """

  name: str
  path: Path
  type: type
  metadata: tuple[tuple[str, Any], ...]
  created: bool = False


class InterceptedNNXModuleMethod(CallNode):
  """One call of a Flax NNX module method, with its submodule calls as children.

  Call it as `node(fl.ArgsAndKwargs.capture(*args, **kwargs), **side_inputs)`; side
  inputs are passed to replacement layers. NNX keeps random state in the model, so
  dropout masks follow the tree's `RngKey`/`RngCount` state variables.

  Attributes:
    module_type: the module's class (the user's class, not an instrumented one).
    method_name: the method called (a string, or the function given as `method=`).
    path: the module's path in the converted model (`("blocks", 0, "linear")`).
    parameters: the module's own `nnx.Param`s as `Parameter`s, by relative name; a
      variable of a submodule that makes no call of its own is held by its nearest
      calling ancestor (`"linear/kernel"`).
    variables: the module's other NNX variables (`BatchStat`, `Cache`, `RngKey`,
      `RngCount`, custom types) as `StateVariable`s, by relative name.
    submodule_calls: `{(call_index, "child.method"): layer}` in call order.
    definition: the module's static definition (its `nnx.GraphDef`); with the
      variables it rebuilds the module.
    specs: one `NNXVariableSpec` per entry of `parameters` and `variables`.
    sliced: whether the call runs inside an NNX transform that slices its variables
      (`nnx.scan`, `nnx.vmap`); such a node runs only as part of its tree.
    call_specs: what conversion saw of each submodule call (arguments and output,
      abstractly); replacement outputs are checked against it.
    origin: the id of the conversion that made the node; a replacement continues a
      call natively only through a node of the same conversion.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> from flax import nnx
    >>> model, x = nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, x)
    >>> bool((tree(fl.ArgsAndKwargs.capture(x)) == model(x)).all())
    True
  """

  module_type: type = static_field()
  method_name: Any = static_field()
  path: Path = static_field()
  parameters: dict[str, Any]
  variables: dict[str, Any]
  submodule_calls: dict[tuple[int, str], Any]
  definition: NNXModuleDef = static_field()
  specs: tuple[NNXVariableSpec, ...] = static_field(default=())
  sliced: bool = static_field(default=False)
  call_specs: tuple[CallSpec, ...] = static_field(default=())
  origin: int = static_field(default=0)

  treescope_hidden_fields = ("specs", "call_specs", "origin")
  treescope_short_fields = ("module_type", "definition")

  def _module_type_name(self) -> str:
    return self.module_type.__name__

  def _run_root(
    self, argument: ArgsAndKwargs, /, random_streams: Any = None, **side_inputs: Any
  ) -> Any:
    if random_streams is not None:
      raise FlaxlensError(
        f"{self._where()}: random_streams is for Linen trees. An NNX model keeps its"
        " random state in the model (its RngKey/RngCount variables are state variables"
        " of this tree); pass an nnx.Rngs as a call argument if the method takes one."
      )
    return _run(self, argument, side_inputs)

  def nnx_module(self) -> nnx.Module:
    """A new NNX module: this call's module with the tree's current variables.

    Edits made in the tree are included, and so are variables the converted call
    created once they hold a value. The module is plain NNX (no flaxlens classes) and
    shares nothing with the tree or the converted model but immutable arrays.

    Raises:
      FlaxlensError: if the tree no longer holds some of the module's variables
        (their calls were replaced), or the call runs inside `nnx.scan`/`nnx.vmap`.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> tree = fl.unflaxify(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 3)))
      >>> tree.parameters["bias"].value += 1.0
      >>> tree.nnx_module().bias[...]
      Array([1., 1.], dtype=float32)
    """
    where = self._where()
    _check_whole(self, "be exported on its own; export the tree it belongs to")
    gathered = _Gathered(self)
    values = gathered.values(where)
    missing = ["/".join(map(str, p)) for p in self.definition.leaf_paths if p not in values]
    if missing:
      raise FlaxlensError(
        f"{where}: the tree no longer holds the variables {missing[:6]}: their calls were"
        " replaced. Export before replacing them, or keep the replaced node inside the"
        " replacement layer."
      )
    model, _ = self.definition.rebuild(values, gathered.created(where))
    apply_static_edits(model, static_edits(self))
    return model

  def set_attributes(
    self, *filters: Any, raise_if_not_found: bool = True, **attributes: Any
  ) -> Self:
    """A copy of this tree whose calls run as after NNX's `module.set_attributes(...)`.

    The tree is immutable: the change is made by NNX on a copy of the module and
    recorded in the nodes' `GraphDef`s.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
      ...                        nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
      >>> x = jnp.ones((1, 2))
      >>> tree = fl.unflaxify(model, x).set_attributes(deterministic=True)
      >>> bool((tree(fl.ArgsAndKwargs.capture(x)) == model.layers[0](x)).all())
      True
    """
    return _restatic(
      self,
      lambda m: m.set_attributes(*filters, raise_if_not_found=raise_if_not_found, **attributes),
    )

  def train(self, **attributes: Any) -> Self:
    """A copy of this tree in training mode, as NNX's `module.train(**attributes)`.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
      >>> model.eval()
      >>> x = jnp.ones((4,))
      >>> tree = fl.unflaxify(model, x)
      >>> model.train()
      >>> expected = model(x)
      >>> bool((tree.train()(fl.ArgsAndKwargs.capture(x)) == expected).all())
      True
    """
    return _restatic(self, lambda m: m.train(**attributes))

  def eval(self, **attributes: Any) -> Self:
    """A copy of this tree in evaluation mode, as NNX's `module.eval(**attributes)`.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((4,))
      >>> tree = fl.unflaxify(model, x).eval()
      >>> tree(fl.ArgsAndKwargs.capture(x))
      Array([1., 1., 1., 1.], dtype=float32)
    """
    return _restatic(self, lambda m: m.eval(**attributes))

  def view(self, *, only: Any = ..., raise_if_not_found: bool = True, **kwargs: Any) -> Self:
    """A copy of this tree whose calls run as those of `nnx.view(module, **kwargs)`.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((4,))
      >>> tree = fl.unflaxify(model, x).view(deterministic=True)
      >>> tree(fl.ArgsAndKwargs.capture(x))
      Array([1., 1., 1., 1.], dtype=float32)
    """
    return _restatic(
      self,
      lambda m: nnx.view(m, only=only, raise_if_not_found=raise_if_not_found, **kwargs),
    )


# --- rebuilding a module from a tree ---------------------------------------------------


class _Marker:
  __slots__ = ("index",)

  def __init__(self, index: int):
    self.index = index


def leaf_paths(graphdef: Any) -> tuple[Path, ...]:
  """The variable paths of `graphdef`, in the order `nnx.merge` takes a list of leaves."""
  count = fi.nnx_leaf_count(graphdef)
  probe = nnx.merge(graphdef, [_Marker(i) for i in range(count)])
  paths: list[Path] = [()] * count
  for path, variable in nnx.to_flat_state(nnx.state(probe)):
    paths[variable.get_raw_value().index] = tuple(path)
  return tuple(paths)


def abstract(value: Any) -> Any:
  """`value` with every array replaced by its `jax.ShapeDtypeStruct`."""
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, value
  )


class NNXModuleDef:
  """The static definition of a converted module: its `GraphDef` and variable shapes.

  Attributes:
    graphdef: the module's `nnx.GraphDef` (static attributes such as `deterministic`
      included, and the type and metadata of every variable).
    abstract_leaves: shape and dtype (`jax.ShapeDtypeStruct`s) of every variable of
      `graphdef`, in the order `nnx.merge` takes them.
    leaf_paths: the paths of those variables, in the same order.

  Its hash is computed once: hashing a `GraphDef` walks all of it, and jit looks up its
  cache by the static fields of a tree on every call. A static attribute NNX cannot hash
  (a dict, a list) leaves the variables' paths as the hash; equality still compares
  the whole `GraphDef`, as NNX does.
  """

  __slots__ = ("graphdef", "abstract_leaves", "leaf_paths", "family", "_hash", "_statics")

  def __init__(
    self,
    graphdef: Any,
    abstract_leaves: tuple[Any, ...],
    paths: tuple[Path, ...] | None = None,
    family: object | None = None,
  ):
    self.graphdef = graphdef
    self.abstract_leaves = abstract_leaves
    self.leaf_paths = leaf_paths(graphdef) if paths is None else paths
    # Definitions made together from one model (by conversion, or by one change of
    # static attributes) share a family: they agree on every module they both hold.
    self.family = object() if family is None else family
    self._statics: dict[Path, dict[str, Any]] | None = None
    self._hash = _hash_or(graphdef, lambda: hash(self.leaf_paths))
    self._hash = _hash_or((self._hash, abstract_leaves), lambda: self._hash)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    return self is other or (
      type(other) is NNXModuleDef
      and self._hash == other._hash
      and _equal(self.graphdef, other.graphdef)
      and _equal(self.abstract_leaves, other.abstract_leaves)
    )

  def __repr__(self) -> str:
    return f"NNXModuleDef(<GraphDef>, {len(self.leaf_paths)} variables)"

  def with_graphdef(self, graphdef: Any, family: object) -> NNXModuleDef:
    """The same module with other static attributes (same variables)."""
    return NNXModuleDef(graphdef, self.abstract_leaves, self.leaf_paths, family)

  def statics(self) -> dict[Path, dict[str, Any]]:
    """The static attributes of each module of the definition, by relative path."""
    if self._statics is None:
      template = nnx.merge(self.graphdef, [None] * len(self.leaf_paths))
      self._statics = {tuple(p): fi.nnx_static_attributes(m) for p, m in nnx.iter_modules(template)}
    return self._statics

  def rebuild(self, values: dict[Path, Any], created: dict[Path, Any]) -> tuple[Any, set[Path]]:
    """The module rebuilt from `values`, and the paths of its variables no node holds.

    `nnx.merge` creates fresh `Variable`s of the types and metadata the `GraphDef`
    records, and values that can change in place (NumPy arrays) are copied, so nothing
    is shared with the model the values came from but immutable arrays. Variables no
    node holds belong to calls that were replaced: they stand in as zeros of their
    shape, so that transforms over the module's state (`nnx.vmap`, `nnx.scan`) still
    see the shapes they need. `created` variables (made by the
    converted call) are set as attributes of their modules.
    """
    leaves = [
      private_value(values[p]) if p in values else jax.tree_util.tree_map(_zeros, a)
      for p, a in zip(self.leaf_paths, self.abstract_leaves, strict=True)
    ]
    model = nnx.merge(self.graphdef, leaves)
    for path, variable in created.items():
      setattr(navigate(model, path[:-1]), path[-1], variable)
    return model, {p for p in self.leaf_paths if p not in values}


def _hash_or(value: Any, fallback: Callable[[], int]) -> int:
  try:
    return hash(value)
  except TypeError:
    return fallback()


def _equal(a: Any, b: Any) -> bool:
  """`a == b`, False where comparing raises (arrays held as static attributes, say)."""
  if a is b:
    return True
  try:
    return bool(a == b)
  except Exception:
    return False


def static_edits(root: InterceptedNNXModuleMethod) -> dict[Path, dict[str, Any]]:
  """Static attributes that nodes under `root` set otherwise than `root.definition`.

  A subtree whose mode was changed on its own (`node.eval()` grafted back into the
  tree) holds definitions of another family than the root's; where they differ from
  the root's, their modules' static attributes are set on the rebuilt model (nodes
  deeper in the tree win). Computed once per root node.
  """
  cached = root.__dict__.get("_flaxlens_static_edits")
  if cached is not None:
    return cached
  family = root.definition.family
  edits: dict[Path, dict[str, Any]] = {}
  base: dict[Path, dict[str, Any]] | None = None
  for node in own_call_nodes(root):
    if node.definition.family is family:
      continue
    base = root.definition.statics() if base is None else base
    rel = node.path[len(root.path) :]
    for sub, statics in node.definition.statics().items():
      before = base.get(rel + sub)
      if before is None:
        continue
      changed = {k: v for k, v in statics.items() if k not in before or not _equal(before[k], v)}
      if changed:
        edits.setdefault(rel + sub, {}).update(changed)
  object.__setattr__(root, "_flaxlens_static_edits", edits)
  return edits


def apply_static_edits(model: Any, edits: dict[Path, dict[str, Any]]) -> None:
  """Sets the static attributes `static_edits` found on the modules of `model`."""
  for path, attributes in edits.items():
    module = navigate(model, path)
    for name, value in attributes.items():
      fi.nnx_set_static(module, name, value)


def _zeros(leaf: Any) -> Any:
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jnp.zeros(leaf.shape, leaf.dtype)
  return leaf


def navigate(root: Any, path: Path) -> Any:
  """The object at `path` (attribute names and list indices) inside an NNX graph."""
  node = root
  for key in path:
    node = node[key] if isinstance(key, int) else getattr(node, key)
  return node


_ABSENT = object()


class _Gathered:
  """The variables of one run, gathered from the nodes of a tree by path."""

  def __init__(self, root: InterceptedNNXModuleMethod):
    self.specs: dict[Path, NNXVariableSpec] = {}
    self.entries: dict[Path, Any] = {}
    prefix = root.path
    for node in own_call_nodes(root):
      if node.path[: len(prefix)] != prefix:
        raise UnsupportedFlaxFeatureError(
          f"{root._where()}: this call uses the module at"
          f" {'/'.join(map(str, node.path))!r}, which lives outside it; call the"
          " enclosing tree instead."
        )
      base = node.path[len(prefix) :]
      for spec in node.specs:
        entry = node.parameters.get(spec.name, node.variables.get(spec.name, _ABSENT))
        if entry is _ABSENT:
          raise FlaxlensError(
            f"{node._where()}: the node has no entry {spec.name!r} any more. Edit a"
            " variable's .value instead of removing it from parameters/variables."
          )
        path = base + spec.path
        seen = self.entries.get(path, _ABSENT)
        if seen is not _ABSENT:
          if not same_entry(seen, entry):
            raise FlaxlensError(
              f"{node._where()}: two calls of the module hold different values for"
              f" {'/'.join(map(str, path))!r}. Calls of one module share their"
              " variables; edit the shared variable's .value instead of replacing it"
              " in one call."
            )
          continue
        self.specs[path] = spec
        self.entries[path] = entry

  def values(self, where: str) -> dict[Path, Any]:
    """Current values of the variables the `GraphDef` has (not those made by the call)."""
    return {p: value_of(e, where) for p, e in self.entries.items() if not self.specs[p].created}

  def created(self, where: str) -> dict[Path, Any]:
    """Variables the converted call created and that hold a value by now, as NNX ones."""
    made = {}
    for path, entry in self.entries.items():
      spec = self.specs[path]
      if spec.created:
        value = value_of(entry, where)
        if not isinstance(value, Uninitialized):
          made[path] = spec.type.from_metadata(private_value(value), dict(spec.metadata))
    return made


# --- running a tree --------------------------------------------------------------------


def _check_whole(node: InterceptedNNXModuleMethod, cannot: str) -> None:
  if node.sliced:
    raise UnsupportedFlaxFeatureError(
      f"{node._where()}: this call runs inside an NNX transform (nnx.scan, nnx.vmap)"
      f" that slices its variables, so it cannot {cannot}."
    )


def call_method(model: Any, method: Any, args: Any, kwargs: Any) -> Any:
  if isinstance(method, str):
    return getattr(model, method)(*args, **kwargs)
  return method(model, *args, **kwargs)


def _run(
  root: InterceptedNNXModuleMethod,
  argument: ArgsAndKwargs,
  side_inputs: dict[str, Any],
  interceptor: NNXInterceptor | None = None,
) -> Any:
  where = root._where()
  _check_whole(root, "be called on its own. Call the tree it belongs to (patches apply inside)")
  gathered = _Gathered(root)
  values = gathered.values(where)
  model, orphans = root.definition.rebuild(values, gathered.created(where))
  apply_static_edits(model, static_edits(root))
  if interceptor is None:
    interceptor = NNXInterceptor(side_inputs=side_inputs, building=False)
    traced = frozenset(map(id, gathered.entries.values()))
    interceptor.token = RunToken(interceptor, (root, side_inputs), traced)
  interceptor.instrument(model, root.path)
  method = root.method_name
  frame = Frame(root.path, node=root, absorb=method if isinstance(method, str) else None)
  interceptor.frames.append(frame)
  with interceptor.active():
    output = call_method(model, method, argument.args, argument.kwargs)
  interceptor.check_reached(frame)
  _write_back(root, gathered, values, orphans, model)
  return output


def _write_back(
  root: InterceptedNNXModuleMethod,
  gathered: _Gathered,
  values: dict[Path, Any],
  orphans: set[Path],
  model: Any,
) -> None:
  updates = {tuple(p): v.get_raw_value() for p, v in nnx.to_flat_state(nnx.state(model))}
  unknown = [p for p in updates if p not in gathered.entries and p not in orphans]
  if unknown:
    names = ["/".join(map(str, p)) for p in unknown[:6]]
    raise CallStructureError(
      f"{root._where()}: this call created variables that did not exist at conversion:"
      f" {names}. Convert with example arguments that create them (for example the"
      " same flags), so the tree has state variables to hold them."
    )
  changed = [
    (entry, value)
    for path, value in updates.items()
    if isinstance(entry := gathered.entries.get(path), AbstractVariable)
    and value is not values.get(path, _ABSENT)
  ]
  for entry, value in changed:
    check_storable(entry, value, root._where())
  for entry, value in changed:
    entry.value = value


def _restatic(
  root: InterceptedNNXModuleMethod, change: Callable[[Any], Any]
) -> InterceptedNNXModuleMethod:
  """`root` with every node's `GraphDef` as NNX's `change(module)` leaves it."""
  _check_whole(root, "change its attributes on its own; change those of the tree it belongs to")
  _Gathered(root)  # Checks that every node belongs under the root.
  definition = root.definition
  model = nnx.merge(definition.graphdef, [None] * len(definition.leaf_paths))
  apply_static_edits(model, static_edits(root))
  changed = change(model)
  if isinstance(changed, nnx.Module):
    model = changed
  graphdefs: dict[Path, Any] = {}
  family = object()

  def regraph(node: InterceptedNNXModuleMethod) -> InterceptedNNXModuleMethod:
    rel = node.path[len(root.path) :]
    if rel not in graphdefs:
      graphdefs[rel] = nnx.graphdef(navigate(model, rel))
    fields = node.attributes_dict()
    fields["definition"] = node.definition.with_graphdef(graphdefs[rel], family)
    fields["submodule_calls"] = {
      key: jax.tree_util.tree_map(
        lambda x: regraph(x) if is_call_node(x) and x.origin == root.origin else x,
        child,
        is_leaf=is_call_node,
      )
      for key, child in node.submodule_calls.items()
    }
    return type(node).from_attributes(**fields)

  return regraph(root)


# --- instrumentation -------------------------------------------------------------------

_STDLIB_MODULES = ("builtins", "abc", "typing", "collections.abc")


def plain_module(graphdef: Any, leaves: list[Any]) -> Any:
  """A plain NNX module (no run site) from a split of a module of a run."""
  module = nnx.merge(graphdef, leaves)
  for _, sub in nnx.iter_modules(module):
    fi.nnx_clear_site(sub)
  return module


def split_leaves(module: Any) -> tuple[Any, list[Any]]:
  """`(graphdef, leaves)` of `module`, leaves in the order `nnx.merge` takes them."""
  graphdef, state = nnx.split(module)
  flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
  return graphdef, [flat[p].get_raw_value() for p in leaf_paths(graphdef)]


class _Site(NamedTuple):
  """What a module of a run's private copy carries (static, so it survives transforms).

  `token` finds the run and keys inner jits on it; `jit` is the key of the jitted call
  the module is passed to, while that call runs.
  """

  path: Path
  token: RunToken
  jit: Any = None


def _is_flax_base(cls: type) -> bool:
  return cls in fi.nnx_flax_bases() or cls.__module__ in _STDLIB_MODULES


def _is_method(attr: Any) -> bool:
  if isinstance(attr, type | staticmethod | classmethod | property):
    return False
  return inspect.isfunction(attr) or (callable(attr) and hasattr(type(attr), "__get__"))


@functools.cache
def _reported(cls: type) -> tuple[tuple[type, str], ...]:
  """`(defining class, name)` of the methods of `cls` that report calls.

  The public methods and `__call__` that `cls` and its bases define, up to (not
  including) NNX's own base and container classes, each at the class that defines the
  one `cls` uses.
  """
  found = []
  for name in sorted({n for k in cls.__mro__ for n in vars(k)}):
    if name.startswith("_") and name != "__call__":
      continue
    definer = _definer(cls, name)
    if not _is_flax_base(definer) and _is_method(vars(definer)[name]):
      found.append((definer, name))
  return tuple(found)


@functools.cache
def _definer(cls: type, name: str) -> type:
  return next(k for k in cls.__mro__ if name in vars(k))


def _report(definer: type, name: str) -> Callable[[Any], Callable[..., Any]]:
  """Wraps `definer.name` so that a module of an active run reports its calls."""

  def wrap(method: Any) -> Callable[..., Any]:
    def reporting(self: Any, *args: Any, **kwargs: Any) -> Any:
      bound = method.__get__(self, type(self))
      site = fi.nnx_site(self)
      if site is None or _definer(type(self), name) is not definer:
        return bound(*args, **kwargs)  # Not a run's module, or reached through super().
      interceptor = site.token.interceptor
      if interceptor is None or not interceptor.frames or not is_active(interceptor):
        return bound(*args, **kwargs)
      return interceptor.dispatch(self, site.path, name, bound, args, kwargs)

    functools.update_wrapper(reporting, method, updated=())
    return reporting

  return wrap


def _variable_shapes(module: Any) -> tuple[Any, ...]:
  return tuple(
    (tuple(p), getattr(v.get_raw_value(), "shape", None))
    for p, v in nnx.to_flat_state(nnx.state(module))
  )


class NNXInterceptor(CallInterceptor):
  """Receives the calls reported by the modules of one private copy of a model.

  While active, the methods of the copy's classes are wrapped in place (in the
  `__dict__` of the classes that define them) and restored exactly afterwards. A
  wrapper reports a call only for a module carrying a site of an active run of this
  thread; any other call of the class (the user's own model, another thread) runs the
  original method directly. So `type(module)` is the user's class, the `GraphDef`
  records it, and no class is ever created: user `__init_subclass__` hooks and class
  registries see nothing. (Swapping each instance's class for a cached subclass, the
  earlier design, made `type(m) is nnx.Linear` false inside a call and ran those hooks.)
  Inner `nnx.jit` calls key their traces on the run and on the jitted call's position,
  by putting that key into the site attributes of the modules they are passed.
  """

  def __init__(self, side_inputs: dict[str, Any], building: bool):
    super().__init__(side_inputs, building)
    self.modules: dict[int, Any] = {}  # id -> module, for the copy's own instances
    self.by_path: dict[Path, Any] = {}
    self.classes: set[type] = set()

  def instrument(self, model: Any, prefix: Path) -> None:
    """Records its path on every module of `model` (its class is wrapped while active)."""
    for rel, module in nnx.iter_modules(model):
      path = prefix + tuple(rel)
      self.by_path[path] = module
      self.classes.add(type(module))
      fi.nnx_set_site(module, _Site(path, self.token))
      self.modules[id(module)] = module

  @contextmanager
  def active(self) -> Iterator[None]:
    methods = {pair for cls in self.classes for pair in _reported(cls)}
    wrappers = {(definer, name): _report(definer, name) for definer, name in methods}
    with fi.patched(wrappers), fi.nnx_jit_keys(self._jit_call), super().active():
      yield

  def _jit_call(self, call: Callable[[], Any], arguments: Any) -> Any:
    """Runs one `nnx.jit` call with the run's key in its modules' sites."""
    ours = [
      m
      for leaf in jax.tree_util.tree_leaves(arguments, is_leaf=_is_module)
      if _is_module(leaf)
      for _, m in nnx.iter_modules(leaf)
      if _site_of(m, self) is not None
    ]
    if not ours or not self.frames:
      return call()
    sites = [fi.nnx_site(m) for m in ours]
    with self.inner_jit(fi.current_trace()) as key:
      for module, site in zip(ours, sites, strict=True):
        fi.nnx_set_site(module, site._replace(jit=key[1]))
      try:
        return call()
      finally:
        for module, site in zip(ours, sites, strict=True):
          fi.nnx_set_site(module, site)

  def new_record(self, module: Any, path: Path, name: str) -> CallRecord:
    record = CallRecord(type(module), path, name)
    if id(module) not in self.modules:
      # A transform re-created the module inside its trace; it slices the variables
      # (nnx.scan, nnx.vmap) when their shapes differ from the model's own.
      record.extra["sliced"] = _variable_shapes(module) != _variable_shapes(self.by_path[path])
    return record

  def same_module(self, node: CallNode, module: Any) -> bool:
    return node.module_type is type(module)


def _is_module(x: Any) -> bool:
  return isinstance(x, nnx.Module)


def _site_of(module: Any, interceptor: NNXInterceptor) -> _Site | None:
  site = fi.nnx_site(module)
  return site if site is not None and site.token.interceptor is interceptor else None
