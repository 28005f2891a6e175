"""What the processes of a multi-process harvest (`jax.distributed`) share: small results
read whole on every process, barriers, and which processes failed a step. Each is a
collective over JAX's devices (`jax.experimental.multihost_utils`), so every process
calls it at the same point; in one process each is local and immediate. No Flax
internals here.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def fetch_whole(array: Any) -> np.ndarray:
  """The whole value of a small array on every process (gathered where it spans processes
  unreplicated: a collective, so every process calls it at the same point)."""
  if not isinstance(array, jax.Array) or array.is_fully_addressable:
    return np.asarray(array)
  if array.is_fully_replicated:
    return np.asarray(array.addressable_data(0))
  return multihost_utils.process_allgather(array, tiled=True)


def barrier(name: str) -> None:
  """Returns once every process reached the barrier `name` (a collective over all devices)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"flaxlens.harvest: {name}")


def failed_processes(ok: bool) -> list[int]:
  """The processes where `ok` is False (every process calls this at the same point)."""
  if jax.process_count() == 1:
    return [] if ok else [0]
  flags = multihost_utils.process_allgather(np.asarray([ok], np.int32), tiled=True)
  return [int(i) for i in np.flatnonzero(flags == 0)]
