"""A harvest killed mid-run resumes: the same call continues after the committed batches,
with no row missing or repeated; a partial store never says it is complete."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl

from . import models, workload

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _committed(path: pathlib.Path) -> int:
  try:
    return fl.open_harvest(path).batches_committed
  except fl.HarvestError:
    return 0


def _kill_after(path: pathlib.Path, framework: str, batches: int) -> None:
  """Runs the workload in a subprocess and SIGKILLs it once `batches` are committed."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  process = subprocess.Popen(
    [sys.executable, str(HERE / "workload.py"), str(path), framework],
    env=env,
    stderr=subprocess.PIPE,
  )
  try:
    deadline = time.monotonic() + 120
    while _committed(path) < batches:
      if process.poll() is not None:
        pytest.fail(f"the harvest ended before it was killed: {process.stderr.read()[-2000:]}")
      if time.monotonic() > deadline:
        pytest.fail("no batch was committed within 120 s")
      time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_a_killed_harvest_resumes_without_missing_or_repeated_rows(framework, tmp_path):
  killed, whole = tmp_path / "killed", tmp_path / "whole"
  _kill_after(killed, framework, batches=3)
  partial = fl.open_harvest(killed)
  assert not partial.complete and 3 <= partial.batches_committed < workload.BATCHES
  resumed = workload.harvest(str(killed), framework, workload.batches())
  expected = workload.harvest(str(whole), framework, workload.batches())
  assert resumed.complete and len(resumed) == len(expected) == 3 * 11 + 2
  model = models.build(framework)
  for site in model.sites:
    np.testing.assert_array_equal(resumed[site][:], expected[site][:])
    np.testing.assert_array_equal(resumed[site].index[:], expected[site].index[:])
    np.testing.assert_array_equal(resumed[site].ids[:], expected[site].ids[:])
    assert len(np.unique(resumed[site].index[:], axis=0)) == len(resumed[site])
  tokens = np.concatenate(models.token_batches(workload.BATCHES, last=2))
  captured = np.concatenate(
    [
      np.asarray(fl.capture(model.tree, b, model.sites[1])[1][model.sites[1]])
      for b in models.token_batches(workload.BATCHES, last=2)
    ]
  )
  np.testing.assert_array_equal(resumed[model.sites[1]][:], captured[tokens != models.PAD])


def test_a_complete_store_is_returned_without_running_a_batch(linen_model, tmp_path):
  batches = models.token_batches(3)
  fl.harvest(linen_model.tree, batches, "Block_0", tmp_path / "s")
  taken = []

  def stream():
    for b in batches:
      taken.append(b)
      yield b

  again = fl.harvest(linen_model.tree, stream(), "Block_0", tmp_path / "s")
  assert again.complete and len(taken) == 1  # the first batch, to check it is the same call


def test_a_store_stopped_by_an_error_mid_stream_is_partial(linen_model, tmp_path):
  good = models.token_batches(2)
  wide = np.zeros((3, models.LENGTH + 2), np.int32)  # refused: another row count per example
  with pytest.raises(fl.HarvestError, match="batch 2 gives rows"):
    fl.harvest(linen_model.tree, [*good, wide], "Block_0", tmp_path / "s", positions=None)
  stored = fl.open_harvest(tmp_path / "s")
  assert not stored.complete and stored.batches_committed == 2 and len(stored) == 6
  with pytest.raises(fl.HarvestError, match="not complete"):
    stored.batches(4)
  assert sum(len(b["Block_0"]) for b in stored.batches(4, partial=True)) == 6


def test_a_call_on_its_own_complete_store_runs_no_model_code(tmp_path):
  traced = []

  class Counting(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      traced.append(tokens.shape)  # runs each time the model is traced or run eagerly
      return nn.Dense(models.WIDTH)(nn.Embed(models.VOCAB, models.WIDTH)(tokens))

  batches = models.token_batches(2)
  module = Counting()
  tree = fl.unflaxify(module, module.init(jax.random.key(0), batches[0]), batches[0])
  first = fl.harvest(tree, batches, "Dense_0", tmp_path / "s")
  traced.clear()
  again = fl.harvest(tree, batches, "Dense_0", tmp_path / "s")
  assert traced == [] and again.complete and len(again) == len(first)


_DTYPES = ["float32", "bfloat16", "float16", "int8", "uint8", "bool", "int32", "int16", "complex64"]


@pytest.mark.parametrize("dtype", _DTYPES)
def test_the_checksum_summed_on_the_host_equals_the_one_summed_by_a_jitted_program(dtype):
  # On CPU a store's checksums (the model's variables, the first batch) are summed with
  # NumPy; arrays on accelerators or over several devices are summed by a jitted program. A
  # store made one way must resume the other, so both must give the same numbers. The
  # array spans several of the host's slices, and a partial one.
  from flaxlens.tools.harvest import _fingerprints

  rng = np.random.default_rng(0)
  size = 2 * _fingerprints._SPAN + 7
  values = rng.standard_normal(size) * 50 + 1j * rng.standard_normal(size)
  if dtype == "bool":
    array = values.real > 0
  elif dtype.startswith(("int", "uint")):
    array = np.clip(values.real, -100, 100).astype(dtype)
  else:
    array = (values if dtype.startswith("complex") else values.real).astype(jnp.dtype(dtype))
  device = jax.device_put(array)
  on_device = _fingerprints._checksums([device])[0].tolist()
  assert list(_fingerprints._host_checksum(_fingerprints._on_host(array))) == on_device
  assert list(_fingerprints._host_checksum(_fingerprints._on_host(device))) == on_device
  # And the fingerprint is the same for the NumPy array and the device array.
  assert _fingerprints.fingerprint([("a", array)]) == _fingerprints.fingerprint([("a", device)])


def test_the_checksum_of_64_bit_arrays_is_the_same_on_the_host_and_on_device():
  from flaxlens.tools.harvest import _fingerprints

  enable_x64 = getattr(jax, "enable_x64", None)  # a config state: no truth value
  if enable_x64 is None:
    from jax.experimental import enable_x64
  rng = np.random.default_rng(1)
  with enable_x64(True):
    for array in (rng.standard_normal(1000), rng.integers(-(2**62), 2**62, 1000)):
      on_device = _fingerprints._checksums([jax.device_put(array)])[0].tolist()
      assert list(_fingerprints._host_checksum(_fingerprints._on_host(array))) == on_device


def test_progress_counts_rows_only_after_the_writes_are_synced(linen_model, tmp_path, monkeypatch):
  # The arrays are written without a sync per chunk; `progress.json` may count rows only
  # once a sync of the store's filesystem came after their writes (else a crash of the
  # machine could leave counted rows unwritten). Every save is seen in order.
  from flaxlens.tools.harvest import _store, _writing

  events = []
  flush, write_progress = _store.flush, _store.write_progress
  monkeypatch.setattr(_store, "flush", lambda path: (events.append("sync"), flush(path))[1])
  monkeypatch.setattr(
    _store,
    "write_progress",
    lambda path, progress: (events.append(progress["batches"]), write_progress(path, progress))[1],
  )
  monkeypatch.setattr(_writing, "COMMIT_EVERY", 0.0)  # every batch is saved
  fl.harvest(linen_model.tree, models.token_batches(4), "Block_0", tmp_path / "s", positions=None)
  assert _store.syncs_itself()
  saved = [i for i, event in enumerate(events) if event != "sync"]
  assert [events[i] for i in saved] == [1, 2, 3, 4, 4]  # each batch, then complete
  assert all(events[i - 1] == "sync" for i in saved)
  assert fl.open_harvest(tmp_path / "s").complete


def test_a_failed_save_of_the_progress_stops_the_run_with_its_error(
  linen_model, tmp_path, monkeypatch
):
  from flaxlens.tools.harvest import _store, _writing

  def refuse(path, progress):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(_store, "write_progress", refuse)
  monkeypatch.setattr(_writing, "COMMIT_EVERY", 0.0)
  with pytest.raises(OSError, match="No space left"):
    fl.harvest(linen_model.tree, models.token_batches(4), "Block_0", tmp_path / "s", positions=None)
  monkeypatch.undo()
  assert not fl.open_harvest(tmp_path / "s").complete
