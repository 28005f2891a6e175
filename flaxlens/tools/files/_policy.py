"""What an artifact may make flaxlens import: the loading policy, checked before any import.

An artifact names code by `"package.module:Qualified.name"` references, and importing a
module runs its code, so a reference is imported only from a package the user named
(`allow=[...]`, `--allow PKG`) or from flaxlens itself. A reference into the other
libraries flaxlens runs on (`DEFAULT_PACKAGES`: jax, flax, numpy) imports nothing: it is
looked up in a module already loaded (`sys.modules`, walking module dictionaries, never a
module's lazy `__getattr__`), and refused, naming the fix, if its module is not loaded;
`import flaxlens` loads every module a saved Linen or NNX model refers to, and the allowed
packages are imported first, so what they import is found too. A module path with a
`__main__` part that is not loaded already is refused in every package, allowed or not:
importing one runs a program (`numpy.f2py.__main__`); the running script's own
`__main__` is loaded, so a script may load what it saved with `allow=["__main__"]`.
Whatever an import raises, `SystemExit` included (but not `KeyboardInterrupt`), becomes
an `ArtifactError`. The package name never comes from the artifact, and a refusal
advises allowing only packages its references name (`needs_allowing`), never one of
`UNSAFE_PACKAGES` (builtins, os, subprocess, ...), which no `allow=` admits; the
manifest's own `requires` list is informational. Then each object is checked for the
role it plays (a module class, a data type, a function) before anything is constructed or
called; objects from user-allowed packages are trusted in every role (a class named as a
Flax module must still be one), objects from the default packages only in the vetted
roles below. Where an allowed module is found is `import_folders`' rule (the user's
`import_path` folders, the current folder, then `sys.path`), the one the CLI follows for
a TARGET's module too.
Flax internals: the classes a `GraphDef` is made of, through `flaxlens._compat.nnx_graph`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib
import importlib.util
import os
import re
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from flaxlens._compat import nnx_graph
from flaxlens.core._checks import check_items, refuse
from flaxlens.core._variables import Uninitialized
from flaxlens.errors import ArgumentError, ArtifactError

# The packages flaxlens runs on, whose objects an artifact may name without `allow=`:
# flaxlens's own modules are imported, the others' only looked up if already loaded (some
# of their modules run code when imported). Objects from them are checked role by role.
DEFAULT_PACKAGES = frozenset({"jax", "flax", "numpy", "flaxlens"})
# The one default package whose modules an artifact may make flaxlens import: its own.
_IMPORTED_PACKAGE = "flaxlens"

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
# Built-in data types a saved value may name (a pytree node type, a module's `dtype=float`):
# resolved without any import or `allow=`, so an artifact never needs `builtins` allowed.
_BUILTIN_TYPES = {
  f"builtins:{cls.__name__}": cls
  for cls in (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)
}
# Standard-library modules that hand whoever names their functions the process itself:
# running code, importing or unpickling it, running commands, touching files or the
# network. No model needs one allowed, and an artifact allowed one could call, say,
# `os:system` with values it chooses; so no `allow=` admits them, no refusal advises them,
# and a reference into one is refused, whatever is allowed. Each maps to an example.
UNSAFE_PACKAGES = {
  "builtins": "exec",
  "code": "interact",
  "codeop": "compile_command",
  "runpy": "run_path",
  "importlib": "import_module",
  "pkgutil": "resolve_name",
  "zipimport": "zipimporter",
  "marshal": "loads",
  "pickle": "loads",
  "_pickle": "loads",
  "copyreg": "__newobj__",
  "shelve": "open",
  "types": "FunctionType",
  "ctypes": "CDLL",
  "_ctypes": "dlopen",
  "timeit": "timeit",
  "pdb": "run",
  "bdb": "Bdb.run",
  "trace": "Trace.run",
  "profile": "run",
  "cProfile": "run",
  "os": "system",
  "posix": "system",
  "nt": "system",
  "sys": "exit",
  "subprocess": "run",
  "_posixsubprocess": "fork_exec",
  "multiprocessing": "Process",
  "signal": "raise_signal",
  "pty": "spawn",
  "shutil": "rmtree",
  "pathlib": "Path.write_text",
  "io": "open",
  "_io": "open",
  "tempfile": "mkdtemp",
  "socket": "socket",
  "urllib": "request.urlopen",
  "http": "client.HTTPConnection",
  "webbrowser": "open",
}
_MISSING = object()

# Functions a module field may hold, by namespace (checked by identity after import).
_FUNCTIONS = {
  "jax.nn": (
    "celu elu gelu glu hard_sigmoid hard_silu hard_swish hard_tanh identity leaky_relu"
    " log_sigmoid log_softmax logsumexp mish one_hot relu relu6 selu sigmoid silu soft_sign"
    " softmax softplus sparse_plus sparse_sigmoid squareplus standardize swish tanh"
    " dot_product_attention"
  ),
  "jax.nn.initializers": (
    "constant delta_orthogonal glorot_normal glorot_uniform he_normal he_uniform"
    " kaiming_normal kaiming_uniform lecun_normal lecun_uniform normal ones orthogonal"
    " truncated_normal uniform variance_scaling xavier_normal xavier_uniform zeros"
  ),
  "flax.linen.activation": (
    "celu elu gelu glu hard_sigmoid hard_silu hard_swish hard_tanh leaky_relu log_sigmoid"
    " log_softmax logsumexp one_hot relu relu6 selu sigmoid silu soft_sign softmax softplus"
    " standardize swish tanh"
  ),
  "flax.linen.attention": "dot_product_attention dot_product_attention_weights",
  "flax.linen.dtypes": "promote_dtype",
  "flax.nnx.nn.activations": (
    "celu elu gelu glu hard_sigmoid hard_silu hard_swish hard_tanh identity leaky_relu"
    " log_sigmoid log_softmax logsumexp one_hot relu relu6 selu sigmoid silu soft_sign"
    " softmax softplus standardize swish tanh"
  ),
  "flax.nnx.nn.attention": "dot_product_attention dot_product_attention_weights",
  "flax.nnx.nn.dtypes": "promote_dtype",
  # Pure, elementwise or contraction functions only: no I/O (`jnp.load`, `np.save`).
  "jax.numpy": (
    "abs absolute exp exp2 expm1 log log1p log2 log10 sqrt cbrt square sign sin cos tan sinh"
    " cosh tanh arcsin arccos arctan arcsinh arccosh arctanh maximum minimum add subtract"
    " multiply divide true_divide negative reciprocal power floor ceil round clip where"
    " matmul dot einsum sum mean max min prod var std logaddexp"
    " bool_ int4 int8 int16 int32 int64 uint4 uint8 uint16 uint32 uint64 bfloat16 float16"
    " float32 float64 complex64 complex128 float8_e4m3fn float8_e5m2"
  ),
  "jax.lax": (
    "dot_general conv_general_dilated batch_matmul dot abs exp log log1p expm1 sqrt rsqrt"
    " tanh logistic erf erf_inv sin cos max min add sub mul div neg sign square integer_pow"
  ),
}


@functools.cache
def _vetted_functions() -> frozenset[int]:
  ids = set()
  for namespace, names in _FUNCTIONS.items():
    module = importlib.import_module(namespace)
    ids.update(id(getattr(module, name)) for name in names.split())
  return frozenset(ids)


@functools.cache
def _vetted_bases() -> dict[str, tuple[type, ...]]:
  """Per role, the classes of the default packages a reference may name (or subclass)."""
  import flax.linen as nn
  from flax import nnx
  from flax.core import frozen_dict, meta

  graph_data = tuple(internal() for internal in nnx_graph.GRAPH_DATA)
  graph_nodes = (nn.Module, nnx.Pytree, nnx.Variable, nnx_graph.GENERIC_PYTREE())
  return {
    # A class used as a value (a module field, a GraphDef node type, a pytree node type:
    # before flax 0.12.5 a module's FrozenDict attribute is a pytree node of the graph).
    "type": (*graph_nodes, nnx_graph.PYTREE_STATE(), frozen_dict.FrozenDict, enum.Enum),
    "dataclass": (nn.Module, meta.AxisMetadata, *graph_data, Uninitialized),
    "mapping": (frozen_dict.FrozenDict, nnx_graph.HASHABLE_MAPPING()),
  }


def _is_namedtuple(cls: Any) -> bool:
  return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


@dataclasses.dataclass(frozen=True)
class LoadPolicy:
  """The packages an artifact may import from: the defaults plus those the user allowed."""

  allowed: frozenset[str] = frozenset()
  folders: tuple[str, ...] = ()  # Where allowed modules are imported from (`import_folders`).
  source: str | None = None  # The file loaded, where refusals look for a missing module.
  cli: bool = True  # Whether refusals also name the flags of `flaxlens replay`.

  @classmethod
  def create(
    cls,
    allow: Iterable[str] | None,
    where: str = "fl.load_isolated",
    import_path: Any = None,
    source: str | None = None,
    cli: bool = True,
  ) -> LoadPolicy:
    """The policy allowing the packages in `allow`, imported from `import_folders(import_path)`;
    `where` names the caller in refusals, `source` the file being loaded.

    Raises:
      ArgumentError: `allow` is not a list of top-level package names, or `import_path`
        not a list of folders.
    """
    if isinstance(allow, str) or not isinstance(allow, Iterable | None):
      example = repr(allow) if isinstance(allow, str) else "'mypackage'"
      raise refuse(
        where,
        "allow",
        allow,
        "a list of top-level package names",
        f"Pass a list, e.g. allow=[{example}].",
      )
    packages = frozenset(allow or ())
    for package in packages:
      if not isinstance(package, str) or not re.fullmatch(_NAME, package):
        raise ArgumentError(
          f"{where}: allow takes top-level package names such as 'transformers'; {package!r}"
          " is not one. Name the package as you import it (allow=['mypackage'] for"
          " mypackage.models)."
        )
      if package in UNSAFE_PACKAGES:
        raise ArgumentError(
          f"{where}: allow={[package]!r} is refused: {_hands_out(package)}, so allowing it"
          " would let the artifact run any code it chooses. No artifact flaxlens saves"
          " needs it: built-in types (tuple, list, dict, int, float, ...) load without"
          " allow=, and a class defined in your script with allow=['__main__']. Remove"
          f" {package!r} from allow; if the artifact still names {package}, it was crafted"
          " or edited by hand: do not use it."
        )
    return cls(packages, import_folders(import_path, where), source, cli)

  def user_allowed(self, ref: str) -> bool:
    return package_of(ref) in self.allowed

  def check_package(self, ref: str, where: str, references: Iterable[str]) -> None:
    """Refuses `ref` unless its package may be imported; names the `allow=` that allows it
    and the file's other `references` (and the CLI flag, if the file is one the CLI
    loads), and where to put the package if it cannot be found either. A `__main__`
    module is refused in every package, a reference into `UNSAFE_PACKAGES` always."""
    package = package_of(ref)
    why = unsafe(ref)
    if why is not None:
      raise ArtifactError(
        f"The artifact names {ref!r} at {where}; {why}, so nothing is ever loaded from"
        f" {package}, whatever is allowed. flaxlens never saves such a reference: the"
        " artifact was crafted or edited by hand; do not use it."
      )
    module = ref.partition(":")[0]
    if "__main__" in module.split(".") and module not in sys.modules:
      raise ArtifactError(
        f"The artifact references {ref!r} at {where}; a `__main__` module runs a program when"
        " imported, so none is loaded that is not running already, whatever is allowed. If"
        " the artifact is yours and names a class or function defined in a script, load it"
        " from that script (with allow=['__main__']), or move the definition into a module"
        " file (mymodel.py), save again and load with allow=['mymodel']; otherwise do not"
        " use the artifact."
      )
    if not needs_allowing(ref) or package in self.allowed:
      return
    missing = sorted({package_of(r) for r in references if needs_allowing(r)} - self.allowed)
    flags = " ".join(f"--allow {p}" for p in missing)
    findable = self.findable(package)
    raise ArtifactError(
      f"The artifact references {ref!r} at {where}, from package {package!r}, which"
      " is not allowed to be imported (loading imports code). If you trust where this"
      f" artifact comes from and that package, load it with allow={missing!r}"
      + (f" (CLI: `flaxlens replay PATH {flags}`)." if self.cli else ".")
      + ("" if findable else f" {self.not_found(package, self.cli)}")
    )

  def findable(self, package: str) -> bool:
    """Whether the top-level `package` can be imported from `folders` and `sys.path`;
    finding it runs none of its code."""
    if package in sys.modules:
      return True
    with importing_from(self.folders):
      try:
        return importlib.util.find_spec(package) is not None
      except (ImportError, ValueError):
        return False

  def not_found(self, package: str, cli: bool) -> str:
    """How to make the missing top-level `package` importable: `import_folders`' rule."""
    option = "import_path=[DIR]" + (" (CLI: --import-path DIR)" if cli else "")
    return missing_module(package, self.folders, option, near=self.source)

  def resolve(self, ref: str, role: str, where: str, base: type | None = None) -> Any:
    """Imports `ref` (its package already checked) and checks it may play `role`.

    Roles: "value" (a function or class held as data), "function" (a function that will be
    called, never a class), "module" (a Linen or NNX module class), "method" (a Linen
    method given as a function), "enum", "namedtuple", "dataclass", "mapping" (classes
    whose instances are rebuilt), "subclass" (a class that must subclass `base`, for
    registered codecs).
    """
    obj = _BUILTIN_TYPES.get(ref)
    if obj is None:
      obj = self._import(ref, where)
    if not self._fits(obj, ref, role, base):
      fix = _ROLE_FIX.get(role, f"It must subclass {getattr(base, '__qualname__', base)}.")
      raise ArtifactError(
        f"The artifact names {ref!r} at {where} as {_ROLES[role]}, which the loading policy"
        f" does not accept from {package_of(ref)!r}. {fix}"
      )
    return obj

  def import_allowed(self, references: Iterable[tuple[str, str, str]]) -> None:
    """Imports the `(ref, role, where)` references into user-allowed packages, before the
    others are resolved: the modules of jax, flax and numpy that they import are then
    loaded, whatever the order of the references."""
    for ref, _, where in references:
      if self.user_allowed(ref):
        self._import(ref, where)

  def _import(self, ref: str, where: str) -> Any:
    """The object `ref` names: imported from `folders` and `sys.path` if its package is
    allowed or flaxlens, else looked up in its already loaded module; refusals say how to
    make it load."""
    package = package_of(ref)
    if package != _IMPORTED_PACKAGE and not self.user_allowed(ref):
      return self._loaded(ref, where)
    with importing_from(self.folders):
      try:
        return _import(ref, where)
      except ArtifactError as e:
        if isinstance(e.__cause__, ModuleNotFoundError) and e.__cause__.name == package:
          raise ArtifactError(
            f"Cannot import {ref!r} named by the artifact at {where}:"
            f" {self.not_found(package, self.cli)}"
          ) from None
        raise

  def _loaded(self, ref: str, where: str) -> Any:
    """The object `ref` names in a default package, looked up without importing anything:
    its module must be loaded already, and each module on the way is read through its
    dictionary (a module's `__getattr__` may import others: `numpy.f2py`)."""
    module_name, _, qualname = ref.partition(":")
    obj = sys.modules.get(module_name)
    if obj is None:
      package = package_of(ref)
      raise ArtifactError(
        f"Cannot import {ref!r} named by the artifact at {where}: the module {module_name!r}"
        " is not loaded, and an artifact makes flaxlens import no module of"
        f" {package} (importing one runs its code; some, such as numpy.f2py.__main__, run a"
        " program). If you trust the artifact and that module, import it yourself before"
        f" loading (`import {module_name}`), or allow the package with allow=[{package!r}]"
        + (f" (CLI: --allow {package})" if self.cli else "")
        + f", which lets the artifact import and use any module of {package}."
      )
    for part in qualname.split("."):
      if isinstance(obj, types.ModuleType):
        found = vars(obj).get(part, _MISSING)
      else:
        found = getattr(obj, part, _MISSING)
      if found is _MISSING:
        raise ArtifactError(
          f"Cannot import {ref!r} named by the artifact at {where}: {module_name!r} has no"
          f" {qualname!r}. Load it where the versions of jax, flax and numpy that saved it"
          " are installed."
        )
      obj = found
    return obj

  def _fits(self, obj: Any, ref: str, role: str, base: type | None) -> bool:
    trusted = self.user_allowed(ref)
    bases = _vetted_bases()
    if role == "value":
      if id(obj) in _vetted_functions() or obj in _BUILTIN_TYPES.values():
        return True
      if isinstance(obj, type):
        return trusted or issubclass(obj, bases["type"]) or _is_namedtuple(obj)
      return trusted and callable(obj)
    if role == "function":
      plain = callable(obj) and not isinstance(obj, type)
      return plain and (id(obj) in _vetted_functions() or trusted)
    if role == "module":
      import flax.linen as nn
      from flax import nnx

      return _subclass(obj, (nn.Module, nnx.Module))
    if role == "method":
      import flax.linen as nn

      owner_ref = ref.rpartition(".")[0]
      owner = self._import(owner_ref, "") if ":" in owner_ref else None
      return _subclass(owner, nn.Module) and callable(obj) and not isinstance(obj, type)
    if role == "enum":
      return _subclass(obj, enum.Enum)
    if role == "namedtuple":
      return _is_namedtuple(obj)
    if role == "dataclass":
      return (
        _subclass(obj, object)
        and dataclasses.is_dataclass(obj)
        and (trusted or issubclass(obj, bases["dataclass"]))
      )
    if role == "mapping":
      return _subclass(obj, Mapping) and (trusted or issubclass(obj, bases["mapping"]))
    if role == "subclass":
      return _subclass(obj, base)
    raise AssertionError(role)


def _subclass(obj: Any, base: type | tuple[type, ...]) -> bool:
  return isinstance(obj, type) and issubclass(obj, base)


_ROLES = {
  "value": "a function or class held as a value",
  "function": "a function to call",
  "module": "a Flax module class",
  "method": "a module method",
  "enum": "an enum",
  "namedtuple": "a NamedTuple",
  "dataclass": "a dataclass to construct",
  "mapping": "a mapping type to construct",
  "subclass": "the class of a saved configuration object",
}
_ROLE_FIX = {
  "value": "Functions must come from jax.nn, its initializers, Flax's activations and"
  " attention functions or a vetted set of jax.numpy/jax.lax functions; anything else only"
  " from a package you allow with allow=[...] (CLI: --allow PKG).",
  "function": "Functions must come from the vetted set of jax.nn, Flax and pure"
  " jax.numpy/jax.lax functions, or from a package you allow with allow=[...].",
  "module": "It must subclass flax.linen.Module or flax.nnx.Module.",
  "method": "A method must be a function defined on a flax.linen.Module subclass.",
  "enum": "It is not an enum.",
  "namedtuple": "It is not a NamedTuple.",
  "dataclass": "Only flax.linen.Module subclasses, Flax's own data types, and dataclasses"
  " from packages you allow with allow=[...] (CLI: --allow PKG) are constructed.",
  "mapping": "Only Flax's FrozenDict/HashableMapping and mapping types from packages you"
  " allow with allow=[...] (CLI: --allow PKG) are constructed.",
}


def package_of(ref: str) -> str:
  return ref.partition(":")[0].partition(".")[0]


def needs_allowing(ref: str) -> bool:
  """Whether loading `ref` needs its package allowed (`allow=`): it is neither a built-in
  data type nor in a default package. A reference into `UNSAFE_PACKAGES`, which no
  `allow=` admits, needs none: it is refused."""
  package = package_of(ref)
  return (
    ref not in _BUILTIN_TYPES and package not in DEFAULT_PACKAGES and package not in UNSAFE_PACKAGES
  )


def unsafe(ref: str) -> str | None:
  """Why no loading ever accepts `ref`, a reference into `UNSAFE_PACKAGES` other than a
  built-in data type; None for any other reference."""
  package = package_of(ref)
  if ref in _BUILTIN_TYPES or package not in UNSAFE_PACKAGES:
    return None
  return _hands_out(package)


def _hands_out(package: str) -> str:
  example = f"{package}.{UNSAFE_PACKAGES[package]}"
  return f"{package} hands whoever names its functions this process ({example} among them)"


def _import(ref: str, where: str) -> Any:
  module_name, _, qualname = ref.partition(":")
  try:
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
      obj = getattr(obj, part)
  except (ImportError, AttributeError) as e:
    raise ArtifactError(
      f"Cannot import {ref!r} named by the artifact at {where} ({e}). Install the package"
      " that defines it (at a compatible version) where you load the artifact."
    ) from e
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # The module's own code raised (or exited) while imported.
    message = " ".join(str(e).split())
    raise ArtifactError(
      f"Importing {module_name!r} for {ref!r} named by the artifact at {where} raised"
      f" {type(e).__name__}{f': {message}' if message else ''}. Fix that module so that"
      f" `python -c 'import {module_name}'` runs."
    ) from e
  return obj


def import_folders(import_path: Any, where: str) -> tuple[str, ...]:
  """The folders modules are imported from before `sys.path`: those in `import_path`,
  then the current folder.

  This is the one rule for every module flaxlens imports by name: a TARGET's module
  (`flaxlens inspect`, `flaxlens check`) and the allowed packages an artifact names
  (`flaxlens replay`, `fl.load_isolated`, `fl.load_interventions`), as `python -m` finds
  modules, the folders given with `--import-path` (`import_path=`) first.

  Raises:
    ArgumentError: `import_path` is not a list of folders.

  Example:
    >>> import os
    >>> from flaxlens.tools.files._policy import import_folders
    >>> import_folders(["models"], "f") == (os.path.abspath("models"), os.getcwd())
    True
  """
  if isinstance(import_path, str | os.PathLike):
    raise refuse(
      where, "import_path", import_path, "a list of folders", f"Pass [{str(import_path)!r}]."
    )
  folders = check_items(
    [] if import_path is None else import_path,
    lambda f: isinstance(f, str | os.PathLike),
    where,
    "import_path",
    "a list of folders",
    "Pass folders that hold the modules, e.g. import_path=['models'].",
  )
  return tuple(dict.fromkeys([*(os.path.abspath(f) for f in folders), os.getcwd()]))


@contextlib.contextmanager
def importing_from(folders: Iterable[str]) -> Iterator[None]:
  """`sys.path` with `folders` first (those not on it already), as it was afterwards.

  Modules imported meanwhile stay imported (`sys.modules`), so classes and functions
  from them keep working; what they import later comes from `sys.path` alone.
  """
  added = [f for f in folders if f not in sys.path]
  sys.path[:0] = added
  if added:
    importlib.invalidate_caches()
  try:
    yield
  finally:
    for folder in added:
      with contextlib.suppress(ValueError):
        sys.path.remove(folder)


def missing_module(package: str, folders: Iterable[str], option: str, near: Any = None) -> str:
  """Says that `package` is in none of `folders` nor on `sys.path`, and how to make it load.

  `option` names the option that adds a folder (`--import-path DIR`); `near`, a file
  being loaded: a `package.py` (or `package/`) in its folder or the folder that holds it
  is named.
  """
  found = [
    place
    for place in _near(near)
    if os.path.isfile(os.path.join(place, f"{package}.py"))
    or os.path.isfile(os.path.join(place, package, "__init__.py"))
  ]
  hint = ""
  if found:
    given = option.replace("[DIR]", f"[{found[0]!r}]").replace("DIR", found[0])
    hint = f" {package} is in {found[0]}: pass {given}."
  return (
    f"Python finds no module {package!r} in {list(folders)} nor among the installed packages"
    f" (sys.path). Run from the folder that holds {package}.py (or the package"
    f" {package}/), pass that folder with {option}, or install the package.{hint}"
  )


def _near(source: str | None) -> list[str]:
  if source is None:
    return []
  source = os.path.abspath(source)
  return list(dict.fromkeys([os.path.dirname(source), os.path.dirname(os.path.dirname(source))]))


def resolve_imported(ref: str) -> Any:
  """The object `ref` names, for references the running code itself chose (save side)."""
  return _import(ref, "")


def reference(obj: Any) -> str | None:
  """`"module:qualname"` under which `obj` can be imported again, or None (save side)."""
  module = getattr(obj, "__module__", None)
  qualname = getattr(obj, "__qualname__", None)
  if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
    return None
  ref = f"{module}:{qualname}"
  if ref in _BUILTIN_TYPES:
    return ref if _BUILTIN_TYPES[ref] is obj else None
  try:
    found = _import(ref, "")
  except ArtifactError:
    return None
  return ref if found is obj else None
