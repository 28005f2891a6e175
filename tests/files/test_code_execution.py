"""Finding 1: loading an artifact runs no code the user did not allow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import flaxlens as fl
from flaxlens import cli

from .conftest import read_manifest, write_manifest

RCE_V1 = {
  "format": "flaxlens-isolated",
  "format_version": 1,
  "arrays": {},
  "recipe": {
    "kind": "linen",
    "method": {"ref": "flax.linen.combinators:Sequential.__call__"},
    "module": {
      "dataclass": "flax.linen.combinators:Sequential",
      "fields": {"layers": {"list": [{"ref": "os:system"}]}},
    },
    "variables": {"dict": []},
    "rngs": None,
    "mutable": [],
    "capture_intermediates": False,
  },
  "saved": {
    "args": {"tuple": ["touch PWNED"]},
    "kwargs": {"dict": []},
    "side_inputs": {"dict": []},
    "output": 0,
    "initial": [],
    "final": [],
  },
}


def _sequential_calling(manifest: dict, ref: str, requires: list[str]) -> dict:
  """The issue's attack in format 2: a Sequential whose one layer is `ref`, called on a
  shell command, with a valid manifest checksum (which anyone can compute)."""
  manifest["requires"] = requires
  manifest["recipe"]["method"] = {"ref": "flax.linen.combinators:Sequential.__call__"}
  manifest["recipe"]["module"] = {
    "object": "dataclass",
    "class": "flax.linen.combinators:Sequential",
    "data": {"dict": [["layers", {"list": [{"ref": ref}]}]]},
  }
  manifest["saved"]["args"] = {"tuple": ["touch PWNED"]}
  return manifest


def test_the_issue_manifest_runs_nothing(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "manifest.json").write_text(json.dumps(RCE_V1))
  with pytest.raises(fl.ArtifactError, match="format 1"):
    fl.load_isolated(tmp_path / "a")
  assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("ref", ["os:system", "subprocess:getoutput", "builtins:eval"])
def test_a_forged_function_reference_is_refused_before_anything_runs(
  artifact, tmp_path, monkeypatch, capsys, ref
):
  monkeypatch.chdir(tmp_path)
  package = ref.partition(":")[0]
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), ref, [package]))
  with pytest.raises(fl.ArtifactError, match=ref):
    fl.load_isolated(artifact)
  assert cli.main(["replay", str(artifact)]) == 2
  assert ref in capsys.readouterr().err
  assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("ref", ["numpy:save", "jax.numpy:load", "flax.linen:jit"])
def test_a_function_of_an_allowed_package_outside_the_vetted_set_is_refused(artifact, ref):
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), ref, []))
  with pytest.raises(fl.ArtifactError, match=f"names '{ref}'.*function or class held as a"):
    fl.load_isolated(artifact)


def test_the_refusal_names_the_allow_flag(artifact):
  manifest = _sequential_calling(read_manifest(artifact), "mymodels:relu", ["mymodels"])
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"allow=\['mymodels'\].*--allow mymodels"):
    fl.load_isolated(artifact)


@pytest.mark.parametrize("ref", ["os:system", "builtins:exec", "subprocess:run"])
def test_a_reference_into_a_module_that_hands_out_the_process_is_never_advised(artifact, ref):
  package = ref.partition(":")[0]
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), ref, [package]))
  with pytest.raises(fl.ArtifactError, match=f"names '{ref}'.*crafted") as refusal:
    fl.load_isolated(artifact)
  assert "allow=[" not in str(refusal.value)


@pytest.fixture
def side_effect_package(tmp_path, monkeypatch):
  """A module on sys.path whose import writes a file: importing it is running code."""
  package = tmp_path / "pkgs"
  package.mkdir()
  marker = tmp_path / "IMPORTED"
  (package / "sideeffect_mod.py").write_text(
    f"open({str(marker)!r}, 'w').close()\nimport flax.linen as nn\nclass Block(nn.Dense):\n  pass\n"
  )
  monkeypatch.syspath_prepend(str(package))
  yield marker
  sys.modules.pop("sideeffect_mod", None)


def test_a_module_class_from_an_unallowed_package_is_not_imported(artifact, side_effect_package):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = "sideeffect_mod:Block"
  manifest["requires"] = ["sideeffect_mod"]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"'sideeffect_mod:Block'.*allow=\['sideeffect_mod'\]"):
    fl.load_isolated(artifact)
  assert not side_effect_package.exists()
  assert "sideeffect_mod" not in sys.modules


@pytest.mark.parametrize("ref", ["this:s", "antigravity:geohash"])
def test_a_standard_library_module_named_by_the_manifest_is_not_imported(artifact, ref):
  module = ref.partition(":")[0]
  already = module in sys.modules
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), ref, [module]))
  with pytest.raises(fl.ArtifactError, match="not allowed to be imported"):
    fl.load_isolated(artifact)
  assert (module in sys.modules) == already


def test_nothing_is_imported_before_the_whole_manifest_is_valid(artifact, side_effect_package):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = "sideeffect_mod:Block"
  manifest["requires"] = ["sideeffect_mod"]
  manifest["saved"]["final"] = [["label", {"no such tag": 1}]]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=r"at \$\.saved\.final\[0\]\[1\]: 'no such tag'"):
    fl.load_isolated(artifact, allow=["sideeffect_mod"])
  assert not side_effect_package.exists()


def test_the_policy_is_checked_before_the_arrays_are_read(artifact):
  write_manifest(artifact, _sequential_calling(read_manifest(artifact), "os:system", ["os"]))
  (artifact / "arrays.safetensors").unlink()
  with pytest.raises(fl.ArtifactError, match="os:system"):
    fl.load_isolated(artifact)


def test_a_dataclass_that_is_not_a_module_is_not_constructed(artifact):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"] = {
    "object": "dataclass",
    "class": "flaxlens.core._args:ArgsAndKwargs",
    "data": {"dict": [["args", {"tuple": []}], ["kwargs", {"dict": []}]]},
  }
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match="ArgsAndKwargs.*as a dataclass to construct"):
    fl.load_isolated(artifact)


def test_a_mapping_type_outside_flax_is_not_constructed(artifact):
  manifest = read_manifest(artifact)
  manifest["saved"]["kwargs"] = {
    "object": "mapping",
    "class": "flax.core.scope:Scope",
    "data": {"dict": []},
  }
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError):
    fl.load_isolated(artifact)


def test_an_unimportable_module_class_is_reported(artifact):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = "flax.no_such_module:Dropout"
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match="Cannot import 'flax.no_such_module:Dropout'"):
    fl.load_isolated(artifact)


def test_a_user_allowed_package_loads(artifact, side_effect_package):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"] = {
    "object": "dataclass",
    "class": "sideeffect_mod:Block",
    "data": {"dict": [["features", 3]]},
  }
  manifest["requires"] = ["sideeffect_mod"]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match="cannot be rebuilt"):
    fl.load_isolated(artifact, allow=["sideeffect_mod"])
  assert side_effect_package.exists()


def test_allow_rejects_a_bare_string():
  with pytest.raises(fl.ArgumentError, match=r"allow=\['transformers'\]"):
    fl.load_isolated("anywhere", allow="transformers")


F2PY_MAIN = "numpy.f2py.__main__:main"  # Importing numpy.f2py.__main__ runs f2py's main().


@pytest.fixture
def interventions(tmp_path):
  path = tmp_path / "edits"
  fl.save_interventions([fl.modify("Dense_0", jax.nn.relu)], path)
  return path


def test_a_module_that_runs_a_program_is_not_imported_for_an_intervention_set(interventions, capfd):
  manifest = read_manifest(interventions)
  manifest["interventions"][0]["fn"] = {"ref": F2PY_MAIN}
  write_manifest(interventions, manifest)
  with pytest.raises(fl.ArtifactError, match=rf"'{F2PY_MAIN}' at interventions\[0\]\.fn.*__main__"):
    fl.load_interventions(interventions)
  assert "f2py" not in "".join(capfd.readouterr())
  assert "numpy.f2py.__main__" not in sys.modules


def test_a_module_that_runs_a_program_is_not_imported_by_flaxlens_replay(artifact, capfd):
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = F2PY_MAIN
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=F2PY_MAIN):
    fl.load_isolated(artifact)
  assert cli.main(["replay", str(artifact)]) == 2
  out, err = capfd.readouterr()
  assert "f2py" not in out
  assert F2PY_MAIN in err
  assert "numpy.f2py.__main__" not in sys.modules


@pytest.fixture
def f2py_unloaded(monkeypatch):
  """numpy.f2py unloaded for the test (restored after it, if it was loaded)."""
  for name in [n for n in sys.modules if n == "numpy.f2py" or n.startswith("numpy.f2py.")]:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.delattr(np, "f2py", raising=False)


@pytest.mark.parametrize(
  "ref", ["numpy.f2py:main", "numpy:f2py.main"], ids=["module", "lazy attribute"]
)
def test_a_default_package_module_not_loaded_is_refused_with_the_fix(
  interventions, f2py_unloaded, ref
):
  manifest = read_manifest(interventions)
  manifest["interventions"][0]["fn"] = {"ref": ref}
  write_manifest(interventions, manifest)
  fix = r"import numpy\.f2py.*allow=\['numpy'\]" if ref.startswith("numpy.f2py") else "has no"
  with pytest.raises(fl.ArtifactError, match=rf"'{ref}'.* at interventions\[0\]\.fn.*{fix}"):
    fl.load_interventions(interventions)
  assert "numpy.f2py" not in sys.modules


def test_a_default_package_module_the_user_imported_is_looked_up(interventions, f2py_unloaded):
  manifest = read_manifest(interventions)
  manifest["interventions"][0]["fn"] = {"ref": "numpy.f2py:main"}
  write_manifest(interventions, manifest)
  import numpy.f2py  # noqa: F401  (what the refusal tells the user to do)

  with pytest.raises(fl.ArtifactError, match="'numpy.f2py:main'.*as a function to call"):
    fl.load_interventions(interventions)


@pytest.mark.parametrize("package", ["numpy", "sideeffect_mod"])
def test_a_main_module_is_refused_even_in_an_allowed_package(
  artifact, side_effect_package, package
):
  ref = f"{package}.__main__:main"
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = ref
  manifest["requires"] = [package]
  write_manifest(artifact, manifest)
  with pytest.raises(fl.ArtifactError, match=rf"'{ref}'.*`__main__` module runs a program"):
    fl.load_isolated(artifact, allow=[package])
  assert not side_effect_package.exists()
  assert f"{package}.__main__" not in sys.modules


@pytest.fixture
def local_module(tmp_path, monkeypatch):
  """Writes a module `name` with `source` into a folder on sys.path; unloaded afterwards."""
  folder = tmp_path / "local"
  folder.mkdir()
  monkeypatch.syspath_prepend(str(folder))
  names = []

  def write(name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(source)
    names.append(name)

  yield write
  for name in names:
    sys.modules.pop(name, None)


class Stop(BaseException):
  """A BaseException other than KeyboardInterrupt, as a module could raise at import."""


@pytest.mark.parametrize("raised", ["SystemExit(0)", "SystemExit('bye')", "Stop()"])
def test_whatever_an_allowed_modules_import_raises_is_a_refusal(
  artifact, local_module, capsys, raised
):
  local_module("exits_mod", f"from {__name__} import Stop\nraise {raised}\n")
  manifest = read_manifest(artifact)
  manifest["recipe"]["module"]["class"] = "exits_mod:Block"
  manifest["requires"] = ["exits_mod"]
  write_manifest(artifact, manifest)
  error = raised.partition("(")[0]
  with pytest.raises(fl.ArtifactError, match=rf"Importing 'exits_mod'.* raised {error}"):
    fl.load_isolated(artifact, allow=["exits_mod"])
  assert cli.main(["replay", str(artifact), "--allow", "exits_mod"]) == 2
  assert error in capsys.readouterr().err
  assert "exits_mod" not in sys.modules


def test_a_module_an_allowed_package_imports_is_found_whatever_the_order(local_module, monkeypatch):
  from flaxlens.tools.files._codec import resolve_references
  from flaxlens.tools.files._policy import LoadPolicy

  monkeypatch.delitem(sys.modules, "flax.cursor", raising=False)
  local_module("cursor_user", "import flax.cursor\n\n\nclass Mark:\n  pass\n")
  references = [("flax.cursor:AccessType", "enum", "$.a"), ("cursor_user:Mark", "value", "$.b")]
  resolved = resolve_references(LoadPolicy.create(allow=["cursor_user"]), references)
  assert resolved["flax.cursor:AccessType"] is sys.modules["flax.cursor"].AccessType


QUITS = """
import sys
import jax
import flax.linen as nn

EXIT_WHEN = None  # "traced" (as loading rebuilds the call) or "run" (as replay runs it)


class Quits(nn.Module):
  @nn.compact
  def __call__(self, x):
    if EXIT_WHEN == ("traced" if isinstance(x, jax.core.Tracer) else "run"):
      sys.exit(0)
    return nn.Dense(2)(x)
"""


@pytest.mark.parametrize("when", ["traced", "run"])
def test_an_allowed_model_that_exits_fails_the_load_or_the_replay_never_exits_0(
  local_module, tmp_path, monkeypatch, capsys, when
):
  local_module("quits_mod", QUITS)
  import quits_mod

  model, x = quits_mod.Quits(), jax.numpy.ones((1, 3))
  tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  fl.save_isolated(fl.isolate(tree, x, ""), tmp_path / "quits")
  monkeypatch.setattr(quits_mod, "EXIT_WHEN", when)
  if when == "traced":
    with pytest.raises(fl.ArtifactError, match="cannot be rebuilt.*SystemExit"):
      fl.load_isolated(tmp_path / "quits", allow=["quits_mod"])
  assert cli.main(["replay", str(tmp_path / "quits"), "--allow", "quits_mod", "--no-cache"]) == 2
  assert "SystemExit" in capsys.readouterr().err


def test_replay_of_an_allow_that_names_no_package_exits_2(artifact, capsys):
  assert cli.main(["replay", str(artifact), "--allow", "linen.corpus"]) == 2
  assert "allow takes top-level package names" in capsys.readouterr().err


def test_a_script_loads_the_interventions_it_defined_itself_with_allow_main(tmp_path):
  """The running script's `__main__` is loaded already: importing it runs nothing."""
  script = tmp_path / "script.py"
  script.write_text(
    "import sys, jax.numpy as jnp, flax.linen as nn, flaxlens as fl\n"
    "def double(x):\n"
    "  return 2 * x\n"
    "path = sys.argv[1]\n"
    "fl.save_interventions([fl.modify(nn.Dense, double)], path)\n"
    "(loaded,) = fl.load_interventions(path, allow=['__main__'])\n"
    "print('LOADED', loaded.fn(jnp.ones(2)).tolist())\n"
  )
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run(
    [sys.executable, str(script), str(tmp_path / "set")],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert "LOADED [2.0, 2.0]" in done.stdout, done.stderr[-2000:]
