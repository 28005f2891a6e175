"""Dictionary files: our format round-trips bit for bit; damaged and foreign files are
refused with an ArtifactError naming the file; SAELens, circuit-tracer and Gemma Scope
files encode the same features as the library that wrote them.

The foreign fixtures (tests/dictionaries/fixtures/) were written by the libraries' own
classes and save code, with the features and reconstructions their own loaders compute
for a fixed input (`make_fixtures.py`, run in a separate torch environment; versions in
`versions.txt`). Tolerance: 2e-6 absolute for float32 values of order 1 (the matmuls'
summation order differs between torch and XLA; measured at most 7.2e-7), and the same
active features exactly.
"""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import flaxlens as fl
import flaxlens.dictionaries as fld
from flaxlens.tools.dictionaries._files import weights_of

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TOLERANCE = 2e-6


def _randomized(build):
  """The dictionary `build` makes, built abstractly (fast), every variable then random
  (biases, thresholds and BatchTopK's running threshold too), so a round trip checks
  them all."""
  dictionary = nnx.eval_shape(build)
  leaves = []
  for index, (path, var) in enumerate(nnx.to_flat_state(nnx.state(dictionary))):
    value = np.random.default_rng(index).uniform(0.05, 0.5, var.get_value().shape)
    leaves.append((path, var.replace(jnp.asarray(value, var.get_value().dtype))))
  nnx.update(dictionary, nnx.from_flat_state(leaves))
  return dictionary


BUILDERS = {
  "sae-relu": lambda: fld.SAE(6, 16, rngs=nnx.Rngs(0)),
  "sae-jumprelu": lambda: fld.SAE(6, 16, activation="jumprelu", rngs=nnx.Rngs(0)),
  "sae-topk-bf16": lambda: fld.SAE(
    6, 16, activation="topk", k=3, dtype="bfloat16", rngs=nnx.Rngs(0)
  ),
  "sae-batchtopk": lambda: fld.SAE(6, 16, activation="batchtopk", k=3, rngs=nnx.Rngs(0)),
  "transcoder-jumprelu-skip": lambda: fld.Transcoder(
    6, 5, 16, activation="jumprelu", skip=True, rngs=nnx.Rngs(0)
  ),
  "clt-topk-skip": lambda: fld.CrossLayerTranscoder(
    3, 6, 5, 8, activation="topk", k=2, skip=True, rngs=nnx.Rngs(0)
  ),
  "clt-batchtopk": lambda: fld.CrossLayerTranscoder(
    2, 6, 6, 8, activation="batchtopk", k=2, rngs=nnx.Rngs(0)
  ),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_save_then_load_gives_the_same_dictionary_bit_for_bit(name, tmp_path):
  dictionary = _randomized(BUILDERS[name])
  fld.save(dictionary, tmp_path / "d", reads=["layers_0"], writes=["layers_1"])
  loaded = fld.load(tmp_path / "d")
  assert type(loaded) is type(dictionary) and loaded.config == dictionary.config
  saved, back = weights_of(dictionary), weights_of(loaded)
  assert saved.keys() == back.keys()
  for key in saved:
    assert saved[key].dtype == back[key].dtype
    np.testing.assert_array_equal(saved[key], back[key], err_msg=key)
  lead = (dictionary.config.layers,) if dictionary.config.kind == "clt" else ()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(*lead, 4, 6)), dictionary.config.dtype)
  np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(dictionary(x)))
  # The weights file is a standard safetensors file.
  assert set(load_file(tmp_path / "d" / "weights.safetensors")) == set(saved)


def test_save_never_writes_over_what_is_not_a_saved_dictionary(tmp_path):
  sae = _randomized(lambda: fld.SAE(4, 8, rngs=nnx.Rngs(0)))
  fld.save(sae, tmp_path / "d")
  with pytest.raises(fl.ArtifactError, match="exists. Pass overwrite=True"):
    fld.save(sae, tmp_path / "d")
  fld.save(_randomized(lambda: fld.SAE(4, 12, rngs=nnx.Rngs(0))), tmp_path / "d", overwrite=True)
  assert fld.load(tmp_path / "d").config.width == 12
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  with pytest.raises(fl.ArtifactError, match="is not a saved dictionary"):
    fld.save(sae, tmp_path / "other", overwrite=True)
  assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_save_refuses_nan_weights_and_sites_that_are_no_list(tmp_path):
  sae = _randomized(lambda: fld.SAE(4, 8, rngs=nnx.Rngs(0)))
  with pytest.raises(fl.ArgumentError, match="reads='layers_0' is not a list"):
    fld.save(sae, tmp_path / "d", reads="layers_0")
  sae.b_enc[...] = jnp.full((8,), jnp.nan)
  with pytest.raises(fl.ArgumentError, match="b_enc holds NaN"):
    fld.save(sae, tmp_path / "d")
  assert not (tmp_path / "d").exists()


@pytest.fixture
def saved(tmp_path):
  fld.save(
    _randomized(lambda: fld.SAE(4, 8, activation="jumprelu", rngs=nnx.Rngs(0))), tmp_path / "d"
  )
  return tmp_path / "d"


def _edit_config(folder, edit):
  config = json.loads((folder / "config.json").read_text())
  edit(config)
  (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
  "edit, message",
  [
    (lambda c: c["config"].update(kind="gated"), r"malformed at \$.config.kind"),
    (lambda c: c["config"].update(shift=1.0), r"malformed at \$.config"),
    (lambda c: c.update(format="other"), "is not a flaxlens dictionary config"),
    (lambda c: c.update(format_version=9), "Upgrade flaxlens"),
    (lambda c: c["config"].update(width=9), r"'W_dec' has shape \[8, 4\], but a sae"),
    (lambda c: c["arrays"].pop("activation.threshold"), r"lacks the tensors \['activation.thr"),
    (lambda c: c["config"].update(activation="topk", k=3), r"holds the tensors \['activation"),
    (lambda c: c["config"].update(dtype="float16"), "is float32, but the config's dtype"),
  ],
)
def test_load_refuses_a_config_that_is_foreign_or_disagrees_with_the_weights(saved, edit, message):
  _edit_config(saved, edit)
  with pytest.raises(fl.ArtifactError, match=message):
    fld.load(saved)


def test_load_refuses_truncated_or_altered_weights(saved):
  weights = saved / "weights.safetensors"
  raw = weights.read_bytes()
  weights.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
  with pytest.raises(fl.ArtifactError, match="does not match its checksum"):
    fld.load(saved)
  weights.write_bytes(raw[:-5])
  with pytest.raises(fl.ArtifactError, match="weights.safetensors"):
    fld.load(saved)
  (saved / "config.json").write_bytes(b"{" * (2**20 + 1))
  with pytest.raises(fl.ArtifactError, match="too large"):
    fld.load(saved)


def test_load_names_the_loader_of_a_foreign_folder():
  with pytest.raises(fl.ArtifactError, match=r"SAELens dictionary.*fld.load_saelens"):
    fld.load(FIXTURES / "saelens_standard")
  with pytest.raises(fl.ArtifactError, match="fld.load_gemma_scope"):
    fld.load(FIXTURES / "gemma_scope")


def _check_against(dictionary, expected_file):
  expected = load_file(FIXTURES / expected_file)
  features = np.asarray(dictionary.encode(jnp.asarray(expected["x"])))
  np.testing.assert_allclose(features, expected["features"], rtol=0, atol=TOLERANCE)
  np.testing.assert_array_equal(features != 0, expected["features"] != 0)
  out = np.asarray(dictionary(jnp.asarray(expected["x"])))
  np.testing.assert_allclose(out, expected["reconstruction"], rtol=0, atol=TOLERANCE)


SAELENS = {
  "saelens_standard": ("sae", "relu"),
  "saelens_jumprelu": ("sae", "jumprelu"),
  "saelens_topk": ("sae", "topk"),
  "saelens_topk_rescaled": ("sae", "topk"),
  "saelens_batchtopk": ("sae", "jumprelu"),
  "saelens_transcoder": ("transcoder", "relu"),
  "saelens_skip_transcoder": ("transcoder", "relu"),
  "saelens_jumprelu_transcoder": ("transcoder", "jumprelu"),
  "saelens_jumprelu_skip_transcoder": ("transcoder", "jumprelu"),
}


@pytest.mark.parametrize("name", sorted(SAELENS))
def test_a_saelens_dictionary_encodes_what_saelens_encodes(name):
  dictionary = fld.load_saelens(FIXTURES / name)
  assert (dictionary.config.kind, dictionary.config.activation) == SAELENS[name]
  _check_against(dictionary, f"{name}.expected.safetensors")


def test_circuit_tracer_transcoders_encode_what_circuit_tracer_encodes():
  layers = fld.load_circuit_tracer(FIXTURES / "circuit_tracer_plt")
  assert [t.config.skip for t in layers] == [True, True]
  for layer, transcoder in enumerate(layers):
    _check_against(transcoder, f"circuit_tracer_plt_{layer}.expected.safetensors")
  single = fld.load_circuit_tracer(FIXTURES / "circuit_tracer_plt" / "layer_1.safetensors")
  _check_against(single, "circuit_tracer_plt_1.expected.safetensors")
  clt = fld.load_circuit_tracer(FIXTURES / "circuit_tracer_clt")
  assert (clt.config.layers, clt.config.activation) == (3, "jumprelu")
  _check_against(clt, "circuit_tracer_clt.expected.safetensors")


def test_a_gemma_scope_transcoder_encodes_what_circuit_tracer_reads_from_it():
  transcoder = fld.load_gemma_scope(FIXTURES / "gemma_scope" / "params.npz", transcoder=True)
  _check_against(transcoder, "gemma_scope.expected.safetensors")
  sae = fld.load_gemma_scope(FIXTURES / "gemma_scope")
  assert (sae.config.kind, sae.config.center_input) == ("sae", False)


@pytest.mark.parametrize(
  "edit, message",
  [
    ({"normalize_activations": "layer_norm"}, "normalize_activations='layer_norm'"),
    ({"architecture": "gated"}, "architecture='gated' is not one flaxlens represents"),
    ({"d_sae": 33}, r"'W_dec' has shape \[32, 8\], but a sae \(d_in=8, d_out=8, width=33"),
  ],
)
def test_a_saelens_config_flaxlens_cannot_compute_is_refused_naming_the_key(
  tmp_path, edit, message
):
  folder = shutil.copytree(FIXTURES / "saelens_standard", tmp_path / "sae")
  config = json.loads((folder / "cfg.json").read_text())
  (folder / "cfg.json").write_text(json.dumps({**config, **edit}))
  with pytest.raises(fl.ArtifactError, match=message):
    fld.load_saelens(folder)


def test_damaged_foreign_weights_are_refused(tmp_path):
  folder = shutil.copytree(FIXTURES / "saelens_jumprelu", tmp_path / "sae")
  weights = folder / "sae_weights.safetensors"
  tensors = load_file(weights)
  weights.write_bytes(weights.read_bytes()[:-4])
  with pytest.raises(fl.ArtifactError, match="truncated or damaged"):
    fld.load_saelens(folder)
  save_file({**tensors, "threshold": np.full(32, np.nan, np.float32)}, weights)
  with pytest.raises(fl.ArtifactError, match="'threshold' holds NaN"):
    fld.load_saelens(folder)
  save_file({k: v for k, v in tensors.items() if k != "b_enc"}, weights)
  with pytest.raises(fl.ArtifactError, match=r"lacks the tensors \['b_enc'\]"):
    fld.load_saelens(folder)
  weights.write_bytes((2**40).to_bytes(8, "little") + b"{}")
  with pytest.raises(fl.ArtifactError, match="is truncated or no safetensors file"):
    fld.load_saelens(folder)


def test_an_npz_with_pickles_is_refused_unread(tmp_path):
  params = dict(np.load(FIXTURES / "gemma_scope" / "params.npz"))
  np.savez(tmp_path / "params.npz", **params, extra=np.array([{"run": "code"}], dtype=object))
  with pytest.raises(fl.ArtifactError, match="never pickles"):
    fld.load_gemma_scope(tmp_path / "params.npz")
  (tmp_path / "params.npz").write_bytes(b"PK\x03\x04 not a zip")
  with pytest.raises(fl.ArtifactError, match=r"is no \.npz archive"):
    fld.load_gemma_scope(tmp_path / "params.npz")


def test_a_negative_circuit_tracer_threshold_is_refused(tmp_path):
  tensors = load_file(FIXTURES / "circuit_tracer_plt" / "layer_0.safetensors")
  tensors["activation_function.threshold"] = -np.abs(tensors["activation_function.threshold"])
  save_file(tensors, tmp_path / "layer_0.safetensors")
  with pytest.raises(fl.ArtifactError, match="threshold is negative"):
    fld.load_circuit_tracer(tmp_path / "layer_0.safetensors")


def test_saelens_files_from_before_6_0_load_as_saelens_6_computes_them(tmp_path):
  topk = shutil.copytree(FIXTURES / "saelens_topk", tmp_path / "topk")
  old = {"d_in": 8, "d_sae": 32, "activation_fn": "topk", "activation_fn_kwargs": {"k": 4}}
  (topk / "cfg.json").write_text(json.dumps(old))
  _check_against(fld.load_saelens(topk), "saelens_topk.expected.safetensors")
  jump = shutil.copytree(FIXTURES / "saelens_jumprelu", tmp_path / "jump")
  tensors = load_file(jump / "sae_weights.safetensors")
  tensors["log_threshold"] = np.log(tensors.pop("threshold"))
  save_file(tensors, jump / "sae_weights.safetensors")
  _check_against(fld.load_saelens(jump), "saelens_jumprelu.expected.safetensors")
