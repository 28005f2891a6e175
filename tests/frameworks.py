"""How the tests reach each Flax API: one `Framework` object for Linen, one for NNX.

The shared specification (tests/shared) states each behaviour once and runs it against
both APIs. Everything that differs between them goes through this file: converting a
corpus case, calling the model natively (with one of its calls wrapped, under jit, twice,
or from exported variables), the flat view of variables that both sides are compared in,
a node's parameters and state variables, exporting a tree, and the node class. A renamed
node attribute or export verb changes this file only.

Variables are compared as `{label: value}` with the labels the tree gives them: Linen
"collection:path" (state variables only: a Linen call returns its mutable collections),
NNX "Type:path" (every variable: an NNX model holds them all). Path keys are joined by
"/"; a "/" inside a key is written "~1" and a "~" "~0".
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from linen import corpus as linen_corpus  # the test packages tests/linen and tests/nnx
from nnx import corpus as nnx_corpus

import flaxlens as fl


@dataclasses.dataclass(frozen=True)
class Wrap:
  """Wraps the native call at `path` (method `__call__`): it returns `fn(output, *args)`.

  `calls`, when given, numbers the calls of that module from 0 and wraps only those.
  """

  path: str
  fn: Callable[..., Any]
  calls: frozenset[int] | None = None


def _key(key: Any) -> str:
  return str(key).replace("~", "~0").replace("/", "~1")


def _unkey(text: str) -> str:
  return text.replace("~1", "/").replace("~0", "~")


def _label(prefix: str, path: tuple) -> str:
  return f"{prefix}:{'/'.join(map(_key, path))}"


class Framework(abc.ABC):
  """The operations the shared tests need, written once per Flax API.

  A corpus case is a `linen.corpus.Case` or an `nnx.corpus.Case`; a node is a call node
  of a converted tree; `state` dicts are `{label: value}` as the module docstring says.
  """

  name: str
  corpus: ModuleType  # the framework's corpus: `build()`, `NAMES`, `CALL_KWARGS`
  node_type: type  # the class of the framework's call nodes

  def __repr__(self) -> str:
    return self.name

  @abc.abstractmethod
  def unflaxify_arguments(self, case, **overrides) -> tuple[tuple, dict]:
    """The positional and keyword arguments of `fl.unflaxify` for the case."""

  @abc.abstractmethod
  def argument(self, case, **kwargs) -> fl.ArgsAndKwargs:
    """The argument of a tree call as the case calls its model (`kwargs` overriding)."""

  @abc.abstractmethod
  def side_inputs(self, case) -> dict[str, Any]:
    """The side inputs of that call (Linen: its `random_streams`)."""

  @abc.abstractmethod
  def parameters(self, node) -> dict[str, fl.Parameter]:
    """The node's own parameters by name."""

  @abc.abstractmethod
  def state(self, node) -> dict[str, Any]:
    """The node's own state variables."""

  @abc.abstractmethod
  def export(self, tree) -> Any:
    """The tree exported back to the framework (Linen variables, an NNX module)."""

  @abc.abstractmethod
  def unedited_export(self, case) -> Any:
    """What exporting the case's unedited tree must equal (Linen: its variables, NNX: its model)."""

  @abc.abstractmethod
  def export_form(self, exported) -> Any:
    """An exported model as a pytree whose structure holds every static detail.

    Linen: the variables dict itself (boxes such as `nn.Partitioned` are nodes with
    their names). NNX: `(graphdef, state)` of `nnx.split` (variable types and metadata
    are in the state's structure).
    """

  @abc.abstractmethod
  def plain_model(self, case) -> Any:
    """The case's model as `fl.check_equivalence` takes it (Linen: `(module, variables)`)."""

  @abc.abstractmethod
  def equivalence_call(self, case) -> tuple[fl.ArgsAndKwargs, dict]:
    """`check_equivalence`'s model arguments and options, calling as the case calls."""

  @abc.abstractmethod
  def module_class(self, node) -> type:
    """The class of the Flax module the node calls."""

  @abc.abstractmethod
  def tree_state(self, tree) -> dict[str, Any]:
    """The tree's variables that a native call returns or updates, as `{label: value}`."""

  @abc.abstractmethod
  def model_state(self, case) -> dict[str, Any]:
    """Every variable of the case's model, as `{label: value}`."""

  @abc.abstractmethod
  def native(self, case, *, times=1, jit=False, wrap=None, **kwargs) -> tuple[Any, dict]:
    """The native call `times` times in a row (`jax.jit`-ed / `nnx.jit`-ed if `jit`).

    `wrap` wraps one call inside; `kwargs` override the call's keywords. Returns the
    last output and the state (as `tree_state` reads it) after the last call.
    """

  @abc.abstractmethod
  def native_captures(
    self, case, *, jit=False, every_method=False
  ) -> tuple[Any, dict[tuple, tuple]]:
    """The native call with Flax's own capture of every method output.

    Linen: `capture_intermediates=True` (calls of `__call__`), or with `every_method`
    a filter taking every method but `setup`; NNX:
    `nnx.capture(..., method_outputs=nnx.Intermediate)` (every method). Returns the
    output and `{(module path..., method): (output of each call, in order)}`.
    """

  @abc.abstractmethod
  def native_function(self, case) -> Callable[..., Any]:
    """A function of the call's positional arguments running the model natively."""

  @abc.abstractmethod
  def native_parameter_grads(self, case, loss) -> dict[str, Any]:
    """The gradient of `loss(native output)` for each parameter, as `{label: grad}`."""

  @abc.abstractmethod
  def native_of_node(self, case, node, *args) -> tuple[Any, dict]:
    """The node's module called natively on its own; its output and the model's state."""

  @abc.abstractmethod
  def with_variable(self, case, label, value):
    """A copy of the case whose model has the variable `label` set to `value`."""

  @abc.abstractmethod
  def with_exported(self, case, exported):
    """A copy of the case whose model is what `export` returned."""

  def convert(self, case: Any, **overrides: Any) -> fl.Layer:
    """`fl.unflaxify` of a corpus case; `overrides` replace its conversion options."""
    args, kwargs = self.unflaxify_arguments(case, **overrides)
    return fl.unflaxify(*args, **kwargs)

  def call(self, tree: fl.Layer, case: Any, **kwargs: Any) -> Any:
    """Calls `tree` as the case calls its model; `kwargs` override the call's keywords."""
    return tree(self.argument(case, **kwargs), **self.side_inputs(case))

  def isolate(self, case: Any, path: str | None, **options: Any) -> Any:
    """`fl.isolate` of the call at `path` (None: the root call) of the case's converted
    tree, on the case's arguments; `options` are `fl.isolate`'s (`every=True`)."""
    tree = self.convert(case)
    at = tree if path is None else path
    return fl.isolate(tree, self.argument(case), at, **options, **self.side_inputs(case))


class _Linen(Framework):
  name = "linen"
  corpus = linen_corpus
  node_type = fl.InterceptedFlaxModuleMethod

  def unflaxify_arguments(self, case, **overrides):
    options = dict(
      method=case.method,
      rngs=case.rngs,
      mutable=case.mutable,
      capture_intermediates=case.capture_intermediates,
    )
    return (case.module, case.variables, *case.args), {**options, **overrides, **case.kwargs}

  def argument(self, case, **kwargs):
    return fl.ArgsAndKwargs.capture(*case.args, **{**case.kwargs, **kwargs})

  def side_inputs(self, case):
    return {"random_streams": case.rngs}

  def parameters(self, node):
    return node.scope_data.parameters

  def state(self, node):
    return node.scope_data.variables

  def export(self, tree):
    return tree.export()

  def unedited_export(self, case):
    return case.variables

  def export_form(self, exported):
    return exported

  def plain_model(self, case):
    return (case.module, case.variables)

  def equivalence_call(self, case):
    options = dict(method=case.method, random_streams=case.rngs, mutable=case.mutable)
    return fl.ArgsAndKwargs(args=tuple(case.args), kwargs=dict(case.kwargs)), options

  def module_class(self, node):
    return type(node.module)

  def tree_state(self, tree):
    return {
      v.label: v.value
      for v in fl.variables_in(tree)
      if isinstance(v, fl.StateVariable) and not isinstance(v.value, fl.Uninitialized)
    }

  def model_state(self, case):
    return flat_collections(case.variables)

  def native(self, case, *, times=1, jit=False, wrap=None, **kwargs):
    # Each `module.apply` starts from the collections the one before returned.
    call_kwargs = {**case.kwargs, **kwargs}

    def apply(variables, *args):
      return case.module.apply(
        variables,
        *args,
        method=case.method,
        rngs=case.rngs,
        mutable=case.mutable,
        capture_intermediates=case.capture_intermediates,
        **call_kwargs,
      )

    run = jax.jit(apply) if jit else apply
    variables, updates = case.variables, {}
    with nn.intercept_methods(_linen_interceptor(wrap)):
      for _ in range(times):
        result = run(variables, *case.args)
        if case.mutable or case.capture_intermediates:
          output, updates = result
          variables = {**variables, **updates}
        else:
          output = result
    return output, flat_collections(updates)

  def native_captures(self, case, *, jit=False, every_method=False):
    mutable = case.mutable
    if mutable is False:
      mutable = ["intermediates"]
    elif mutable is not True:
      mutable = [*([mutable] if isinstance(mutable, str) else mutable), "intermediates"]

    def apply(variables, *args):
      return case.module.apply(
        variables,
        *args,
        method=case.method,
        rngs=case.rngs,
        mutable=mutable,
        capture_intermediates=(lambda m, name: name != "setup") if every_method else True,
        **case.kwargs,
      )

    output, updates = (jax.jit(apply) if jit else apply)(case.variables, *case.args)
    found = {}

    def walk(path, tree):
      for name, child in tree.items():
        if isinstance(child, tuple):
          found[(*path, name)] = child
        else:
          walk((*path, name), child)

    walk((), updates.get("intermediates", {}))
    return output, found

  def native_function(self, case):
    return lambda *args: case.module.apply(case.variables, *args, method=case.method)

  def native_parameter_grads(self, case, loss):
    def loss_of(params):
      return loss(case.apply(variables={**case.variables, "params": params}))

    return flat_collections({"params": jax.grad(loss_of)(case.variables["params"])})

  def native_of_node(self, case, node, *args):
    # The module applied to its part of each collection; nothing is mutable.
    variables = {}
    for collection, tree in case.variables.items():
      for key in node.path:
        tree = tree.get(key, {})
      if tree:
        variables[collection] = tree
    return node.module.apply(variables, *args, method=node.method_name), {}

  def with_variable(self, case, label, value):
    collection, path = label.split(":", 1)
    *keys, last = [collection, *map(_unkey, path.split("/"))]

    def replace(tree, keys):
      if not keys:
        return {**tree, last: value}
      return {**tree, keys[0]: replace(tree[keys[0]], keys[1:])}

    return dataclasses.replace(case, variables=replace(case.variables, keys))

  def with_exported(self, case, exported):
    return dataclasses.replace(case, variables=exported)


def _linen_interceptor(wrap: Wrap | None):
  count = itertools.count()

  def interceptor(next_fun, args, kwargs, context):
    output = next_fun(*args, **kwargs)
    if wrap is None or context.method_name != "__call__":
      return output
    if "/".join(context.module.path) != wrap.path:
      return output
    if wrap.calls is not None and next(count) not in wrap.calls:
      return output
    return wrap.fn(output, *args)

  return interceptor


def flat_collections(collections: Mapping[str, Any]) -> dict[str, Any]:
  """A Flax collections dict as {"collection:path": leaf}, mappings being nodes."""
  flat = {}

  def walk(collection, path, value):
    if hasattr(value, "items"):
      for name, child in value.items():
        walk(collection, path + (name,), child)
    else:
      flat[_label(collection, path)] = value

  for collection, tree in collections.items():
    walk(collection, (), tree)
  return flat


class _NNX(Framework):
  name = "nnx"
  corpus = nnx_corpus
  node_type = fl.InterceptedNNXModuleMethod

  def unflaxify_arguments(self, case, **overrides):
    return (case.model, *case.args), {"method": case.method, **overrides, **case.kwargs}

  def argument(self, case, **kwargs):
    args, kwargs = case.fresh_arguments(**kwargs)
    return fl.ArgsAndKwargs.capture(*args, **kwargs)

  def side_inputs(self, case):
    return {}

  def parameters(self, node):
    return node.scope_data.parameters

  def state(self, node):
    # NNX groups state by collection; the tests name a variable by its path alone.
    return {n: v for group in node.scope_data.variables.values() for n, v in group.items()}

  def export(self, tree):
    return tree.export()

  def unedited_export(self, case):
    return case.model

  def export_form(self, exported):
    return nnx.split(exported)

  def plain_model(self, case):
    return case.model

  def equivalence_call(self, case):
    argument = fl.ArgsAndKwargs(args=tuple(case.args), kwargs=dict(case.kwargs))
    return argument, {"method": case.method}

  def module_class(self, node):
    return node.module_type

  def tree_state(self, tree):
    return {
      v.label: v.value for v in fl.variables_in(tree) if not isinstance(v.value, fl.Uninitialized)
    }

  def model_state(self, case):
    return model_state(case.model)

  def native(self, case, *, times=1, jit=False, wrap=None, **kwargs):
    # Calls to one copy of the model, which keeps its state from call to call.
    model = nnx.clone(case.model)
    if wrap is not None:
      module = _nnx_module_at(model, wrap.path)
      object.__setattr__(module, "__class__", _wrapped_class(type(module), wrap))
    if jit:
      args, call_kwargs = case.fresh_arguments(**kwargs)
      step = nnx.jit(lambda m, *args: getattr(m, case.method)(*args, **call_kwargs))
      outputs = [step(model, *args) for _ in range(times)]
    else:
      outputs = [case.native(model, **kwargs) for _ in range(times)]
    return outputs[-1], model_state(model)

  def native_captures(self, case, *, jit=False, every_method=False):
    def call(model, args, kwargs):
      if isinstance(case.method, str):
        return getattr(model, case.method)(*args, **kwargs)
      return case.method(model, *args, **kwargs)

    args, kwargs = case.fresh_arguments()

    def traced(a):  # Python values stay static under jit, as fl.run keeps them.
      return not isinstance(a, int | float | str | tuple | type(None))

    dynamic = ([a for a in args if traced(a)], {k: v for k, v in kwargs.items() if traced(v)})

    def with_dynamic(model, given):
      it = iter(given[0])
      return call(model, [next(it) if traced(a) else a for a in args], {**kwargs, **given[1]})

    captured = nnx.capture(with_dynamic, nnx.Intermediate, method_outputs=nnx.Intermediate)
    model = nnx.clone(case.model)
    output, state = (nnx.jit(captured) if jit else captured)(model, dynamic)
    found = {tuple(path): raw_value(variable) for path, variable in nnx.to_flat_state(state)}
    return output, found

  def native_function(self, case):
    return getattr(nnx.clone(case.model), case.method)

  def native_parameter_grads(self, case, loss):
    return model_state(nnx.grad(lambda model: loss(case.native(model)))(nnx.clone(case.model)))

  def native_of_node(self, case, node, *args):
    # The module, inside a copy of the model, called through its method.
    model = nnx.clone(case.model)
    module = _nnx_module_at(model, "/".join(map(str, node.path)))
    return getattr(module, node.method_name)(*args), model_state(model)

  def with_variable(self, case, label, value):
    model = nnx.clone(case.model)
    for path, variable in nnx.iter_graph(model):
      if isinstance(variable, nnx.Variable) and _label(type(variable).__name__, path) == label:
        if nnx_corpus.FLAX_RELEASE >= (0, 12, 1):
          variable.set_value(value)
        else:  # flax 0.12.0 has no `set_value`
          variable.value = value
    return dataclasses.replace(case, model=model)

  def with_exported(self, case, exported):
    return dataclasses.replace(case, model=exported)


def _nnx_module_at(model: nnx.Module, path: str) -> nnx.Module:
  for key in path.split("/"):
    model = model[int(key)] if key.isdigit() else getattr(model, key)
  return model


def _wrapped_class(cls: type, wrap: Wrap) -> type:
  """A subclass of `cls` whose `__call__` wraps its output, as an NNX user patches by hand.

  The class survives `nnx.split`/`nnx.merge`, so it applies inside transforms too.
  """
  count = itertools.count()

  class Wrapped(cls):
    def __call__(self, *args, **kwargs):
      output = super().__call__(*args, **kwargs)
      if wrap.calls is not None and next(count) not in wrap.calls:
        return output
      return wrap.fn(output, *args)

  return Wrapped


def raw_value(variable: nnx.Variable) -> Any:
  """An NNX variable's value as stored, read as the installed Flax offers it.

  `get_raw_value()` from flax 0.12.1, which deprecates the `raw_value` attribute that
  flax 0.12.0 has instead.
  """
  return variable.get_raw_value() if nnx_corpus.FLAX_RELEASE >= (0, 12, 1) else variable.raw_value


def nnx_modules(node: Any) -> list[tuple[tuple[Any, ...], nnx.Module]]:
  """`(path, module)` of every NNX module in `node`, as the installed Flax walks them.

  The `nnx.iter_modules` function from flax 0.12.1, which deprecates the method that
  flax 0.12.0 has instead.
  """
  if nnx_corpus.FLAX_RELEASE >= (0, 12, 1):
    return list(nnx.iter_modules(node))
  return list(node.iter_modules())


def model_state(model: nnx.Module) -> dict[str, Any]:
  """All variables of an NNX model (or state) as {"Type:path": value}."""
  return {
    _label(type(v).__name__, path): raw_value(v) for path, v in nnx.to_flat_state(nnx.state(model))
  }


LINEN = _Linen()
NNX = _NNX()
FRAMEWORKS = {fw.name: fw for fw in (LINEN, NNX)}
